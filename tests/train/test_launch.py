"""`python -m diffzoo.train` on shards with bad samples in them: the two-process run under torchrun, the other
command lines through its `main` in this process (`python -m diffzoo.train` runs as a process of its own in the
demo's trainings, tests/test_demo.py, and under scripts/train.sh, tests/train/test_train_sh.py)."""
import json
import math
import os
import re
import sys

import pytest

from diffzoo.train.launch import main
from tests.factory import call, run, write_shards

pytestmark = pytest.mark.slow  # trainings, one of them under torchrun


def train(argv, cwd):
    """`python -m diffzoo.train ARGV` in this process."""
    return call(main, argv, cwd)


@pytest.fixture(scope='module')
def damaged_run(tmp_path_factory):
    """One epoch of diffclip-tiny on shards with a corrupt JPEG, a sample without caption, an empty
    shard and a truncated one."""
    root = tmp_path_factory.mktemp('launch')
    write_shards(root / 'shards', 5, 12, corrupt={(0, 3)}, no_caption={(1, 5)}, empty={2})
    truncated = root / 'shards' / '00004.tar'
    truncated.write_bytes(truncated.read_bytes()[:truncated.stat().st_size // 2])
    argv = ['--recipe', 'diffclip-tiny', '--train_data', 'shards', '--epochs', '1', '--global_batch_size', '8',
            '--report_to', 'tensorboard']
    result = train(argv, cwd=root)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return root, argv, result


def test_bad_samples_are_skipped_counted_and_reported(damaged_run):
    """sizes.json says 48 (4 × 12); the shards hold 42 (12 + 12 + 12 + the 6 before 00004.tar's cut), 40 of them
    readable; 6 batches of 8: the first pass trains all 40, the loader wraps and trains 8 of them again."""
    root, _, result = damaged_run
    run_dir = root / 'runs' / 'diffclip-tiny'
    report = json.loads((run_dir / 'data.jsonl').read_text().splitlines()[0])
    assert (report['samples_trained'], report['samples_distinct'], report['samples_repeated']) == (48, 40, 8)
    assert report['samples_readable'] == 40 and report['all_shards_read']
    assert report['skipped'] == {'undecodable_image': 1, 'no_caption': 1, 'empty_shard': 1, 'unreadable_shard': 1}
    opened = {os.path.basename(url): n for url, n in report['ranks'][0]['shards'].items()}
    assert opened == {f'0000{i}.tar': 2 for i in range(5)}  # the second pass fills its shuffle buffer from all
    events = report['skip_events']
    assert events['empty_shard'] == events['unreadable_shard'] == 2  # met once per pass, each one shard
    assert events['undecodable_image'] in (1, 2) and events['no_caption'] in (1, 2)  # as far as the 2nd pass got
    examples = {(reason, key) for reason, _, key in report['examples']}
    assert ('undecodable_image', '000000003') in examples and ('no_caption', '000010005') in examples
    log = (run_dir / 'out.log').read_text()
    assert ('epoch 1 data: 48 samples trained (40 distinct, 8 repeats: trained again in the same epoch, '
            'to fill the whole batches open_clip_train makes of each data-loader worker\'s share)' in log)
    reported = {line.strip().split(' (')[0].split(',')[0].split(' ', 2)[2]: line for line in log.splitlines()
                if line.startswith('  skipped ')}
    assert reported.keys() == {'undecodable image', 'without caption', 'empty shard', 'unreadable shard'}
    assert '00000.tar/000000003' in reported['undecodable image']
    assert '00001.tar/000010005' in reported['without caption']
    # the loop's own wait for its 6 batches, timed at the loader: one line an epoch, in the run's log
    waits = [line for line in log.splitlines() if 'diffzoo data wait: epoch 1: 6 batches, ' in line]
    assert len(waits) == 1 and re.search(r'waiting for them \(\d+\.\d %\); after the first, [\d.]+ s of '
                                         r'[\d.]+ s \(\d+\.\d %\)$', waits[0])
    assert 'skipped 1 empty shard, met 2 times (1 repeat) (00002.tar)' in reported['empty shard']
    assert 'skipped 1 unreadable shard, met 2 times (1 repeat) (00004.tar)' in reported['unreadable shard']
    warning = ('shards/sizes.json says 48 samples, the shards hold 42 (40 readable): each sample is trained ~1.2× per '
               'epoch (8 repeats in epoch 1); fix sizes.json with `python -m diffzoo.data sizes shards --recount` or '
               'pass --train-num-samples 40')
    assert log.count(warning) == 1
    assert (run_dir / 'checkpoints' / 'epoch_1.pt').exists()


def test_the_run_ends_on_its_loss_against_chance(damaged_run):
    """The last line: the mean loss of the last logged steps (lambda.jsonl) against ln 8, the contrastive loss of
    scoring every pair of the global batch of 8 alike, and the verdict those two numbers give."""
    root, _, result = damaged_run
    log = root / 'runs' / 'diffclip-tiny' / 'lambda.jsonl'
    records = (json.loads(line) for line in log.read_text().splitlines())
    losses = [r['loss'] for r in records if r['loss'] is not None][-10:]
    loss = sum(losses) / len(losses)
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith(f'trained: loss {loss:.3f} (mean of the last {len(losses)} logged steps); chance ln 8 = '
                           f'{math.log(8):.3f} (global batch 8): '), last
    verdict = 'worse than' if loss > math.log(8) else 'at' if loss > math.log(0.9 * 8) else 'better than'
    assert last.split('): ', 1)[1].startswith(f'{verdict} chance (the right pair is as likely as one in '
                                              f'{math.exp(loss):.1f} of the batch\'s 8'), last


def test_resolved_configuration_is_printed_first(damaged_run):
    _, _, result = damaged_run
    out = result.stdout
    assert out.startswith('diffzoo.train: recipe diffclip-tiny')
    assert 'derived for 1 process(es): shards 5, samples 48' in out
    assert re.search(r'^  data_backend +open_clip \(the default on cpu\)$', out, re.M)  # the recipe names none
    assert 'open_clip_train --model diffclip-tiny' in out
    # open_clip_train's model and parameter dump: one line on the console, whole in out.log
    log = (damaged_run[0] / 'runs' / 'diffclip-tiny' / 'out.log').read_text()
    assert 'Params:' in log and 'model structure and settings: in runs/diffclip-tiny/out.log' in out + result.stderr
    assert 'Params:' not in out + result.stderr and len((out + result.stderr).splitlines()) < len(log.splitlines()) / 2


def test_lambda_log_and_plot(damaged_run):
    root, _, _ = damaged_run
    run_dir = root / 'runs' / 'diffclip-tiny'
    records = [json.loads(line) for line in (run_dir / 'lambda.jsonl').read_text().splitlines()]
    assert [r['step'] for r in records] == list(range(7))  # initial λ + 6 steps
    assert records[0]['loss'] is None and all(r['loss'] > 0 for r in records[1:])
    layers = records[-1]['lambda']
    assert len(layers) == 8 and sum(n.startswith('visual.trunk.blocks.') for n in layers) == 4
    assert records[-1]['lambda'] != records[0]['lambda']  # λ is trained
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(run_dir / 'tensorboard'))
    events.Reload()
    for name, value in records[-1]['lambda'].items():
        scalars = events.Scalars(f'lambda/{name}')
        assert [s.step for s in scalars] == list(range(7)) and scalars[-1].value == pytest.approx(value)
    result = train(['plot-lambda', run_dir], cwd=root)
    assert result.returncode == 0, result.stderr[-2000:]
    png = run_dir / 'lambda.png'
    assert result.stdout.strip() == str(png) and png.read_bytes()[:4] == b'\x89PNG'


def test_a_run_directory_with_other_settings_is_refused(damaged_run):
    root, argv, _ = damaged_run
    result = train(argv + ['--lr', '0.01'], cwd=root)
    assert result.returncode == 2
    assert 'holds a run started with other settings (lr: 0.001 -> 0.01)' in result.stderr
    assert '--name NEW' in result.stderr


def test_rerunning_a_finished_run_says_so_and_how_to_extend_it(damaged_run):
    root, argv, _ = damaged_run
    checkpoint = root / 'runs' / 'diffclip-tiny' / 'checkpoints' / 'epoch_1.pt'
    before = checkpoint.stat().st_mtime_ns
    log_before = (root / 'runs' / 'diffclip-tiny' / 'out.log').read_text()
    result = train(argv, cwd=root)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == (
        f'{os.path.join("runs", "diffclip-tiny")}: finished, epoch 1 of 1; nothing to train. To train longer, run '
        f'the same command with --epochs N (N > 1): it resumes from epoch 1.')
    assert 'INFO' not in result.stdout + result.stderr  # not open_clip_train's log of a run that trains nothing
    assert (root / 'runs' / 'diffclip-tiny' / 'out.log').read_text() == log_before
    assert checkpoint.stat().st_mtime_ns == before


@pytest.mark.parametrize('args, message', [
    (['--train_data', 'missing/{00000..00009}.tar'], 'matches no shard (missing does not exist)'),
    (['--train_data', '/nonexistent'], "train_data '/nonexistent' matches no shard (/nonexistent does not exist)"),
    (['--train_data', 'no_sizes/{00005..00006}.tar'], 'matches no shard (no_sizes holds 2 *.tar files)'),
    (['--train_data', 'no_sizes'], 'no sizes.json in no_sizes and no train_num_samples'),
    (['--train_data', 'no_sizes', '--train_num_samples', '10', '--learning_rate', '1'], 'unknown recipe keys'),
    (['--train_data', 'no_sizes', '--train_num_samples', '10', '--model', 'diffclip-tyni'],
     "model 'diffclip-tyni' is not an open_clip model; did you mean diffclip-tiny"),
])
def test_bad_data_fails_before_any_model_is_built(tmp_path, args, message):
    write_shards(tmp_path / 'no_sizes', 2, 2, sizes=False)
    result = train(['--recipe', 'diffclip-tiny'] + args, cwd=tmp_path)
    assert result.returncode == 2
    assert message in result.stderr
    assert not (tmp_path / 'runs').exists()


def test_a_corpus_no_batch_fills_is_refused_with_the_numbers_and_the_fix_works(tmp_path):
    """One shard of 16 samples and a global batch of 32: the loader would look for a full batch forever
    (open_clip_train alone hangs after "Start epoch 0"); refused before any model is built, and the fix the
    message gives trains. Accumulating two batches of 16 would make no step of 32 from 16 samples: refused too."""
    write_shards(tmp_path / 'small', 1, 16)
    cmd = ['--recipe', 'clip-tiny-baseline', '--train_data', 'small', '--epochs', '1', '--global_batch_size', '32']
    result = train(cmd, cwd=tmp_path)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert ('error: 1 shard(s) of 16 samples in small give each of the 1 data worker(s) of 1 process(es) 1 shard(s) '
            'a pass, as few as 16 samples: fewer than one batch of 32 per process, so the loader would wait for a '
            'full batch forever. Pass a global batch of at most 16, more data or --dataset-resampled') in result.stderr
    accumulated = train(cmd + ['--max_batch_per_gpu', '16'], cwd=tmp_path)
    assert accumulated.returncode == 2
    assert ('error: 16 samples in small make no optimizer step of global batch 32 (16 per process × 1 process(es) × 2 '
            'accumulated). Pass a global batch of at most 16, more data or --dataset-resampled') in accumulated.stderr
    assert not (tmp_path / 'runs').exists()
    fixed = train(cmd[:-1] + ['16'], cwd=tmp_path)
    assert fixed.returncode == 0, fixed.stdout[-2000:] + fixed.stderr[-2000:]
    assert json.loads((tmp_path / 'runs' / 'clip-tiny-baseline' / 'data.jsonl').read_text())['samples_trained'] == 16


def test_a_shard_cut_short_that_no_batch_fills_ends_the_run_by_name_instead_of_spinning(tmp_path):
    """sizes.json says 16, the tar holds 5 readable samples before its cut: every pass makes no batch of 8, and
    open_clip_train alone would repeat the pass forever, logging the tar error each time."""
    write_shards(tmp_path / 'shards', 1, 16)
    shard = tmp_path / 'shards' / '00000.tar'
    data = shard.read_bytes()
    shard.write_bytes(data[:len(data) * 5 // 16 + 700])  # five whole samples and a cut sixth
    result = train(['--recipe', 'clip-tiny-baseline', '--train_data', 'shards', '--epochs', '1',
                    '--global_batch_size', '8'], cwd=tmp_path)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    err = result.stderr
    assert 'error: data worker 0 of rank 0 read 5 sample(s) in a pass over its shards (00000.tar in shards) and made ' \
           'no full batch of 8; every pass would make none' in err
    assert 'python -m diffzoo.data check shards' in err and 'Traceback' not in err.split('error: ')[-1]
    log = (tmp_path / 'runs' / 'clip-tiny-baseline' / 'out.log').read_text()
    assert log.count('Train Epoch') == 0 and log.count('00000.tar') < 10  # one pass, not thousands


def test_more_workers_than_a_batch_fills_are_refused_naming_the_worker_count_that_works(tmp_path):
    """4 shards of 8 over 4 workers: each worker reads 8 samples a pass, fewer than a batch of 16; 2 workers fill it."""
    write_shards(tmp_path / 'shards', 4, 8)
    result = train(['--recipe', 'clip-tiny-baseline', '--train_data', 'shards', '--global_batch_size', '16',
                    '--workers', '4'], cwd=tmp_path)
    assert result.returncode == 2
    assert 'as few as 8 samples: fewer than one batch of 16 per process' in result.stderr
    assert 'Pass --max_batch_per_gpu 8 (the same global batch, accumulated), a global batch of at most 8, --workers 2, ' \
        'more data or --dataset-resampled' in result.stderr


def test_an_all_zero_sizes_json_is_refused_before_any_model_is_built(tmp_path):
    write_shards(tmp_path / 'shards', 2, 4)
    (tmp_path / 'shards' / 'sizes.json').write_text(json.dumps({'00000.tar': 0, '00001.tar': 0}))
    result = train(['--recipe', 'clip-tiny-baseline', '--train_data', 'shards'], cwd=tmp_path)
    assert result.returncode == 2
    assert ('error: shards/sizes.json counts no sample in its 2 shard(s): run python -m diffzoo.data sizes shards to '
            'count their members') in result.stderr
    assert not (tmp_path / 'runs').exists()


def test_a_shard_deleted_since_sizes_json_was_written_is_named_and_the_rest_trains(tmp_path):
    """sizes.json lists 3 shards, one is gone: the run names it and its samples, and trains the two that are
    there; a pattern naming a subset of the shards on disk is no loss and prints nothing."""
    write_shards(tmp_path / 'shards', 3, 4)
    (tmp_path / 'shards' / '00001.tar').unlink()
    cmd = ['--recipe', 'clip-tiny-baseline', '--epochs', '1', '--global_batch_size', '4', '--workers', '1']
    result = train(cmd + ['--train_data', 'shards'], cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert ('warning: shards/sizes.json lists 1 shards that are not in shards (00001.tar; 4 samples): this run '
            'trains without them; put them back, or run python -m diffzoo.data sizes shards --recount') in result.stdout
    assert result.stdout.count('shards that are not in') == 1  # once a run, from rank 0
    write_shards(tmp_path / 'more', 3, 4)
    subset = train(cmd + ['--train_data', 'more/{00000..00001}.tar', '--name', 'subset'], cwd=tmp_path)
    assert subset.returncode == 0 and 'not in more' not in subset.stdout


def test_a_run_that_stopped_before_its_first_checkpoint_starts_again_with_new_settings(tmp_path):
    write_shards(tmp_path / 'shards', 2, 4)
    cmd = ['--recipe', 'clip-tiny-baseline', '--train_data', 'shards', '--epochs', '1', '--global_batch_size', '4']
    with pytest.raises(RuntimeError, match='missing.pt'):  # open_clip's own error (a process exits 1 on it)
        train(cmd + ['--', '--pretrained', 'missing.pt'], cwd=tmp_path)
    run_dir = tmp_path / 'runs' / 'clip-tiny-baseline'
    assert (run_dir / 'diffzoo-run.json').exists()
    fixed = train(cmd, cwd=tmp_path)
    assert fixed.returncode == 0, fixed.stdout[-2000:] + fixed.stderr[-2000:]
    assert (run_dir / 'checkpoints' / 'epoch_1.pt').exists()
    assert json.loads((run_dir / 'diffzoo-run.json').read_text())['pretrained'] == ''  # the settings that trained


OPEN_CLIP_FLAGS = ['--model', 'clip-tiny-baseline', '--train-data', 'shards/{00000..00001}.tar',
                   '--train-num-samples', '16', '--dataset-type', 'webdataset', '--batch-size', '8', '--epochs', '1',
                   '--workers', '1', '--device', 'cpu', '--logs', 'runs']


@pytest.mark.parametrize('separator', [[], ['--']])
def test_open_clip_train_flags_alone_describe_a_run(tmp_path, separator):
    """As `python -m open_clip_train.main` takes them; the lone -- of earlier versions still works."""
    write_shards(tmp_path / 'shards', 2, 8, sizes=False)
    result = train(separator + OPEN_CLIP_FLAGS + ['--name', 'raw'], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / 'runs' / 'raw' / 'checkpoints' / 'epoch_1.pt').exists()
    records = [json.loads(line) for line in (tmp_path / 'runs' / 'raw' / 'lambda.jsonl').read_text().splitlines()]
    assert records[-1]['lambda'] == {} and records[-1]['loss'] > 0  # the baseline has no λ; loss is logged


def test_torchrun_takes_open_clip_train_flags_without_a_separator_and_two_processes_count_each_bad_shard_once(
        tmp_path):
    """torchrun keeps a lone -- for itself, so its command line is the flags alone (without --logs, which
    torchrun reads as an abbreviation of its own --logs-specs: open_clip_train's default ./logs/ is used).
    2 ranks of 3 shards: 4 clean shards of 4, an empty one and one that is not a tar. sizes.json says 20, so 3
    batches of 4 per rank: every readable sample is trained (16 distinct), 8 of them twice, whichever rank reads
    which shards (each rank's readable samples come in whole batches of 4)."""
    write_shards(tmp_path / 'shards', 6, 4, empty={4})
    (tmp_path / 'shards' / '00005.tar').write_bytes(b'not a tar file ' * 100)
    flags = [f for f in OPEN_CLIP_FLAGS if f not in ('--logs', 'runs', '--train-num-samples', '16')]
    flags[flags.index('--train-data') + 1] = 'shards/{00000..00005}.tar'
    result = run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc-per-node', '2',
                  '-m', 'diffzoo.train', *flags, '--name', 'ddp', '--batch-size', '4'], cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    run_dir = tmp_path / 'logs' / 'ddp'
    assert (run_dir / 'checkpoints' / 'epoch_1.pt').exists()
    record = json.loads((run_dir / 'data.jsonl').read_text().splitlines()[0])
    assert len(record['ranks']) == 2 and [r['samples_trained'] for r in record['ranks']] == [12, 12]
    assert (record['samples_trained'], record['samples_distinct'], record['samples_repeated']) == (24, 16, 8)
    assert record['samples_readable'] == 16
    assert record['skipped'] == {'empty_shard': 1, 'unreadable_shard': 1}
    log = (run_dir / 'out.log').read_text()
    assert '  skipped 1 empty shard' in log and '  skipped 1 unreadable shard' in log


def test_flags_after_the_separator_reach_the_checks(tmp_path):
    """A recipe's data check reads --train-num-samples given after --: no sizes.json needed."""
    write_shards(tmp_path / 'shards', 2, 4, sizes=False)
    result = train(['--recipe', 'clip-tiny-baseline', '--train_data', 'shards', '--epochs', '1',
                    '--global_batch_size', '4', '--', '--train-num-samples', '8'], cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]


def test_lambda_log_with_gradient_accumulation_that_leaves_micro_batches_over(tmp_path):
    """9 batches of 4 with accum_freq 2: 4 optimizer steps, and one micro-batch open_clip drops."""
    write_shards(tmp_path / 'shards', 3, 12)
    result = train(['--recipe', 'diffclip-tiny', '--train_data', 'shards', '--epochs', '1',
                    '--global_batch_size', '8', '--max_batch_per_gpu', '4'], cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert 'batch_per_gpu 4, accum_freq 2' in result.stdout
    records = [json.loads(line) for line in (tmp_path / 'runs' / 'diffclip-tiny' / 'lambda.jsonl').read_text()
               .splitlines()]
    assert [r['step'] for r in records] == [0, 1, 2, 3, 4]
    assert all(r['loss'] > 0 for r in records[1:])


def test_the_same_seed_trains_on_the_same_batches(tmp_path):
    """webdataset seeds its sample shuffle from the clock; the launcher's seeded shuffle makes --seed hold. 4 shards
    of 4, 2 batches of 8: a clock-seeded shuffle of 16 samples would all but never repeat its order."""
    write_shards(tmp_path / 'shards', 4, 4)
    losses = {}
    for name, seed in (('a', 0), ('b', 0), ('c', 1)):
        result = train(['--recipe', 'clip-tiny-baseline', '--train_data', 'shards', '--epochs', '1',
                        '--global_batch_size', '8', '--seed', str(seed), '--name', name], cwd=tmp_path)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        log = (tmp_path / 'runs' / name / 'lambda.jsonl').read_text().splitlines()
        losses[name] = [json.loads(line)['loss'] for line in log[1:]]
    assert len(losses['a']) == 2
    assert losses['a'] == losses['b']
    assert losses['a'] != losses['c']


def test_fine_tuning_a_converted_clip_from_a_pretrained_file_with_lambda_at_its_own_rate(tmp_path):
    """A config that converts both towers, a plain pretrained file, `lambda_lr` 5000× `lr`: the run starts from
    the file's weights converted, moves the sub-norms (initially 1) far more than the pretrained weights, and its
    checkpoint reloads under the plain model name."""
    import open_clip
    import torch
    config = open_clip.get_model_config('clip-tiny-baseline')
    config['vision_cfg']['diffzoo'] = {'variant': 'duplicate'}
    config['text_cfg']['diffzoo'] = {'convert': True, 'variant': 'split'}
    (tmp_path / 'configs').mkdir()
    (tmp_path / 'configs' / 'vit-tiny-converted-test.json').write_text(json.dumps(config))
    open_clip.add_model_config(str(tmp_path / 'configs'))
    torch.manual_seed(0)
    pretrained = open_clip.create_model('clip-tiny-baseline').state_dict()
    torch.save(pretrained, tmp_path / 'pretrained.pt')
    write_shards(tmp_path / 'shards', 2, 16)
    result = train(['--recipe', 'clip-tiny-baseline', '--model', 'vit-tiny-converted-test', '--pretrained',
                    str(tmp_path / 'pretrained.pt'), '--train_data', 'shards', '--epochs', '1',
                    '--global_batch_size', '8', '--lr', '1e-5', '--lambda_lr', '5e-2', '--warmup_epochs', '0',
                    '--name', 'converted'], cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    checkpoint = tmp_path / 'runs' / 'converted' / 'checkpoints' / 'epoch_1.pt'
    tuned = open_clip.create_model('clip-tiny-baseline', pretrained=str(checkpoint))  # the plain name
    state = tuned.state_dict()
    norms = [state[k] for k in state if k.endswith('sub_norm.weight')]
    assert norms and min((n - 1).abs().max().item() for n in norms) > 0.05
    weights = [(state[k] - pretrained[k]).abs().max().item() for k in pretrained
               if k.endswith(('mlp.c_fc.weight', 'mlp.fc1.weight'))]
    assert weights and max(weights) < 1e-3  # 4 steps at lr 1e-5
    # the run record keeps lambda_lr: another value on resume is accepted and recorded, leaving it out is refused
    common = ['--recipe', 'clip-tiny-baseline', '--model', 'vit-tiny-converted-test', '--pretrained',
              str(tmp_path / 'pretrained.pt'), '--train_data', 'shards', '--global_batch_size', '8', '--lr', '1e-5',
              '--warmup_epochs', '0', '--name', 'converted']
    longer = train(common + ['--epochs', '2', '--lambda_lr', '1e-2'], cwd=tmp_path)
    assert longer.returncode == 0, longer.stdout[-3000:] + longer.stderr[-3000:]
    assert 'lambda_lr 0.05 -> 0.01: λ and the sub-norm train at the new rate from the resume after epoch 1' in longer.stderr
    record = json.loads((tmp_path / 'runs' / 'converted' / 'diffzoo-run.json').read_text())
    assert record['lambda_lr'] == 1e-2
    assert record['changes_on_resume'][-1]['changed']['lambda_lr'] == [5e-2, 1e-2]
    without = train(common + ['--epochs', '3'], cwd=tmp_path)
    assert without.returncode != 0
    assert 'trained λ and the sub-norm at lambda_lr 0.01' in without.stderr and 'Traceback' not in without.stderr
