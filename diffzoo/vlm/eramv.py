"""eRAM-V's efficient visual integration for `build_vlm(..., integration="eramv")`.

Instead of all P visual tokens in the LLM's sequence (LLaVA/PaliGemma-style, `integration="full"`):

- Visual anchors: the k patch tokens with the highest CLS attention in the vision tower's last block
  (score of patch j = mean over heads of A[CLS, j]; for a differential tower, its A1 − λ·A2),
  re-sorted to their original order, projected by the shared projector, then fed with the text.
- Fine-grained features: all P patch tokens, projected the same way, become extra keys and values
  at the chosen decoder layers, made by each layer's own input norm and K/V projections (no new
  attention parameters; no rotary position: they are a set, keys at position 0). Text tokens attend
  to them; the anchor tokens do not (their path stays causal as before). Default layers: every
  second layer 8–22 of a 32-layer LLM, scaled to other depths: round(l · L / 32).
- Post-projection MLP on the visual tokens: v + W2·GELU(W1·v), W2 zero-initialised so the model
  starts as the plain projection.

The injected keys enter through diffzoo's attention functions (`diffzoo.vlm.differential`), so they
compose with `differentialize` (both maps then span the injected keys as well).

`cost_report(models, pixel_values, input_ids)` counts forward FLOPs (torch.utils.flop_counter), in
total and per part (vision tower, projector, post-MLP, language model: eRAM-V saves in the last), and
times forward passes, with ratios against the first model (the full-token one).
"""
import time
from contextlib import contextmanager
from typing import Dict, List, Optional, Sequence

import torch
import torch.nn as nn

REFERENCE_DEPTH = 32
REFERENCE_LAYERS = tuple(range(8, 23, 2))  # eRAM-V's injection layers in a 32-layer LLM


def default_inject_layers(depth: int) -> List[int]:
    """Every second layer 8–22 of 32, scaled to `depth` layers."""
    return sorted({min(depth - 1, round(l * depth / REFERENCE_DEPTH)) for l in REFERENCE_LAYERS})


class PostProjectionMLP(nn.Module):
    """v + W2·GELU(W1·v) on projected visual tokens; W2 = 0 at init."""

    def __init__(self, dim: int):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, dim)
        nn.init.zeros_(self.fc2.weight)
        nn.init.zeros_(self.fc2.bias)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(x)))


def cls_attention(vision, pixel_values: torch.Tensor):
    """(patch tokens (B, P, D_v), scores (B, P)): the tower's tokens and its last block's CLS attention."""
    from diffzoo.layers.maps import capture_attention_maps
    if vision.kind != 'timm' or vision.prefix_tokens < 1:
        raise ValueError('eRAM-V anchors need a vision tower with a CLS token (a timm / diffzoo ViT trunk); '
                         f'this one is {vision.kind} with {vision.prefix_tokens} prefix tokens')
    blocks = getattr(vision.tower, 'blocks', None)
    with capture_attention_maps(blocks[-1] if blocks is not None else vision.tower) as maps:
        tokens = vision(pixel_values)  # (B, P, D_v); only the map-read block runs its explicit path
    last = maps[list(maps)[-1]]  # (B, heads, N, N)
    return tokens, last[:, :, 0, vision.prefix_tokens:].float().mean(1)  # (B, P)


def select_anchors(tokens: torch.Tensor, scores: torch.Tensor, k: int):
    """(anchors (B, k, D), indices (B, k) ascending): the k best-scored tokens in their original order."""
    k = min(k, tokens.shape[1])
    index = scores.topk(k, dim=1).indices.sort(dim=1).values  # (B, k)
    return tokens.gather(1, index[..., None].expand(-1, -1, tokens.shape[-1])), index


def injected_kv(layer: nn.Module, features: torch.Tensor):
    """Keys and values (B, H_kv, P, d) of `features` (B, P, D) by a decoder layer's own norm and projections."""
    attn = layer.self_attn
    B, P, _ = features.shape
    h = layer.input_layernorm(features)
    k = attn.k_proj(h).view(B, P, -1, attn.head_dim).transpose(1, 2)
    v = attn.v_proj(h).view(B, P, -1, attn.head_dim).transpose(1, 2)
    if hasattr(attn, 'k_norm'):
        k = attn.k_norm(k)
    return k, v


@contextmanager
def injecting(decoder: nn.Module, layers: Sequence[int], features: Optional[torch.Tensor], queries: torch.Tensor):
    """Attach injected K/V to the chosen layers' attention for the calls inside; `queries` (B, L) bool
    marks the query positions allowed to read them."""
    if features is None:
        yield
        return
    attentions = [decoder.layers[i].self_attn for i in layers]
    try:
        for i, attn in zip(layers, attentions):
            k, v = injected_kv(decoder.layers[i], features)
            attn.injected_kv = (k, v, queries)
        yield
    finally:
        for attn in attentions:
            attn.injected_kv = None


