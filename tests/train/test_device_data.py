"""data_backend device on real shards, against open_clip's own pipeline: open_clip_train's training loader built by
`get_wds_dataset` with diffzoo.train.seams installed either way (the same shards, shuffles and data accounting),
the crop draws and the decoders; the slow tests train through `python -m diffzoo.train`."""
import argparse
import io
import json
import os
import sys

import open_clip
import open_clip_train.data
from open_clip_train.params import parse_args
import pytest
import torch
from PIL import Image
from scipy import stats
from torchvision.io import decode_jpeg
from torchvision.transforms import functional as TF

from diffzoo.checkpoint import RUN_CONFIG
from diffzoo.recipes import RecipeError
from diffzoo.train import data_events, data_report, data_stages, seams
from diffzoo.train.device_data import EncodedCollation, EncodedImage, TrainTransform, draw_boxes, encoded_image
from diffzoo.train.device_loader import DeviceLoader, decode_images, pil_decode
from diffzoo.train.launch import main as train_main
from diffzoo.train.run_record import CHANGES, check_run_dir
from tests.factory import call, run, sample, write_shards
from tests.train import jpegs

MODEL = 'clip-tiny-baseline'
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # as the tiny recipes train


def _encoded(img: Image.Image, fmt: str = 'JPEG', mode: str = 'RGB', cut: bool = False, **options) -> bytes:
    buf = io.BytesIO()
    img.convert(mode).save(buf, fmt, **options)
    data = buf.getvalue()
    return data[:len(data) // 2] if cut else data


def _epoch(urls, backend: str, batch_size: int, samples: int, workers: int = 1, device: str = 'cpu'):
    """Epoch 0 of open_clip_train's training loader with diffzoo's seams and `backend`, batches made on `device`:
    ([(images, tokens)] on the CPU, the epoch's data.jsonl record)."""
    size = open_clip.get_model_config(MODEL)['vision_cfg']['image_size']
    preprocess = open_clip.image_transform(size, is_train=True, mean=MEAN, std=STD)
    args = argparse.Namespace(train_data='::'.join(map(str, urls)), val_data=None, train_num_samples=samples,
                              dataset_resampled=False, train_data_upsampling_factors=None, seed=0,
                              batch_size=batch_size, world_size=1, rank=0, workers=workers, device=device)
    with seams.installed(data_backend=backend):
        events = os.environ[data_events.ENV]
        data_report.start_epoch(events, 0)
        info = open_clip_train.data.get_wds_dataset(args, preprocess, True, epoch=0,
                                                    tokenizer=open_clip.get_tokenizer(MODEL))
        info.set_epoch(0)
        batches = [(images.cpu(), tokens.cpu()) for images, tokens in info.dataloader]
        assert len(batches) == info.dataloader.num_batches
        return batches, data_report.epoch_record(1, [data_report.collect(events, 0)])


def test_an_epoch_trains_open_clips_samples_in_its_order(tmp_path):
    """3 shards of 8: a file that is no image (skipped by the worker, from its header), a PNG and a CMYK JPEG (PIL
    decodes them on the device's side, counted). Batches of 4, 24 samples: the same 6 batches, tokens for tokens,
    as open_clip's pipeline, the same pixel statistics after normalisation (the crops are drawn apart), and the
    same data.jsonl record."""
    image, _ = sample(3)
    write_shards(tmp_path / 'shards', 3, 8, corrupt={(1, 2)},
                 members={(0, 3): {'jpg': _encoded(image, 'PNG')}, (2, 5): {'jpg': _encoded(image, mode='CMYK')}})
    urls = sorted((tmp_path / 'shards').glob('*.tar'))
    plain, plain_record = _epoch(urls, 'open_clip', 4, 24)
    device, device_record = _epoch(urls, 'device', 4, 24)
    assert len(device) == len(plain) == 6
    for (a, ta), (b, tb) in zip(plain, device):
        assert torch.equal(ta, tb)  # the same samples in the same order
        assert a.shape == b.shape and b.dtype == torch.float32
    a, b = (torch.cat([images for images, _ in batches]) for batches in (plain, device))
    assert torch.allclose(a.mean((0, 2, 3)), b.mean((0, 2, 3)), atol=0.02)  # pixel statistics after normalisation
    assert torch.allclose(a.std((0, 2, 3)), b.std((0, 2, 3)), atol=0.02)
    assert device_record.pop('device_data') == {'pil_decodes': 2, 'fill_repeats': 0}
    assert device_record == plain_record
    assert plain_record['skipped'] == {'undecodable_image': 1} and plain_record['samples_readable'] == 23


ON_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason='nvJPEG, on CUDA')]


