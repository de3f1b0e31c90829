"""The VLM settings' names and checks, without torch: what recipes validate and command lines list
(`python -m diffzoo.train.vlm --help` imports this, not the models)."""
from typing import Optional

VARIANTS = ('duplicate', 'split')
HEAD_PAIRINGS = ('halves', 'adjacent')  # split: query heads (i, i + H/2) as DiffLlama, or (2i, 2i + 1)
MLPS = ('original', 'swiglu')
INTEGRATIONS = ('full', 'eramv')
INJECTED_QUERIES = ('all', 'text')
# attention over [image or anchors | text]: PaliGemma's prefix-LM (integration="full"'s default) or causal
# (eRAM-V's Eq. 4, as LLaVA-1.5: integration="eramv"'s default)
SEQUENCE_MASKS = ('prefix_lm', 'causal')
PROJECTOR_NAMES = ('linear', 'mlp2x_gelu')  # PaliGemma's one Linear; LLaVA-1.5's Linear → GELU → Linear
FINAL_NORM = 'final_norm'  # select_layer: the last block's output through the tower's final norm
# conversation prompt formats (diffzoo.vlm.templates): LLaVA's pre-training `plain`, LLaVA-1.5's vicuna_v1,
# TinyLLaVA_Factory's qwen2_instruct, the language model's own chat template
CONVERSATION_FORMATS = ('plain', 'vicuna_v1', 'qwen2_instruct', 'chat_template')
# a conversation whose rounds the reference cannot count (its "tokenization mismatch"): nothing of it scored, as
# LLaVA and TinyLLaVA do, or its answers scored
MISMATCH_RULES = ('mask', 'score')
# how a conversation's image meets the tower: padded to a square of the normaliser's mean (LLaVA-1.5's 'pad'), or
# the tower's own transform alone (LLaVA's and TinyLLaVA's other setting, 'square' in TinyLLaVA's scripts)
IMAGE_ASPECTS = ('pad', 'crop')


def check_select_layer(select_layer, depth: Optional[int] = None) -> Optional[int]:
    """0-based index of the block whose output `select_layer` takes (module docstring) in a tower of
    `depth` blocks; without `depth`, only the form is checked (None)."""
    if select_layer == FINAL_NORM:
        return None if depth is None else depth - 1
    top = '' if depth is None else f' of the tower\'s {depth}'
    if isinstance(select_layer, bool) or not isinstance(select_layer, int) or select_layer == 0 or (
            depth is not None and not -depth <= select_layer <= depth):
        raise ValueError(f'select_layer={select_layer!r}: expected a block{top}, counted from the end (-1: the last '
                         f'block\'s output, -2: the penultimate one\'s, as LLaVA-1.5 and eRAM-V) or from 1, without '
                         f'the final norm; or {FINAL_NORM!r} (the last block through the tower\'s final norm)')
    if depth is None:
        return None
    return select_layer + depth if select_layer < 0 else select_layer - 1
