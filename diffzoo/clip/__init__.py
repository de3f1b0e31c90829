"""open_clip's side of diffzoo: the seams (`install`), the differential text tower and the hub layout."""
from .seams import install
from .text_tower import DiffResidualAttentionBlock, DiffTextTransformer, DiffTransformer

__all__ = ['install', 'DiffResidualAttentionBlock', 'DiffTextTransformer', 'DiffTransformer']
