"""A stage run again after it finished, after a stop, or after a save that failed (`diffzoo.train.vlm.resume`,
`VLMTrainer.data_counts`): its records of bad data kept, a log line cut short dropped, a full disk named, and the
rerun going on from the last complete checkpoint. Real runs of `python -m diffzoo.train.vlm` on the suite's tiny
stage 1 (a DiffCLIP tower's projector on captions), one of them in a process whose file size is limited."""
import json
import resource
import shutil
import signal
import subprocess
import sys

import pytest
import yaml

from diffzoo.train.vlm import main
from tests.factory import call, python_env
from tests.vlm.models import write_chat_language_model, write_llava_sets


@pytest.fixture(scope='module')
def stage1(tmp_path_factory):
    """stage1.yaml (tests/vlm/test_stages.py's stage 1, at 4 captions a step: 8 steps an epoch) in its folder."""
    root = tmp_path_factory.mktemp('reruns')
    write_chat_language_model(root / 'lm')
    write_llava_sets(root, count=32)
    recipe = dict(model=dict(type='build_vlm', vision='diffclip-tiny', language_model=str(root / 'lm'), select_layer=-2,
                             projector='mlp2x_gelu', sequence_mask='causal'),
                  attention=dict(type='differential', lambda_init=0.5), train=dict(projector=True), lr=3e-3,
                  data=dict(type='conversations', json=str(root / 'pretrain.json'), image_folder=str(root / 'images'),
                            format='plain', max_length=128),  # the tower's 64 patch positions and the text
                  global_batch_size=4, batch_size=4, log_every=1, save_every=4, report_to='none', device='cpu')
    (root / 'stage1.yaml').write_text(yaml.safe_dump(recipe))
    return root


def _steps(run):
    return [json.loads(line)['step'] for line in (run / 'log.jsonl').read_text().splitlines()]


def test_a_rerun_keeps_the_records_of_bad_data_and_the_output_and_a_cut_log_line_is_dropped(stage1, tmp_path):
    """A finished stage run again trains nothing (its last step in mid-epoch: Trainer took one more) and keeps what
    its run recorded: unreadable images and conversations cut (both were rewritten as 0); a longer rerun adds to
    them, as the checkpoint kept them. A log line cut short by a stop is dropped with a note (it stopped every
    resume)."""
    images = tmp_path / 'images'
    shutil.copytree(stage1 / 'images', images)
    bad = sorted((images / 'scenes').glob('*.jpg'))[::2]  # half of them: the first steps meet some
    for path in bad:
        path.write_bytes(path.read_bytes()[:300])
    argv = ['--recipe', stage1 / 'stage1.yaml', '--output', tmp_path / 'runs', '--data.image_folder', images,
            '--data.max_length', 64 + 3]  # the image's 64 positions and 3 of each caption's tokens
    first = call(main, [*argv, '--max_steps', '2'], stage1)
    assert first.returncode == 0, first.stderr[-3000:]
    run = tmp_path / 'runs' / 'stage1'
    kept = ('skipped_images.json', 'data_problems.json', 'log.jsonl', 'stage/stage.json',
            'stage/stage_model.safetensors')
    before = {name: (run / name).read_bytes() for name in kept}
    skipped, problems = json.loads(before['skipped_images.json']), json.loads(before['data_problems.json'])
    assert skipped['count'] > 0 and set(skipped['files']) <= {str(p) for p in bad}
    assert skipped['samples_trained'] + skipped['samples_skipped'] == 2 * 4 and problems['cut_to_max_length'] > 0

    again = call(main, [*argv, '--max_steps', '2'], stage1)
    assert again.returncode == 0 and 'resuming stage1 from step 2' in again.stdout, again.stderr[-3000:]
    assert {name: (run / name).read_bytes() for name in kept} == before
    assert f'{skipped["count"]} unreadable image file(s) left out' in again.stdout

    longer = call(main, [*argv, '--max_steps', '3'], stage1)
    assert longer.returncode == 0, longer.stderr[-3000:]
    now = json.loads((run / 'skipped_images.json').read_text())
    assert now['samples_trained'] + now['samples_skipped'] == 3 * 4 and set(skipped['files']) <= set(now['files'])
    assert json.loads((run / 'data_problems.json').read_text())['cut_to_max_length'] >= problems['cut_to_max_length']

    with open(run / 'log.jsonl', 'a') as f:  # a run stopped while writing step 4's line, before its checkpoint
        f.write('{"step": 4, "epoch": 0.5, "lo')
    resumed = call(main, [*argv, '--max_steps', '4'], stage1)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f'{run / "log.jsonl"}: its last line was cut short (\'{{"step": 4, "epoch": 0.5, "lo\'…)' in resumed.stdout
    assert _steps(run) == [1, 2, 3, 4]


