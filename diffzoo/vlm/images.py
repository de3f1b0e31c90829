"""The image files a VLM reads (training samples, benchmark questions): what a path is when it is not an image file,
and decoding within PIL's pixel limit.

PIL opens an image lazily: `Image.open` reads the header only. It refuses an image of more than twice
`Image.MAX_IMAGE_PIXELS` (DecompressionBombError) but only warns for one between 1× and 2× the limit, and then
decodes it whole: 3 bytes a pixel in RGB, 268 to 537 MB at PIL's default limit of 89,478,485 pixels, a spike a
data-loader worker can die of. `open_rgb` reads the size from the header first. A JPEG over the limit is decoded at
the first DCT scale (1/2, 1/4 or 1/8: PIL's `draft`) that brings it under, so the whole image is never held (what
the vision tower then resizes differs from a full decode by the DCT's scaling filter); any other image over the
limit is refused (`DecompressionBombError`, naming its size and the limit). The limit stays as PIL, or the user,
sets it.
"""
import errno
import math
import os
import stat
import warnings
from pathlib import Path
from typing import BinaryIO, Optional, Union

from PIL import Image

DCT_SCALES = (2, 4, 8)  # the reductions libjpeg decodes at directly


def path_problem(path: Union[str, Path]) -> Optional[str]:
    """Why `path` is not an image file to read, in words, or None: missing, a symlink to nothing, a symlink loop, a
    directory, not a regular file, or refused by the system (a name over 255 bytes, a folder without permission)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return 'image path a symlink to a missing file' if os.path.islink(path) else 'image file missing'
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return 'image path a symlink loop'
        return f'image path refused by the system ({exc.strerror})'
    if stat.S_ISDIR(mode):
        return 'image path a directory'
    return None if stat.S_ISREG(mode) else 'image path not a regular file'


def open_rgb(source: Union[str, Path, BinaryIO]) -> Image.Image:
    """The image at `source` (a path or a binary file) decoded to RGB, never holding more pixels than PIL's limit
    (module docstring)."""
    with warnings.catch_warnings():  # PIL's warning for 1× to 2× its limit: handled below
        warnings.simplefilter('ignore', Image.DecompressionBombWarning)
        with Image.open(source) as im:
            limit = Image.MAX_IMAGE_PIXELS
            width, height = im.size
            if limit and width * height > limit:
                scale = next((s for s in DCT_SCALES if math.ceil(width / s) * math.ceil(height / s) <= limit), None)
                if im.format != 'JPEG' or scale is None:
                    raise Image.DecompressionBombError(
                        f'{width}×{height} = {width * height:,} pixels, over PIL\'s Image.MAX_IMAGE_PIXELS '
                        f'({limit:,}), and a {im.format} image cannot be decoded at a smaller scale; resize the file, '
                        f'or raise the limit')
                im.draft('RGB', (width // scale, height // scale))  # decoded at 1/scale: the full size never held
            return im.convert('RGB')
