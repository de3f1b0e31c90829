"""Why some training steps take longer than others: consecutive steps of each model, the slowest against the fastest.

Per model (built and warmed up as the model section does), `steps` consecutive training steps are timed, then
as many again under torch.profiler (CPU and, on CUDA, CUDA activities), each in its own `record_function`
range. For every step it records:

    time_s     the step's time (`measure.time_steps`' clocks: CUDA events between consecutive steps, or
               the wall clock on CPU)
    host_s     the step's time on the host, launching its work
    gpu        on CUDA, the step's kernels (a kernel belongs to the step whose host range launched it):
               busy time (the union of their intervals), idle gaps between them, `lead` (the GPU idle
               between the previous step's last kernel and this step's first: waiting for the host), and
               time per kernel name; on CPU, self time per aten op
    gc         Python garbage collections during the step (gc.callbacks): milliseconds, oldest generation
    compiles   Triton kernels compiled during the step (triton.knobs.runtime.jit_post_compile_hook)
    allocator  on CUDA, cudaMalloc and cudaFree calls and allocation retries of PyTorch's caching allocator

On CUDA, nvidia-smi samples the SM clock, power draw and throttle reasons every 100 ms while the steps run.
The slowest and the fastest profiled step are compared: the difference split into kernel time and idle
time, the kernels whose time differs most, and each step's collections, compilations and allocator calls;
`verdict` names the largest part. The comparison is written beside the results JSON as `<stem>-steps.txt`.
"""
import bisect
import datetime
import gc
import subprocess
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from .measure import allocator_calls, allocator_counts, summarize, synchronize, without_profiler_notes
from .whole_model import Subject, build, train_step

STEP = 'diffzoo.bench step {}'
SMI_FIELDS = ('timestamp', 'clocks.sm', 'power.draw', 'temperature.gpu')
THROTTLE_FIELDS = ('clocks_event_reasons.active', 'clocks_throttle_reasons.active')  # newer, older drivers


class Recorder:
    """Garbage collections and Triton compilations while it is entered, each tagged with `step`."""

    def __init__(self):
        self.step = -1
        self.collections: List[Tuple[int, int, float]] = []  # (step, generation, seconds)
        self.compiles: List[Tuple[int, str]] = []  # (step, kernel)
        self._started = 0.0
        self._knobs = None

    def _gc(self, phase: str, info: Dict) -> None:
        if phase == 'start':
            self._started = time.perf_counter()
        else:
            self.collections.append((self.step, info['generation'], time.perf_counter() - self._started))

    def _compiled(self, **kwargs) -> None:
        fn = kwargs.get('fn')
        self.compiles.append((self.step, getattr(fn, 'name', str(fn))))

    def __enter__(self):
        gc.callbacks.append(self._gc)
        try:  # Triton: a heavy optional dependency, here only to count compilations
            from triton import knobs
            self._knobs, self._saved = knobs.runtime, knobs.runtime.jit_post_compile_hook
            self._knobs.jit_post_compile_hook = self._compiled
        except (ImportError, AttributeError):
            self._knobs = None
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self._gc)
        if self._knobs is not None:
            self._knobs.jit_post_compile_hook = self._saved
        return False

    def of(self, step: int) -> Dict:
        mine = [(g, s) for i, g, s in self.collections if i == step]
        return {'gc_count': len(mine), 'gc_ms': sum(s for _, s in mine) * 1e3,
                'gc_oldest': max((g for g, _ in mine), default=None),
                'compiles': [k for i, k in self.compiles if i == step]}


