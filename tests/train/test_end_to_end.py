"""From a CC3M-layout URL list to a trained DiffCLIP, as a researcher runs it, in real processes.

An HTTP server on 127.0.0.1 serves generated pictures (plus URLs that 404 and a file that is not
a JPEG); `scripts/download_cc3m.sh` turns the list into webdataset shards with img2dataset;
`diffzoo.data sizes/check/retry` read them; `scripts/train.sh` trains diffclip-tiny for 2 epochs
with `torchrun --nproc_per_node 2` (gloo on CPU); the final checkpoint loads with
`open_clip.create_model`. (A run killed and resumed through scripts/train.sh:
tests/train/test_train_sh.py.)
"""
import io
import json
import os
from pathlib import Path

import open_clip
import pytest
import torch
from PIL import Image

from diffzoo.data.__main__ import main as data_main
from diffzoo.data.shards import iter_samples
from tests.factory import call, http_server, run, serve_dataset

pytestmark = pytest.mark.slow  # real processes: a download, a torchrun training

ROOT = Path(__file__).resolve().parents[2]
IMAGES, MISSING, CORRUPT = 160, 6, 1
PER_SHARD = 32  # 167 URLs -> 6 shards
SHARDS = 6
GLOBAL_BATCH = 16  # 8 per process
STEPS_PER_EPOCH = IMAGES // GLOBAL_BATCH
RECIPE = 'diffclip-tiny'


IMAGENET = dict(image_mean=(0.485, 0.456, 0.406), image_std=(0.229, 0.224, 0.225))  # as the recipe trains


@pytest.fixture(scope='module')
def downloaded(tmp_path_factory):
    root = tmp_path_factory.mktemp('e2e')
    rows = serve_dataset(root / 'www', IMAGES, MISSING, CORRUPT)
    with http_server(root / 'www') as base:
        # CC3M's published layout: caption <TAB> url, no header
        (root / 'cc3m.tsv').write_text(''.join(f'{caption}\t{base}{path}\n' for caption, path in rows))
        cmd = ['bash', str(ROOT / 'scripts' / 'download_cc3m.sh'), 'cc3m.tsv', 'shards', '--',
               '--number_sample_per_shard', str(PER_SHARD)]
        env = dict(IMG2DATASET_PROCESSES=1, IMG2DATASET_THREADS=4)
        first = run(cmd, cwd=root, **env)
        assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
        shards = root / 'shards'
        before = {p.name: p.stat().st_mtime_ns for p in shards.glob('*.tar')}
        again = run(cmd, cwd=root, **env)  # incremental: finished shards are kept as they are
        assert again.returncode == 0, again.stderr[-3000:]
        assert {p.name: p.stat().st_mtime_ns for p in shards.glob('*.tar')} == before
    return root, first


def test_download_writes_shards_and_sizes_of_the_urls_that_still_work(downloaded):
    root, result = downloaded
    shards = root / 'shards'
    sizes = json.loads((shards / 'sizes.json').read_text())
    assert sorted(sizes) == [f'{i:05d}.tar' for i in range(SHARDS)]
    assert sum(sizes.values()) == IMAGES
    assert f'{SHARDS} shards, {IMAGES} samples' in result.stdout
    first_key, members = next(iter_samples(shards / '00000.tar'))
    assert {'jpg', 'txt', 'json'} <= set(members)
    with Image.open(io.BytesIO(members['jpg'])) as img:
        assert min(img.size) == 224  # shorter side 224, aspect ratio kept
    assert members['txt'].decode().startswith('a ')


def test_sizes_check_and_retry_on_the_downloaded_shards(downloaded):
    root, _ = downloaded
    (root / 'shards' / 'sizes.json').unlink()
    sizes = call(data_main, ['sizes', 'shards'], cwd=root)  # (tests/data/test_download.py runs it in a process)
    assert sizes.returncode == 0 and f'{SHARDS} shards, {IMAGES} samples' in sizes.stdout
    check = call(data_main, ['check', 'shards', '--workers', '2'], cwd=root)
    assert check.returncode == 0, check.stdout + check.stderr
    assert check.stdout.rstrip().endswith('shards: OK')
    retry = call(data_main, ['retry', 'shards', 'failed.tsv'], cwd=root)
    assert retry.returncode == 0, retry.stderr
    failed = (root / 'failed.tsv').read_text().splitlines()
    assert failed[0] == 'url\tcaption' and len(failed) == 1 + MISSING + CORRUPT
    assert sum('/gone_' in line for line in failed) == MISSING and sum('/bad_' in line for line in failed) == CORRUPT