def test_the_last_partial_batch_trains_and_its_unreadable_image_is_named(stage1, tmp_path):
    """11 captions at batch 4, one of them on an unreadable image: three steps (4, 4 and the last 3), 10 samples
    trained and the image named, as LLaVA's and TinyLLaVA's trainers keep the last batch (transformers' default).
    The unreadable one is caption 7, which the sampler's order under seed 0 puts in the last batch. Before: two steps,
    "8 samples trained, no unreadable image": the last three were dropped every epoch, uncounted."""
    records = json.loads((stage1 / 'pretrain.json').read_text())[:11]
    bad = tmp_path / 'images' / records[7]['image']
    shutil.copytree(stage1 / 'images', tmp_path / 'images')
    bad.write_bytes(bad.read_bytes()[:300])
    (tmp_path / 'eleven.json').write_text(json.dumps(records))
    done = call(main, ['--recipe', stage1 / 'stage1.yaml', '--output', tmp_path / 'runs', '--data.json',
                       tmp_path / 'eleven.json', '--data.image_folder', tmp_path / 'images', '--epochs', '1'], stage1)
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / 'runs' / 'stage1'
    assert _steps(run) == [1, 2, 3]
    assert json.loads((run / 'skipped_images.json').read_text()) == {
        'count': 1, 'files': [str(bad)], 'samples_skipped': 1, 'samples_trained': 10}
    assert f'10 samples trained; 1 unreadable image file(s) left out (1 samples): {bad}' in done.stdout
    assert 'stage1: 11 conversations (every record kept whole), 3 steps of 4 × 1 × 1' in done.stdout


def _limited(size):
    def limit():  # in the child: a write past `size` bytes fails with EFBIG (SIGXFSZ, which would kill it, ignored)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
    return limit


@pytest.mark.slow  # real processes
def test_a_save_that_fails_names_the_disk_and_the_rerun_goes_on_from_the_last_complete_checkpoint(stage1, tmp_path):
    """A checkpoint that cannot be written (here a process limited in file size, as a full disk fails) ends the
    run with exit 2 naming the checkpoint, the disk's free space and where a rerun resumes (torch said
    'basic_ios::clear: iostream error'); so does the stage's output. The rerun sets the part-written checkpoint
    aside, resumes from the one before and finishes."""
    argv = ['--recipe', stage1 / 'stage1.yaml', '--output', tmp_path / 'runs', '--save_every', '1']
    assert call(main, [*argv, '--max_steps', '1'], stage1).returncode == 0
    run = tmp_path / 'runs' / 'stage1'
    checkpoints = run / 'checkpoints'
    size = (checkpoints / 'checkpoint-1' / 'stage_model.safetensors').stat().st_size // 2  # a save's first file
    full = subprocess.run([sys.executable, '-m', 'diffzoo.train.vlm', *map(str, argv), '--max_steps', '2'], cwd=stage1,
                          env=python_env(), preexec_fn=_limited(size), capture_output=True, text=True, timeout=300)
    assert full.returncode == 2 and 'Traceback' not in full.stderr, full.stderr[-3000:]
    assert f'error: {checkpoints / "checkpoint-2"}: writing a checkpoint failed (' in full.stderr
    assert 'MB free of' in full.stderr
    assert f'it resumes from its last complete checkpoint, {checkpoints / "checkpoint-1"}' in full.stderr

    (run / 'stage' / 'stage.json.tmp').mkdir()  # the stage's output cannot be written either
    stopped = call(main, [*argv, '--max_steps', '2'], stage1)
    assert stopped.returncode == 2
    assert f'skipping {checkpoints / "checkpoint-2"}: incomplete' in stopped.stdout
    assert 'resuming stage1 from step 1' in stopped.stdout
    assert f"error: {run / 'stage'}: writing the stage's output failed (IsADirectoryError" in stopped.stderr
    assert f'it resumes from its last complete checkpoint, {checkpoints / "checkpoint-2"}' in stopped.stderr
    assert not (run / 'stage' / 'stage.json').exists()  # not finished: no later stage starts from it

    (run / 'stage' / 'stage.json.tmp').rmdir()
    done = call(main, [*argv, '--max_steps', '2'], stage1)
    assert done.returncode == 0 and 'resuming stage1 from step 2' in done.stdout, done.stderr[-3000:]
    assert json.loads((run / 'stage' / 'stage.json').read_text())['steps'] == 2 and _steps(run) == [1, 2]