class Clocks:
    """nvidia-smi's SM clock, power, temperature and throttle reasons every 100 ms while entered (CUDA only)."""

    def __init__(self, device: torch.device):
        self.device, self.samples, self.error, self._proc = device, [], None, None

    def __enter__(self):
        if self.device.type != 'cuda':
            return self
        index = str(self.device.index if self.device.index is not None else torch.cuda.current_device())
        for reason in THROTTLE_FIELDS:
            query = ','.join(SMI_FIELDS + (reason,))
            try:
                probe = subprocess.run(['nvidia-smi', '-i', index, f'--query-gpu={query}', '--format=csv,noheader'],
                                       capture_output=True, text=True, timeout=10)
            except (OSError, subprocess.SubprocessError) as exc:
                self.error = f'{type(exc).__name__}: {exc}'
                return self
            if probe.returncode == 0:
                self._proc = subprocess.Popen(['nvidia-smi', '-i', index, f'--query-gpu={query}',
                                               '--format=csv,noheader,nounits', '-lms', '100'],
                                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
                return self
            self.error = probe.stdout.strip() or probe.stderr.strip()
        return self

    def __exit__(self, *exc):
        if self._proc is None:
            return False
        self._proc.terminate()
        out, _ = self._proc.communicate(timeout=10)
        for line in out.splitlines():
            parts = [p.strip() for p in line.split(',')]
            try:
                stamp = datetime.datetime.strptime(parts[0], '%Y/%m/%d %H:%M:%S.%f').timestamp()
                self.samples.append({'t': stamp, 'sm_mhz': float(parts[1]), 'power_w': float(parts[2]),
                                     'temp_c': float(parts[3]), 'throttle': parts[4]})
            except (ValueError, IndexError):
                continue  # a line cut short at the end
        return False

    def between(self, start: float, end: float) -> Optional[Dict]:
        inside = [s for s in self.samples if start <= s['t'] < end]
        if not inside:
            return None
        return {'sm_mhz_min': min(s['sm_mhz'] for s in inside), 'power_w_max': max(s['power_w'] for s in inside),
                'throttle': sorted({s['throttle'] for s in inside})}


def run_steps(s: Subject, precision: str, steps: int, device: torch.device, rec: Recorder,
              profiled: bool = False) -> List[Dict]:
    """`steps` consecutive training steps, each timed and recorded (see the module docstring)."""
    from torch.profiler import record_function
    cuda = device.type == 'cuda'
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)] if cuda else []
    rows, before = [], allocator_counts(device)
    synchronize(device)
    if cuda:
        marks[0].record()
    for i in range(steps):
        rec.step = i
        start, wall = time.perf_counter(), time.time()
        with record_function(STEP.format(i)) if profiled else _nothing():
            train_step(s, precision)
        if cuda:
            marks[i + 1].record()
        host = time.perf_counter() - start
        after = allocator_counts(device)
        rows.append({'step': i, 'host_s': host, 'wall_start': wall, 'wall_end': time.time(),
                     'allocator': allocator_calls(before, after)})
        before = after
    synchronize(device)
    rec.step = -1
    for i, row in enumerate(rows):
        row['time_s'] = marks[i].elapsed_time(marks[i + 1]) / 1e3 if cuda else row['host_s']
        row.update(rec.of(i))
    return rows


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _union(intervals: List[Tuple[float, float]]) -> Tuple[float, float]:
    """(busy, gaps) in µs of sorted (start, end) intervals between the first start and the last end."""
    busy = gaps = 0.0
    end = intervals[0][0]
    for a, b in intervals:
        if a > end:
            gaps += a - end
        busy += max(0.0, b - max(a, end))
        end = max(end, b)
    return busy, gaps


def kernel_spans(prof) -> List[Tuple[float, float, str, float]]:
    """(start, end, name, launch) in µs of each GPU kernel the profiler recorded, `launch` the start of the host op
    that launched it, on the clock of `prof.events()`. Read from the kineto events themselves: the kernel's
    linked correlation id names its host op on every torch (FunctionEvent carries it only from torch 2.12 on)."""
    results = prof.profiler.kineto_results
    origin = results.trace_start_ns()
    events = results.events()
    host = {e.correlation_id(): e.start_ns() for e in events  # torch's ops; runtime calls count on CUPTI's ids
            if e.device_type() == torch.autograd.DeviceType.CPU and e.linked_correlation_id() == 0}
    return [((e.start_ns() - origin) / 1e3, (e.start_ns() + e.duration_ns() - origin) / 1e3, e.name(),
             (host[e.linked_correlation_id()] - origin) / 1e3) for e in events
            if e.device_type() == torch.autograd.DeviceType.CUDA and not e.is_user_annotation()
            and e.linked_correlation_id() in host]


