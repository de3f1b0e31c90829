"""`python -m diffzoo.demo_vlm`'s parts that need no training: which towers it reuses, the towers' and POPE's
tables (intervals and the paired test from the counts), the one loss figure, and the stages' console progress.
The command end to end, on the towers of `python -m diffzoo.demo`, is in tests/test_demo.py."""
import io
import json
import math
import re
from contextlib import redirect_stdout
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from diffzoo import demo_vlm, demo_vlm_report
from diffzoo.train.vlm.trainer import RunLog
from tests.factory import call, wilson

MODELS = ('clip-tiny-baseline', 'diffclip-tiny')
ACCURACY = re.compile(r'^  (\w+)\s+accuracy\s+([\d.]+) \(([\d.]+)–([\d.]+)\)\s+([\d.]+) \(([\d.]+)–([\d.]+)\)'
                      r'\s+50\.0\s+(\d+)   (within chance|[+-][\d.]+) \((p = [\d.]+|p < 0\.01)\)$')


def mcnemar_p(b, c):
    """The exact McNemar test's two-sided p for b and c discordant pairs, from the binomial sum."""
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(b, c) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def accuracy_rows(printed):
    """split → (baseline, its interval, model, its interval, n, verdict, p) from the POPE table's accuracy rows."""
    rows = {}
    for line in printed.splitlines():
        match = ACCURACY.match(line)
        if match:
            g = match.groups()
            rows[g[0]] = (float(g[1]), (float(g[2]), float(g[3])), float(g[4]), (float(g[5]), float(g[6])),
                          int(g[7]), g[8], g[9])
    return rows


def check_pope_table(printed, correct, questions):
    """The POPE table's accuracies, intervals, n and verdicts are those the answers' counts give."""
    rows = accuracy_rows(printed)
    assert set(rows) == set(questions)
    for split, ids in questions.items():
        a, a_ci, b, b_ci, n, verdict, p_shown = rows[split]
        hits = [sum(correct[t][i] for i in ids) for t in MODELS]
        assert n == len(ids)
        assert (a, b) == tuple(round(100 * h / n, 1) for h in hits)
        assert (a_ci, b_ci) == tuple(tuple(round(v, 1) for v in wilson(h, n)) for h in hits)
        only = [sum(correct[t][i] and not correct[o][i] for i in ids) for t, o in (MODELS, MODELS[::-1])]
        p = mcnemar_p(*only)
        assert p_shown == (f'p = {p:.2f}' if p >= 0.01 else 'p < 0.01')
        assert verdict == ('within chance' if p >= 0.05 else f'{100 * (hits[1] - hits[0]) / n:+.1f}')
    return rows


def answers(n, right_a, right_b, both):
    """Correctness of two models on n questions: `both` right by both, the rest of each one's right apart."""
    a = [i < right_a for i in range(n)]
    b = [i < both or right_a <= i < right_a + right_b - both for i in range(n)]
    assert sum(a) == right_a and sum(b) == right_b
    return a, b


def test_pope_table_gives_each_accuracy_an_interval_and_calls_a_difference_only_beyond_chance():
    splits = {'random': (100, 52, 60, 40),  # 12 vs 20 discordant: p ≈ 0.22, within chance
              'popular': (100, 50, 85, 45),  # 5 vs 40: p < 0.01
              'adversarial': (40, 30, 22, 20)}  # 10 vs 2: p ≈ 0.04, below: −20.0
    correct, questions = {t: {} for t in MODELS}, {}
    for split, (n, right_a, right_b, both) in splits.items():
        questions[split] = [f'{split}-{i + 1}' for i in range(n)]
        for name, right in zip(MODELS, answers(n, right_a, right_b, both)):
            correct[name].update(zip(questions[split], right))
    comparison = demo_vlm.compare_pope(correct, *MODELS, questions)
    assert comparison['popular']['only_right'] == {MODELS[0]: 5, MODELS[1]: 40}
    assert comparison['random']['p_value'] == pytest.approx(mcnemar_p(12, 20))
    assert comparison['adversarial'][MODELS[0]]['interval'] == pytest.approx(wilson(30, 40))
    json.dumps(comparison)  # results.json holds it (plain floats and bools, no numpy scalars)
    scores = {t: {s: dict.fromkeys(('precision', 'recall', 'f1', 'yes_ratio'), 0.5) for s in splits} for t in MODELS}
    printed = demo_vlm.pope_table(scores, comparison, *MODELS)
    rows = check_pope_table(printed, correct, questions)
    assert [rows[s][5] for s in splits] == ['within chance', '+35.0', '-20.0']
    words = ' '.join(printed.split())
    assert ('The VLMs differ beyond chance on popular, adversarial, in one seed of each training: a second seed '
            'would say how much of it the seed makes.') in words
    assert 'answers yes to' not in words  # every yes-ratio 50 %
    assert ('At chance (the interval holds 50): clip-tiny-baseline random, clip-tiny-baseline popular, '
            'diffclip-tiny adversarial.') in words  # 52, 50 of 100 and 22 of 40: each interval holds 50
    assert 'exact McNemar test' in words and 'Wilson 95% interval' in words

    same = demo_vlm.compare_pope({t: correct[MODELS[0]] for t in MODELS}, *MODELS, questions)
    assert 'On no split do the VLMs differ beyond chance (one seed of each training).' in ' '.join(
        demo_vlm.pope_table(scores, same, *MODELS).split())


