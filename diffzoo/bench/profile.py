"""Where one training step's time goes: attention, matrix products and everything else, per model.

One training step (as `whole_model.train_step`, after `warmup` untimed steps) runs under
`torch.profiler`; each kernel's time is put in one category by its name:

    attention  SDPA / flash / cuDNN attention kernels and diffzoo's Triton kernels (`_diff_attn_*`)
    gemm       matrix products (cuBLAS / CUTLASS / nvjet kernels; on CPU aten::mm, addmm, bmm, …)
    other      the rest: elementwise, normalisation, reductions, copies, the optimizer step

On CUDA the times are the GPU kernels' own durations; on CPU, the self time of each aten op (and of
diffzoo's custom op), so nothing is counted twice. Each model's profiler table (top kernels by time)
is written beside the results JSON as `<json stem>-profile-<model>.txt`.
"""
import re
from pathlib import Path
from typing import Dict, List, Optional

import torch

from .measure import synchronize, without_profiler_notes
from .whole_model import build, train_step

ATTENTION = re.compile(r'flash|fmha|sdpa|attention|attn|scaled_dot_product', re.IGNORECASE)
GEMM = re.compile(r'gemm|cutlass|cublas|nvjet|xmma|wgmma|^aten::(mm|addmm|bmm|baddbmm|matmul|linear)$', re.IGNORECASE)
CATEGORIES = ('attention', 'gemm', 'other')


def category(name: str) -> str:
    if ATTENTION.search(name):
        return 'attention'
    return 'gemm' if GEMM.search(name) else 'other'


def _kernel_times(prof, device: torch.device) -> Dict[str, float]:
    """{kernel or op name: microseconds} for one profiled step, without double counting."""
    times: Dict[str, float] = {}
    if device.type == 'cuda':
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                times[e.name] = times.get(e.name, 0.) + e.time_range.elapsed_us()
    else:
        for e in prof.key_averages():
            if e.key.startswith(('aten::', 'diffzoo::')):
                times[e.key] = times.get(e.key, 0.) + e.self_cpu_time_total
    return times


def profile_model(name: str, batch: int, precision: str, warmup: int, device: torch.device,
                  split_kernel: str, table_path: Optional[Path]) -> Dict:
    from torch.profiler import ProfilerActivity, profile
    s = build(name, batch, device, split_kernel, precision)
    s.model.train()
    for _ in range(max(1, warmup)):
        train_step(s, precision)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == 'cuda' else [])
    synchronize(device)
    with without_profiler_notes(), profile(activities=activities) as prof:
        train_step(s, precision)
        synchronize(device)
    times = _kernel_times(prof, device)
    totals = {c: 0. for c in CATEGORIES}
    for kernel, us in times.items():
        totals[category(kernel)] += us
    top = sorted(times.items(), key=lambda kv: -kv[1])
    if table_path is not None:
        sort_by = 'self_device_time_total' if device.type == 'cuda' else 'self_cpu_time_total'
        table_path.write_text(prof.key_averages().table(sort_by=sort_by, row_limit=40) + '\n')
    return {
        'model': name, 'batch': batch,
        **{f'{c}_ms': totals[c] / 1e3 for c in CATEGORIES}, 'total_ms': sum(totals.values()) / 1e3,
        'top': {c: [{'name': k[:160], 'ms': us / 1e3} for k, us in top if category(k) == c][:8] for c in CATEGORIES},
        'table': None if table_path is None else table_path.name,
    }


def run(names: List[str], baseline: str, batch: int, precision: str, warmup: int, device: torch.device,
        split_kernel: str = 'auto', out: Optional[Path] = None) -> Dict:
    rows = []
    for name in names:
        print(f'  profiling one training step of {name}', flush=True)
        table = None if out is None else out.with_name(f'{out.stem}-profile-{name.replace("@", "-")}.txt')
        rows.append(profile_model(name, batch, precision, warmup, device, split_kernel, table))
        if device.type == 'cuda':
            torch.cuda.empty_cache()
    base = {r['model']: r for r in rows}[baseline]
    for r in rows:
        r['vs_baseline'] = {
            'attention_time': r['attention_ms'] / base['attention_ms'] if base['attention_ms'] else None,
            'other_ms_more': r['other_ms'] - base['other_ms'],
            'gemm_ms_more': r['gemm_ms'] - base['gemm_ms'],
        }
    return {'baseline': baseline, 'split_kernel': split_kernel, 'rows': rows}
