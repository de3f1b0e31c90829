import hashlib
import json
import shutil

import open_clip
import pytest
import torch

from diffzoo.data.shards import iter_samples
from diffzoo.eval.__main__ import main
from diffzoo.eval.results import read_json
from tests.factory import wilson


def _training_run(run_dir, epochs=(1, 2)):
    """A run directory as diffzoo.train leaves it: diffzoo-run.json and open_clip_train checkpoints."""
    (run_dir / 'checkpoints').mkdir(parents=True)
    (run_dir / 'diffzoo-run.json').write_text(json.dumps({'model': 'diffclip-tiny', 'image_mean': [0.485, 0.456, 0.406],
                                                          'image_std': [0.229, 0.224, 0.225]}))
    for epoch in epochs:
        torch.manual_seed(epoch)
        model = open_clip.create_model('diffclip-tiny')
        torch.save({'epoch': epoch, 'name': run_dir.name, 'optimizer': {},
                    'state_dict': {f'module.{k}': v for k, v in model.state_dict().items()}},
                   run_dir / 'checkpoints' / f'epoch_{epoch}.pt')
    torch.save({}, run_dir / 'checkpoints' / 'epoch_latest.pt')  # not an epoch of its own


def test_every_checkpoint_of_a_run_gives_a_table_json_and_plot(corpus, tmp_path, capsys):
    run_dir = tmp_path / 'runs' / 'tiny'
    _training_run(run_dir)
    assert main(['--run-dir', str(run_dir), '--every-checkpoint', '--dataset', 'synthetic', '--dataset-root',
                 str(corpus), '--workers', '0']) == 0
    out = capsys.readouterr().out
    rows = read_json(run_dir / 'eval' / 'results.json')  # the default output of a run
    assert {r.epoch for r in rows} == {1, 2} and {r.model for r in rows} == {'diffclip-tiny'}
    for epoch in (1, 2):
        path = run_dir / 'checkpoints' / f'epoch_{epoch}.pt'
        sha = hashlib.sha256(path.read_bytes()).hexdigest()[:12]
        assert {(r.pretrained, r.checkpoint_sha256) for r in rows if r.epoch == epoch} == {(str(path), sha)}
    assert {r.task for r in rows} == {'zeroshot_classification', 'zeroshot_retrieval'}
    by_epoch = [{r.metric: r.value for r in rows if r.epoch == e} for e in (1, 2)]
    assert by_epoch[0].keys() == by_epoch[1].keys() and by_epoch[0] != by_epoch[1]  # other weights, other results
    header = next(line for line in out.splitlines() if line.split()[:1] == ['dataset'])
    assert header.split()[-7:] == ['epoch', '1', 'epoch', '2', 'chance', 'n', 'difference']
    _check_intervals_and_verdicts(out, rows, corpus / 'val')
    assert (run_dir / 'eval' / 'results_vs_epoch.png').stat().st_size > 0
    assert f'plot: {run_dir / "eval" / "results_vs_epoch.png"}' in out


def _check_intervals_and_verdicts(out, rows, val):
    """The table's synthetic rows as the demo prints them: each accuracy with the Wilson interval of its hits over
    the val scenes (distinct captions for text→image), the chance level of zero-shot, n, and for two columns the
    difference or "within chance" where the intervals overlap; the notes name the accuracies at chance."""
    columns = list(dict.fromkeys(r.column for r in rows))
    scenes = [json.loads(m['json']) for shard in sorted(val.glob('*.tar')) for _, m in iter_samples(shard)]
    captions = len({s['caption'] for s in scenes})
    at_chance = []
    for metric in {r.metric for r in rows}:
        n = captions if metric.startswith('text_to_image') else len(scenes)
        chance = {'zero_shot_shape': 100 / 3, 'zero_shot_colour': 100 / 6}.get(metric)
        line = next(line.split('  ') for line in out.splitlines() if f'  {metric} ' in line)
        cells = [c.strip() for c in line if c.strip()]
        spans = []
        for column in columns:
            value = next(r.value for r in rows if r.metric == metric and r.column == column)
            assert next(r.n for r in rows if r.metric == metric and r.column == column) == n
            low, high = wilson(round(value * n / 100), n)
            assert f'{value:.1f} ({low:.1f}–{high:.1f})' in cells, (metric, cells)
            spans.append((low, high, value))
            if chance is not None and low <= chance <= high:
                at_chance.append(f'{column} {metric}')
        assert cells[-2 if len(columns) == 2 else -1] == str(n)
        if chance is not None:
            assert f'{chance:.1f}' in cells
        if len(columns) == 2:
            (a_low, a_high, a), (b_low, b_high, b) = spans
            overlap = a_low <= b_high and b_low <= a_high
            assert cells[-1] == ('within chance' if overlap else f'{b - a:+.1f}')
    notes = ' '.join(out.split())
    assert 'Wilson 95% interval of each accuracy over its n trials (val scenes; distinct captions for' in notes
    for entry in at_chance:
        assert entry in notes.split('At chance (the interval holds the chance level): ')[1]