@pytest.mark.parametrize('device', ['cpu', pytest.param('cuda', marks=ON_CUDA)])
def test_every_damaged_jpeg_open_clip_refuses_is_refused_by_the_device_backend_where_and_as_it_is(tmp_path, device):
    """tests/train/jpegs.py's damaged JPEGs (cut short, bits flipped and bytes overwritten in each segment and in
    the scan, segments missing, false dimensions, restart markers out of order: over a hundred, about half of
    which libjpeg still decodes) among intact samples, 16 shards of 16, two workers, batches of 8: the device
    backend's workers refuse each one open_clip's pipeline refuses, at the same place, so the same samples are
    trained in the same order, and the epoch's records are the same; the training process decodes every file it
    is handed (no hole to fill), with the JPEG decoder of `device` or PIL."""
    files = list(jpegs.damaged().items())
    members = {(k // 8, 2 * (k % 8)): {'jpg': data} for k, (_, data) in enumerate(files)}
    write_shards(tmp_path / 'shards', 16, 16, members=members)
    urls = sorted((tmp_path / 'shards').glob('*.tar'))
    plain, plain_record = _epoch(urls, 'open_clip', 8, 256, workers=2)
    ours, device_record = _epoch(urls, 'device', 8, 256, workers=2, device=device)
    assert len(ours) == len(plain) == 32
    assert all(torch.equal(ta, tb) for (_, ta), (_, tb) in zip(plain, ours))  # the same samples in the same order
    pil = device_record.pop('device_data')
    assert device_record == plain_record and pil['fill_repeats'] == 0
    refused = plain_record['skipped']['undecodable_image']
    readable = sum(_decodes(data) for _, data in files)
    assert refused == len(files) - readable and 40 < refused < len(files) - 40
    assert plain_record['samples_readable'] == 256 - refused


def _decodes(data: bytes) -> bool:
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
            image.convert('RGB')
        return True
    except Exception:  # noqa: BLE001  whatever PIL raises, open_clip's pipeline skips the sample
        return False


def _unchecked(data: bytes) -> EncodedImage:
    """An image member as the workers would hand it over if they did not check it decodes."""
    with Image.open(io.BytesIO(data)) as image:
        return EncodedImage(data, image.size, image.format, image.mode)


def test_an_image_the_training_process_cannot_decode_leaves_a_hole_the_next_sample_fills_counted(tmp_path,
                                                                                                monkeypatch):
    """Two batches of 4 encoded as a worker collates them, the second image of the first cut short and handed over
    unchecked: the training process skips it (journalled as the worker's pipeline would: an undecodable image, not
    trained), the next sample takes its place, and the epoch's last place is filled by a sample trained before it,
    counted as a repeat."""
    transform = TrainTransform.of(open_clip.image_transform(64, is_train=True, mean=MEAN, std=STD))
    collate = EncodedCollation(transform)
    files = [_encoded(sample(i)[0], cut=i == 1) for i in range(8)]
    encoded = []
    for first in (0, 4):
        items = []
        for i in range(first, first + 4):
            item = data_stages._Numbered((_unchecked(files[i]), torch.tensor([i])))
            item.sample_id, item.key = ('shard.tar', i), f'{i:04d}'
            items.append(item)
        encoded.append(collate(items))
    monkeypatch.setenv(data_events.ENV, str(tmp_path))
    data_report.start_epoch(tmp_path, 0)
    loader = DeviceLoader(argparse.Namespace(num_batches=2, num_samples=8), transform, 4, torch.device('cpu'))
    loader.loader = encoded
    batches = [tokens[:, 0].tolist() for _, tokens in loader]
    assert batches == [[0, 2, 3, 4], [5, 6, 7, 0]]  # the last place: the batch before's first sample again
    record = data_report.epoch_record(1, [data_report.collect(tmp_path, 0)])
    assert record['skipped'] == {'undecodable_image': 1} and record['device_data'] == {
        'pil_decodes': 1, 'fill_repeats': 1}
    assert '1 sample(s) trained again to fill the holes' in data_report.summary(record)


@pytest.mark.parametrize('size, scale', [((256, 256), None), ((200, 320), (0.08, 1.0)), ((330, 190), (0.5, 1.0))])
def test_crop_boxes_follow_open_clips_random_resized_crop(size, scale):
    """10,000 boxes of `draw_boxes` against 10,000 of torchvision's RandomResizedCrop with the scale and ratio of
    open_clip's train transform (its default (0.9, 1.0), then wider): the same distributions of area share, aspect
    and place (two-sample KS, fixed seeds)."""
    preprocess = open_clip.image_transform(224, is_train=True, aug_cfg=None if scale is None else {'scale': scale})
    transform, crop = TrainTransform.of(preprocess), preprocess.transforms[0]
    height, width = size
    torch.manual_seed(1)
    ours = draw_boxes(torch.tensor([size] * 10_000), transform.scale, transform.ratio).double()  # (n, 4)
    torch.manual_seed(2)
    image = Image.new('RGB', (width, height))
    theirs = torch.tensor([crop.get_params(image, crop.scale, crop.ratio) for _ in range(10_000)]).double()

    def features(boxes):  # area share, log aspect, place of the top left corner in its range
        top, left, h, w = boxes.unbind(1)
        return [h * w / (height * width), torch.log(w / h), top / (height - h + 1), left / (width - w + 1)]
    for a, b in zip(features(ours), features(theirs)):
        assert stats.ks_2samp(a.numpy(), b.numpy()).pvalue > 0.01
    assert transform.scale == tuple(crop.scale) and (ours[:, 2:] > 0).all()
    assert (ours[:, 0] + ours[:, 2] <= height).all() and (ours[:, 1] + ours[:, 3] <= width).all()


def test_the_device_transform_is_open_clips_on_the_same_box_within_one_level():
    """Decoded, cropped, resized (bicubic, antialias) and normalised on the device side against open_clip's
    train transform's steps on the same box (PIL's crop and resize, ToTensor, Normalize): every pixel within 1/255
    (PIL's resize and torch's round differently), the same statistics."""
    preprocess = open_clip.image_transform(64, is_train=True, mean=MEAN, std=STD)
    transform = TrainTransform.of(preprocess)
    loader = DeviceLoader(argparse.Namespace(num_batches=0, num_samples=0), transform, 8, torch.device('cpu'))
    files = [_encoded(sample(i)[0].resize((120, 90))) for i in range(8)]
    torch.manual_seed(0)
    boxes = draw_boxes(torch.tensor([[90, 120]] * 8), transform.scale, transform.ratio)
    decoded, _ = decode_images([torch.frombuffer(bytearray(f), dtype=torch.uint8) for f in files], [False] * 8,
                               torch.device('cpu'))
    ours = loader.normalized(torch.stack([loader.cropped(image, box.tolist()) for image, box in zip(decoded, boxes)]))
    crop, normalize = preprocess.transforms[0], preprocess.transforms[-1]
    theirs = torch.stack([normalize(TF.to_tensor(TF.resized_crop(Image.open(io.BytesIO(f)).convert('RGB'),
                                                                 *box.tolist(), list(crop.size), crop.interpolation)))
                          for f, box in zip(files, boxes)])
    assert ours.shape == theirs.shape == (8, 3, 64, 64)
    assert (ours - theirs).abs().max() <= 1 / 255 / min(STD) + 1e-5
    assert torch.allclose(ours.mean((0, 2, 3)), theirs.mean((0, 2, 3)), atol=1e-3)
    assert torch.allclose(ours.std((0, 2, 3)), theirs.std((0, 2, 3)), atol=1e-3)


@pytest.mark.parametrize('bicubic', [True, False])
def test_the_batched_crop_and_resize_is_torchs_antialiased_resize_and_within_one_level_of_pils(bicubic):
    """resample.resized_crops over images of five sizes (zero-padded to the largest, in chunks): each pixel within one
    level of torch's antialiased resize of the same box in float (the CUDA path of torchvision's resized_crop, rounded)
    and of PIL's resize; its weights equal torch's to 1e-12 in fp64."""
    from diffzoo.train.resample import CHUNK, resized_crops, weights
    mode = TF.InterpolationMode.BICUBIC if bicubic else TF.InterpolationMode.BILINEAR
    shapes = [(96, 96), (120, 90), (70, 130), (96, 60), (33, 47)]
    pils = [sample(i)[0].resize(shapes[i % len(shapes)]) for i in range(CHUNK + 6)]  # two chunks, the second short
    images = [TF.pil_to_tensor(p) for p in pils]
    torch.manual_seed(1)
    boxes = draw_boxes(torch.tensor([i.shape[-2:] for i in images]), (0.08, 1.0), (3 / 4, 4 / 3))
    ours = resized_crops(images, boxes, (40, 48), bicubic)
    floats = torch.stack([TF.resized_crop(i.float(), *b.tolist(), [40, 48], mode, antialias=True)
                          for i, b in zip(images, boxes)]).round().clamp(0, 255)
    pil = torch.stack([TF.pil_to_tensor(TF.resized_crop(p, *b.tolist(), [40, 48], mode)) for p, b in zip(pils, boxes)])
    assert ours.shape == (CHUNK + 6, 3, 40, 48) and ours.dtype == torch.uint8
    assert (ours.int() - floats.int()).abs().max() <= 1 and (ours.int() - pil.int()).abs().max() <= 1
    assert (ours.int() != floats.int()).float().mean() < 1e-3  # only values within float rounding of .5 differ
    x = torch.rand(1, 1, 1, 130, dtype=torch.float64)
    for start, length, out in ((0, 130, 48), (17, 29, 48), (5, 100, 40)):
        w = weights(torch.tensor([float(start)], dtype=torch.float64), torch.tensor([float(length)], dtype=torch.float64),
                    out, 130, bicubic)[0]
        ref = torch.nn.functional.interpolate(x[..., start:start + length], size=(1, out), antialias=True,
                                              mode='bicubic' if bicubic else 'bilinear', align_corners=False)
        torch.testing.assert_close(w @ x[0, 0, 0], ref[0, 0, 0], rtol=0, atol=1e-12)


def test_a_batch_cropped_at_once_trains_the_same_samples_as_one_crop_at_a_time():
    """The loader's batched path (CUDA's) and its per-image path (the CPU's) on one collated batch of JPEGs of three
    sizes, a PNG and a file no decoder reads: the same samples in the same order, the same one skipped, every pixel
    within one level."""
    transform = TrainTransform.of(open_clip.image_transform(64, is_train=True, mean=MEAN, std=STD))
    files = [_encoded(sample(i)[0].resize(((96, 96), (120, 90), (60, 80))[i % 3])) for i in range(9)]
    files[4] = _encoded(sample(4)[0], 'PNG')
    files[6] = _encoded(sample(6)[0], cut=True)  # its header reads, its pixels do not
    encoded_files = [_unchecked(f) for f in files]
    kept = [i for i, e in enumerate(encoded_files) if e is not None]
    tokens = torch.arange(len(kept))[:, None]
    torch.manual_seed(0)
    batch, tokens = EncodedCollation(transform)([(encoded_files[i], tokens[j]) for j, i in enumerate(kept)])
    out = {}
    for batched in (True, False):
        loader = DeviceLoader(argparse.Namespace(num_batches=0, num_samples=0), transform, 8, torch.device('cpu'),
                              batched=batched)
        out[batched] = list(loader.decoded(batch, tokens, None))
    assert [int(t) for _, t, _ in out[True]] == [int(t) for _, t, _ in out[False]] == [
        j for j, i in enumerate(kept) if i != 6]  # the tokens name the samples
    for (a, _, _), (b, _, _) in zip(out[True], out[False]):
        assert a.shape == b.shape == (3, 64, 64)
        assert (a.int() - b.int()).abs().max() <= 2  # each within one level of the float resize, either side


# nvJPEG against PIL (libjpeg) on this test's 4:2:0 JPEGs, measured on an H200: mean |difference| 0.7-1.2 levels,
# 99th percentile 14-18, largest 43-59 (chroma upsampling and inverse DCT of its own); 4:4:4 and greyscale JPEGs
# matched. The bounds leave a margin over those figures.
NVJPEG_MEAN_LEVELS, NVJPEG_P99_LEVELS = 2.0, 24


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason='the CUDA path: nvJPEG, the batched resize, the side stream')
def test_on_cuda_the_batches_are_open_clips_transform_of_nvjpegs_pixels_and_nvjpeg_is_within_its_bound_of_pil():
    """The loader on CUDA (nvJPEG, the batch resized at once in float64, made ahead in a thread on its own stream,
    the consumer's stream waiting on each), batch for batch, against open_clip's CPU transform (PIL's crop and
    resize on the same box, ToTensor, Normalize) of the pixels nvJPEG decoded in the loader's own batched call:
    every pixel within one level. (Against files nvJPEG decoded one at a time, an H200 measured two levels.) The
    decoders apart, on the same files: nvJPEG's pixels against PIL's, mean and 99th percentile of the difference
    in levels over the 4:2:0 files within the stated bounds; 4:4:4 and greyscale files within one level."""
    from diffzoo.train.device_loader import ahead
    cuda = torch.device('cuda')
    preprocess = open_clip.image_transform(64, is_train=True, mean=MEAN, std=STD)
    transform = TrainTransform.of(preprocess)
    files = [_encoded(sample(i)[0].resize(((96, 96), (120, 90), (60, 80))[i % 3])) for i in range(12)]
    torch.manual_seed(0)
    collate = EncodedCollation(transform)
    encoded = [collate([(encoded_image('.jpg', f), torch.tensor([i])) for i, f in enumerate(files[k:k + 4], k)])
               for k in range(0, 12, 4)]
    loader = DeviceLoader(argparse.Namespace(num_batches=3, num_samples=12), transform, 4, cuda)
    loader.loader = encoded
    assert loader.batched
    made = [(images.cpu(), tokens) for images, tokens in ahead(loader.batches, cuda)]
    crop, normalize = preprocess.transforms[0], preprocess.transforms[-1]

    def nvjpeg(data: bytes) -> torch.Tensor:  # (3, H, W) uint8, one file decoded alone
        return decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), device=cuda).cpu()

    for k, (images, tokens) in enumerate(made):
        assert tokens[:, 0].tolist() == list(range(4 * k, 4 * k + 4)) and images.shape == (4, 3, 64, 64)
        group = [torch.frombuffer(bytearray(f), dtype=torch.uint8) for f in files[4 * k:4 * k + 4]]
        pixels, by_pil = decode_images(group, [False] * 4, cuda)  # nvJPEG's batched call, as the loader decodes
        assert by_pil == 0
        theirs = torch.stack([normalize(TF.to_tensor(TF.resized_crop(TF.to_pil_image(p.cpu()), *box.tolist(),
                                                                     list(crop.size), crop.interpolation)))
                              for p, box in zip(pixels, encoded[k][0]['boxes'])])
        assert (images - theirs).abs().max() <= 1 / 255 / min(STD) + 1e-5
    image = sample(0)[0].resize((120, 90))
    others = {'444': [_encoded(image, subsampling=0)], 'grey': [_encoded(image, mode='L')]}
    for kind, data in (('420', files), *others.items()):
        levels = torch.cat([(nvjpeg(f).int() - pil_decode(torch.frombuffer(bytearray(f), dtype=torch.uint8)).int())
                            .abs().flatten() for f in data]).double()
        if kind == '420':
            assert levels.mean() <= NVJPEG_MEAN_LEVELS and levels.quantile(0.99) <= NVJPEG_P99_LEVELS
        else:
            assert levels.max() <= 1, kind


