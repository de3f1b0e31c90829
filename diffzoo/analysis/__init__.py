"""Layer by layer: how much each layer changes the visual tokens, and where the attention goes (eRAM-V).

The package: `maps` (a CLIP tower's attention maps, query relevance, entropy per block;
`python -m diffzoo.analysis.overlays`), `metrics` (the definitions below), `capture` (hooks on a
forward pass), `layers` (the analyses of a VLM or CLIP tower), `plots` and `report` (figures, tables),
`cli` (`python -m diffzoo.analysis`).

    python -m diffzoo.analysis --model RECIPE [--adapter DIR] --images DIR --prompts "…" "…"
        [--model RECIPE [--compare-adapter DIR]] [--out analysis/]
    python -m diffzoo.analysis --model NAME[,PRETRAINED] --images DIR [--model NAME[,PRETRAINED]]

writes `analysis.json` (every number below, per sample and averaged) and PNGs with the models
overlaid, and prints a table. Natural log throughout; l = 0 … L−1 are decoder layers or vision blocks.

Average cosine similarity (eRAM-V Eq. 1) of two (N, D) token matrices X, Y, token i of both at the
same position:

    S(X, Y) = (1/N) Σ_i ⟨x_i, y_i⟩ / (‖x_i‖ ‖y_i‖)

For layer l, X = h_l (its input) and Y = h_{l+1} (its output): h_0 is the input embeddings and h_l the
output of layer l − 1, all before the final norm (transformers' `output_hidden_states` puts the
final norm on its last entry, which would make the last pair compare a normalised state with an
unnormalised one). S near 1: the layer hardly changes those tokens.

Attention entropy (eRAM-V Eq. 2) of an attention row a over keys j, in nats, 0 ≤ H ≤ log N:

    H(a) = −Σ_j p_j log p_j,    p_j = |a_j| / Σ_k |a_k|,    0·log 0 = 0

For softmax attention p = a. A differential map A1 − λ·A2 is signed and its rows sum to 1 − λ; H is
then the entropy of its normalised magnitude (`metrics.attention_entropy`, as `maps.block_entropy` uses it).

Attention mass on a token category c: m_c = Σ_{j∈c} p_j with the same p, so the masses of a row sum
to 1 in every layer, softmax or differential. `row_sum` = Σ_j a_j is recorded too (1 for softmax,
1 − λ for a differential layer).

Token categories of a VLM's sequence: visual (the image tokens: build_vlm's image prefix, PaliGemma's
`<image>` positions), special (the other positions whose id is one of the tokenizer's special ids:
BOS, EOS, pad, unk, added special tokens such as image-boundary tokens), text (the rest).

VLM, per layer: one image and one prompt per forward pass (no padding); the query is the last prompt
token, whose output predicts the first generated token. Entropy, masses and `row_sum` are means
over the layer's heads (differential heads in differential layers); cosine similarity is over the
visual tokens and, for contrast, the text tokens. Every per-layer number is the mean over all
(image, prompt) pairs.

Top-k overlap across prompts: each visual token j gets the score s_j = mean_l mean_h a_lhj / Σ_k |a_lhk|,
the query's signed share of attention averaged over heads and then layers (a token the differential
map cancels ranks low); T = the k highest (k = min(25, visual tokens)). For two prompts on the same
image, J = |T_A ∩ T_B| / |T_A ∪ T_B|, reported for every pair of prompts and as the mean over pairs.

eRAM-V models (`build_vlm(..., integration="eramv")`): the visual tokens of the sequence are the
anchors; at injection layers the P injected keys count as visual keys in the entropy and the masses,
and the top-k scores cover the sequence's (anchor) tokens only.

CLIP tower, per vision block: S over the patch tokens (prefix tokens excluded), and the entropy of
the CLS token's attention row over all N tokens, mean over heads; both averaged over the images.

Maps are read on explicit paths: decoders run with `eager` attention (`diffzoo_eager` when
differential) during the analysis, restored afterwards; vision towers through
`diffzoo.layers.capture_attention_maps`.
"""
from diffzoo._lazy import lazy_exports

# name -> submodule, imported on first use (PEP 562): the submodules import torch, and
# `python -m diffzoo.analysis --help` imports this package before it parses
_EXPORTS = {
    'layers': ('DEFINITIONS', 'analyse_clip', 'analyse_vlm'),
    'maps': ('attention_maps', 'block_entropy', 'cls_attention', 'image_entropy', 'query_attention', 'vision_trunk'),
    'metrics': ('CATEGORIES', 'CLIP_METRICS', 'SPECIAL', 'TEXT', 'TOP_K', 'VISUAL', 'VLM_METRICS', 'attention_entropy',
                'attention_mass', 'average_cosine_similarity', 'jaccard', 'layer_metrics', 'token_categories',
                'top_k_tokens'),
    'plots': ('overlay_figure', 'plot_analysis', 'plot_entropy', 'plot_overlays'),
}
_SOURCE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_SOURCE)
__getattr__, __dir__ = lazy_exports(__name__, _SOURCE)
