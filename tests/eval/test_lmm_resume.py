"""`python -m diffzoo.eval.lmm` writes each batch's replies to `<task>_predictions.jsonl` as they are made, and a
second run with the same OUT reuses them (matched by question id and prompt): a run cut at any question, by a
kill in mid-write included, loses no reply; results.json counts the questions answered, reused and left out. A
question longer than the model takes is cut to it, counted, and neither ends the run nor takes its memory."""
import json
import resource
import signal
import subprocess
import sys
import time

import pytest

from diffzoo.eval.lmm import tasks
from diffzoo.eval.lmm.cli import main
from tests.eval.test_lmm import _pope_lines, _q, tiny_recipe
from tests.factory import call, python_env


def _rows(out):
    return [json.loads(line) for line in (out / 'pope_predictions.jsonl').read_text().splitlines()]


def _results(out):
    return json.loads((out / 'results.json').read_text())['results']['pope']


def test_a_second_run_reuses_the_replies_of_the_first_and_answers_only_the_rest(tmp_path):
    """Before: every run answered every question again and wrote the predictions file only at the end of a task."""
    _pope_lines(tmp_path / 'data', [_q(1), _q(2, 'blue.jpg', label='no'), _q(3, 'missing.jpg')])
    args = ['--model', tiny_recipe(tmp_path), '--task', 'pope', '--data', tmp_path / 'data', '--out',
            tmp_path / 'out', '--max-new-tokens', '2', '--batch-size', '2']
    out, predictions = tmp_path / 'out', tmp_path / 'out' / 'pope_predictions.jsonl'
    smoke = call(main, [*args, '--limit', '2'], tmp_path)  # the task's first two questions
    assert smoke.returncode == 0, smoke.stderr[-3000:]
    assert [r['id'] for r in _rows(out)] == ['random-1', 'random-2']

    # the rows as written, with a planted reply: a reused row is scored as it stands in the file
    rows = _rows(out)
    rows[0]['prediction'] = 'No, there is none.'
    predictions.write_text(''.join(json.dumps(r) + '\n' for r in rows))
    full = call(main, args, tmp_path)
    assert full.returncode == 0, full.stderr[-3000:]
    assert f'pope: 2 replies reused from {predictions}; 7 questions to ask' in full.stdout
    rows = _rows(out)
    assert sorted(r['id'] for r in rows) == sorted(f'{s}-{q}' for s in tasks.POPE_SPLITS for q in (1, 2))
    assert rows[0]['prediction'] == 'No, there is none.'
    pope = _results(out)
    assert (pope['questions'], pope['answered'], pope['reused']) == (9, 6, 2)
    assert pope['left_out'] == {'image does not open': 3}  # missing.jpg, asked again in each run
    assert pope['scores'] == tasks.TASKS['pope'].score(rows)

    # a kill in mid-write leaves a half line: it is cut off, and every whole row is reused
    with open(predictions, 'a') as f:
        f.write('{"id": "random-3", "image": "missing.jpg", "prompt": "Is there a thi')
    again = call(main, args, tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f'the last line of {predictions} was half-written' in again.stdout
    assert f'pope: 6 replies reused from {predictions}; 3 questions to ask' in again.stdout
    assert _rows(out) == rows and predictions.read_text().endswith('}\n')
    assert (_results(out)['answered'], _results(out)['reused']) == (6, 6)
    assert _results(out)['scores'] == pope['scores']

    # another reply length is another answer: the old file is set aside, nothing reused
    longer = call(main, [*args[:-4], '--max-new-tokens', '3', '--batch-size', '2'], tmp_path)
    assert longer.returncode == 0, longer.stderr[-3000:]
    assert f'moved to {out / "pope_predictions.1.jsonl"}, every question is asked anew' in longer.stdout
    assert [json.loads(line) for line in (out / 'pope_predictions.1.jsonl').read_text().splitlines()] == rows
    assert (_results(out)['answered'], _results(out)['reused']) == (6, 0)


@pytest.mark.slow
def test_a_run_killed_while_answering_goes_on_from_its_predictions_file(tmp_path):
    """The real command, killed (SIGKILL) once it has written its first batch; the same command again reuses every
    row it wrote and asks only the rest."""
    questions = [_q(n, 'red.jpg' if n % 2 else 'blue.jpg') for n in range(1, 21)]
    _pope_lines(tmp_path / 'data', questions)
    args = ['--model', tiny_recipe(tmp_path), '--task', 'pope', '--data', tmp_path / 'data', '--out',
            tmp_path / 'out', '--max-new-tokens', '6', '--batch-size', '1']
    predictions = tmp_path / 'out' / 'pope_predictions.jsonl'
    log = open(tmp_path / 'stderr.txt', 'w')
    process = subprocess.Popen([sys.executable, '-m', 'diffzoo.eval.lmm', *map(str, args)], cwd=tmp_path,
                               env=python_env(), stdout=subprocess.DEVNULL, stderr=log)
    deadline = time.time() + 300
    while process.poll() is None and not (predictions.is_file() and predictions.stat().st_size) \
            and time.time() < deadline:
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait()
    log.close()
    assert process.returncode == -signal.SIGKILL, (tmp_path / 'stderr.txt').read_text()[-3000:]
    written = predictions.read_text().count('\n')
    assert 0 < written < 60
    done = call(main, args, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f'pope: {written} replies reused from {predictions}; {60 - written} questions to ask' in done.stdout
    pope = _results(tmp_path / 'out')
    assert (pope['questions'], pope['answered'], pope['reused'], pope['left_out']) == (60, 60, written, {})
    assert sorted(r['id'] for r in _rows(tmp_path / 'out')) == sorted(
        f'{s}-{n}' for s in tasks.POPE_SPLITS for n in range(1, 21))



ADDRESS_SPACE = 8 * 2 ** 30  # the runner takes about 4.2 GB of address space on this suite's tiny model


def _address_space_limited():
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


@pytest.mark.slow
def test_a_question_longer_than_the_model_takes_is_cut_and_counted_and_the_rest_scored_in_limited_memory(tmp_path):
    """A POPE question of 100,000 characters (about 38,000 positions with its image: its 38,000² attention mask alone
    is 5.8 GB) among short ones, the real command in a process of 8 GiB of address space: the long question is cut
    to the recipe's 2,048 positions as LLaVA's model cuts a prompt, answered, counted and named; every question is
    scored; a rerun finishes, every reply reused. Before: both runs ended in prefix_lm_mask, out of memory (without
    a limit, the kernel's out-of-memory killer took the runner)."""
    long = json.dumps({'question_id': 2, 'image': 'red.jpg', 'label': 'yes',
                       'text': ('Is there a dog in the image? ' * 3500)[:100_000]})
    _pope_lines(tmp_path / 'data', [_q(1), long, _q(3, 'blue.jpg', label='no')])
    out = tmp_path / 'out'
    command = [sys.executable, '-m', 'diffzoo.eval.lmm', '--model', tiny_recipe(tmp_path), '--task', 'pope', '--data',
               tmp_path / 'data', '--out', out, '--max-new-tokens', '2', '--batch-size', '2']
    runs = [subprocess.run(list(map(str, command)), cwd=tmp_path, env=python_env(), capture_output=True, text=True,
                           timeout=900, preexec_fn=_address_space_limited) for _ in ('first', 'rerun')]
    for done in runs:
        assert done.returncode == 0, done.stderr[-3000:]
    pope, rows = _results(out), _rows(out)
    assert (pope['questions'], pope['answered'], pope['left_out']) == (9, 9, {})
    assert pope['cut_to_max_length']['count'] == 3 and pope['cut_to_max_length']['max_length'] == 2048
    assert [e.split(' (')[0] for e in pope['cut_to_max_length']['examples']] == [f'{s}-2' for s in tasks.POPE_SPLITS]
    positions = int(pope['cut_to_max_length']['examples'][0].split('(')[1].split(' ')[0].replace(',', ''))
    assert positions > 20_000
    assert "pope: 3 question(s) longer than the model's 2,048 positions, cut to them" in runs[0].stdout
    assert 'pope (9 answered, 3 cut to 2,048 positions; scored as pope)' in runs[0].stdout
    assert sorted(r['id'] for r in rows) == sorted(f'{s}-{q}' for s in tasks.POPE_SPLITS for q in (1, 2, 3))
    assert pope['scores'] == tasks.TASKS['pope'].score(rows)
    assert sum(split['questions'] for split in pope['scores'].values()) == 9
    assert f'pope: 9 replies reused from {out / "pope_predictions.jsonl"}; 0 questions to ask' in runs[1].stdout
