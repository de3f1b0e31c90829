"""`make demo-vlm`: DiffCLIP's Table 3 in miniature — a small VLM on each of the demo's two towers, POPE side by side.

    python -m diffzoo.demo_vlm [--out demo] [--towers DIR] [--scenes 2400] [--pope-scenes 300] [--steps 1000]

1. towers  the demo's CLIP and DiffCLIP (`python -m diffzoo.demo`'s runs under OUT; trained first when absent),
           or with --towers DIR the finished ones of a demo run there (`python -m diffzoo.demo --train 400
           --epochs 1 --out DIR`), reused as they are. How much they learned is measured first: their steps, last
           contrastive loss and zero-shot shape and colour accuracy on the corpus's val scenes, against chance.
2. data    from the demo's synthetic corpus: LLaVA-format captions (stage 1) and object-presence
           conversations (stage 2: "Is there a red circle in the image?", yes for the scene's objects, no for
           absent ones chosen as POPE's random, popular and adversarial splits choose them,
           `diffzoo.data.synthetic.pope_negatives`); POPE's files (coco_pope_<split>.json, val2014/) from the
           val scenes, none of them trained on.
3. stages  the same tiny random Qwen2-style language model (a byte-level BPE tokenizer trained on the data's
           texts, a ChatML chat template) on each tower, in DiffCLIP §5.1's two stages with the vision tower
           frozen: stage 1 on captions, stage 2 projector and language model on the conversations (`python -m
           diffzoo.train.vlm` stages, one recipe per stage and tower, identical but for the tower). §5.1's
           stage 1 trains the projector alone because its Qwen2.5 is pretrained; this language model starts
           random, and a projector trained into a random, frozen one learns nothing (its caption loss stays
           at ln(vocabulary)), so here stage 1 trains the language model with the projector.
4. POPE    both VLMs on the same questions (`python -m diffzoo.eval.lmm --task pope`): accuracy with its Wilson
           95 % interval, precision, recall, F1 and yes-ratio per split, side by side; the difference in accuracy
           where an exact McNemar test on the questions one VLM got right and the other wrong finds it (p < 0.05),
           "within chance" where it does not; and one figure of both VLMs' loss in each stage.

Everything goes under OUT/vlm: `lm/`, `data/`, `recipes/`, `runs/` (each stage's run directory, its log.jsonl
every logged step), `pope/<tower>/` (predictions and rows), `loss.png` and `results.json`. A re-run reuses what
is finished. Nothing is tuned for either tower; the numbers are whatever this seed gives.
"""
import argparse
import json
import math
import random
import re
import sys
import textwrap
import time
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from diffzoo.data.llava_qa import SHORT_ANSWER as SHORT  # LLaVA-1.5's short-answer prompt, as POPE asks
from diffzoo.data.llava_qa import exchange

CONFIDENCE = 0.95  # of each accuracy's interval; the paired test's level is 1 − CONFIDENCE
TOWER_RUN = re.compile(r'(?P<model>.+)-(?P<train>\d+)x(?P<epochs>\d+)')  # demo_steps.train's run names
STAGES = {'pretrain': 'stage 1: captions', 'finetune': 'stage 2: presence questions'}  # recipe suffix → title
POPE_CHANCE = 50.0  # POPE asks as many yes as no questions


def write_sets(root: Path, scenes: int, pope_scenes: int, seed: int = 0) -> Dict[str, Path]:
    """Captions and presence conversations from the corpus's train scenes, POPE's files from its val scenes."""
    from diffzoo.data.synthetic import (POPE_SPLITS, class_frequency, make_scene, pope_negatives, presence_question,
                                        scene_objects)
    if (root / 'done.json').is_file():
        return {k: Path(v) for k, v in json.loads((root / 'done.json').read_text()).items()}
    rng = random.Random(seed)
    images = root / 'images'
    (images / 'train').mkdir(parents=True, exist_ok=True)
    captions, conversations, train_descriptions = [], [], []
    for i in range(scenes):
        image, d = make_scene(seed, 'train', i)
        name = f'train/{i:06d}.png'
        image.save(images / name)
        train_descriptions.append(d)
        captions.append({'id': f'c{i}', 'image': name, 'conversations': exchange('', d['caption'])})
    frequency = class_frequency(train_descriptions)
    for i, d in enumerate(train_descriptions):
        split = POPE_SPLITS[i % 3]
        present, absent = scene_objects(d), pope_negatives(d, split, rng, frequency)
        asked = [(o, 'Yes') for o in present] + [(o, 'No') for o in absent]
        rng.shuffle(asked)
        turns = []
        for j, (obj, answer) in enumerate(asked):
            turns += exchange(f'{presence_question(obj)}\n{SHORT}', answer, image=j == 0)
        conversations.append({'id': f'q{i}', 'image': f'train/{i:06d}.png', 'conversations': turns})
    pope = root / 'pope'
    (pope / 'val2014').mkdir(parents=True, exist_ok=True)
    rows = {split: [] for split in POPE_SPLITS}
    for i in range(pope_scenes):
        image, d = make_scene(seed, 'val', i)
        name = f'val_{i:06d}.png'
        image.save(pope / 'val2014' / name)
        for split in POPE_SPLITS:
            asked = [(o, 'yes') for o in scene_objects(d)] + [(o, 'no') for o in pope_negatives(d, split, rng,
                                                                                               frequency)]
            for obj, label in asked:
                rows[split].append({'question_id': len(rows[split]) + 1, 'image': name,
                                    'text': presence_question(obj), 'label': label})
    for split, lines in rows.items():
        (pope / f'coco_pope_{split}.json').write_text('\n'.join(json.dumps(r) for r in lines) + '\n')
    paths = {'images': images, 'captions': root / 'captions.json', 'conversations': root / 'conversations.json',
             'pope': pope}
    paths['captions'].write_text(json.dumps(captions))
    paths['conversations'].write_text(json.dumps(conversations))
    (root / 'done.json').write_text(json.dumps({k: str(v) for k, v in paths.items()}))
    return paths