def test_pope_verdict_reads_the_yes_ratio_and_the_towers():
    """The demo's run as docs/vlm.md reports it, in counts: 300 questions a split, half of them yes; DiffCLIP's VLM
    right more often on every split (McNemar p < 0.01) while answering yes to 60–68 % of them, CLIP's VLM at 50–53 %,
    and towers within chance of each other on both zero-shot tasks: the verdict names the yes-ratio beyond chance,
    what it does to recall, the one seed, and that the towers are not shown to differ."""
    n, correct, questions, scores = 300, {t: {} for t in MODELS}, {}, {t: {} for t in MODELS}
    yes = {MODELS[0]: {'random': 150, 'popular': 159, 'adversarial': 155},  # 50–53 %: within chance of 50
           MODELS[1]: {'random': 180, 'popular': 195, 'adversarial': 204}}  # 60–68 %
    for split in ('random', 'popular', 'adversarial'):
        questions[split] = [f'{split}-{i}' for i in range(n)]
        for name, right in zip(MODELS, answers(n, 200, 240, 190)):
            correct[name].update(zip(questions[split], right))
            scores[name][split] = {'precision': 0.7, 'recall': 0.9, 'f1': 0.8, 'yes_ratio': yes[name][split] / n,
                                   'questions': n}
    comparison = demo_vlm.compare_pope(correct, *MODELS, questions)
    towers = {MODELS[0]: tower(500, 30, 25), MODELS[1]: tower(500, 28, 27)}  # intervals overlap on both tasks
    words = ' '.join(demo_vlm.pope_table(scores, comparison, *MODELS, towers=towers).split())
    assert ('The VLMs differ beyond chance on random, popular, adversarial, in one seed of each training: a second '
            'seed would say how much of it the seed makes.') in words
    assert ('diffclip-tiny\'s VLM answers yes to 60–68 % of the questions on random, popular, adversarial, where '
            'half are yes (beyond chance): a VLM that says yes more often gains recall without seeing better, so '
            'read its recall beside its precision.') in words
    assert 'clip-tiny-baseline\'s VLM answers yes' not in words  # 159 of 300: its interval holds 50
    assert ('The towers themselves are within chance of each other on zero-shot shape and colour: these questions '
            'show that the VLMs differ, not that one tower sees better.') in words
    apart = {MODELS[0]: tower(500, 10, 6), MODELS[1]: tower(500, 30, 28)}  # towers apart: no such sentence
    assert 'within chance of each other' not in demo_vlm.pope_table(scores, comparison, *MODELS, towers=apart)


def tower(steps, shape, colour, n=32):
    """A `tower_report` entry: 128 scenes × 1 epoch, batch 32, zero-shot hits of shape and colour out of n."""
    zero_shot = {}
    for task, hits, classes in (('shape', shape, 3), ('colour', colour, 6)):
        low, high = wilson(hits, n)
        zero_shot[task] = {'accuracy': 100 * hits / n, 'hits': hits, 'n': n, 'interval': [low, high],
                           'chance': 100 / classes, 'at_chance': low <= 100 / classes <= high}
    return {'checkpoint': 'x', 'train_scenes': 128, 'epochs': 1, 'steps': steps, 'batch': 32, 'last_loss': 3.4,
            'chance_loss': math.log(32), 'zero_shot': zero_shot}


def test_towers_table_says_how_much_each_tower_learned_and_what_that_allows():
    at_chance = demo_vlm.tower_table({MODELS[0]: tower(4, 11, 5), MODELS[1]: tower(4, 12, 6)})
    assert 'clip-tiny-baseline (4 steps of 32)' in at_chance and 'ln 32 = 3.47' in at_chance
    assert '34.4 (20.4–51.7)' in at_chance  # 11 of 32, its Wilson interval
    words = ' '.join(at_chance.split())
    assert '128 scenes × 1 epoch;' in words
    assert 'Both towers are at chance on every zero-shot task' in words and 'says anything about DiffCLIP' in words
    one = ' '.join(demo_vlm.tower_table({MODELS[0]: tower(4, 11, 5), MODELS[1]: tower(500, 30, 28)}).split())
    assert 'clip-tiny-baseline is at chance on every zero-shot task' in one
    learned = ' '.join(demo_vlm.tower_table({MODELS[0]: tower(500, 30, 25), MODELS[1]: tower(500, 30, 28)}).split())
    assert 'Both towers are above chance' in learned and 'at chance on every' not in learned


def write_log(run, losses):
    run.mkdir(parents=True)
    (run / 'log.jsonl').write_text(''.join(json.dumps({'step': 5 * (i + 1), 'loss': x}) + '\n'
                                           for i, x in enumerate(losses)))