def attribute(prof, device: torch.device, rows: List[Dict]) -> None:
    """Each profiled step's kernels (CUDA) or aten ops' self time (CPU), added to its row in place."""
    events = list(prof.events())
    ranges = sorted((e.time_range.start, e.time_range.end, int(e.name.rsplit(' ', 1)[1])) for e in events
                    if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith(STEP.format('')))
    starts = [r[0] for r in ranges]

    def step_of(t: float) -> Optional[int]:
        i = bisect.bisect_right(starts, t) - 1
        return ranges[i][2] if i >= 0 and t <= ranges[i][1] else None

    per_step: Dict[int, List] = {r['step']: [] for r in rows}
    if device.type == 'cuda':
        for start, end, name, launch in kernel_spans(prof):
            step = step_of(launch)
            if step is not None:
                per_step[step].append((start, end, name))
    else:
        for e in events:
            if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith(('aten::', 'diffzoo::')):
                step = step_of(e.time_range.start)
                if step is not None:
                    per_step[step].append((e.time_range.start, e.time_range.start + e.self_cpu_time_total, e.name))
    last_end = None
    for row in rows:
        spans = sorted(per_step[row['step']])
        by_name: Dict[str, List[float]] = {}
        for a, b, name in spans:
            by_name.setdefault(name, [0.0, 0])
            by_name[name][0] += (b - a) / 1e3
            by_name[name][1] += 1
        gpu = {'kernels': len(spans), 'by_name': {k: {'ms': v[0], 'count': v[1]} for k, v in by_name.items()}}
        if device.type == 'cuda' and spans:
            busy, gaps = _union([(a, b) for a, b, _ in spans])
            gpu.update(busy_ms=busy / 1e3, gaps_ms=gaps / 1e3,
                       lead_ms=None if last_end is None else max(0.0, spans[0][0] - last_end) / 1e3)
            last_end = max(b for _, b, _ in spans)
        row['gpu'] = gpu


def compare(rows: List[Dict]) -> Dict:
    """The slowest and the fastest step of `rows` side by side, and what makes up their difference."""
    slow = max(rows, key=lambda r: r['time_s'])
    fast = min(rows, key=lambda r: r['time_s'])
    names = set(slow['gpu']['by_name']) | set(fast['gpu']['by_name'])
    zero = {'ms': 0.0, 'count': 0}
    kernels = sorted(({'name': n[:160], 'slow_ms': slow['gpu']['by_name'].get(n, zero)['ms'],
                       'fast_ms': fast['gpu']['by_name'].get(n, zero)['ms'],
                       'slow_count': slow['gpu']['by_name'].get(n, zero)['count'],
                       'fast_count': fast['gpu']['by_name'].get(n, zero)['count']} for n in names),
                     key=lambda k: -abs(k['slow_ms'] - k['fast_ms']))[:10]
    delta_ms = (slow['time_s'] - fast['time_s']) * 1e3
    parts = {'garbage collection on the host': slow['gc_ms'] - fast['gc_ms'],
             'host time launching the step': (slow['host_s'] - fast['host_s']) * 1e3}
    if 'busy_ms' in slow['gpu'] and 'busy_ms' in fast['gpu']:
        parts['GPU kernel time'] = slow['gpu']['busy_ms'] - fast['gpu']['busy_ms']
        parts['GPU idle, waiting for the host'] = (slow['gpu']['gaps_ms'] + (slow['gpu']['lead_ms'] or 0)
                                                   - fast['gpu']['gaps_ms'] - (fast['gpu']['lead_ms'] or 0))
    largest = max(parts, key=lambda k: parts[k])
    notes = [f'{len(slow["compiles"])} Triton compilation(s)'] if slow['compiles'] else []
    alloc = slow['allocator'] or {}
    if alloc.get('num_device_alloc') or alloc.get('num_alloc_retries'):
        notes.append(f'{alloc["num_device_alloc"]} cudaMalloc, {alloc["num_alloc_retries"]} allocation retries')
    if kernels and 'GPU kernel' in largest:
        notes.append(f'most in {kernels[0]["name"][:80]} ({kernels[0]["slow_ms"] - kernels[0]["fast_ms"]:+.2f} ms)')
    verdict = (f'step {slow["step"]} {slow["time_s"] * 1e3:.2f} ms against step {fast["step"]} '
               f'{fast["time_s"] * 1e3:.2f} ms ({delta_ms:+.2f} ms): largest part {largest} '
               f'({parts[largest]:+.2f} ms)' + ''.join(f'; {n}' for n in notes))
    return {'slow': slow['step'], 'fast': fast['step'], 'delta_ms': delta_ms, 'parts_ms': parts,
            'kernels': kernels, 'verdict': verdict}