def write_language_model(directory: Path, texts: List[str], seed: int = 0) -> Path:
    """The tiny random Qwen2-style LM both VLMs share (`diffzoo.vlm.tiny`: 2 layers of width 64, a byte-level
    BPE tokenizer trained on the data's texts, ChatML)."""
    if (directory / 'config.json').is_file():
        return directory
    from diffzoo.vlm.tiny import write_tiny_qwen2
    return write_tiny_qwen2(directory, texts, hidden=64, layers=2, seed=seed)


def stage_recipes(tower: str, checkpoint: Path, lm: Path, paths: Dict[str, Path], out: Path, steps: int) -> List[Path]:
    """The two stage recipes of one tower (identical for both towers but for `model.vision`)."""
    import yaml
    model = {'type': 'build_vlm', 'vision': f'{tower},{checkpoint}', 'language_model': str(lm), 'select_layer': -2,
             'projector': 'mlp2x_gelu', 'sequence_mask': 'causal'}
    common = {'model': model, 'epochs': 1, 'max_steps': steps, 'batch_size': 16, 'global_batch_size': 16,
              'weight_decay': 0.0, 'warmup_ratio': 0.03, 'lr_scheduler': 'cosine', 'log_every': 5, 'save_every': steps,
              'report_to': 'none', 'device': 'cpu', 'precision': 'fp32', 'seed': 0, 'output': str(out / 'runs')}
    stages = {
        'pretrain': {'data': {'type': 'conversations', 'json': str(paths['captions']), 'format': 'plain',
                              'image_folder': str(paths['images']), 'max_length': 64},
                     'train': {'projector': True, 'language_model': 'full'}, 'lr': 3e-3},
        'finetune': {'data': {'type': 'conversations', 'json': str(paths['conversations']), 'format': 'chat_template',
                              'image_folder': str(paths['images']), 'max_length': 160},
                     'train': {'projector': True, 'language_model': 'full'}, 'lr': 3e-3,
                     'init_from': f'{tower}-pretrain'},
    }
    files = []
    (out / 'recipes').mkdir(parents=True, exist_ok=True)
    for stage, settings in stages.items():
        path = out / 'recipes' / f'{tower}-{stage}.yaml'
        path.write_text(yaml.safe_dump({**common, **settings}))
        files.append(path)
    return files


def finished_towers(directory: Path, models: Sequence[str]) -> Dict[Tuple[int, int], Dict[str, Path]]:
    """The finished tower runs of a `python -m diffzoo.demo --out DIRECTORY` (RUN/checkpoints/epoch_E.pt of its
    runs/MODEL-SCENESxE), by (train scenes, epochs): {(scenes, epochs): {model: last checkpoint}}."""
    found: Dict[Tuple[int, int], Dict[str, Path]] = {}
    for run in sorted((directory / 'runs').glob('*x*')):
        match = TOWER_RUN.fullmatch(run.name)
        if match and match['model'] in models:
            last = run / 'checkpoints' / f'epoch_{match["epochs"]}.pt'
            if last.is_file():
                found.setdefault((int(match['train']), int(match['epochs'])), {})[match['model']] = last
    return found


