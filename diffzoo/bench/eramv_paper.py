"""eRAM-V's efficiency tables (Table 1, Table 10) recounted at the paper's shapes, on the CPU, with no weights.

The models are built on the meta device: CLIP ViT-L/14 at 336 px as timm builds it
(`vit_large_patch14_clip_336`: 576 patches and a class token), LLaVA-1.5's projector (`mlp2x_gelu`) and a
Vicuna-7B- or 13B-shaped Llama (hidden 4096 / 5120, MLP 11008 / 13824, 32 / 40 layers and heads, vocabulary
32,000). Rows, each through `build_vlm` (so what is counted is what runs):

- `llava`: LLaVA-1.5, every visual token in the sequence (`integration="full"`, the penultimate block's
  features, the two-layer projector, causal attention);
- `eramv`: eRAM-V (65 anchors, the features injected at layers 8, 10, …, 22 of 32, or the scaled ones);
- `eramv_no_ca`: eRAM-V without its cross-attention, the injection ("w/o CA", Table 10: `inject_layers=[]`);
- `eramv_no_ar`: eRAM-V without its anchors in the input ("w/o AR", Table 10: `anchors=0, include_cls=False`).

Forward FLOPs are counted by `torch.utils.flop_counter` (`flop_counter`: 2 per multiply-accumulate of matmuls,
convolutions and attention, attention over every query-key pair as torch counts it, causal or not; norms,
activations, softmax and rotary embeddings are not counted) for one image and a prompt of T tokens. The paper
gives neither its convention nor its prompt length; `reconcile` finds the prompt length at which our LLaVA-1.5
count equals its Table 1 figure, under FLOPs (2 per MAC) and under MACs, and every other row is read at that
length beside the paper's.
"""
import functools
from typing import Dict, Optional

# Table 1 (TFLOPs, LLaVA-1.5 and eRAM-V with Vicuna-7B / -13B at 336 px) and Table 10 (7B ablations)
PAPER = {
    '7b': {'llava': 13.32, 'eramv': 4.43, 'eramv_no_ca': 3.54, 'eramv_no_ar': 2.56},
    '13b': {'llava': 25.14, 'eramv': 8.17},
}
LLMS = {  # Vicuna v1.5 (Llama 2) shapes
    '7b': dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32),
    '13b': dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40),
}
VISION = 'vit_large_patch14_clip_336'
ROWS = {
    'llava': dict(integration='full', select_layer=-2, projector='mlp2x_gelu', sequence_mask='causal'),
    'eramv': dict(integration='eramv'),
    'eramv_no_ca': dict(integration='eramv', inject_layers=[]),
    'eramv_no_ar': dict(integration='eramv', anchors=0, include_cls=False),
}


def meta_models(size: str, rows=tuple(ROWS)) -> Dict:
    """{row: VisionLanguageModel} at the paper's shapes on the meta device (module docstring)."""
    import timm
    import torch
    import transformers

    from diffzoo.vlm.model import build_vlm
    models = {}
    with torch.device('meta'):
        tower = timm.create_model(VISION, pretrained=False)
        config = transformers.LlamaConfig(vocab_size=32000, max_position_embeddings=4096, **LLMS[size])
        config._attn_implementation = 'sdpa'
        lm = transformers.AutoModelForCausalLM.from_config(config)
        for row in rows:
            settings = dict(ROWS[row])
            models[row] = build_vlm(tower, lm, settings.pop('integration'), **settings).eval()
    return models