@pytest.fixture(scope='module')
def trained(downloaded):
    """scripts/train.sh with torchrun --nproc_per_node 2 for 2 epochs."""
    root, _ = downloaded
    cmd = ['bash', str(ROOT / 'scripts' / 'train.sh'), RECIPE, '--train_data', 'shards', '--epochs', '2',
           '--global_batch_size', str(GLOBAL_BATCH), '--logs', 'e2e-runs']
    result = run(cmd, cwd=root, timeout=300, NPROC_PER_NODE=2)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return root, root / 'e2e-runs' / RECIPE, result


def test_each_rank_reads_different_shards(trained):
    _, run_dir, _ = trained
    records = [json.loads(line) for line in (run_dir / 'data.jsonl').read_text().splitlines()]
    assert [r['epoch'] for r in records] == [1, 2]
    for record in records:
        assert len(record['ranks']) == 2
        rank0, rank1 = ({os.path.basename(u) for u in r['shards']} for r in record['ranks'])
        assert rank0 and rank1 and not rank0 & rank1
        assert rank0 | rank1 == {f'{i:05d}.tar' for i in range(SHARDS)}
        assert record['samples_trained'] == STEPS_PER_EPOCH * GLOBAL_BATCH


def test_loss_went_down_and_the_checkpoint_loads_in_open_clip(trained):
    root, run_dir, result = trained
    assert sorted(p.name for p in (run_dir / 'checkpoints').glob('*.pt')) == ['epoch_1.pt', 'epoch_2.pt',
                                                                              'epoch_latest.pt']
    lines = [json.loads(line) for line in (run_dir / 'lambda.jsonl').read_text().splitlines()]
    assert [r['step'] for r in lines] == list(range(2 * STEPS_PER_EPOCH + 1))
    records = {r['step']: r for r in lines}
    first_epoch = [records[s]['loss'] for s in range(1, STEPS_PER_EPOCH + 1)]
    last_epoch = [records[s]['loss'] for s in range(STEPS_PER_EPOCH + 1, 2 * STEPS_PER_EPOCH + 1)]
    assert sum(last_epoch) < sum(first_epoch)  # (near chance, ln 16, after a few steps: the margin is small)

    checkpoint = run_dir / 'checkpoints' / 'epoch_2.pt'
    trained_model, _, preprocess = open_clip.create_model_and_transforms(RECIPE, pretrained=str(checkpoint),
                                                                         **IMAGENET)
    state = torch.load(checkpoint, map_location='cpu', weights_only=False)['state_dict']
    for name, value in trained_model.state_dict().items():
        assert torch.equal(value, state['module.' + name]), name
    torch.manual_seed(0)
    untrained = open_clip.create_model(RECIPE)
    tokenizer = open_clip.get_tokenizer(RECIPE)
    images, texts = [], []
    for shard in sorted((root / 'shards').glob('*.tar'))[:2]:
        for _, members in iter_samples(shard):
            images.append(preprocess(Image.open(io.BytesIO(members['jpg'])).convert('RGB')))
            texts.append(members['txt'].decode())
    images, texts = torch.stack(images), tokenizer(texts)
    loss = open_clip.ClipLoss()

    def clip_loss(model):
        model.eval()
        with torch.no_grad():
            return loss(model.encode_image(images, normalize=True), model.encode_text(texts, normalize=True),
                        model.logit_scale.exp()).item()
    assert clip_loss(trained_model) < clip_loss(untrained)
    assert 'run directory: e2e-runs/diffclip-tiny' in result.stdout  # --logs reached the script intact
