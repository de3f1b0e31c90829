"""open_clip's side of diffzoo: the seams (`install`), the differential text tower and the hub layout.
Names are imported on first use, so `diffzoo.clip.text_tower` loads without the seams."""
from diffzoo._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    'install': 'seams', 'DiffResidualAttentionBlock': 'text_tower', 'DiffTextTransformer': 'text_tower',
    'DiffTransformer': 'text_tower'})
