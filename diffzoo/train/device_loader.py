"""`data_backend: device`, the training process's side: each batch of encoded images decoded and transformed on
the run's device (`diffzoo.train.device_data` is the workers' side).

- Decoding: the batch's JPEGs in one `torchvision.io.decode_jpeg(list, device=…)` call (nvJPEG on CUDA,
  libjpeg-turbo on the CPU, where it gives PIL's pixels exactly); if that call fails, one image at a time. An
  image the JPEG decoder refuses, and every image the worker sent to PIL (PNG, WebP, CMYK, a JPEG without its end
  marker), is decoded as open_clip decodes it (PIL, `convert('RGB')`) and counted (`pil_decodes`). The workers
  hand over only images PIL decodes (`device_data.check_decodes`); one that no decoder here reads all the same
  is skipped and counted as open_clip's pipeline counts it (an undecodable image, and not trained: the worker
  had counted it as trained when the batch left it).
- The transform: each worker's crop box resized to the model's size (bicubic or bilinear as open_clip's crop, with
  antialias), uint8 as PIL's output; then the batch scaled to [0, 1] and normalised with the model's mean and std,
  float32 (open_clip's loop casts it to the input dtype). On CUDA the whole batch is cropped and resized at once
  (`diffzoo.train.resample`: two batched products, not one launch-bound call per image); on the CPU, where
  torchvision's per-image uint8 resize is the faster, one `resized_crop` per image (`batched` chooses). Against
  open_clip's PIL resize on the same box a pixel differs by at most 1 of 255 either way (rounding).
- Overlap: the batches are made one ahead, in a thread of the training process (on CUDA on a stream of its own,
  which the training stream waits on per batch), so the decode's CPU work and any wait inside the decoder
  overlap the training step instead of stalling it; an error there is raised in the training loop, and a loop
  that stops early stops the thread. open_clip_train's `Data (t)` is then the wait for a batch not yet made.
- Equal batches: every rank must make `num_batches` batches of `batch_size` (DDP steps and open_clip's gathered
  loss need the same shapes). An image skipped here leaves a hole that the next sample fills, and so on to the end
  of the epoch, where the batches lack as many samples as were skipped here: samples trained earlier in the epoch
  (the last batch's, in order) fill them, counted as trained again (`fill_repeats`, among data.jsonl's repeats).
"""
import collections
import contextlib
import io
import logging
import queue
import threading
from typing import Iterator, List, Optional, Tuple

import torch
from PIL import Image
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms import InterpolationMode
from torchvision.transforms.v2 import functional as F

from diffzoo.data.shards import DataError
from . import data_events
from .resample import resized_crops

Decoded = Tuple[torch.Tensor, torch.Tensor, tuple]  # (image (3, S, S) uint8, tokens (context,), (url, position, key))


def pil_decode(data: torch.Tensor) -> Optional[torch.Tensor]:
    """An encoded image (1-D uint8) as open_clip's pipeline decodes it (webdataset's "pilrgb"): (3, H, W) uint8,
    or None when PIL cannot read it."""
    try:
        with Image.open(io.BytesIO(data.numpy().tobytes())) as image:
            image.load()
            return F.pil_to_tensor(image.convert('RGB'))
    except Exception:  # noqa: BLE001  whatever PIL raises, open_clip's handler skips the sample
        return None


def decode_images(files: List[torch.Tensor], needs_pil: List[bool], device: torch.device
                  ) -> Tuple[List[Optional[torch.Tensor]], int]:
    """(each file decoded, (3, H, W) uint8 on `device`, None where no decoder reads it; how many PIL decoded)."""
    images: List[Optional[torch.Tensor]] = [None] * len(files)
    jpegs = [i for i, pil in enumerate(needs_pil) if not pil]
    to_pil = [i for i, pil in enumerate(needs_pil) if pil]
    if jpegs:
        try:
            decoded = decode_jpeg([files[i] for i in jpegs], mode=ImageReadMode.RGB, device=device)
        except RuntimeError:  # one image the decoder refuses fails the batch call: one at a time
            decoded = []
            for i in jpegs:
                try:
                    decoded.append(decode_jpeg(files[i], mode=ImageReadMode.RGB, device=device))
                except RuntimeError:
                    decoded.append(None)
        for i, image in zip(jpegs, decoded):
            if image is None:
                to_pil.append(i)
            else:
                images[i] = image
    for i in to_pil:
        image = pil_decode(files[i])
        images[i] = None if image is None else image.to(device)
    return images, len(to_pil)