@pytest.mark.filterwarnings('ignore:Unused augmentation cfg items')  # open_clip warns of the jitter it applies
def test_the_transform_is_read_from_open_clips_and_one_with_other_steps_is_refused():
    transform = TrainTransform.of(open_clip.image_transform(64, True, mean=MEAN, std=STD, aug_cfg={'scale': (0.5, 1)}))
    assert (transform.size, transform.scale, transform.mean, transform.std) == ((64, 64), (0.5, 1), MEAN, STD)
    assert transform.ratio == pytest.approx((3 / 4, 4 / 3)) and transform.antialias
    jitter = open_clip.image_transform(64, True, aug_cfg={'color_jitter': (0.4, 0.4, 0.4, 0.1),
                                                          'color_jitter_prob': 0.8})
    with pytest.raises(RecipeError, match='color_jitter.*use data_backend open_clip'):
        TrainTransform.of(jitter)


def test_a_batch_the_jpeg_decoder_refuses_is_decoded_one_by_one_and_by_pil():
    """A cut JPEG sent to the JPEG decoder fails the batch call: the others decode one by one, exactly as PIL
    decodes them (libjpeg-turbo on the CPU), the cut one goes to PIL, which cannot read it either."""
    image = sample(1)[0]
    files = [_encoded(image), _encoded(image, cut=True), _encoded(image, 'PNG'), _encoded(image, mode='L')]
    tensors = [torch.frombuffer(bytearray(f), dtype=torch.uint8) for f in files]
    images, pil = decode_images(tensors, [False, False, True, False], torch.device('cpu'))
    assert pil == 2 and images[1] is None
    for decoded, tensor in zip([images[0], images[2], images[3]], [tensors[0], tensors[2], tensors[3]]):
        assert decoded.shape == (3, 96, 96) and torch.equal(decoded, pil_decode(tensor))
    assert encoded_image('.png', files[2]).needs_pil and _unchecked(files[1]).needs_pil
    assert not encoded_image('.jpg', files[3]).needs_pil and encoded_image('.txt', b'a caption') is None
    with pytest.raises(OSError, match='truncated'):  # the workers refuse it, as open_clip's decode does
        encoded_image('.jpg', files[1])


