"""Ratios against the same run's baseline, the project's performance targets, and the printed tables.

Every ratio is model / baseline measured in this run, as time or bytes: above 1 is slower or larger.
A whole model's time ratio is the median of its per-block ratios (each block's median step against
the baseline's block of the same round), reported with their interquartile range; a ratio whose
range spans more than SPREAD_LIMIT of its median is flagged unsteady. Other ratios are of medians.
A target is PASS or MISS with the measured ratio, or n/a with what it needs.
"""
import statistics
from typing import Dict, List, Optional, Sequence

from .measure import fmt_mb, summarize

SPREAD_LIMIT = 0.03  # interquartile range of the per-block ratios, as a share of their median
AGREEMENT_LIMIT = 0.02  # the model section's training ratio against the steps section's consecutive steps

# (name, section, measured quantity, limit, needs): `needs` are run settings the target is defined for (a tuple:
# any of them).
# Ratios are model / baseline (limit in ×); `other_ms_more` is a difference in milliseconds per step.
GPU = {'device': 'cuda', 'precision': ('bf16', 'fp16'), 'batch': 256}
TARGETS = (
    ('CPU fp32 training step time', 'model', 'train_time', 1.10, {'device': 'cpu', 'precision': 'fp32'}),
    ('CPU fp32 training peak memory', 'model', 'train_memory', 1.05, {'device': 'cpu', 'precision': 'fp32'}),
    ('GPU 16-bit b256 training step time', 'model', 'train_time', 1.00, GPU),
    ('GPU 16-bit b256 training peak memory', 'model', 'train_memory', 1.05, GPU),
    ('GPU 16-bit b256 inference time', 'model', 'infer_time', 1.03, GPU),
    ('GPU 16-bit b256 compiled training step time', 'compile', 'train_time', 1.00, GPU),
    ('GPU 16-bit b256 compiled training peak memory', 'compile', 'train_memory', 1.05, GPU),
    ('GPU 16-bit b256 compiled inference time', 'compile', 'infer_time', 1.03, GPU),
    ('GPU attention layer fwd+bwd at 197 tokens vs SDPA', 'layer', 'fwd_bwd_time', 1.25,
     {'device': 'cuda', 'precision': 'bf16'}),
    ('GPU attention layer fwd at 197 tokens vs SDPA', 'layer', 'fwd_time', 1.10, {'device': 'cuda', 'precision': 'bf16'}),
    ('attention layer fwd+bwd at 197 tokens vs SDPA', 'layer', 'fwd_bwd_time', 1.6, {'device': 'cpu'}),
    ('no N×N matrix on the default path at 4096 tokens', 'layer', 'no_nn_4096', None, {}),
    ('GPU profile: attention kernel time vs the baseline\'s', 'profile', 'attention_time', 1.3, GPU),
    ('GPU profile: other non-GEMM time over the baseline\'s (ms per step)', 'profile', 'other_ms_more', 1.0, GPU),
    ('training loader samples/s, plain / with data accounting', 'data', 'accounting', 1.01, {}),
    ('data accounting\'s own CPU per sample, as a slowdown of a worker core', 'data', 'accounting_stages', 1.01, {}),
    ('data_backend device: worker CPU per sample vs open_clip\'s pipeline', 'data', 'worker_cpu', 0.2, {}),
)
SECTION_KEY = {'model': 'models', 'compile': 'models', 'layer': 'layers', 'profile': 'profile', 'data': 'data'}


def block_ratio(model_blocks: Sequence[Sequence[float]], base_blocks: Sequence[Sequence[float]]) -> Dict:
    """The per-block ratios model / baseline (each block's median step, blocks of the same round paired) as a
    summary, with `rel_iqr` = (q3 − q1) / median and `unsteady` when that is over SPREAD_LIMIT."""
    stats = summarize([statistics.median(a) / statistics.median(b) for a, b in zip(model_blocks, base_blocks)])
    stats['rel_iqr'] = (stats['q3'] - stats['q1']) / stats['median']
    stats['unsteady'] = stats['rel_iqr'] > SPREAD_LIMIT
    return stats


