"""Image files from the command line: named files and the images inside named directories."""
from pathlib import Path
from typing import List, Sequence

from PIL import Image, UnidentifiedImageError

from diffzoo.vlm.images import open_rgb

IMAGE_SUFFIXES = ('.jpg', '.jpeg', '.png', '.bmp', '.webp', '.gif', '.tif', '.tiff')


def image_files(paths: Sequence[str]) -> List[Path]:
    """Image files named, and those inside named directories (sorted, by suffix)."""
    found = []
    for text in paths:
        path = Path(text)
        if path.is_dir():
            inside = sorted(p for p in path.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
            if not inside:
                raise ValueError(f'--images {path}: no image files ({", ".join(IMAGE_SUFFIXES)}) in this directory')
            found += inside
        elif path.is_file():
            found.append(path)
        else:
            raise ValueError(f'--images {path}: no such file or directory; pass image files or a directory of them')
    return found


def load_images(paths: Sequence) -> List[Image.Image]:
    """RGB images, decoded within PIL's pixel limit (`diffzoo.vlm.images.open_rgb`: a larger JPEG at a reduced DCT
    scale); a missing or unreadable file, or another image over the limit, raises ValueError naming it."""
    images = []
    for path in paths:
        if not Path(path).is_file():
            raise ValueError(f'IMAGE {path}: no such file; pass the path of an existing image')
        try:
            images.append(open_rgb(path))
        except Image.DecompressionBombError as exc:  # PIL's refusal over 2× its limit names no fix
            raise ValueError(f'IMAGE {path}: over PIL\'s pixel limit, Image.MAX_IMAGE_PIXELS ({exc}); pass a smaller '
                             f'copy of it') from None
        except (UnidentifiedImageError, OSError) as exc:
            raise ValueError(f'IMAGE {path}: not an image PIL can read ({exc}); pass a JPEG or PNG') from None
    return images
