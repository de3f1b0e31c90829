"""`make demo-vlm`'s report: the towers' accuracy against chance, POPE with intervals and a paired test, and one
loss figure (`diffzoo.demo_vlm` runs the demo; the intervals are the CLIP demo's, `diffzoo.confidence.wilson`)."""
import json
import math
import re
import textwrap
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from diffzoo.confidence import CONFIDENCE, overlap, wilson
from diffzoo.train import loss_report

TOWER_RUN = re.compile(r'(?P<model>.+)-(?P<train>\d+)x(?P<epochs>\d+)')  # demo_steps.train's run names
STAGES = {'pretrain': 'stage 1: captions', 'finetune': 'stage 2: presence questions'}  # recipe suffix → title
POPE_CHANCE = 50.0  # POPE asks as many yes as no questions


def scenes_epochs(scenes: int, epochs: int) -> str:
    """A tower's training in words: `4,000 scenes × 4 epochs`."""
    return f'{scenes:,} scenes × {epochs} epoch' + 's' * (epochs != 1)


def tower_report(towers: Dict[str, Path], val_dir: Path) -> Dict[str, Dict]:
    """What each tower learned: its run's optimizer steps, batch and last loss (mean of its last 10 steps; ln batch
    is the contrastive loss of guessing), and its zero-shot shape and colour accuracy on the corpus's val scenes
    with hits, Wilson interval and chance (1 / classes), `at_chance` where the interval holds chance."""
    import torch

    from diffzoo.checkpoint import run_settings
    from diffzoo.data.synthetic import class_names
    from diffzoo.demo_steps import load
    from diffzoo.eval.synthetic import encode_images, load_split, zero_shot_accuracy
    from diffzoo.train.lambda_log import read_lambda_log
    report = {}
    for name, checkpoint in towers.items():
        run = checkpoint.parents[1]
        logged = [r for r in read_lambda_log(str(run)) if r.get('loss') is not None]
        batch = loss_report.global_batch(run_settings(run))
        match = TOWER_RUN.fullmatch(run.name)
        loaded = load(checkpoint)
        images, scenes = load_split(val_dir, loaded.preprocess)
        zero_shot = {}
        with torch.no_grad():
            features = encode_images(loaded.model.eval(), images)
            for task, classes in class_names().items():
                accuracy = zero_shot_accuracy(features, scenes, loaded.model, loaded.tokenizer, task)
                hits, chance = round(accuracy * len(scenes) / 100), 100 / len(classes)
                low, high = wilson(hits, len(scenes))
                zero_shot[task] = {'accuracy': accuracy, 'hits': hits, 'n': len(scenes), 'interval': [low, high],
                                   'chance': chance, 'at_chance': low <= chance <= high}
        report[name] = {'checkpoint': str(checkpoint), 'train_scenes': int(match['train']) if match else None,
                        'epochs': int(match['epochs']) if match else None,
                        'steps': max((r['step'] for r in logged), default=0), 'batch': batch,
                        'last_loss': (loss_report.last_loss(logged) or (0.0, 0))[0],
                        'chance_loss': loss_report.chance_loss(batch), 'zero_shot': zero_shot}
    return report


def tower_table(report: Dict[str, Dict]) -> str:
    """The towers' training and zero-shot accuracy against chance, and what that allows the POPE table to say."""
    tasks = list(next(iter(report.values()))['zero_shot'])
    label = {name: f'{name} ({r["steps"]:,} steps of {r["batch"]})' for name, r in report.items()}
    width = max(map(len, label.values())) + 2
    head = f'  {"tower (its training)":<{width}}' + ''.join(f'{f"zero-shot {t}":>20}' for t in tasks) + \
        f'{"last loss":>15}'
    lines = [head, '  ' + '─' * (len(head) - 2)]
    for name, r in report.items():
        cells = ''.join(f'{"{:.1f} ({:.1f}–{:.1f})".format(z["accuracy"], *z["interval"]):>20}'
                        for z in r['zero_shot'].values())
        lines.append(f'  {label[name]:<{width}}{cells}{r["last_loss"]:>15.2f}')
    first = next(iter(report.values()))
    guess = f'ln {first["batch"]} = {first["chance_loss"]:.2f}'
    lines.append(f'  {"chance":<{width}}' + ''.join(f'{z["chance"]:>20.1f}' for z in first['zero_shot'].values())
                 + f'{guess:>15}')
    at_chance = [n for n, r in report.items() if all(z['at_chance'] for z in r['zero_shot'].values())]
    trained = '; '.join(sorted({scenes_epochs(r['train_scenes'], r['epochs']) for r in report.values()
                                if r['train_scenes']}))
    notes = (f'Towers trained on the demo\'s synthetic corpus ({trained}; optimizer steps of the batch shown); '
             f'zero-shot accuracy on its {first["zero_shot"][tasks[0]]["n"]} val scenes, (a–b) its Wilson '
             f'{CONFIDENCE:.0%} interval; last loss: the mean contrastive loss of the last '
             f'{loss_report.LAST_STEPS} steps. ')
    if len(at_chance) == len(report):
        notes += ('Both towers are at chance on every zero-shot task (each interval holds it): they learned nothing '
                  'measurable, so no difference between the VLMs below says anything about DiffCLIP against CLIP. '
                  'Train them on more scenes or epochs (--train, --epochs), or pass --towers DIR with better-trained '
                  'ones.')
    elif at_chance:
        notes += (f'{" and ".join(at_chance)} is at chance on every zero-shot task: it learned nothing measurable, '
                  'so a difference between the VLMs below may be the other tower\'s training, not its attention.')
    else:
        notes += 'Both towers are above chance on some zero-shot task.'
    return '\n'.join(lines + [''] + textwrap.wrap(notes, width=len(head), initial_indent='  ',
                                                   subsequent_indent='  ', break_on_hyphens=False))