def _ratios(rows: List[Dict], baseline: str) -> None:
    b = {r['model']: r for r in rows}[baseline]
    for r in rows:
        r['ratio_spread'] = {'train_time': block_ratio(r['train']['blocks'], b['train']['blocks']),
                             'infer_time': block_ratio(r['infer']['blocks'], b['infer']['blocks'])}
        r['ratios'] = {
            'train_time': r['ratio_spread']['train_time']['median'],
            'train_memory': r['train']['peak_bytes'] / b['train']['peak_bytes'],
            'infer_time': r['ratio_spread']['infer_time']['median'],
            'infer_memory': r['infer']['peak_bytes'] / b['infer']['peak_bytes'],
        }


def add_model_ratios(section: Dict, baseline: str) -> None:
    """ratios = model / baseline for training step time, training peak memory, inference time and
    memory; for compiled models, against the compiled baseline."""
    section['baseline'] = baseline
    _ratios(section['rows'], baseline)
    if 'compile' in section:
        _ratios(section['compile']['rows'], baseline)


def steps_agreement(results: Dict) -> Optional[List[Dict]]:
    """Per model in both the model and the steps sections: its training time ratio from the blocks against the
    ratio of the steps section's medians of consecutive steps (the baseline's from the same section), and
    whether they agree within AGREEMENT_LIMIT. None unless both sections ran with the baseline."""
    models, steps = results.get('models'), results.get('steps')
    if not models or not steps:
        return None
    medians = {r['model']: r['timed']['time_s']['median'] for r in steps['rows']}
    base = models['baseline']
    if base not in medians:
        return None
    rows = []
    for r in models['rows']:
        if r['model'] in medians:
            consecutive = medians[r['model']] / medians[base]
            difference = r['ratios']['train_time'] / consecutive - 1
            rows.append({'model': r['model'], 'blocks_ratio': r['ratios']['train_time'],
                         'consecutive_ratio': consecutive, 'difference': difference,
                         'agrees': abs(difference) <= AGREEMENT_LIMIT})
    return rows


def _measure(results: Dict, section: str, quantity: str, target_model: str):
    """(measured value or None, detail) of one target from the sections that ran."""
    data = results.get(SECTION_KEY[section])
    if section == 'compile':
        data = None if data is None else data.get('compile')
    if data is None:
        return None, f'needs the {section} section' + (' (--compile)' if section == 'compile' else '')
    if section == 'data' and quantity == 'worker_cpu':
        w = data.get('worker_cpu')
        if w is None:
            return None, 'needs the data section\'s worker_cpu'
        return w['ratio'], (f'{w["device_cpu_s_per_sample"] * 1e3:.2f} ms against '
                            f'{w["open_clip_cpu_s_per_sample"] * 1e3:.2f} ms per sample; the device side '
                            f'{w["device_s_per_batch"] * 1e3:.1f} ms per batch of {w["batch"]} on {w["device"]}')
    if section == 'data' and quantity == 'accounting_stages':
        st = data['accounting']['stages']
        return data['accounting']['stage_slowdown'], (
            f'{st["accounting_cpu_s_per_sample"] * 1e6:.1f} µs of counting stages per sample (plain stages '
            f'{st["plain_cpu_s_per_sample"] * 1e6:.1f} µs) against a core\'s share of plain samples/s')
    if section == 'data':
        a = data['accounting']
        cpu = f'worker CPU per batch {a["cpu_ratio"]:.3f}x, ' if a.get('cpu_ratio') else ''
        return a['slowdown'], (f'medians of {a["reps"]} reads, {a["workers"]} workers, {a["shards"]:,} shards of '
                               f'{a["per_shard"]:,}; {cpu}journal {a["journal_bytes_per_epoch"] / 1e6:,.1f} MB per epoch')
    if section in ('model', 'compile', 'profile'):
        rows = {r['model']: r for r in data['rows']}
        if target_model not in rows:
            return None, f'needs {target_model} in --models'
        row = rows[target_model]
        value = row['vs_baseline'][quantity] if section == 'profile' else row['ratios'][quantity]
        baseline = data.get('baseline') or results['models']['baseline']
        detail = f'{target_model} / {baseline}' + (' (compiled)' if section == 'compile' else '')
        spread = row.get('ratio_spread', {}).get(quantity)
        if spread:
            detail += (f', per-block IQR {spread["q1"]:.3f}-{spread["q3"]:.3f}'
                       + (f' UNSTEADY (over {SPREAD_LIMIT:.0%})' if spread['unsteady'] else ''))
        return value, detail
    tokens = 4096 if quantity == 'no_nn_4096' else 197
    rows = [r for r in data['rows'] if r['variant'] == 'split-fused' and r['tokens'] == tokens and not r.get('causal')]
    if not rows:
        return None, f'needs {tokens} in --tokens'
    r = rows[0]
    kernel = f'split_kernel {data.get("split_kernel", "auto")}'
    if quantity == 'no_nn_4096':
        return r['peak_bytes'] / r['nn_bytes'], (
            f'peak {fmt_mb(r["peak_bytes"])} MB vs one N×N set {fmt_mb(r["nn_bytes"])} MB, '
            f'{"/".join(r["sdpa_backends"]) or "no SDPA"}, {kernel}')
    return r['ratios'][quantity], f'split-fused / sdpa, {kernel}'


