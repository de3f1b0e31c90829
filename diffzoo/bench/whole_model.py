"""Whole CLIP models: a training step and `encode_image`, eager and (optionally) torch.compile'd.

Training step, as open_clip_train's `train_one_epoch` does it: `zero_grad(set_to_none=True)`, the
model's forward (both towers) under the precision's autocast, `open_clip.ClipLoss`, backward,
`AdamW.step()` (in fp16 through a `GradScaler`, as its `--precision amp`), `logit_scale.clamp_(0, ln 100)`.
Inference: `encode_image` under `inference_mode`.
Inputs are a fixed random image batch (B, 3, S, S) and tokenized captions (B, context_length).

Differential models run with the run's `--split-kernel` (set on every differential layer); a
model named `NAME@KERNEL` (`diffclip-b16@two_calls`) runs NAME with that split kernel instead, so
two kernels are measured in one run against the same baseline.

Each step is timed (`measure.time_steps`: CUDA events between consecutive steps, the wall clock on
CPU) in blocks of `block_steps` consecutive steps of one model, after `warmup` untimed calls of each;
blocks are interleaved across models (round 1: A, B, C; round 2: B, C, A; …), so drift in clocks or
load hits every model alike and no model always runs first. Every step's time is kept, per block, for
the ratios (`report`: the median and spread of per-block ratios). Peak memory is the model's own
state (parameters, plus AdamW's moments for training) plus the transient peak of one profiled call
(see `measure`), so models held side by side do not count against each other.
"""
import math
import statistics
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from diffzoo.layers import set_split_kernel

from .measure import (BenchError, Probe, allocator_calls, allocator_counts, autocast, rate, summarize, tensor_bytes,
                      time_steps)

CAPTIONS = ('a small red circle left of a large blue square', 'a large yellow triangle',
            'a photo of a dog on a beach at sunset', 'a diagram of differential attention')


@dataclass
class Subject:
    """One model under test with its optimizer, loss and inputs."""
    name: str
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    loss: torch.nn.Module
    images: torch.Tensor  # (B, 3, S, S)
    texts: torch.Tensor  # (B, context_length)
    scaler: Optional[torch.amp.GradScaler] = None  # fp16 only
    params: int = 0
    results: Dict = field(default_factory=dict)


def model_and_kernel(name: str, split_kernel: str = 'auto') -> Tuple[str, str]:
    """(open_clip model name, split kernel) of a bench model name, `NAME` or `NAME@KERNEL`."""
    model, _, kernel = name.partition('@')
    return model, kernel or split_kernel


def build(name: str, batch: int, device: torch.device, split_kernel: str = 'auto',
          precision: str = 'fp32') -> Subject:
    import open_clip
    model_name, split_kernel = model_and_kernel(name, split_kernel)
    cfg = open_clip.get_model_config(model_name)
    if cfg is None:
        raise BenchError(f'--models {name}: not an open_clip model config; '
                         f'choose from {", ".join(m for m in open_clip.list_models() if "diff" in m or "B-16" in m)}')
    model = open_clip.create_model(model_name, device=device, output_dict=True)
    set_split_kernel(model, split_kernel)
    size = cfg['vision_cfg'].get('image_size', 224)
    size = (size, size) if isinstance(size, int) else tuple(size)
    tokenizer = open_clip.get_tokenizer(model_name)
    texts = tokenizer([CAPTIONS[i % len(CAPTIONS)] for i in range(batch)]).to(device)  # (B, L)
    images = torch.randn(batch, 3, *size, device=device)  # (B, 3, S, S)
    # open_clip_train's recipe (diffzoo's recipes: lr 5e-4, weight decay 0.5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-4, weight_decay=0.5)
    scaler = torch.amp.GradScaler(device.type) if precision == 'fp16' else None
    return Subject(name, model, optimizer, open_clip.ClipLoss(), images, texts, scaler,
                   params=sum(p.numel() for p in model.parameters()))


def train_step(s: Subject, precision: str) -> None:
    s.optimizer.zero_grad(set_to_none=True)
    with autocast(s.images.device, precision):
        out = s.model(s.images, s.texts)
        loss = s.loss(out['image_features'], out['text_features'], out['logit_scale'])
    if s.scaler is None:
        loss.backward()
        s.optimizer.step()
    else:
        s.scaler.scale(loss).backward()
        s.scaler.step(s.optimizer)
        s.scaler.update()
    with torch.no_grad():
        s.model.logit_scale.clamp_(0, math.log(100))