def test_a_resume_with_another_data_backend_goes_on_with_a_warning_and_is_recorded(tmp_path, capsys):
    """The same schedule, other crops and pixels: accepted as a change of workers is, not replayed bit for bit."""
    args = parse_args(['--model', MODEL, '--train-data', 'x.tar', '--train-num-samples', '16', '--logs',
                       str(tmp_path), '--name', 'run'])
    check_run_dir(args, 0, 1, None, False)
    path = tmp_path / 'run' / RUN_CONFIG
    assert 'data_backend' not in json.loads(path.read_text())  # the default's record as before
    (tmp_path / 'run' / 'checkpoints').mkdir()
    (tmp_path / 'run' / 'checkpoints' / 'epoch_1.pt').write_bytes(b'')
    check_run_dir(args, 0, 1, None, False, data_backend='device')
    assert "data_backend: None -> 'device': the run goes on, but no longer replays" in capsys.readouterr().err
    record = json.loads(path.read_text())
    assert record['data_backend'] == 'device' and record[CHANGES][-1]['changed'] == {'data_backend': [None, 'device']}


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / 'data.jsonl').read_text().splitlines()]


ARGV = ['--recipe', MODEL, '--train_data', 'shards', '--epochs', '2', '--global_batch_size', '8',
        '--data_backend', 'device']