def pope_questions(pope: Path) -> Dict[str, List[str]]:
    """The question ids of each POPE split, as `diffzoo.eval.lmm` names them (`<split>-<question_id>`)."""
    from diffzoo.data.synthetic import POPE_SPLITS
    return {split: [f'{split}-{json.loads(line)["question_id"]}'
                    for line in (pope / f'coco_pope_{split}.json').read_text().splitlines() if line.strip()]
            for split in POPE_SPLITS}


def pope_correct(directory: Path) -> Dict[str, bool]:
    """{question id: right} from `diffzoo.eval.lmm`'s pope_predictions.jsonl in `directory` (each question's last
    reply, read as POPE's evaluate.py reads it)."""
    from diffzoo.eval.lmm.metrics import pope_answer
    rows = [json.loads(line) for line in (directory / 'pope_predictions.jsonl').read_text().splitlines()
            if line.strip()]
    return {r['id']: pope_answer(r['prediction']) == r['label'].strip().lower() for r in rows}


def compare_pope(correct: Dict[str, Dict[str, bool]], baseline: str, model: str,
                 questions: Dict[str, List[str]]) -> Dict[str, Dict]:
    """Per split, over the questions both VLMs answered: each one's hits, accuracy, Wilson interval and whether it
    holds chance (50 %); the questions only one got right; the exact McNemar test's two-sided p (a binomial
    test of those at ½) and `within_chance` where p ≥ 1 − CONFIDENCE."""
    from scipy.stats import binomtest
    rows = {}
    for split, ids in questions.items():
        both = [i for i in ids if i in correct[baseline] and i in correct[model]]
        row = {'n': len(both)}
        for name in (baseline, model):
            hits = sum(correct[name][i] for i in both)
            low, high = wilson(hits, len(both))
            row[name] = {'hits': hits, 'accuracy': 100 * hits / len(both), 'interval': [low, high],
                         'at_chance': low <= POPE_CHANCE <= high}
        only = {name: sum(correct[name][i] and not correct[other][i] for i in both)
                for name, other in ((baseline, model), (model, baseline))}
        discordant = only[baseline] + only[model]
        p = float(binomtest(only[model], discordant, 0.5).pvalue) if discordant else 1.0
        rows[split] = {**row, 'only_right': only, 'p_value': p, 'within_chance': p >= 1 - CONFIDENCE,
                       'difference': row[model]['accuracy'] - row[baseline]['accuracy']}
    return rows


def yes_bias(scores: Dict[str, Dict[str, float]], n: Dict[str, int]) -> Dict[str, Tuple[float, float, float]]:
    """{split: (yes-ratio, its Wilson interval)} in percent, for the splits where one VLM's interval of the share of
    questions it answered yes does not hold 50, the share of yes questions (`scores`: its POPE scores per split, over
    their `questions`, else over `n[split]`)."""
    biased = {}
    for split, row in scores.items():
        questions = int(row.get('questions', n[split]))
        low, high = wilson(round(row['yes_ratio'] * questions), questions)
        if not low <= POPE_CHANCE <= high:
            biased[split] = (100 * row['yes_ratio'], low, high)
    return biased


def pope_verdict(scores: Dict[str, Dict], comparison: Dict[str, Dict], baseline: str, model: str,
                 towers: Optional[Dict[str, Dict]] = None) -> str:
    """What the POPE table supports: the splits where the VLMs differ beyond chance, from one seed of each training;
    each VLM whose yes-ratio departs from 50 beyond chance (answering yes more often raises recall, not what it
    sees); and, given the towers' report (`tower_report`), whether the towers themselves are within chance of each
    other on every zero-shot task, so that a difference between the VLMs is not shown to come from them."""
    apart = [split for split, row in comparison.items() if not row['within_chance']]
    text = (f'The VLMs differ beyond chance on {", ".join(apart)}, in one seed of each training: a second seed '
            f'would say how much of it the seed makes.' if apart else
            'On no split do the VLMs differ beyond chance (one seed of each training).')
    for name in (baseline, model):
        biased = yes_bias(scores[name], {split: row['n'] for split, row in comparison.items()})
        if biased:
            ratios = sorted(r for r, _, _ in biased.values())
            shown = f'{ratios[0]:.0f}' if len(ratios) == 1 else f'{ratios[0]:.0f}–{ratios[-1]:.0f}'
            text += (f' {name}\'s VLM answers yes to {shown} % of the questions on {", ".join(biased)}, where half '
                     f'are yes (beyond chance): a VLM that says yes more often gains recall without seeing better, '
                     f'so read its recall beside its precision.')
    if towers and apart:
        tasks = list(towers[baseline]['zero_shot'])
        if all(overlap(towers[baseline]['zero_shot'][t]['interval'], towers[model]['zero_shot'][t]['interval'])
               for t in tasks):
            text += (f' The towers themselves are within chance of each other on zero-shot {" and ".join(tasks)}: '
                     f'these questions show that the VLMs differ, not that one tower sees better.')
    return text