def infer_step(s: Subject, precision: str) -> None:
    with torch.inference_mode(), autocast(s.images.device, precision):
        s.model.encode_image(s.images)


def _state_bytes(s: Subject, training: bool) -> int:
    state = [p for p in s.model.parameters()] + [b for b in s.model.buffers()]
    if training:
        state += [t for st in s.optimizer.state.values() for t in st.values()]
    return tensor_bytes(state)


def _mallocs(allocs: List[Dict[str, int]]) -> str:
    """' (N cudaMalloc, M retries)' for the last block where the allocator called the driver, else ''."""
    last = allocs[-1] if allocs else {}
    if not (last.get('num_device_alloc') or last.get('num_alloc_retries')):
        return ''
    return f' ({last["num_device_alloc"]} cudaMalloc, {last["num_alloc_retries"]} retries)'


def time_blocks(subjects: List[Subject], kind: str, precision: str, blocks: int, block_steps: int, warmup: int,
                device: torch.device, tag: str = '') -> Dict[str, Dict]:
    """{model: {'step_s': summary of every step, 'blocks': [[seconds per step] per block], 'allocator': per block,
    on CUDA, the caching allocator's cudaMalloc and cudaFree calls and retries during it}} for `kind` ('train' or
    'infer'): `blocks` rounds of one block of `block_steps` consecutive steps per model, the models' order rotated
    each round. A block's first step follows another model's block: its allocations show there."""
    step = train_step if kind == 'train' else infer_step
    for s in subjects:
        s.model.train(kind == 'train')
        print(f'  {tag}{kind} warm-up {s.name} ({warmup} calls)', flush=True)
        for _ in range(warmup):
            step(s, precision)
    times: Dict[str, List[List[float]]] = {s.name: [] for s in subjects}
    allocs: Dict[str, List[Dict[str, int]]] = {s.name: [] for s in subjects}
    for r in range(blocks):
        for s in subjects[r % len(subjects):] + subjects[:r % len(subjects)]:
            s.model.train(kind == 'train')
            before = allocator_counts(device)
            times[s.name].append(time_steps(lambda: step(s, precision), device, block_steps))
            if before is not None:
                allocs[s.name].append(allocator_calls(before, allocator_counts(device)))
        line = ', '.join(f'{s.name} {statistics.median(times[s.name][-1]) * 1e3:,.1f} ms' + _mallocs(allocs[s.name])
                         for s in subjects)
        print(f'  {tag}{kind} block {r + 1}/{blocks} ({block_steps} steps, median): {line}', flush=True)
    return {name: {'step_s': summarize([t for block in bl for t in block]), 'blocks': bl,
                   'allocator': allocs[name] or None} for name, bl in times.items()}


def probe(s: Subject, kind: str, precision: str, device: torch.device) -> Dict:
    """Peak memory (state + transient) and SDPA backends of one profiled call."""
    s.model.train(kind == 'train')
    s.optimizer.zero_grad(set_to_none=True)  # the step starts from parameters + optimizer state
    state = _state_bytes(s, kind == 'train')
    with Probe(device) as p:
        (train_step if kind == 'train' else infer_step)(s, precision)
    return {'state_bytes': state, 'transient_bytes': p.peak_bytes, 'peak_bytes': state + p.peak_bytes,
            'sdpa_backends': p.backends, 'attention_kernels': p.kernels}


def run(names: List[str], batch: int, precision: str, blocks: int, block_steps: int, warmup: int,
        device: torch.device, compile_models: bool = False, split_kernel: str = 'auto', explain: bool = True) -> Dict:
    """The whole-model section: rows per model, and the compile section when asked (`explain`: see
    `run_compiled`)."""
    subjects = []
    for name in names:
        print(f'  building {name} (batch {batch}, {device.type}, {precision})', flush=True)
        subjects.append(build(name, batch, device, split_kernel, precision))
    train = time_blocks(subjects, 'train', precision, blocks, block_steps, warmup, device)
    infer = time_blocks(subjects, 'infer', precision, blocks, block_steps, warmup, device)
    rows = []
    for s in subjects:
        print(f'  profiling {s.name}: one training step and one inference call', flush=True)
        rows.append({
            'model': s.name, 'params': s.params, 'batch': batch,
            'train': {'step_s': train[s.name]['step_s'], 'blocks': train[s.name]['blocks'],
                      'allocator_per_block': train[s.name]['allocator'],
                      'samples_per_s': rate(train[s.name]['step_s'], batch), **probe(s, 'train', precision, device)},
            'infer': {'call_s': infer[s.name]['step_s'], 'blocks': infer[s.name]['blocks'],
                      'allocator_per_block': infer[s.name]['allocator'],
                      'images_per_s': rate(infer[s.name]['step_s'], batch), **probe(s, 'infer', precision, device)},
        })
    section = {'rows': rows, 'split_kernel': split_kernel, 'blocks': blocks, 'block_steps': block_steps}
    if compile_models:
        section['compile'] = run_compiled(subjects, rows, precision, blocks, block_steps, warmup, device, explain)
    return section