class DeviceLoader:
    """open_clip_train's training loader (its `num_batches` and `num_samples` too) yielding (images, tokens)
    batches made on `device` from the workers' encoded batches (module docstring)."""

    def __init__(self, loader, transform, batch_size: int, device: torch.device, batched: Optional[bool] = None,
                 depth: int = 1):
        self.loader, self.transform, self.batch_size, self.device = loader, transform, batch_size, device
        self.depth = depth  # batches made ahead of the one the training loop holds
        self.batched = device.type == 'cuda' if batched is None else batched
        if not transform.antialias:  # resample's weights are the antialiased resize's
            self.batched = False
        self.num_batches, self.num_samples = loader.num_batches, loader.num_samples
        self.mean = torch.tensor(transform.mean, device=device).view(-1, 1, 1)  # (3, 1, 1)
        self.std = torch.tensor(transform.std, device=device).view(-1, 1, 1)

    def __getattr__(self, name):
        return getattr(self.__dict__['loader'], name)

    def cropped(self, image: torch.Tensor, box) -> torch.Tensor:
        """(3, H, W) uint8 -> (3, S, S) uint8: the crop box resized to the model's size."""
        top, left, height, width = box
        return F.resized_crop(image, top, left, height, width, list(self.transform.size),
                              interpolation=self.transform.interpolation, antialias=self.transform.antialias)

    def normalized(self, images: torch.Tensor) -> torch.Tensor:
        """(B, 3, S, S) uint8 -> float32 in [0, 1], normalised (ToTensor, Normalize)."""
        return (images.float().div_(255) - self.mean) / self.std

    def decoded(self, encoded: dict, tokens: torch.Tensor, log) -> Iterator[Decoded]:
        """The batch's samples that decode, transformed; those that do not are journalled as skipped."""
        files = torch.split(encoded['data'], encoded['lengths'].tolist())
        images, pil = decode_images(list(files), encoded['needs_pil'].tolist(), self.device)
        if log is not None and pil:
            log.device['pil_decodes'] = log.device.get('pil_decodes', 0) + pil
        read = [i for i, image in enumerate(images) if image is not None]
        crops = {}
        if self.batched and read:
            resized = resized_crops([images[i] for i in read], encoded['boxes'][read], self.transform.size,
                                    self.transform.interpolation == InterpolationMode.BICUBIC)
            crops = dict(zip(read, resized))
        for i, (image, box, token, sample_id) in enumerate(zip(images, encoded['boxes'].tolist(), tokens,
                                                                encoded['ids'])):
            if image is not None:
                yield crops[i] if self.batched else self.cropped(image, box), token, sample_id
            else:
                url, position, key = sample_id
                logging.warning(f'data_backend device: no decoder reads the image of {url} {key}; skipped')
                if log is not None and url is not None:
                    log.skip('undecodable_image', url, position, key)
                    log.untrained.setdefault(url, []).append(position)

    def batch(self, samples: List[Decoded], log) -> Tuple[torch.Tensor, torch.Tensor]:
        if log is not None:
            log.flush()  # before the batch leaves, as the workers' journals
        images = self.normalized(torch.stack([image for image, _, _ in samples]))  # (B, 3, S, S)
        return images, torch.stack([token for _, token, _ in samples])

    def __iter__(self) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        return ahead(self.batches, self.device, self.depth)

    def batches(self) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        """The epoch's batches, made in the calling thread."""
        log = data_events.device_log()
        if log is not None:
            log.start_pass()
            for name in data_events.DEVICE_COUNTS:  # the epoch's record says which backend ran, with its counts
                log.device.setdefault(name, 0)
        pending, recent, made = collections.deque(), collections.deque(maxlen=self.batch_size), 0
        for encoded, tokens in self.loader:
            pending.extend(self.decoded(encoded, tokens, log))
            while len(pending) >= self.batch_size:
                samples = [pending.popleft() for _ in range(self.batch_size)]
                recent.extend(samples)
                made += 1
                yield self.batch(samples, log)
        pool = list(recent) + list(pending)  # the holes left at the epoch's end: samples trained again
        if made < self.num_batches and not pool:
            raise DataError(f'no image of this epoch\'s {self.num_batches} batches could be decoded (every one was '
                            f'skipped: see the data report); run python -m diffzoo.data check on the shards')
        repeat = 0
        while made < self.num_batches:
            samples = list(pending)
            pending.clear()
            while len(samples) < self.batch_size:
                sample = pool[repeat % len(pool)]
                repeat += 1
                samples.append(sample)
                if log is not None and sample[2][0] is not None:
                    log.trained.setdefault(sample[2][0], []).append(sample[2][1])
                    log.device['fill_repeats'] = log.device.get('fill_repeats', 0) + 1
            made += 1
            yield self.batch(samples, log)


_END = object()


def ahead(make, device: torch.device, depth: int = 1) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
    """`make()`'s batches, made in a thread up to `depth` ahead of the one the caller holds; on CUDA on a side
    stream, each batch's use on the caller's stream ordered after its making (an event) and its memory kept from
    reuse until that use is done (`record_stream`). A thread, not a library's prefetcher: timm's PrefetchLoader
    and torch's pin-memory thread move finished tensors, and the work to overlap here is the making itself."""
    cuda = device.type == 'cuda'
    stream = torch.cuda.Stream(device) if cuda else None
    made: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                made.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def work():
        try:
            with torch.cuda.device(device) if cuda else contextlib.nullcontext(), \
                    torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
                for images, tokens in make():
                    event = None
                    if cuda:
                        event = torch.cuda.Event()
                        event.record(stream)
                    if not put((images, tokens, event)):
                        return
            put(_END)
        except BaseException as exc:  # noqa: BLE001  raised again in the training loop
            put(exc)

    thread = threading.Thread(target=work, name='diffzoo-device-batches', daemon=True)
    thread.start()
    try:
        while True:
            item = made.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            images, tokens, event = item
            if event is not None:
                current = torch.cuda.current_stream(device)
                current.wait_event(event)
                images.record_stream(current)
            yield images, tokens
    finally:
        stop.set()
        thread.join(timeout=30)  # it ends at its next batch; a daemon, it cannot hold up the process's exit