def flop_counter():
    """torch's FlopCounterMode, counting CPU SDPA too: its formula table has the CUDA SDPA kernels but not
    `_scaled_dot_product_flash_attention_for_cpu`, which would count attention as nothing on the CPU. Attention
    is counted over every (query, key) pair, causal or not, as torch counts it on CUDA."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

    def cpu_sdpa(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        return sdpa_flop_count(query_shape, key_shape, value_shape)
    return FlopCounterMode(display=False,
                           custom_mapping={torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: cpu_sdpa})


def count(model, prompt_tokens: int, batch: int = 1) -> Dict:
    """Forward FLOPs of `model` on `batch` images and prompts of `prompt_tokens` tokens: total, per top-level part,
    and the sequence length the language model ran."""
    import torch
    device = next(model.parameters()).device
    h, w = model.vision.image_size
    pixels = torch.empty(batch, 3, h, w, device=device)
    ids = torch.zeros(batch, prompt_tokens, dtype=torch.long, device=device)
    counter = flop_counter()
    with counter, torch.no_grad():
        out = model(pixels, ids)
    counts = counter.get_flop_counts()
    parts = {child: sum(counts.get(f'{type(model).__name__}.{child}', {}).values()) for child, _ in model.named_children()}
    return {'flops': counter.get_total_flops(), 'flops_by_part': parts, 'sequence_length': out.logits.shape[1]}


def _solve(f, target: float, low: int = 1, high: int = 4096) -> Optional[int]:
    """The integer T in [low, high] at which the increasing function f(T) comes nearest `target`, or None when
    `target` lies outside [f(low), f(high)]."""
    if not f(low) <= target <= f(high):
        return None
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if f(mid) <= target else (low, mid)
    return low if target - f(low) <= f(high) - target else high


def reconcile(sizes=('7b', '13b'), prompts=(64, 128, 256)) -> Dict:
    """Every row at `prompts`, and at the prompt lengths that reconcile our counts with the paper's: where our
    LLaVA-1.5 counts Table 1's figure, counted in FLOPs (2 per MAC) and in MACs, and where our eRAM-V / LLaVA-1.5
    ratio is the paper's ('ratio', in FLOPs); beside each row the paper's figure. `costs`: what the anchors and the
    injection add to eRAM-V at the FLOPs fit, ours and as Table 10's differences imply."""
    report = {'vision': VISION, 'projector': 'mlp2x_gelu', 'counter': 'torch.utils.flop_counter, 2 FLOPs per MAC',
              'sizes': {}}
    for size in sizes:
        models = meta_models(size, [r for r in ROWS if r in PAPER[size]])
        # each (model, prompt length) counted once: the searches and the rows read the same counts
        counted = {name: functools.lru_cache(maxsize=None)(lambda t, m=m: count(m, t)) for name, m in models.items()}
        rows = {name: {str(t): counted[name](t) for t in prompts} for name in models}
        flops = {name: (lambda t, name=name: counted[name](t)['flops']) for name in models}
        paper_ratio = PAPER[size]['eramv'] / PAPER[size]['llava']
        fits = {}
        for convention, per_tflop in (('flops', 1e12), ('macs', 2e12), ('ratio', 1e12)):
            if convention == 'ratio':
                t = _solve(lambda t: flops['eramv'](t) / flops['llava'](t), paper_ratio)
            else:
                t = _solve(flops['llava'], PAPER[size]['llava'] * per_tflop)
            fits[convention] = {'prompt_tokens': t}
            if t is None:
                continue
            for name in models:
                c = counted[name](t)
                fits[convention][name] = {
                    **c, 'tflops_in_convention': c['flops'] / per_tflop, 'paper_tflops': PAPER[size][name],
                    'ratio_to_llava': c['flops'] / flops['llava'](t),
                    'paper_ratio_to_llava': PAPER[size][name] / PAPER[size]['llava']}
        costs = {}
        fit = fits['flops']
        if fit['prompt_tokens'] is not None and 'eramv_no_ca' in fit:
            costs = {'anchors_tflops': (fit['eramv']['flops'] - fit['eramv_no_ar']['flops']) / 1e12,
                     'injection_tflops': (fit['eramv']['flops'] - fit['eramv_no_ca']['flops']) / 1e12,
                     'paper_anchors_tflops': PAPER[size]['eramv'] - PAPER[size]['eramv_no_ar'],
                     'paper_injection_tflops': PAPER[size]['eramv'] - PAPER[size]['eramv_no_ca'],
                     'one_token_tflops': (flops['llava'](fit['prompt_tokens'] + 1) - fit['llava']['flops']) / 1e12}
        report['sizes'][size] = {'llm': LLMS[size], 'rows': rows, 'fits': fits, 'costs': costs}
    return report


def render(report: Dict) -> str:
    out = [f'eRAM-V vs LLaVA-1.5 at the paper\'s shapes ({report["vision"]}, {report["projector"]}; '
           f'{report["counter"]}; one image)']
    for size, s in report['sizes'].items():
        for convention, fit in s['fits'].items():
            t = fit['prompt_tokens']
            if t is None:
                out.append(f'{size}: no prompt length up to 4096 gives LLaVA-1.5 {PAPER[size]["llava"]} T{convention.upper()}')
                continue
            unit = 'TMACs' if convention == 'macs' else 'TFLOPs'
            what = ("eRAM-V / LLaVA-1.5 is the paper's ratio" if convention == 'ratio'
                    else 'LLaVA-1.5 matches Table 1')
            out.append(f'\n{size}, counted in {unit}: {what} at a prompt of {t} tokens')
            out.append(f'  {"row":<12}{"sequence":>9}{"ours":>9}{"paper":>8}{"x LLaVA":>9}{"paper x":>9}')
            for name, r in fit.items():
                if name == 'prompt_tokens':
                    continue
                out.append(f'  {name:<12}{r["sequence_length"]:>9}{r["tflops_in_convention"]:>9.2f}'
                           f'{r["paper_tflops"]:>8.2f}{r["ratio_to_llava"]:>9.3f}{r["paper_ratio_to_llava"]:>9.3f}')
        c = s['costs']
        if c:
            out.append(f'\n{size} at the TFLOPs fit: one more prompt token costs {c["one_token_tflops"]:.4f} TFLOPs; the 65 '
                       f'anchors add {c["anchors_tflops"]:.2f} (Table 10: {c["paper_anchors_tflops"]:.2f}), the injection '
                       f'{c["injection_tflops"]:.2f} (Table 10: {c["paper_injection_tflops"]:.2f})')
    return '\n'.join(out)