def text_tower(model: torch.nn.Module) -> torch.nn.Module:
    """The module holding the text blocks: `model.text` (custom text CLIP) or `model.transformer`."""
    text = getattr(model, 'text', None)
    return text if text is not None else model.transformer


def graph_breaks(s: Subject, precision: str) -> Dict:
    """`torch._dynamo.explain` over the training forward (both towers): graph breaks, and those in attention."""
    import torch._dynamo
    s.model.train()
    with autocast(s.images.device, precision):
        explained = torch._dynamo.explain(s.model)(s.images, s.texts)
    torch._dynamo.reset()
    reasons = []
    for br in explained.break_reasons:
        frames = [f'{f.filename.rsplit("/", 1)[-1]}:{f.lineno} {f.name}' for f in (br.user_stack or [])]
        reasons.append({'reason': str(br.reason).splitlines()[0][:300], 'where': frames[-3:]})
    in_attention = [r for r in reasons if any('attention' in w.lower() or 'attn' in w.lower() for w in r['where'])]
    return {'graphs': explained.graph_count, 'graph_breaks': explained.graph_break_count,
            'graph_breaks_in_attention': len(in_attention), 'break_reasons': reasons[:20]}


def run_compiled(subjects: List[Subject], eager_rows: List[Dict], precision: str, blocks: int, block_steps: int,
                 warmup: int, device: torch.device, explain: bool = True) -> Dict:
    """Compile both towers of every model in place (`module.compile()`), time them as the eager
    models were, and report speed-up against the eager medians, peak memory and the graph breaks: per model
    with their reasons (`torch._dynamo.explain`, one more trace of each model) when `explain`, else only those
    met while all the compiled models run."""
    from torch._dynamo.utils import counters
    breaks = {}
    for s in subjects:
        if explain:
            print(f'  torch._dynamo.explain {s.name}', flush=True)
        breaks[s.name] = graph_breaks(s, precision) if explain else dict.fromkeys(
            ('graphs', 'graph_breaks', 'graph_breaks_in_attention', 'break_reasons'))
        s.model.visual.compile()
        text_tower(s.model).compile()
    counters.clear()
    # warm-up includes compilation (train and eval modes compile separately); at least 2 calls each
    train = time_blocks(subjects, 'train', precision, blocks, block_steps, max(warmup, 2), device, tag='compiled ')
    infer = time_blocks(subjects, 'infer', precision, blocks, block_steps, max(warmup, 2), device, tag='compiled ')
    runtime_breaks = sum(counters['graph_break'].values())
    rows = []
    for s, eager in zip(subjects, eager_rows):
        print(f'  profiling compiled {s.name}: one training step and one inference call', flush=True)
        rows.append({
            'model': s.name, **breaks[s.name],
            'train': {'step_s': train[s.name]['step_s'], 'blocks': train[s.name]['blocks'],
                      'samples_per_s': rate(train[s.name]['step_s'], s.images.shape[0]),
                      'speedup': eager['train']['step_s']['median'] / train[s.name]['step_s']['median'],
                      'peak_bytes': probe(s, 'train', precision, device)['peak_bytes']},
            'infer': {'call_s': infer[s.name]['step_s'], 'blocks': infer[s.name]['blocks'],
                      'images_per_s': rate(infer[s.name]['step_s'], s.images.shape[0]),
                      'speedup': eager['infer']['call_s']['median'] / infer[s.name]['step_s']['median'],
                      'peak_bytes': probe(s, 'infer', precision, device)['peak_bytes']},
        })
    return {'rows': rows, 'graph_breaks_while_running_all_models': runtime_breaks}
