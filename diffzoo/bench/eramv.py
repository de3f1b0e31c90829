"""python -m diffzoo.bench.eramv: eRAM-V's FLOPs and latency against the full-token model of the same parts.

`cost_report(models, pixel_values, input_ids)` counts forward FLOPs (`eramv_paper.flop_counter`), in
total and per part (vision tower, projector, post-MLP, language model: eRAM-V saves in the last), and
times forward passes with the bench's timer (`measure.time_call`, which synchronises CUDA), with
ratios against the first model (the full-token one). `generation_report` times greedy generation with
the KV cache: time to first token (image, prefill and one token: `generate(max_new_tokens=1)`) and
tokens/s over --new-tokens tokens with no end-of-sequence stop, so every call makes that many.

    python -m diffzoo.bench.eramv [--sizes 7b 13b] [--out report.json]
    python -m diffzoo.bench.eramv --model VISION LM_DIR [--anchors 64] [--select-layer -2]
        [--projector mlp2x_gelu] [--device cuda] [--new-tokens 32] [--out report.json]

Without --model: the paper's efficiency tables (Table 1, Table 10) recounted at its shapes on the meta device,
FLOPs only, beside its figures, with the prompt lengths and the convention that reconcile them
(`diffzoo.bench.eramv_paper`). With --model: FLOPs and latency of a real model pair.

Both models take the same visual features and projector (eRAM-V's by default: the penultimate block's
output, LLaVA-1.5's two-layer MLP), so the difference is eRAM-V's integration alone.
"""
from __future__ import annotations  # torch's types in the signatures, torch imported on use

import argparse
import json
import sys
from typing import Dict, List, Optional


def cost_report(models: Dict[str, 'torch.nn.Module'], pixel_values: 'torch.Tensor', input_ids: 'torch.Tensor',
                reps: int = 5) -> Dict:
    """Forward FLOPs (total and per top-level part: vision, projector, post_mlp, language_model) and the
    median latency of each model on the same inputs; ratios against the first model."""
    # heavy (torch): imported on use so that the command's --help answers at once
    import torch

    from .eramv_paper import flop_counter
    from .measure import summarize, time_call
    rows = {}
    for name, model in models.items():
        model.eval()
        with torch.no_grad():
            counter = flop_counter()
            with counter:
                out = model(pixel_values, input_ids)
            counts = counter.get_flop_counts()
            parts = {child: sum(counts.get(f'{type(model).__name__}.{child}', {}).values())
                     for child, _ in model.named_children()}
            model(pixel_values, input_ids)  # warm-up
            latency = summarize([time_call(lambda: model(pixel_values, input_ids), pixel_values.device)
                                 for _ in range(reps)])
        rows[name] = {'flops': counter.get_total_flops(), 'flops_by_part': parts, 'latency_s': latency['median'],
                      'latency': latency, 'sequence_length': out.logits.shape[1]}
    first = next(iter(rows.values()))
    for r in rows.values():
        r['flops_ratio'] = r['flops'] / first['flops']
        r['language_model_flops_ratio'] = r['flops_by_part']['language_model'] / first['flops_by_part']['language_model']
        r['latency_ratio'] = r['latency_s'] / first['latency_s']
    return rows


def generation_report(models: Dict[str, 'torch.nn.Module'], pixel_values: 'torch.Tensor', input_ids: 'torch.Tensor',
                      new_tokens: int, reps: int = 5) -> Dict:
    """Per model: time to first token and tokens/s of greedy generation (medians of `reps` calls after
    one warm-up), and tokens/s of the decoding alone (the tokens after the first, over the time after it)."""
    import torch

    from .measure import summarize, time_call
    rows = {}
    device = pixel_values.device
    batch = input_ids.shape[0]
    for name, model in models.items():
        model.eval()
        with torch.no_grad():
            model.generate(pixel_values, input_ids, max_new_tokens=2)  # warm-up
            first = summarize([time_call(lambda: model.generate(pixel_values, input_ids, max_new_tokens=1), device)
                               for _ in range(reps)])
            whole = summarize([time_call(lambda: model.generate(pixel_values, input_ids, max_new_tokens=new_tokens),
                                         device) for _ in range(reps)])
        decode_s = whole['median'] - first['median']
        rows[name] = {'ttft_s': first['median'], 'ttft': first, 'generate_s': whole['median'], 'generate': whole,
                      'new_tokens': new_tokens, 'tokens_per_s': batch * new_tokens / whole['median'],
                      'decode_tokens_per_s': batch * (new_tokens - 1) / decode_s if new_tokens > 1 and decode_s > 0
                      else None}
    return rows


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog='python -m diffzoo.bench.eramv', description=__doc__.split('\n')[0])
    p.add_argument('--sizes', nargs='+', choices=('7b', '13b'), default=['7b', '13b'],
                   help="without --model: the paper's LLM sizes to recount (default both)")
    p.add_argument('--model', nargs=2, metavar=('VISION', 'LM_DIR'), default=None,
                   help='the VLM: its vision tower (open_clip name[,pretrained] or timm:<name> with a CLS token) '
                        'and a local transformers causal LM directory')
    p.add_argument('--anchors', type=int, default=64)
    p.add_argument('--select-layer', default='-2', metavar='LAYER',
                   help="both models' visual features: a block counted from the end (-2, the penultimate, "
                        "eRAM-V's) or from 1, or final_norm (the last block through the tower's final norm)")
    p.add_argument('--projector', default='mlp2x_gelu', choices=('mlp2x_gelu', 'linear'),
                   help="both models' projector (mlp2x_gelu: LLaVA-1.5's, eRAM-V's; linear: PaliGemma's)")
    p.add_argument('--inject-layers', type=int, nargs='*', help="decoder layers counted from 1, as eRAM-V does (default: every second layer 8-22 of 32, scaled to the depth)")
    p.add_argument('--prompt-tokens', type=int, default=32)
    p.add_argument('--batch', type=int, default=1)
    p.add_argument('--reps', type=int, default=5)
    p.add_argument('--device', default='cpu', help='cpu, cuda or cuda:N: where both models run (default cpu)')
    p.add_argument('--new-tokens', type=int, default=32,
                   help='greedy tokens per generation timed for tokens/s (default 32; 0: no generation timing)')
    p.add_argument('--out', metavar='FILE', help='write the report as JSON')
    return p