def test_model_names_the_model_of_a_run_that_does_not(corpus, tmp_path, capsys):
    """--model NAME,RUN evaluates a run whose directory names no model."""
    run_dir = tmp_path / 'runs' / 'tiny'
    _training_run(run_dir, epochs=(1,))
    (run_dir / 'diffzoo-run.json').unlink()
    common = ['--dataset', 'synthetic', '--dataset-root', str(corpus), '--workers', '0']
    assert main(['--run-dir', str(run_dir), *common]) == 2
    assert f'pass --model NAME,{run_dir}' in capsys.readouterr().err
    assert main(['--model', f'diffclip-tiny,{run_dir}', *common]) == 0
    rows = read_json(run_dir / 'eval' / 'results.json')  # one training run: its eval/ folder, as with --run-dir
    assert {(r.model, r.epoch, r.pretrained) for r in rows} == {
        ('diffclip-tiny', 1, str(run_dir / 'checkpoints' / 'epoch_1.pt'))}
    _check_intervals_and_verdicts(capsys.readouterr().out, rows, corpus / 'val')  # one column: no difference


def test_models_side_by_side_with_few_shot(corpus, tmp_path, capsys):
    checkpoint = tmp_path / 'baseline.pt'
    torch.save({'state_dict': open_clip.create_model('clip-tiny-baseline').state_dict()}, checkpoint)
    out = tmp_path / 'r.json'
    assert main(['--model', 'diffclip-tiny', '--model', f'clip-tiny-baseline,{checkpoint}', '--dataset', 'synthetic',
                 '--dataset-root', str(corpus), '--task', 'fewshot', '--fewshot-shot', '1', '--fewshot-query', '2',
                 '--fewshot-episodes', '5', '--workers', '0', '--output', str(out)]) == 0
    rows = read_json(out)
    assert {(r.column, r.checkpoint_sha256) for r in rows} == {
        ('diffclip-tiny (random)', None),
        ('clip-tiny-baseline,baseline.pt', hashlib.sha256(checkpoint.read_bytes()).hexdigest()[:12])}
    assert {r.metric for r in rows} == {'shape_3way_1shot_acc', 'shape_3way_1shot_ci95',
                                        'colour_5way_1shot_acc', 'colour_5way_1shot_ci95'}
    assert 'diffclip-tiny (random)  clip-tiny-baseline,baseline.pt' in capsys.readouterr().out


def test_bad_inputs_name_the_fix(corpus, tmp_path, capsys):
    def error(*argv):
        assert main(list(argv)) == 2
        return capsys.readouterr().err

    assert 'did you mean diffclip-tiny' in error('--model', 'diffclip-tiyn', '--dataset', 'dummy')
    assert 'neither a checkpoint file nor a pretrained tag' in error('--model', 'diffclip-b16,cc4m',
                                                                     '--dataset', 'dummy')
    assert '--every-checkpoint needs --run-dir' in error('--model', 'diffclip-tiny', '--every-checkpoint',
                                                          '--dataset', 'dummy')
    assert 'no checkpoints/epoch_K.pt' in error('--run-dir', str(tmp_path), '--dataset', 'dummy')
    assert 'python -m diffzoo.data synthetic' in error('--model', 'diffclip-tiny', '--dataset', 'synthetic',
                                                       '--dataset-root', str(tmp_path))
    assert '--task mmvp: none of the datasets has it' in error('--model', 'diffclip-tiny', '--dataset', 'synthetic',
                                                               '--dataset-root', str(corpus), '--task', 'mmvp')


