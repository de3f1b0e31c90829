"""Benchmarks of differential attention against the same run's baseline: `python -m diffzoo.bench -h`.

`whole_model` (CLIP training step, inference, torch.compile), `attention` (one layer per variant vs
SDPA), `data` (webdataset decode throughput), `measure` (timing, peak memory, SDPA backend),
`report` (ratios, targets, tables); `gpu` (`python -m diffzoo.bench.gpu`: every GPU check in one
time-boxed run).
"""
