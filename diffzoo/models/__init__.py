from . import vit_diff
from .seams import install

install()