@pytest.mark.slow
def test_a_run_with_the_device_backend_resumes_to_the_same_weights(tmp_path):
    """`python -m diffzoo.train … --data_backend device` for 2 epochs on 2 shards of 8 with a cut JPEG; then the
    run as a kill during epoch 2 leaves it (epoch 2's checkpoint gone), resumed: the same weights, bit for bit,
    and data.jsonl's epoch 2 once."""
    write_shards(tmp_path / 'shards', 2, 8, members={(1, 3): {'jpg': _encoded(sample(0)[0], cut=True)}})
    result = call(train_main, ARGV, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run_dir = tmp_path / 'runs' / MODEL
    for record in _records(run_dir):
        assert (record['samples_trained'], record['samples_distinct'], record['skipped']) == (
            16, 15, {'undecodable_image': 1})
        assert record['device_data'] == {'pil_decodes': 0, 'fill_repeats': 0}  # the workers refused it
    checkpoints = run_dir / 'checkpoints'
    whole = torch.load(checkpoints / 'epoch_2.pt', map_location='cpu', weights_only=True)['state_dict']
    (checkpoints / 'epoch_2.pt').unlink()
    (checkpoints / 'epoch_latest.pt').write_bytes((checkpoints / 'epoch_1.pt').read_bytes())
    resumed = call(train_main, ARGV, cwd=tmp_path)
    assert resumed.returncode == 0 and 'resuming' in resumed.stdout, resumed.stderr[-3000:]
    again = torch.load(checkpoints / 'epoch_2.pt', map_location='cpu', weights_only=True)['state_dict']
    assert all(torch.equal(whole[k], again[k]) for k in whole)
    assert [r['epoch'] for r in _records(run_dir)] == [1, 2]


@pytest.mark.slow
def test_two_processes_with_the_device_backend_train_every_sample_once(tmp_path):
    """torchrun, 2 ranks (gloo) of 2 shards of 4 each, batches of 4 per rank: each rank's batches are made in its
    own training process; every readable sample trained once, the cut one skipped by whichever rank's worker read
    it, whose pass goes on into the next for the last place."""
    write_shards(tmp_path / 'shards', 4, 4, members={(2, 1): {'jpg': _encoded(sample(0)[0], cut=True)}})
    result = run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc-per-node', '2',
                  '-m', 'diffzoo.train', *ARGV[:5], '--epochs', '1', '--global_batch_size', '8',
                  '--data_backend', 'device'], cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    record = _records(tmp_path / 'runs' / MODEL)[0]
    assert [r['samples_trained'] for r in record['ranks']] == [8, 8]
    assert (record['samples_trained'], record['samples_distinct'], record['samples_repeated']) == (16, 15, 1)
    assert record['skipped'] == {'undecodable_image': 1} and record['device_data']['fill_repeats'] == 0