def profile_steps(name: str, batch: int, precision: str, steps: int, warmup: int, device: torch.device,
                  split_kernel: str) -> Dict:
    """One model's steps, timed and then profiled, with the comparison of its slowest and fastest."""
    from torch.profiler import ProfilerActivity, profile
    s = build(name, batch, device, split_kernel, precision)
    s.model.train()
    for _ in range(max(1, warmup)):
        train_step(s, precision)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == 'cuda' else [])
    with Clocks(device) as clocks:
        with Recorder() as rec:
            timed = run_steps(s, precision, steps, device, rec)
        with Recorder() as rec, without_profiler_notes(), profile(activities=activities) as prof:
            profiled = run_steps(s, precision, steps, device, rec, profiled=True)
    attribute(prof, device, profiled)
    for row in timed + profiled:  # the GPU runs behind the host: a step's samples lie up to its end
        row['clocks'] = clocks.between(row['wall_start'], row['wall_end'] + row['time_s'])
    return {'model': name, 'batch': batch, 'steps': steps,
            'timed': {'time_s': summarize([r['time_s'] for r in timed]), 'rows': timed},
            'profiled': {'time_s': summarize([r['time_s'] for r in profiled]), 'rows': profiled},
            'slow_vs_fast': compare(profiled),
            'clocks': {'samples': len(clocks.samples), 'error': clocks.error,
                       'sm_mhz': summarize([c['sm_mhz'] for c in clocks.samples]) if clocks.samples else None,
                       'throttle': sorted({c['throttle'] for c in clocks.samples})}}


def _clock(clocks: Dict) -> str:
    if not clocks['sm_mhz']:
        return f'not sampled ({clocks["error"]})' if clocks['error'] else 'not sampled'
    return (f'{clocks["sm_mhz"]["min"]:.0f}-{clocks["sm_mhz"]["max"]:.0f} MHz, throttle reasons '
            f'{" ".join(clocks["throttle"]) or "-"}')


def _ms(rows: List[Dict]) -> str:
    return ' '.join(f'{r["time_s"] * 1e3:.1f}' for r in rows)


def summary(section: Dict) -> str:
    """The section as text: per model, its step times and the comparison of its slowest and fastest step."""
    lines = [f'Consecutive training steps ({section["device"]}, {section["precision"]}, batch {section["batch"]}); '
             f'times in ms']
    for m in section['rows']:
        timed, prof = m['timed'], m['profiled']
        spread = (timed['time_s']['max'] - timed['time_s']['min']) / timed['time_s']['median']
        gcs = [(r['step'], r['gc_oldest'], r['gc_ms']) for r in timed['rows'] + prof['rows'] if r['gc_count']]
        lines += ['', f'{m["model"]}: median {timed["time_s"]["median"] * 1e3:.2f} ms, range '
                      f'{timed["time_s"]["min"] * 1e3:.2f}-{timed["time_s"]["max"] * 1e3:.2f} '
                      f'({spread:.1%} of the median)',
                  f'  timed:    {_ms(timed["rows"])}', f'  profiled: {_ms(prof["rows"])}',
                  '  garbage collections (step, oldest generation, ms): '
                  + (', '.join(f'({i}, {g}, {t:.1f})' for i, g, t in gcs) or 'none'),
                  f'  Triton compilations: {sum(len(r["compiles"]) for r in timed["rows"] + prof["rows"])}; '
                  f'SM clock: {_clock(m["clocks"])}',
                  f'  slowest vs fastest profiled step: {m["slow_vs_fast"]["verdict"]}']
        lines += [f'    {k}: {v:+.2f} ms' for k, v in m['slow_vs_fast']['parts_ms'].items()]
        lines += [f'    {k["slow_ms"] - k["fast_ms"]:+8.3f} ms  ({k["slow_count"]} vs {k["fast_count"]} calls)  '
                  f'{k["name"][:100]}' for k in m['slow_vs_fast']['kernels'][:6]]
    return '\n'.join(lines) + '\n'


def run(names: List[str], batch: int, precision: str, steps: int, warmup: int, device: torch.device,
        split_kernel: str = 'auto', out: Optional[Path] = None) -> Dict:
    rows = []
    for name in names:
        print(f'  {steps} consecutive steps of {name}, timed, then profiled', flush=True)
        rows.append(profile_steps(name, batch, precision, steps, warmup, device, split_kernel))
        print(f'    {rows[-1]["slow_vs_fast"]["verdict"]}', flush=True)
        if device.type == 'cuda':
            torch.cuda.empty_cache()
    section = {'device': device.type, 'precision': precision, 'batch': batch, 'split_kernel': split_kernel,
               'rows': rows}
    if out is not None:
        path = out.with_name(f'{out.stem}-steps.txt')
        path.write_text(summary(section))
        section['summary'] = path.name
    return section