def reusable_towers(directory: Path, models: Sequence[str]) -> Tuple[Tuple[int, int], Dict[str, Path]]:
    """Of `finished_towers`, the setting every model finished with, the most trained (scenes × epochs) where
    several did; a LookupError naming what DIRECTORY holds and the fix where none."""
    found = finished_towers(directory, models)
    both = {setting: runs for setting, runs in found.items() if set(runs) == set(models)}
    if not both:
        held = '; '.join(f'{", ".join(runs)} at {scenes_epochs(*s)}' for s, runs in sorted(found.items()))
        raise LookupError(f'--towers {directory}: no finished runs of both {" and ".join(models)} under '
                          f'{directory / "runs"} (finished: {held or "none"}); train them with python -m diffzoo.demo '
                          f'--out {directory} [--train N --epochs E], or leave out --towers to train them under --out')
    setting = max(both, key=lambda s: (s[0] * s[1], s))
    return setting, {model: both[setting][model] for model in models}


def scenes_epochs(scenes: int, epochs: int) -> str:
    """A tower's training in words: `4,000 scenes × 4 epochs`."""
    return f'{scenes:,} scenes × {epochs} epoch' + 's' * (epochs != 1)


def wilson(hits: int, n: int) -> Tuple[float, float]:
    """The Wilson score interval (CONFIDENCE) of hits out of n, in percent."""
    from scipy.stats import binomtest
    ci = binomtest(hits, n).proportion_ci(CONFIDENCE, method='wilson')
    return 100 * float(ci.low), 100 * float(ci.high)


def tower_report(towers: Dict[str, Path], val_dir: Path) -> Dict[str, Dict]:
    """What each tower learned: its run's optimizer steps, batch and last loss (mean of its last 10 steps; ln batch
    is the contrastive loss of guessing), and its zero-shot shape and colour accuracy on the corpus's val scenes
    with hits, Wilson interval and chance (1 / classes), `at_chance` where the interval holds chance."""
    import torch

    from diffzoo.checkpoint import run_settings
    from diffzoo.data.synthetic import class_names
    from diffzoo.demo_steps import load
    from diffzoo.eval.synthetic import encode_images, load_split, zero_shot_accuracy
    from diffzoo.train.metrics import read_lambda_log
    report = {}
    for name, checkpoint in towers.items():
        run = checkpoint.parents[1]
        logged = [r for r in read_lambda_log(str(run)) if r.get('loss') is not None]
        settings = run_settings(run)
        batch = settings['batch_size'] * settings.get('accum_freq', 1) * settings.get('world_size', 1)
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
                        'last_loss': sum(r['loss'] for r in logged[-10:]) / max(1, len(logged[-10:])),
                        'chance_loss': math.log(batch), 'zero_shot': zero_shot}
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
             f'{CONFIDENCE:.0%} interval; last loss: the mean contrastive loss of the last 10 steps. ')
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


def pope_table(scores: Dict[str, Dict], comparison: Dict[str, Dict], baseline: str, model: str) -> str:
    """POPE side by side: accuracy (interval) with n, chance and the verdict of the paired test, then precision,
    recall, F1 and yes-ratio; below, what the intervals and the test are and which accuracies are at chance."""
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
    apart = [split for split, row in comparison.items() if not row['within_chance']]
    notes = (f'(a–b): Wilson {CONFIDENCE:.0%} interval of each accuracy over its n questions (half of them yes, so '
             f'chance is 50). difference: {model} − {baseline} where an exact McNemar test on the questions one VLM '
             f'got right and the other wrong gives p < {1 - CONFIDENCE:.2f}; "within chance" where it does not: these '
             f'questions cannot tell the two VLMs apart there. ')
    notes += (f'The VLMs differ beyond chance on {", ".join(apart)}.' if apart else
              'On no split do the VLMs differ beyond chance.')
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

    from diffzoo.train.vlm_trainer import run_log
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