def append_injected(module: nn.Module, query, key, value, attention_mask):
    """key, value with the module's injected K/V appended, and the mask extended: (key, value, mask)."""
    k, v, queries = module.injected_kv
    B, _, L, _ = query.shape
    S = key.shape[2]
    if queries.shape[1] < L:  # generated tokens appended after the prompt: text
        queries = torch.cat([queries, queries.new_ones(B, L - queries.shape[1])], dim=1)
    elif queries.shape[1] > L:  # decoding with a cache: the newest positions, text
        queries = queries[:, -L:]
    k, v = k.to(key.dtype), v.to(value.dtype)
    if attention_mask is None:  # causal over the sequence, the cache in front
        q_pos = torch.arange(L, device=query.device)[:, None] + (S - L)
        attention_mask = (torch.arange(S, device=query.device)[None] <= q_pos)[None, None].expand(B, 1, L, S)
    extra = queries[:, None, :, None].expand(B, 1, L, k.shape[2])  # (B, 1, L, P)
    if attention_mask.dtype == torch.bool:
        mask = torch.cat([attention_mask.expand(B, -1, -1, -1), extra], dim=-1)
    else:
        blocked = torch.finfo(attention_mask.dtype).min
        extra = torch.zeros(extra.shape, dtype=attention_mask.dtype, device=extra.device).masked_fill_(~extra, blocked)
        mask = torch.cat([attention_mask.expand(B, -1, -1, -1), extra], dim=-1)
    return torch.cat([key, k], dim=2), torch.cat([value, v], dim=2), mask


def cost_report(models: Dict[str, nn.Module], pixel_values: torch.Tensor, input_ids: torch.Tensor,
                reps: int = 5) -> Dict:
    """Forward FLOPs (total and per top-level part: vision, projector, post_mlp, language_model) and the
    median latency of each model on the same inputs; ratios against the first model."""
    from torch.utils.flop_counter import FlopCounterMode
    rows = {}
    for name, model in models.items():
        model.eval()
        with torch.no_grad():
            counter = FlopCounterMode(display=False)
            with counter:
                out = model(pixel_values, input_ids)
            counts = counter.get_flop_counts()
            parts = {child: sum(counts.get(f'{type(model).__name__}.{child}', {}).values())
                     for child, _ in model.named_children()}
            model(pixel_values, input_ids)  # warm-up
            times = []
            for _ in range(reps):
                t = time.perf_counter()
                model(pixel_values, input_ids)
                times.append(time.perf_counter() - t)
        rows[name] = {'flops': counter.get_total_flops(), 'flops_by_part': parts,
                      'latency_s': sorted(times)[len(times) // 2], 'sequence_length': out.logits.shape[1]}
    first = next(iter(rows.values()))
    for r in rows.values():
        r['flops_ratio'] = r['flops'] / first['flops']
        r['language_model_flops_ratio'] = r['flops_by_part']['language_model'] / first['flops_by_part']['language_model']
        r['latency_ratio'] = r['latency_s'] / first['latency_s']
    return rows


def main(argv=None) -> int:
    """python -m diffzoo.vlm.eramv: FLOPs and latency of eRAM-V against the full-token model of the same size."""
    import argparse
    import json
    import sys
    import transformers
    from .model import build_vlm
    p = argparse.ArgumentParser(prog='python -m diffzoo.vlm.eramv', description=main.__doc__)
    p.add_argument('--vision', required=True, help='open_clip name[,pretrained] or timm:<name> with a CLS token')
    p.add_argument('--language-model', required=True, metavar='DIR', help='a local transformers causal LM')
    p.add_argument('--anchors', type=int, default=64)
    p.add_argument('--inject-layers', type=int, nargs='*', help="default: eRAM-V's every second layer 8-22 of 32, scaled")
    p.add_argument('--prompt-tokens', type=int, default=32)
    p.add_argument('--batch', type=int, default=1)
    p.add_argument('--reps', type=int, default=5)
    p.add_argument('--out', metavar='FILE', help='write the report as JSON')
    a = p.parse_args(argv)
    models = {}
    for integration in ('full', 'eramv'):
        lm = transformers.AutoModelForCausalLM.from_pretrained(a.language_model)
        torch.manual_seed(0)  # the same tower and projector in both
        kw = {'anchors': a.anchors, 'inject_layers': a.inject_layers} if integration == 'eramv' else {}
        models[integration] = build_vlm(a.vision, lm, integration, **kw)
    h, w = models['full'].vision.image_size
    g = torch.Generator().manual_seed(0)
    pixels = torch.randn(a.batch, 3, h, w, generator=g)
    ids = torch.randint(0, lm.config.get_text_config().vocab_size, (a.batch, a.prompt_tokens), generator=g)
    print(f'timing {a.reps} forward passes of each model (batch {a.batch}, {a.prompt_tokens} prompt tokens)', flush=True)
    report = cost_report(models, pixels, ids, a.reps)
    report['config'] = {**vars(a), 'inject_layers': models['eramv'].inject_layers,
                        'visual_tokens': models['full'].vision(pixels[:1]).shape[1]}
    print(f'\n{"model":<7}{"sequence":>9}{"GFLOPs":>9}{"LM GFLOPs":>11}{"x FLOPs":>9}{"x LM":>7}{"ms":>9}{"x time":>8}')
    for name in ('full', 'eramv'):
        r = report[name]
        print(f'{name:<7}{r["sequence_length"]:>9}{r["flops"] / 1e9:>9.3f}{r["flops_by_part"]["language_model"] / 1e9:>11.3f}'
              f'{r["flops_ratio"]:>9.2f}{r["language_model_flops_ratio"]:>7.2f}{r["latency_s"] * 1e3:>9.1f}'
              f'{r["latency_ratio"]:>8.2f}')
    print(f'anchors {a.anchors} of {report["config"]["visual_tokens"]} visual tokens, injected at layers '
          f'{models["eramv"].inject_layers}')
    if a.out:
        with open(a.out, 'w') as f:
            json.dump(report, f, indent=1)
        print(f'report: {a.out}')
    sys.stdout.flush()
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
