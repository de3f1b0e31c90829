"""Timing, peak memory, SDPA backend detection and the environment record shared by every section.

Time of a call: `synchronize` (CUDA) then `time.perf_counter` around `inner` calls, divided by `inner`.
Time of each of consecutive steps (`time_steps`): on CUDA, events recorded on the current stream between the
steps, read after one synchronize at the end, so the steps run back to back as in training; on CPU, the
wall clock around each step.
Peak memory of one call, *above what was live when it started* (the "transient" bytes):
    cuda  `torch.cuda.reset_peak_memory_stats`, then `max_memory_allocated() − memory_allocated()`
    cpu   torch has no CPU allocator counter, so the call runs under `torch.profiler` with
          `profile_memory=True`; every allocation and free of torch's CPU allocator is an event with
          a signed size, and the peak is the maximum of their running sum in time order. This counts
          tensor storage only (like `max_memory_allocated`), not oneDNN scratch or Python objects.
The same profiled call names the SDPA backend from the aten ops that ran
(`_scaled_dot_product_flash_attention[_for_cpu]`, `_efficient_attention`, `_cudnn_attention`,
`_attention_math`) and, on CUDA, lists the attention kernels that ran.
"""
import contextlib
import math
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch

import diffzoo

MB = 2 ** 20

# forward aten op → backend name; longest names first so "flash_attention_for_cpu" wins over "flash_attention"
SDPA_OPS = {
    'aten::_scaled_dot_product_flash_attention_for_cpu': 'flash-cpu',
    'aten::_scaled_dot_product_flash_attention': 'flash',
    'aten::_scaled_dot_product_efficient_attention': 'mem-efficient',
    'aten::_scaled_dot_product_cudnn_attention': 'cudnn',
    'aten::_scaled_dot_product_fused_attention_overrideable': 'overrideable',
    'aten::_scaled_dot_product_attention_math': 'math',
    'aten::_native_multi_head_attention': 'nn.MHA fast path',
}
ATTENTION_KERNEL = re.compile(r'flash|fmha|sdpa|attention|attn', re.IGNORECASE)


class BenchError(Exception):
    """A bad input or an unusable environment; the message names it and the fix."""


def synchronize(device: torch.device) -> None:
    if device.type == 'cuda':
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], object], device: torch.device, inner: int = 1) -> float:
    """Seconds per call of `fn`, averaged over `inner` back-to-back calls."""
    synchronize(device)
    start = time.perf_counter()
    for _ in range(inner):
        fn()
    synchronize(device)
    return (time.perf_counter() - start) / inner


def time_steps(fn: Callable[[], object], device: torch.device, steps: int) -> List[float]:
    """Seconds of each of `steps` consecutive calls of `fn` (see the module docstring)."""
    if device.type != 'cuda':
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return times
    synchronize(device)
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
    marks[0].record()
    for mark in marks[1:]:
        fn()
        mark.record()
    synchronize(device)
    return [a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:])]


ALLOCATOR = ('num_device_alloc', 'num_device_free', 'num_alloc_retries')


def allocator_counts(device: torch.device) -> Optional[Dict[str, int]]:
    """The caching allocator's cudaMalloc and cudaFree calls and allocation retries so far (None off CUDA)."""
    if device.type != 'cuda':
        return None
    stats = torch.cuda.memory_stats(device)
    return {k: stats.get(k, 0) for k in ALLOCATOR}


def allocator_calls(before: Optional[Dict[str, int]], after: Optional[Dict[str, int]]) -> Optional[Dict[str, int]]:
    """The allocator's calls between two `allocator_counts` (None off CUDA)."""
    return None if before is None or after is None else {k: after[k] - before[k] for k in ALLOCATOR}


def calibrate(fn: Callable[[], object], device: torch.device, target_s: float) -> int:
    """How many back-to-back calls make one timed repeat last about `target_s` (at least 1)."""
    once = time_call(fn, device)
    return max(1, min(1000, math.ceil(target_s / max(once, 1e-6))))


def summarize(values: Sequence[float]) -> Dict:
    """Median and spread (min, max, interquartile range) of repeated measurements, plus the raw values."""
    values = list(values)
    if len(values) >= 2:
        q1, _, q3 = statistics.quantiles(values, n=4, method='inclusive')
    else:
        q1 = q3 = values[0]
    return {'median': statistics.median(values), 'min': min(values), 'max': max(values),
            'q1': q1, 'q3': q3, 'n': len(values), 'values': values}


def rate(seconds: Dict, items: int) -> Dict:
    """A summary of seconds per call turned into items per second (min ↔ max swap)."""
    per_s = [items / s for s in seconds['values']]
    return summarize(per_s)


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _cpu_allocation_peak(prof) -> int:
    """Peak of the running sum of CPU allocator events (bytes) recorded by a memory profile."""
    from torch._C._profiler import _EventType
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == 'cpu':
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
    live = peak = 0
    for _, size in sorted(events):
        live += size
        peak = max(peak, live)
    return peak