def main(argv: List[str] = None) -> int:
    parser = argparse.ArgumentParser(prog='python -m diffzoo.demo_vlm', description=__doc__.split('\n\n')[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split('\n\n', 2)[2])
    parser.add_argument('--out', default='demo', help="the demo's output directory (default ./demo)")
    parser.add_argument('--towers', metavar='DIR', help='reuse the finished towers of a python -m diffzoo.demo '
                        'output folder (the most trained setting both finished), instead of training them under '
                        'OUT with --train and --epochs')
    parser.add_argument('--scenes', type=int, default=2400, help='train scenes the VLMs learn from')
    parser.add_argument('--pope-scenes', type=int, default=300, help='val scenes POPE asks about')
    parser.add_argument('--steps', type=int, default=1000, help='optimizer steps per stage (batch 16)')
    parser.add_argument('--train', type=int, default=4000, help="the towers' training scenes (as the demo)")
    parser.add_argument('--val', type=int, default=500)
    parser.add_argument('--epochs', type=int, default=4, help="the towers' epochs (as the demo)")
    parser.add_argument('--model', default='diffclip-tiny')
    parser.add_argument('--baseline', default='clip-tiny-baseline')
    args = parser.parse_args(argv)
    if args.pope_scenes > args.val:
        parser.error(f'--pope-scenes {args.pope_scenes}: at most the {args.val} val scenes of the corpus')
    names = (args.baseline, args.model)
    if args.towers:
        try:
            setting, towers = reusable_towers(Path(args.towers), names)
        except LookupError as exc:
            parser.error(str(exc))

    from transformers.utils import logging as hf_logging

    from diffzoo import demo_steps
    from diffzoo.eval.lmm import cli as lmm
    from diffzoo.train.vlm import main as train_vlm
    from diffzoo.train.vlm_trainer import PROGRESS_EVERY
    out, vlm = Path(args.out), Path(args.out) / 'vlm'
    start = time.time()
    steps = ['towers', 'data', *(f'{what} {t}' for t in names for what in ('stages on', 'POPE on'))]
    counter = iter(range(1, len(steps) + 1))

    def announce(line: str) -> None:
        print(f'[{next(counter)}/{len(steps)}] {line}', flush=True)

    if args.towers:
        announce(f'towers: {" and ".join(names)} from {args.towers} ({scenes_epochs(*setting)}), reused as they are')
        for name, checkpoint in towers.items():
            print(f'      {name}: reusing {checkpoint}', flush=True)
        corpus = Path(args.towers)
    else:
        announce(f'towers: {" and ".join(names)} ({scenes_epochs(args.train, args.epochs)}, the demo\'s runs under '
                 f'{out / "runs"})')
        others = sorted(s for s, runs in finished_towers(out, names).items()
                        if set(runs) == set(names) and s != (args.train, args.epochs))
        if others:
            print(f'      finished towers under {out / "runs"} at ' + ', '.join(scenes_epochs(*s) for s in others)
                  + f': pass --towers {out} to use them (here the most trained) instead', flush=True)
        demo_steps.make_data(out, args)
        try:
            towers = {name: demo_steps.train(name, out, args) for name in names}
        except demo_steps.TrainingFailed as exc:
            print(f'error: {exc}', file=sys.stderr)
            return 1
        corpus = out
    print(f'      measuring what they learned: zero-shot shape and colour on {corpus / "data" / "val"}', flush=True)
    learned = tower_report(towers, corpus / 'data' / 'val')
    announce(f'data: {args.scenes} train scenes (captions, presence questions), POPE on {args.pope_scenes} '
             f'val scenes')
    paths = write_sets(vlm / 'data', args.scenes, args.pope_scenes)
    texts = [t['value'] for f in ('captions', 'conversations') for r in json.loads(paths[f].read_text())
             for t in r['conversations']]
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # transformers' loading and saving bars: one progress line per stage here
    try:
        lm = write_language_model(vlm / 'lm', texts + [SHORT, 'Is there a in the image?'])
        results, correct, runs = {}, {}, {}
        for tower, checkpoint in towers.items():
            announce(f'stages on {tower}: projector and LM on captions, then on conversations, {args.steps} steps '
                     f'each (a line every {PROGRESS_EVERY} s; every logged step in the runs\' log.jsonl)')
            recipes = stage_recipes(tower, checkpoint, lm, paths, vlm, args.steps)
            code = train_vlm(['chain', *map(str, recipes)])
            if code:
                return code
            runs[tower] = {r.stem[len(tower) + 1:]: vlm / 'runs' / r.stem for r in recipes}
            announce(f'POPE on {tower}')
            answers = vlm / 'pope' / tower
            code = lmm.main(['--model', str(recipes[-1]), '--stage', str(vlm / 'runs' / recipes[-1].stem),
                             '--task', 'pope', '--data-for', f'pope={paths["pope"]}', '--out', str(answers),
                             '--batch-size', '32', '--max-new-tokens', '4'])
            if code:
                return code
            results[tower] = json.loads((answers / 'results.json').read_text())['results']['pope']['scores']
            correct[tower] = pope_correct(answers)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    comparison = compare_pope(correct, *names, pope_questions(paths['pope']))
    vocabulary = json.loads((lm / 'config.json').read_text())['vocab_size']
    figure = vlm / 'loss.png'
    loss_figure(runs, vocabulary, figure)
    summary = {'pope': results, 'comparison': comparison, 'towers': learned, 'figure': str(figure),
               'seconds': round(time.time() - start)}
    (vlm / 'results.json').write_text(json.dumps(summary, indent=1) + '\n')
    print('\n' + tower_table(learned))
    print('\n' + pope_table(results, comparison, *names))
    print(f'\n  results: {vlm / "results.json"}')
    print(f'  figure:  {figure}')
    print(f'  done in {summary["seconds"]}s')
    return 0


if __name__ == '__main__':
    sys.exit(main())