def main(argv: Optional[List[str]] = None) -> int:
    p = parser()
    a = p.parse_args(argv)
    if a.model is None:
        model_only = [f'--{k.replace("_", "-")}' for k, v in vars(a).items()
                      if k not in ('model', 'sizes', 'out') and v != p.get_default(k)]
        if model_only:
            p.error(f'{" ".join(model_only)} apply to a model pair: add --model VISION LM_DIR, or leave them out to '
                    f'recount the paper\'s tables')
        return _paper(a.sizes, a.out)
    a.vision, a.language_model = a.model
    del a.model
    if a.select_layer != 'final_norm':
        try:
            a.select_layer = int(a.select_layer)
        except ValueError:
            p.error(f'--select-layer {a.select_layer}: expected a block number (-2: the penultimate) or final_norm')
    print(f'loading torch and transformers, then the language model {a.language_model} twice (full and eRAM-V) '
          f'with the tower {a.vision}', flush=True)
    # heavy (torch, transformers): imported after parsing so that --help answers at once
    import torch
    import transformers

    from diffzoo.vlm.model import build_vlm

    from .measure import BenchError, device_name, resolve_device
    try:
        device = resolve_device(a.device)
    except BenchError as exc:
        p.error(str(exc))
    if a.new_tokens < 0:
        p.error(f'--new-tokens {a.new_tokens}: must be 0 or more')
    models = {}
    for integration in ('full', 'eramv'):
        print(f'building the {integration} model', flush=True)
        lm = transformers.AutoModelForCausalLM.from_pretrained(a.language_model)
        torch.manual_seed(0)  # the same tower and projector in both
        kw = {'anchors': a.anchors, 'inject_layers': a.inject_layers} if integration == 'eramv' else {}
        models[integration] = build_vlm(a.vision, lm, integration, select_layer=a.select_layer,
                                        projector=a.projector, **kw).to(device)
    h, w = models['full'].vision.image_size
    g = torch.Generator().manual_seed(0)
    pixels = torch.randn(a.batch, 3, h, w, generator=g).to(device)
    ids = torch.randint(0, lm.config.get_text_config().vocab_size, (a.batch, a.prompt_tokens), generator=g).to(device)
    print(f'timing {a.reps} forward passes of each model on {device_name(device)} (batch {a.batch}, '
          f'{a.prompt_tokens} prompt tokens)', flush=True)
    report = cost_report(models, pixels, ids, a.reps)
    with torch.no_grad():
        visual_tokens = models['full'].vision(pixels[:1]).shape[1]
    report['config'] = {**vars(a), 'inject_layers': models['eramv'].inject_layers, 'visual_tokens': visual_tokens,
                        'device_name': device_name(device)}
    if a.new_tokens:
        print(f'timing greedy generation of {a.new_tokens} tokens', flush=True)
        for name, row in generation_report(models, pixels, ids, a.new_tokens, a.reps).items():
            report[name].update(row)
    print(f'\n{"model":<7}{"sequence":>9}{"GFLOPs":>9}{"LM GFLOPs":>11}{"x FLOPs":>9}{"x LM":>7}{"ms":>9}{"x time":>8}')
    for name in ('full', 'eramv'):
        r = report[name]
        print(f'{name:<7}{r["sequence_length"]:>9}{r["flops"] / 1e9:>9.3f}{r["flops_by_part"]["language_model"] / 1e9:>11.3f}'
              f'{r["flops_ratio"]:>9.2f}{r["language_model_flops_ratio"]:>7.2f}{r["latency_s"] * 1e3:>9.1f}'
              f'{r["latency_ratio"]:>8.2f}')
    if a.new_tokens:
        print(f'\n{"model":<7}{"TTFT ms":>9}{"tokens/s":>10}{"decode tokens/s":>17}')
        for name in ('full', 'eramv'):
            r = report[name]
            decode = '-' if r['decode_tokens_per_s'] is None else f'{r["decode_tokens_per_s"]:.1f}'
            print(f'{name:<7}{r["ttft_s"] * 1e3:>9.2f}{r["tokens_per_s"]:>10.1f}{decode:>17}')
    print(f'anchors {a.anchors} of {report["config"]["visual_tokens"]} visual tokens, injected at layers '
          f'{models["eramv"].inject_layers}, on {device_name(device)}')
    if a.out:
        with open(a.out, 'w') as f:
            json.dump(report, f, indent=1)
        print(f'report: {a.out}')
    sys.stdout.flush()
    return 0


def _paper(sizes: List[str], out: Optional[str]) -> int:
    print(f'counting forward FLOPs at the paper\'s shapes on the meta device ({", ".join(sizes)}): loading torch and '
          f'transformers, then one model per size (a minute on 2 cores)', flush=True)
    from . import eramv_paper
    report = eramv_paper.reconcile(sizes)
    print(eramv_paper.render(report))
    if out:
        with open(out, 'w') as f:
            json.dump(report, f, indent=1)
        print(f'report: {out}')
    sys.stdout.flush()
    return 0


if __name__ == '__main__':
    sys.exit(main())