def test_one_loss_figure_holds_both_towers_in_each_stage(tmp_path):
    runs = {}
    for k, name in enumerate(MODELS):
        runs[name] = {}
        for stage in demo_vlm_report.STAGES:
            runs[name][stage] = tmp_path / f'{name}-{stage}'
            write_log(runs[name][stage], [5.0 - k - i / 10 for i in range(12)])
    series = demo_vlm.loss_figure(runs, 512, tmp_path / 'loss.png')
    assert list(series) == list(demo_vlm_report.STAGES) == ['pretrain', 'finetune']
    for stage, lines in series.items():
        assert list(lines) == list(MODELS)
        for name, (steps, losses) in lines.items():
            log = [json.loads(line) for line in (runs[name][stage] / 'log.jsonl').read_text().splitlines()]
            assert (steps, losses) == ([r['step'] for r in log], [r['loss'] for r in log])
    with Image.open(tmp_path / 'loss.png') as image:
        assert image.size[0] > 800 and len(np.unique(np.asarray(image.convert('L')))) > 20


def finished(root, run, epochs):
    (root / 'runs' / run / 'checkpoints').mkdir(parents=True)
    for epoch in range(1, epochs + 1):
        (root / 'runs' / run / 'checkpoints' / f'epoch_{epoch}.pt').write_bytes(b'')


def test_towers_are_reused_from_the_most_trained_setting_both_finished(tmp_path):
    finished(tmp_path, 'clip-tiny-baseline-400x1', 1)
    finished(tmp_path, 'diffclip-tiny-400x1', 1)
    finished(tmp_path, 'clip-tiny-baseline-128x1', 1)
    finished(tmp_path, 'diffclip-tiny-128x1', 1)
    finished(tmp_path, 'clip-tiny-baseline-4000x4', 4)
    finished(tmp_path, 'diffclip-tiny-4000x4', 2)  # stopped after epoch 2: not finished
    (tmp_path / 'runs' / 'diffclip-tiny-4000x4' / 'checkpoints' / 'epoch_4.pt').unlink(missing_ok=True)
    finished(tmp_path, 'diffclip-tiny-typo-9000x9', 9)  # another model
    setting, towers = demo_vlm.reusable_towers(tmp_path, MODELS)
    assert setting == (400, 1)
    assert towers == {m: tmp_path / 'runs' / f'{m}-400x1' / 'checkpoints' / 'epoch_1.pt' for m in MODELS}
    assert set(demo_vlm.finished_towers(tmp_path, MODELS)) == {(400, 1), (128, 1), (4000, 4)}


def test_towers_that_are_not_there_are_refused_before_any_work(tmp_path):
    finished(tmp_path / 'quick', 'clip-tiny-baseline-400x1', 1)
    done = call(demo_vlm.main, ['--out', tmp_path / 'out', '--towers', tmp_path / 'quick'], tmp_path)
    assert done.returncode == 2 and not (tmp_path / 'out').exists()
    message = ' '.join(done.stderr.split())
    assert f'--towers {tmp_path / "quick"}: no finished runs of both clip-tiny-baseline and diffclip-tiny' in message
    assert 'clip-tiny-baseline at 400 scenes × 1 epoch)' in message and 'python -m diffzoo.demo --out' in message


def logged(run_log, steps, max_steps, clock):
    """RunLog's console for a run logging at `steps` (a fake clock: one second per logged step)."""
    state = SimpleNamespace(global_step=0, max_steps=max_steps, epoch=0.0, is_world_process_zero=True)
    printed = io.StringIO()
    with redirect_stdout(printed):
        clock[0] = 0.0
        run_log.on_train_begin(None, state, None)
        for step in steps:
            clock[0] += 1.0
            state.global_step, state.epoch = step, step / 100
            run_log.on_log(None, state, None, logs={'loss': 10.0 / step})
    return printed.getvalue().splitlines()


def test_a_stage_prints_a_progress_line_every_few_seconds_and_logs_every_step(tmp_path, monkeypatch):
    clock = [0.0]
    monkeypatch.setattr('diffzoo.train.vlm.trainer.time.time', lambda: clock[0])
    run = tmp_path / 'clip-tiny-baseline-pretrain'
    run.mkdir()
    lines = logged(RunLog(run / 'log.jsonl', 16, every=10), range(5, 1001, 5), 1000, clock)  # 200 s, 200 logs
    assert len(lines) == 20  # one every 10 s, the last at step 1000
    assert lines[0] == ('  clip-tiny-baseline-pretrain: step 50/1000  loss 0.2000  elapsed 10s  eta 190s  '
                        '(80.0 samples/s)')
    assert lines[-1].startswith('  clip-tiny-baseline-pretrain: step 1000/1000  loss 0.0100  elapsed 200s  eta 0s')
    log = [json.loads(line) for line in (run / 'log.jsonl').read_text().splitlines()]
    assert [r['step'] for r in log] == list(range(5, 1001, 5))  # every logged step, as before
    quick = tmp_path / 'quick'
    quick.mkdir()
    assert len(logged(RunLog(quick / 'log.jsonl', 16), [5, 10, 15], 15, clock)) == 1  # the last step alone