@contextlib.contextmanager
def without_profiler_notes(prefix: bytes = b'USDT:'):
    """Drop the lines torch's native profiler writes to file descriptor 2 at every start and stop ("USDT: …
    profiler_start"); anything else written there meanwhile reaches stderr afterwards, in order."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = [line for line in caught.read().splitlines(keepends=True) if not line.startswith(prefix)]
            if kept:
                sys.stderr.write(b''.join(kept).decode(errors='replace'))
                sys.stderr.flush()


class Probe:
    """One profiled call: transient peak memory, SDPA backends and attention kernels.

        with Probe(device) as probe:
            step()
        probe.peak_bytes, probe.backends, probe.kernels
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.peak_bytes = 0
        self.backends: List[str] = []
        self.kernels: List[str] = []

    def __enter__(self):
        from torch.profiler import ProfilerActivity, profile
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == 'cuda' else [])
        self._prof = profile(activities=activities, profile_memory=self.device.type == 'cpu')
        synchronize(self.device)
        if self.device.type == 'cuda':
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        with without_profiler_notes():
            self._prof.__enter__()
        return self

    def __exit__(self, *exc):
        synchronize(self.device)
        if self.device.type == 'cuda':
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._start
        with without_profiler_notes():
            self._prof.__exit__(*exc)
        if exc[0] is not None:
            return False
        if self.device.type == 'cpu':
            self.peak_bytes = _cpu_allocation_peak(self._prof)
        names = {e.name for e in self._prof.events()}
        self.backends = sorted({SDPA_OPS[n] for n in names if n in SDPA_OPS})
        if self.device.type == 'cuda':
            kernels = {e.name for e in self._prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}
            self.kernels = sorted(k[:120] for k in kernels if ATTENTION_KERNEL.search(k))
        return False


def resolve_device(name: str) -> torch.device:
    if name not in ('cpu', 'cuda') and not name.startswith('cuda:'):
        raise BenchError(f'--device {name}: expected cpu or cuda (or cuda:N)')
    device = torch.device(name)
    if device.type == 'cuda' and not torch.cuda.is_available():
        raise BenchError(f'--device {name}: torch.cuda.is_available() is False here; run with --device cpu')
    return device


def cpu_name() -> str:
    try:
        with open('/proc/cpuinfo') as f:
            for line in f:
                if line.startswith('model name'):
                    return line.split(':', 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or 'unknown'


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == 'cuda' else cpu_name()


def device_slug(device: torch.device) -> str:
    """`cuda-NVIDIA-H100-80GB-HBM3`, `cpu-AMD-EPYC-7763`: the device part of the results file name."""
    name = device_name(device)
    if device.type == 'cpu':
        name = re.sub(r'\((R|TM|tm|r)\)|\bCPU\b|@.*$|\b\d+-Core Processor\b|\bProcessor\b', ' ', name)
    name = re.sub(r'[^A-Za-z0-9.]+', '-', name).strip('-')
    return f'{device.type}-{name or "unknown"}'


def environment(device: torch.device) -> Dict:
    import open_clip
    import timm

    env = {
        'python': platform.python_version(), 'platform': platform.platform(),
        'torch': torch.__version__, 'timm': timm.__version__, 'open_clip': open_clip.__version__,
        'diffzoo': diffzoo.__version__, 'device': device_name(device), 'cpu': cpu_name(),
        'cpu_count': os.cpu_count(), 'torch_threads': torch.get_num_threads(),
        'torch_interop_threads': torch.get_num_interop_threads(),
        'mkldnn': torch.backends.mkldnn.is_available(),
    }
    if device.type == 'cuda':
        props = torch.cuda.get_device_properties(device)
        env.update({
            'cuda': torch.version.cuda, 'cudnn': torch.backends.cudnn.version(),
            'gpu_memory_gb': round(props.total_memory / 2 ** 30, 1), 'capability': f'{props.major}.{props.minor}',
            'tf32_matmul': torch.backends.cuda.matmul.allow_tf32, 'tf32_cudnn': torch.backends.cudnn.allow_tf32,
            'sdpa_enabled': {
                'flash': torch.backends.cuda.flash_sdp_enabled(),
                'mem_efficient': torch.backends.cuda.mem_efficient_sdp_enabled(),
                'cudnn': torch.backends.cuda.cudnn_sdp_enabled(),
                'math': torch.backends.cuda.math_sdp_enabled(),
            },
        })
    return env


def autocast(device: torch.device, precision: str):
    """bf16 or fp16 autocast as open_clip_train's `--precision amp_bf16` and `amp`; fp32 runs without autocast."""
    if precision in ('bf16', 'fp16'):
        return torch.autocast(device.type, dtype=torch.bfloat16 if precision == 'bf16' else torch.float16)
    return contextlib.nullcontext()


def fmt_mb(num_bytes: Optional[float]) -> str:
    return '-' if num_bytes is None else f'{num_bytes / MB:,.1f}'
