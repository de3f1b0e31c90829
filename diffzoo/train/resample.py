"""Crop-and-resize of a whole batch as two batched products: `data_backend: device`'s train transform.

Each image's crop box resized to S×S with antialias is separable: rows, then columns, each a weighted sum of input
positions. The weights are those of PyTorch's antialiased resize (`F.interpolate(..., antialias=True)`, PIL's
resampling filter: bicubic with a = −0.5 or the triangle, support widened by the scale when shrinking, each output's
weights normalised to sum 1), built for every image at once as matrices whose columns outside the crop box are 0,
so the batch, zero-padded to its largest image, is resized by `Wy · image · Wxᵀ` in two `matmul` calls instead of
one `resized_crop` per image. Written here because torchvision and PyTorch resize one size at a time, and a
batch's crop boxes all differ.

The products run in float64 on CUDA (TF32, which open_clip_train turns on for float32 products, would move pixels
by ~0.25 of a level) and float32 on the CPU, in chunks of images so that the padded batch stays small.
"""
from typing import List, Optional, Sequence

import torch

CHUNK = 64  # images per product: a chunk of 64 padded 256×384 images in float64 is ~150 MB


def _kernel(t: torch.Tensor, bicubic: bool) -> torch.Tensor:
    """PIL's and PyTorch's antialias filters: bicubic (a = −0.5) on |t| < 2, else the triangle on |t| < 1."""
    t = t.abs()
    if not bicubic:
        return (1 - t).clamp(min=0)
    a = -0.5
    near = ((a + 2) * t - (a + 3)) * t * t + 1
    far = (((t - 5) * t + 8) * t - 4) * a
    return torch.where(t < 1, near, torch.where(t < 2, far, torch.zeros_like(t)))


def weights(start: torch.Tensor, length: torch.Tensor, out: int, extent: int, bicubic: bool) -> torch.Tensor:
    """(B, out, extent): row o of image b weights the input positions 0..extent−1 for output position o of the span
    [start, start + length) resized to `out`, as PyTorch's antialiased resize of that span does."""
    dtype, device = start.dtype, start.device
    scale = length / out  # (B,)
    support = (2. if bicubic else 1.) * scale.clamp(min=1)
    inv = 1 / scale.clamp(min=1)
    center = scale[:, None] * (torch.arange(out, dtype=dtype, device=device) + 0.5)  # (B, out)
    lo = (center - support[:, None] + 0.5).floor().clamp(min=0)  # the span's first and last + 1 positions read
    hi = torch.minimum((center + support[:, None] + 0.5).floor(), length[:, None])
    x = torch.arange(extent, dtype=dtype, device=device) - start[:, None, None]  # (B, 1, extent): within the span
    w = _kernel((x - center[..., None] + 0.5) * inv[:, None, None], bicubic)
    w = w * ((x >= lo[..., None]) & (x < hi[..., None]))
    return w / w.sum(-1, keepdim=True)


def resized_crops(images: Sequence[torch.Tensor], boxes: torch.Tensor, size: Sequence[int], bicubic: bool,
                  dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """(B, 3, S_h, S_w) uint8: each (3, H, W) uint8 image's box (top, left, height, width) resized with antialias,
    rounded as torchvision rounds a resized uint8 image; the products in `dtype` (default: module docstring)."""
    device = images[0].device
    dtype = dtype or (torch.float64 if device.type == 'cuda' else torch.float32)
    boxes = boxes.to(device=device, dtype=dtype)
    out: List[torch.Tensor] = []
    for first in range(0, len(images), CHUNK):
        chunk, box = images[first:first + CHUNK], boxes[first:first + CHUNK]
        height, width = max(i.shape[-2] for i in chunk), max(i.shape[-1] for i in chunk)
        if all(i.shape[-2:] == (height, width) for i in chunk):
            batch = torch.stack(list(chunk)).to(dtype)
        else:
            batch = torch.zeros(len(chunk), 3, height, width, dtype=dtype, device=device)
            for target, image in zip(batch, chunk):
                target[:, :image.shape[-2], :image.shape[-1]] = image
        wy = weights(box[:, 0], box[:, 2], size[0], height, bicubic)  # (b, S_h, H)
        wx = weights(box[:, 1], box[:, 3], size[1], width, bicubic)  # (b, S_w, W)
        resized = wy[:, None] @ batch @ wx[:, None].transpose(-1, -2)  # (b, 3, S_h, S_w)
        out.append(resized.round_().clamp_(0, 255).to(torch.uint8))
    return torch.cat(out)
