"""`data_backend: device`, the data-loader workers' side: encoded images, crop boxes and tokens, not pixels.

open_clip_train's workers decode every JPEG and run the train transform on a CPU core (~2.7 ms a 256 px image);
with this backend they run open_clip's own pipeline (`get_wds_dataset`: the same shards, shuffles, sharding over
ranks and workers, epochs and data accounting) with three of its stages swapped for cheap ones:

- `decode`: an image member is not decoded for training; its header is read for its size, and PIL decides
  whether it decodes as the default path's decode would: a JPEG decoded at 1/8 of its size (`check_decodes`), any
  other format whole. A file PIL refuses is skipped and counted exactly where and as the default path skips and
  counts it (`data_events.log_and_continue`: an undecodable image), so the training process's decoder (nvJPEG on
  CUDA, which decodes some files libjpeg refuses) never sees it. Captions and json decode as before.
- the image transform: none in the worker; the image stays encoded.
- `batched`: the batch's crop boxes are drawn at once from the headers' sizes (`draw_boxes`: RandomResizedCrop's
  rule with the scale and ratio of the transform open_clip built for the model, `TrainTransform.of`, from the
  worker's torch generator, which `diffzoo.train.shuffle` seeds per run, rank, worker and epoch: the same boxes
  run after run and on resume); the batch is one uint8 buffer of the encoded files with their lengths, the
  boxes, which images go to PIL rather than the JPEG decoder (`EncodedImage.needs_pil`), the samples' ids (shard
  url, position, key) and the tokens; `data_stages.Batched` counts it as before.

`wds_dataset_on_device` wraps open_clip_train's `get_wds_dataset` for training data only (validation keeps the
default path) and hands its loader to `diffzoo.train.device_loader.DeviceLoader`, which decodes and transforms
each batch in the training process, on its device.
"""
import functools
import io
import math
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import webdataset
from PIL import Image
from torchvision.transforms import InterpolationMode, Normalize, RandomResizedCrop

from diffzoo import seam
from diffzoo.clip.seams import OpenClipChanged
from diffzoo.data.shards import IMAGE_EXTS
from diffzoo.recipes import RecipeError
from . import data_stages
from .device_loader import DeviceLoader

# open_clip's train transform between its crop and its normalisation: RGB conversion and ToTensor
_BETWEEN = ('MaybeConvertMode', '_convert_to_rgb', 'ToTensor', 'MaybeToTensor')
_JPEG_END = b'\xff\xd9'  # EOI: a JPEG without it at its end is cut short, or has bytes after it


@dataclass(frozen=True)
class TrainTransform:
    """open_clip's train transform as data: RandomResizedCrop(size, scale, ratio, interpolation, antialias),
    RGB, ToTensor, Normalize(mean, std)."""
    size: Tuple[int, int]
    scale: Tuple[float, float]
    ratio: Tuple[float, float]
    interpolation: InterpolationMode
    antialias: bool
    mean: Tuple[float, ...]
    std: Tuple[float, ...]

    @classmethod
    def of(cls, transform) -> 'TrainTransform':
        """The settings of `transform` (open_clip's `image_transform(is_train=True)`, a torchvision Compose);
        a transform with other steps (colour jitter, greyscale, timm's) is refused by name."""
        steps = list(getattr(transform, 'transforms', [transform]))
        crop, normalize = steps[0], steps[-1]
        names = [getattr(s, '__name__', type(s).__name__) for s in steps[1:-1]]
        others = [n for n in names if n not in _BETWEEN]
        if not isinstance(crop, RandomResizedCrop) or not isinstance(normalize, Normalize) or others:
            found = ', '.join(getattr(s, '__name__', type(s).__name__) for s in steps)
            raise RecipeError(f'data_backend device runs open_clip\'s default train transform (RandomResizedCrop, '
                              f'RGB, ToTensor, Normalize) on the device; this run\'s is {found}. Leave out the '
                              f'augmentation settings that add steps (--aug-cfg), or use data_backend open_clip')
        if crop.interpolation not in (InterpolationMode.BICUBIC, InterpolationMode.BILINEAR):
            raise RecipeError(f'data_backend device resizes bicubic or bilinear; the train transform\'s crop '
                              f'resizes {crop.interpolation.value}: use data_backend open_clip')
        return cls(tuple(crop.size), tuple(crop.scale), tuple(crop.ratio), crop.interpolation,
                   bool(crop.antialias), tuple(normalize.mean), tuple(normalize.std))