def pope_table(scores: Dict[str, Dict], comparison: Dict[str, Dict], baseline: str, model: str,
               towers: Optional[Dict[str, Dict]] = None) -> str:
    """POPE side by side: accuracy (interval) with n, chance and the verdict of the paired test, then precision,
    recall, F1 and yes-ratio; below, what the intervals and the test are, which accuracies are at chance, and what
    the table supports (`pope_verdict`; `towers`: the towers' report)."""
    width = max(22, len(baseline) + 2, len(model) + 2)
    head = f'  {"POPE (%)":<24}{baseline:>{width}}{model:>{width}}{"chance":>8}{"n":>6}   difference'
    lines = [head, '  ' + '─' * (len(head) - 2)]
    for split, row in comparison.items():
        cells = ''.join(f'{"{:.1f} ({:.1f}–{:.1f})".format(row[t]["accuracy"], *row[t]["interval"]):>{width}}'
                        for t in (baseline, model))
        p = f'p = {row["p_value"]:.2f}' if row['p_value'] >= 0.01 else 'p < 0.01'
        verdict = f'within chance ({p})' if row['within_chance'] else f'{row["difference"]:+.1f} ({p})'
        lines.append(f'  {split:<12}{"accuracy":<12}{cells}{POPE_CHANCE:>8.1f}{row["n"]:>6}   {verdict}')
        for metric in ('precision', 'recall', 'f1', 'yes_ratio'):
            lines.append(f'  {split:<12}{metric:<12}' + ''.join(f'{100 * scores[t][split][metric]:>{width}.1f}'
                                                                for t in (baseline, model)))
    at_chance = [f'{t} {split}' for split, row in comparison.items() for t in (baseline, model)
                 if row[t]['at_chance']]
    notes = (f'(a–b): Wilson {CONFIDENCE:.0%} interval of each accuracy over its n questions (half of them yes, so '
             f'chance is 50). difference: {model} − {baseline} where an exact McNemar test on the questions one VLM '
             f'got right and the other wrong gives p < {1 - CONFIDENCE:.2f}; "within chance" where it does not: these '
             f'questions cannot tell the two VLMs apart there. ')
    notes += pope_verdict(scores, comparison, baseline, model, towers)
    if at_chance:
        notes += ' At chance (the interval holds 50): ' + ', '.join(at_chance) + '.'
    return '\n'.join(lines + [''] + textwrap.wrap(notes, width=len(head), initial_indent='  ',
                                                   subsequent_indent='  ', break_on_hyphens=False))


def loss_figure(runs: Dict[str, Dict[str, Path]], vocabulary: int, png: Path) -> Dict[str, Dict[str, Tuple]]:
    """Both VLMs' training loss, one panel per stage (captions, then presence questions) with a line per tower,
    and ln(vocabulary): the loss of a uniform guess over the vocabulary. `runs`: {tower: {stage: run dir}}.
    Returns the series drawn, {stage: {tower: (steps, losses)}}."""
    import matplotlib
    matplotlib.use('Agg')
    from matplotlib.figure import Figure

    from diffzoo.train.vlm.run import run_log
    fig = Figure(figsize=(10, 3.8))
    axes = fig.subplots(1, len(STAGES), sharey=True)
    series: Dict[str, Dict[str, Tuple]] = {}
    for ax, (stage, title) in zip(axes, STAGES.items()):
        series[stage] = {}
        for (tower, stages), colour in zip(runs.items(), ('tab:blue', 'tab:red', 'tab:green')):
            log = run_log(stages[stage])
            steps, losses = [r['step'] for r in log], [r['loss'] for r in log]
            series[stage][tower] = (steps, losses)
            ax.plot(steps, losses, color=colour, label=tower)
        ax.axhline(math.log(vocabulary), color='grey', linestyle='--', linewidth=1,
                   label=f'ln {vocabulary} = {math.log(vocabulary):.2f}: uniform over the vocabulary')
        ax.set_title(title, fontsize=10)
        ax.set_xlabel('optimizer step')
        ax.grid(alpha=0.3)
    axes[0].set_ylabel('answer-token loss')
    axes[0].legend(fontsize=8)
    fig.suptitle('VLM training loss on each tower (same language model, data and recipe)', fontsize=11)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    return series