def test_batches_are_made_ahead_in_order_an_error_reaches_the_loop_and_an_early_stop_ends_the_thread():
    """`ahead`: the batches in order, at most one made beyond the one held plus the one in the making; the maker's
    DataError raised in the loop after the batches before it; a loop that stops early leaves no thread behind."""
    import threading
    import time
    from diffzoo.data.shards import DataError
    from diffzoo.train.device_loader import ahead
    made = []

    def make(fail_at=None):
        for i in range(6):
            if i == fail_at:
                raise DataError('shard 3 is unreadable')
            made.append(i)
            yield torch.full((2,), i), torch.tensor([i])

    seen = []
    for images, tokens in ahead(make, torch.device('cpu')):
        time.sleep(0.05)  # the maker is ahead by now, as far as it may go
        assert len(made) <= len(seen) + 3
        seen.append(int(tokens))
        assert images.tolist() == [seen[-1]] * 2
    assert seen == list(range(6))

    got = []
    with pytest.raises(DataError, match='shard 3'):
        for _, tokens in ahead(lambda: make(fail_at=3), torch.device('cpu')):
            got.append(int(tokens))
    assert got == [0, 1, 2]

    batches = ahead(make, torch.device('cpu'))
    next(batches)
    batches.close()
    assert not [t for t in threading.enumerate() if t.name == 'diffzoo-device-batches']