def test_a_truncated_val_shard_is_an_error_naming_it(corpus, tmp_path, capsys):
    root = tmp_path / 'corpus'
    shutil.copytree(corpus, root)
    shard = root / 'val' / '00000.tar'
    data = shard.read_bytes()
    shard.write_bytes(data[:len(data) // 3])
    assert main(['--model', 'diffclip-tiny', '--dataset', 'synthetic', '--dataset-root', str(root), '--workers', '0',
                 '--output', str(tmp_path / 'r.json')]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f'error: {shard}: unreadable after sample ') and 'Traceback' not in err
    assert f'python -m diffzoo.data synthetic {root} --fresh' in err


def test_a_directory_named_like_a_tag_is_refused_naming_both_readings(corpus, tmp_path, capsys, monkeypatch):
    """--model diffclip-b16,cc3m with a ./cc3m directory could mean the tag or the run: refused with the fix;
    ./cc3m is the directory."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / 'cc3m').mkdir()
    common = ['--dataset', 'synthetic', '--dataset-root', str(corpus), '--workers', '0']
    assert main(['--model', 'diffclip-b16,cc3m', *common]) == 2
    err = capsys.readouterr().err
    assert "'cc3m' is both a pretrained tag of diffclip-b16 and a directory here" in err
    assert '--model diffclip-b16,./cc3m' in err
    assert main(['--model', 'diffclip-b16,./cc3m', *common]) == 2  # read as a run: it has no checkpoints
    err = capsys.readouterr().err
    assert 'is both' not in err and 'cc3m' in err and 'checkpoint' in err


def test_a_converted_model_evaluates_under_its_plain_name(corpus, tmp_path):
    """A checkpoint of a model converted with diffzoo.differentialize (through create_model's diffzoo=)
    evaluates as `--model clip-tiny-baseline,RUN`: the loader converts the plain model with the saved settings."""
    run_dir = tmp_path / 'runs' / 'converted'
    (run_dir / 'checkpoints').mkdir(parents=True)
    torch.manual_seed(0)
    model = open_clip.create_model('clip-tiny-baseline', diffzoo={'vision': {'variant': 'split'},
                                                                  'text': {'variant': 'duplicate'}})
    torch.save({'epoch': 1, 'state_dict': model.state_dict()}, run_dir / 'checkpoints' / 'epoch_1.pt')
    assert main(['--model', f'clip-tiny-baseline,{run_dir}', '--dataset', 'synthetic', '--dataset-root', str(corpus),
                 '--workers', '0']) == 0
    rows = read_json(run_dir / 'eval' / 'results.json')
    assert {r.task for r in rows} == {'zeroshot_classification', 'zeroshot_retrieval'}


def test_two_runs_get_a_column_each_and_a_repeat_is_refused(corpus, tmp_path, capsys):
    """Two runs' `epoch 2` are two columns named by their runs, each holding its own run's rows; the plot draws a
    line per run; the same checkpoint asked for twice is refused before anything loads."""
    runs = [tmp_path / 'a', tmp_path / 'b']
    for run_dir, epochs in zip(runs, ((1, 2), (2,))):
        _training_run(run_dir, epochs)
    out = tmp_path / 'r.json'
    common = ['--dataset', 'synthetic', '--dataset-root', str(corpus), '--workers', '0', '--output', str(out)]
    assert main(['--model', f'diffclip-tiny,{runs[0]}', '--model', f'diffclip-tiny,{runs[1]}', *common]) == 0
    rows = read_json(out)
    assert {(r.column, r.pretrained) for r in rows} == {
        (f'{run_dir} epoch 2', str(run_dir / 'checkpoints' / 'epoch_2.pt')) for run_dir in runs}
    header = next(line for line in capsys.readouterr().out.splitlines() if line.split()[:1] == ['dataset'])
    assert f'{runs[0]} epoch 2' in header and f'{runs[1]} epoch 2' in header
    assert main(['--run-dir', str(runs[0]), '--model', f'diffclip-tiny,{runs[0]}', *common]) == 2
    assert f'{runs[0]} epoch 2 is asked for twice' in capsys.readouterr().err


def test_both_zero_shot_tasks_asked_write_each_row_once(corpus, tmp_path):
    out = tmp_path / 'r.json'
    assert main(['--model', 'diffclip-tiny', '--dataset', 'synthetic', '--dataset-root', str(corpus), '--task',
                 'zeroshot_classification', '--task', 'zeroshot_retrieval', '--workers', '0', '--output',
                 str(out)]) == 0
    keys = [(r.task, r.metric) for r in read_json(out)]
    assert len(keys) == len(set(keys)) == 8  # zero-shot shape and colour, six recalls: one pass, written once


def test_a_val_shard_gone_from_the_corpus_is_named(tmp_path, capsys):
    """A val shard sizes.json lists but the folder lacks would leave its scenes out of every metric: the evaluation
    and `python -m diffzoo.data check` both name it."""
    from diffzoo.data.check import check_dataset
    from diffzoo.data.synthetic import CorpusConfig, write_corpus
    write_corpus(tmp_path, CorpusConfig(train=1, val=32, per_shard=16, image_size=64), progress=None)
    gone = sorted((tmp_path / 'val').glob('*.tar'))[1]
    gone.unlink()
    assert main(['--model', 'diffclip-tiny', '--dataset', 'synthetic', '--dataset-root', str(tmp_path),
                 '--workers', '0', '--output', str(tmp_path / 'r.json')]) == 2
    err = capsys.readouterr().err
    assert f'{tmp_path / "val"}: 1 shard(s) its sizes.json lists are not there ({gone.name}; 16 samples)' in err
    assert 'Traceback' not in err and not (tmp_path / 'r.json').exists()
    problems = check_dataset(tmp_path / 'val', workers=1, progress=None).problems()
    assert any(p.startswith(f'sizes.json lists 1 shards that are not in {tmp_path / "val"} ({gone.name}; 16 samples)')
               for p in problems)


def test_bad_settings_are_refused_before_any_model_loads(corpus, tmp_path, capsys):
    """Each names the flag and the fix, with exit 2 and nothing written, before a model loads."""
    common = ['--model', 'diffclip-tiny', '--dataset', 'synthetic', '--dataset-root', str(corpus), '--workers', '0']

    def error(*argv):
        assert main([*common, *argv]) == 2
        err = capsys.readouterr().err
        assert 'Traceback' not in err and 'loading' not in capsys.readouterr().out
        return err

    for flag, value, why in (('--batch-size', '0', 'a whole number'), ('--workers', '-1', 'a whole number'),
                             ('--seed', '-1', 'a whole number'), ('--force-image-size', '0', 'a whole number'),
                             ('--device', 'bogus', 'not a torch device')):
        with pytest.raises(SystemExit) as exit_:
            main([*common, flag, value])
        assert exit_.value.code == 2 and f"argument {flag}: '{value}': {why}" in capsys.readouterr().err
    (tmp_path / 'file').write_text('')
    for value, why in ((str(tmp_path), 'a folder; give the file to write'),
                       (str(tmp_path / 'file' / 'r.json'), f'{tmp_path / "file"} is a file, so nothing can be written')):
        with pytest.raises(SystemExit) as exit_:
            main([*common, '--output', value])
        assert exit_.value.code == 2 and f"argument --output: '{value}': {why}" in capsys.readouterr().err
    assert 'not a template of {dataset}' in error('--dataset-root', str(tmp_path / '{datset}'))
    run_dir = tmp_path / 'run'
    _training_run(run_dir, epochs=(1,))
    (run_dir / 'diffzoo-run.json').write_text('{not json')
    assert f'{run_dir / "diffzoo-run.json"}: not JSON' in error('--run-dir', str(run_dir))
    (run_dir / 'diffzoo-run.json').write_text('[]')
    assert 'a JSON list, not the object of run settings' in error('--run-dir', str(run_dir))
    assert main([*common, '--force-image-size', '7', '--output', str(tmp_path / 'r.json')]) == 2  # under one patch
    assert '--force-image-size 7: diffclip-tiny cannot take images of that size' in capsys.readouterr().err