class EncodedImage:
    """An image member as the worker keeps it: its bytes, and from its header its size (width, height), format
    and mode."""
    __slots__ = ('data', 'size', 'format', 'mode')

    def __init__(self, data: bytes, size: Tuple[int, int], format: Optional[str], mode: str):
        self.data, self.size, self.format, self.mode = data, size, format, mode

    @property
    def needs_pil(self) -> bool:
        """Decoded by PIL, as open_clip decodes it, rather than the JPEG decoder: not a JPEG (PNG, WebP), a JPEG in
        another colour space than RGB or greyscale (CMYK), or one whose end marker is missing."""
        return (self.format != 'JPEG' or self.mode not in ('RGB', 'L')
                or not self.data.rstrip(b'\x00\r\n ').endswith(_JPEG_END))


def check_decodes(image: Image.Image) -> None:
    """Raise what PIL raises for `image` (opened, not loaded) if open_clip's decode (load, then convert to RGB)
    would fail on it. A JPEG is decoded at 1/8 of its size (libjpeg's DCT scaling): every coefficient of its
    scans is read, where damage shows, and the inverse DCT and colour conversion mostly skipped; on the project's
    damaged JPEGs (tests/train/jpegs.py) it refuses exactly what the full decode refuses. Any other format is
    decoded whole and converted, as open_clip's decode does."""
    if image.format == 'JPEG':
        image.draft(None, ((image.width + 7) // 8, (image.height + 7) // 8))
        image.load()
    else:
        image.load()
        image.convert('RGB')


def encoded_image(key: str, data: bytes) -> Optional[EncodedImage]:
    """A webdataset decoder handler (`wds.decode(encoded_image)`): image members become `EncodedImage`s, other
    members go on to webdataset's own decoders. Raises PIL's error for a file open_clip's decode refuses
    (`check_decodes`)."""
    if key.rsplit('.', 1)[-1].lower() not in IMAGE_EXTS:
        return None
    with Image.open(io.BytesIO(data)) as image:
        encoded = EncodedImage(data, image.size, image.format, image.mode)
        check_decodes(image)
    return encoded


def kept_encoded(image: EncodedImage) -> EncodedImage:
    """The image transform of open_clip's pipeline under this backend: none (the crop box is drawn per batch)."""
    return image


def draw_boxes(sizes: torch.Tensor, scale, ratio, tries: int = 10) -> torch.Tensor:
    """Crop boxes (B, 4) as (top, left, height, width) for images of `sizes` (B, 2) as (height, width), by
    RandomResizedCrop's rule: up to `tries` draws of an area share ~ U(scale) and a log aspect ~ U(log ratio), the
    first box that fits, at a uniform place; else the centre of the image with its aspect clamped to `ratio`.
    Written out rather than calling torchvision's `get_params` per image: that costs ~20 µs a try and up to ten
    tries an image (a quarter of a worker's CPU here); this is a dozen tensor operations a batch."""
    height, width = sizes[:, :1].double(), sizes[:, 1:].double()  # (B, 1)
    n = sizes.shape[0]
    area = height * width * torch.empty(n, tries, dtype=torch.float64).uniform_(*scale)  # (B, tries)
    aspect = torch.exp(torch.empty(n, tries, dtype=torch.float64).uniform_(math.log(ratio[0]), math.log(ratio[1])))
    w, h = torch.round(torch.sqrt(area * aspect)), torch.round(torch.sqrt(area / aspect))  # (B, tries)
    fits = (w > 0) & (h > 0) & (w <= width) & (h <= height)
    first = fits.to(torch.uint8).argmax(1, keepdim=True)  # (B, 1): the first try that fits
    w, h, found = w.gather(1, first)[:, 0], h.gather(1, first)[:, 0], fits.any(1)  # (B,)
    height, width = height[:, 0], width[:, 0]
    wide, tall = width / height > max(ratio), width / height < min(ratio)
    w = torch.where(found, w, torch.where(wide, torch.round(height * max(ratio)), width))
    h = torch.where(found, h, torch.where(tall, torch.round(width / min(ratio)), height))
    top = torch.where(found, torch.floor(torch.rand(n, dtype=torch.float64) * (height - h + 1)),
                      torch.floor((height - h) / 2))
    left = torch.where(found, torch.floor(torch.rand(n, dtype=torch.float64) * (width - w + 1)),
                       torch.floor((width - w) / 2))
    return torch.stack([top, left, h, w], 1).long()  # (B, 4)


class DeviceTuples(data_stages.NumberedTuples):
    """`data_stages.NumberedTuples` that also keeps each sample's key (for the examples of what is skipped)."""

    def run(self, src):
        last = {}

        def remembered(samples):
            for sample in samples:
                last['key'] = sample.get('__key__')
                yield sample

        for result in super().run(remembered(src)):
            if isinstance(result, data_stages._Numbered):
                result.key = last['key']
            yield result


class EncodedCollation:
    """(encoded batch, tokens) from (EncodedImage, tokens) tuples: the files as one uint8 buffer and their
    lengths (one shared-memory tensor for the batch, not one per image), the crop boxes (`draw_boxes`), which
    go to PIL, and the samples' (url, position, key) (None where the pipeline does not number them)."""

    def __init__(self, transform: TrainTransform):
        self.transform = transform

    def __call__(self, samples: List[tuple]) -> tuple:
        images = [image for image, _ in samples]
        data = bytearray(b''.join(image.data for image in images))
        sizes = torch.tensor([image.size[::-1] for image in images], dtype=torch.int64).reshape(-1, 2)
        batch = {
            'data': torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8),
            'lengths': torch.tensor([len(image.data) for image in images], dtype=torch.int64),
            'boxes': draw_boxes(sizes, self.transform.scale, self.transform.ratio),  # (B, 4)
            'needs_pil': torch.tensor([image.needs_pil for image in images], dtype=torch.bool),
            'ids': [(*(getattr(s, 'sample_id', None) or (None, None)), getattr(s, 'key', None)) for s in samples],
        }
        return batch, torch.stack([tokens for _, tokens in samples])  # tokens: (B, context)


class DeviceWebdataset:
    """The webdataset module as open_clip_train.data sees it while it builds a training pipeline for this
    backend: `decode` reads headers only, `to_tuple` keeps keys, `batched` collates encoded images."""

    to_tuple = DeviceTuples

    def __init__(self, module, transform: TrainTransform):
        self._module, self.transform = module, transform

    def decode(self, *handlers, handler=None, **kwargs):
        """open_clip's `wds.decode("pilrgb", handler=…)`: the same stage and handler, with image members kept
        encoded instead of decoded to PIL."""
        return self._module.decode(encoded_image, handler=handler, **kwargs)

    def batched(self, batchsize: int, partial: bool = True):
        return data_stages.Batched(batchsize, collation_fn=EncodedCollation(self.transform), partial=partial)

    def __getattr__(self, name):
        return getattr(self._module, name)


def wds_dataset_on_device(build, data_module):
    """`build` (open_clip_train.data.get_wds_dataset, as diffzoo.train.seams has wrapped it) building training
    pipelines for this backend: `data_module.wds` is `DeviceWebdataset` while it builds (a seam row applied for the
    build), with the settings of the image transform open_clip passes, which becomes `kept_encoded`; the DataInfo's
    loader a `DeviceLoader`."""
    @functools.wraps(build)  # its signature too, which train.seams checks
    def get_wds_dataset(args, preprocess_img, is_train, *rest, **kwargs):
        if not is_train:
            return build(args, preprocess_img, is_train, *rest, **kwargs)
        transform = TrainTransform.of(preprocess_img)
        built_with = data_module.wds  # the run's (train.seams' row: counting, seeded shuffles) is kept beneath
        row = seam.Seam(data_module, 'wds', lambda _: DeviceWebdataset(built_with, transform),
                        'its training pipeline decodes and transforms each image in the worker: while this one is '
                        'built, the decode reads headers and the batches keep the images encoded',
                        holds=lambda original: original is webdataset, what='the webdataset module')
        with seam.patched([row], OpenClipChanged):
            info = build(args, kept_encoded, is_train, *rest, **kwargs)
        info.dataloader = DeviceLoader(info.dataloader, transform, args.batch_size, torch.device(args.device))
        return info
    return get_wds_dataset