def evaluate_targets(results: Dict, target_model: str) -> List[Dict]:
    cfg = results['config']
    out = []
    for name, section, quantity, limit, needs in TARGETS:
        row = {'target': name, 'model': target_model if section != 'layer' else 'split-fused'}
        unmet = [f'{k} {"/".join(map(str, v)) if isinstance(v, tuple) else v}' for k, v in needs.items()
                 if str(cfg[k]) not in (tuple(map(str, v)) if isinstance(v, tuple) else (str(v),))]
        measured, detail = (None, f'needs {", ".join(unmet)}') if unmet else _measure(
            results, section, quantity, target_model)
        if quantity == 'no_nn_4096':
            limit = 1.0
        if measured is None:
            status = 'n/a'
        else:
            passed = measured < limit if quantity == 'no_nn_4096' else measured <= limit
            status = 'PASS' if passed else 'MISS'
        unit = 'ms' if quantity == 'other_ms_more' else 'x'
        out.append({**row, 'limit': limit, 'unit': unit, 'ratio': measured, 'status': status, 'detail': detail})
    return out


def _table(header: List[str], rows: List[List[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = ['  '.join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths)))]
    lines.append('  '.join('-' * w for w in widths))
    for r in rows:
        lines.append('  '.join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    return '\n'.join(lines)


def _spread(stats: Dict, fmt: str = '{:,.1f}') -> str:
    return f'{fmt.format(stats["median"])} [{fmt.format(stats["min"])}-{fmt.format(stats["max"])}]'


def _ms(seconds: Dict) -> str:
    return _spread({k: seconds[k] * 1e3 for k in ('median', 'min', 'max')}, '{:,.2f}')


def _ratio(x: Optional[float]) -> str:
    return '-' if x is None else f'{x:.2f}x'


def _count(n: Optional[int]) -> str:
    return '-' if n is None else str(n)


def _block_ratio(row: Dict, quantity: str) -> str:
    """A time ratio with the interquartile range of its per-block ratios; `!` marks an unsteady one."""
    s = row.get('ratio_spread', {}).get(quantity)
    if s is None:
        return _ratio(row['ratios'][quantity])
    return f'{s["median"]:.3f}x [{s["q1"]:.3f}-{s["q3"]:.3f}]' + ('!' if s['unsteady'] else '')


def _unsteady_note(rows: List[Dict]) -> List[str]:
    flagged = [f'{r["model"]} {q}' for r in rows for q, s in r.get('ratio_spread', {}).items() if s['unsteady']]
    if not flagged:
        return []
    return [f'  ! unsteady (per-block ratios spread over {SPREAD_LIMIT:.0%} of their median): {", ".join(flagged)}']


def render(results: Dict) -> str:
    out = []
    env, cfg = results['environment'], results['config']
    out.append(f'diffzoo.bench on {env["device"]} ({cfg["device"]}, {cfg["precision"]}, batch {cfg["batch"]}, '
               f'torch {env["torch"]}, {env["torch_threads"]} threads'
               + (f', TF32 {"on" if env.get("tf32_matmul") else "off"}' if cfg['device'] == 'cuda' else '') + ')')
    models = results.get('models')
    if models:
        out.append(f'\nWhole model (per step, median [min-max] over {models["blocks"]} interleaved blocks of '
                   f'{models["block_steps"]} consecutive steps per model; ratios vs {models["baseline"]}, time or '
                   f'bytes, >1 = slower/larger; time ratios: median [IQR] of the per-block ratios)')
        rows = [[r['model'], f'{r["params"] / 1e6:.1f}M', _spread(r['train']['samples_per_s']),
                 _block_ratio(r, 'train_time'), fmt_mb(r['train']['peak_bytes']), _ratio(r['ratios']['train_memory']),
                 _spread(r['infer']['images_per_s']), _block_ratio(r, 'infer_time'),
                 '/'.join(r['train']['sdpa_backends']) or '-']
                for r in models['rows']]
        out.append(_table(['model', 'params', 'train samples/s', 'x time', 'train peak MB', 'x mem',
                           'infer images/s', 'x time', 'SDPA backends (train)'], rows))
        out.extend(_unsteady_note(models['rows']))
        comp = models.get('compile')
        if comp:
            out.append('\ntorch.compile (both towers; speed-up = eager median / compiled median; x = vs the compiled baseline)')
            rows = [[r['model'], _spread(r['train']['samples_per_s']), f'{r["train"]["speedup"]:.2f}x',
                     _block_ratio(r, 'train_time'), fmt_mb(r['train']['peak_bytes']),
                     _ratio(r['ratios']['train_memory']), _spread(r['infer']['images_per_s']),
                     f'{r["infer"]["speedup"]:.2f}x', _block_ratio(r, 'infer_time'),
                     _count(r['graph_breaks']), _count(r['graph_breaks_in_attention'])] for r in comp['rows']]
            out.append(_table(['model', 'train samples/s', 'speed-up', 'x time', 'train peak MB', 'x mem',
                               'infer images/s', 'speed-up', 'x time', 'graph breaks', 'in attention'], rows))
            met = comp['graph_breaks_while_running_all_models']
            out.append(f'graph breaks met while the compiled models ran: {met}')
            out.extend(_unsteady_note(comp['rows']))
    agreement = results.get('steps_agreement')
    if agreement:
        out.append(f'\nTraining time ratio vs {models["baseline"]}: the model section\'s blocks against the steps '
                   f'section\'s consecutive steps (agreeing within {AGREEMENT_LIMIT:.0%})')
        out.append(_table(['model', 'blocks', 'consecutive steps', 'difference', 'agree'],
                          [[a['model'], f'{a["blocks_ratio"]:.3f}x', f'{a["consecutive_ratio"]:.3f}x',
                            f'{a["difference"]:+.1%}', 'yes' if a['agrees'] else 'NO'] for a in agreement]))
    layers = results.get('layers')
    if layers:
        out.append(f'\nAttention layer alone, width {layers["dim"]} (ms median [min-max]; ratios vs sdpa at the same N; '
                   f'N×N = B·maps·N²·bytes; N×N? yes/no/? = held / not held / inconclusive)')
        rows = [[r['variant'], f'{r["tokens"]}{" causal" if r.get("causal") else ""}', str(r['batch']), _ms(r['fwd_bwd_s']),
                 _ratio(r['ratios']['fwd_bwd_time']), _ms(r['fwd_s']),
                 _ratio(r['ratios']['fwd_time']), fmt_mb(r['peak_bytes']), fmt_mb(r['nn_bytes']),
                 {True: 'yes', False: 'no', None: '?'}[r['materialises_nn']], '/'.join(r['sdpa_backends']) or '-']
                for r in layers['rows']]
        out.append(_table(['variant', 'N', 'B', 'fwd+bwd ms', 'x', 'fwd ms', 'x', 'peak MB', 'N×N MB',
                           'N×N?', 'SDPA backend'], rows))
    data = results.get('data')
    if data:
        out.append(f'\nData pipeline ({data["source"]}; {data["shards"]} shards; preprocess of {data["model"]})')
        rows = [[str(r['workers']), f'{r["images_per_s"]:,.1f}', f'{r["images_per_s_per_worker"]:,.1f}',
                 str(r['images_timed'])] for r in data['rows']]
        out.append(_table(['workers', 'images/s', 'images/s per worker', 'images timed'], rows))
        w = data.get('worker_cpu')
        if w:
            out.append(f'\nWorker CPU per sample, one pass of {w["samples"]} samples with one torch thread; the device '
                       f'side per batch of {w["batch"]} on {w["device"]} (decode, crop, resize, normalise)')
            out.append(_table(['open_clip pipeline', 'data_backend device', 'ratio', 'device ms per batch',
                               'its CPU ms', 'ms per image / batched'],
                              [[f'{w["open_clip_cpu_s_per_sample"] * 1e3:.3f} ms',
                                f'{w["device_cpu_s_per_sample"] * 1e3:.3f} ms', f'{w["ratio"]:.3f}x',
                                f'{w["device_s_per_batch"] * 1e3:.1f}',
                                f'{w["device_cpu_s_per_batch"] * 1e3:.1f}',
                                f'{w["device_s_per_batch_per_image"] * 1e3:.1f} / '
                                f'{w["device_s_per_batch_batched"] * 1e3:.1f}']]))
        a = data.get('accounting')
        if a:
            out.append(f'\nTraining loader with and without data accounting ({a["shards"]:,} shards of {a["per_shard"]:,} '
                       f'in sizes.json, {a["workers"]} workers, batch {a["batch"]}, {a["batches_timed"]} batches per read, '
                       f'{a["reps"]} reads each; samples/s median [min-max])')
            rows = [['plain open_clip_train', _spread(a['plain_samples_per_s']), '-'],
                    ['diffzoo accounting', _spread(a['accounted_samples_per_s']),
                     f'{a["journal_bytes_per_sample"]:.1f} B/sample, {a["journal_bytes_per_epoch"] / 1e6:,.1f} MB per '
                     f'epoch of {a["epoch_samples"]:,}']]
            out.append(_table(['loader', 'samples/s', 'journal'], rows))
    train = results.get('train')
    if train:
        out.append(f'\nscripts/train.sh end to end ({train["processes"]} process(es), batch {train["batch_per_gpu"]} per GPU, '
                   f'{train["samples"]} synthetic {train["image_size"]} px samples, first {train["warmup_steps"]} steps '
                   f'dropped; data share = Data (t) / Batch (t), the loader limits a run above '
                   f'{train["loader_bound_share"]:.0%})')
        rows = [[r['recipe'], str(r['steps_timed']), _spread(r['images_per_s_per_gpu']),
                 _spread({k: r['data_share'][k] * 100 for k in ('median', 'min', 'max')}) + ' %',
                 'yes' if r['loader_bound'] else 'no'] for r in train['rows']]
        out.append(_table(['recipe', 'steps', 'images/s per GPU', 'data share', 'loader-bound'], rows))
        out.append(f'  step time {train["recipes"][0]} / {train["baseline"]}: {train["train_time_ratio"]:.2f}x')
    prof = results.get('profile')
    if prof:
        out.append(f'\nOne training step profiled (ms of {"GPU kernel" if cfg["device"] == "cuda" else "CPU op self"} '
                   f'time; vs {prof["baseline"]})')
        rows = [[r['model'], f'{r["attention_ms"]:,.2f}', _ratio(r['vs_baseline']['attention_time']),
                 f'{r["gemm_ms"]:,.2f}', f'{r["other_ms"]:,.2f}', f'{r["vs_baseline"]["other_ms_more"]:+,.2f}',
                 f'{r["total_ms"]:,.2f}'] for r in prof['rows']]
        out.append(_table(['model', 'attention', 'x', 'gemm', 'other', 'other vs base', 'total'], rows))
        out.append('  other vs base: the model\'s other time minus the baseline\'s, in ms; below 0 where the model '
                   'spends less outside attention and GEMMs (work its fused attention op does inside)')
    targets = results.get('targets')
    if targets and cfg.get('smoke'):
        out.append('\nTargets: not judged in --smoke (tiny models, one short read each: the ratios say nothing '
                   'about the targets; run without --smoke on the device)')
    elif targets:
        out.append('\nTargets')
        for t in targets:
            unit = t.get('unit', 'x')
            limit = '' if t['limit'] is None else f' (limit {t["limit"]:.2f}{unit})'
            ratio = '' if t['ratio'] is None else f' {t["ratio"]:.2f}{unit}'
            out.append(f'  {t["status"]:<4}  {t["target"]}:{ratio}{limit}  {t["detail"]}')
    return '\n'.join(out)
