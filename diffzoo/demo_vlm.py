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
import random
import sys
import time
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from diffzoo.data.llava_qa import SHORT_ANSWER as SHORT  # LLaVA-1.5's short-answer prompt, as POPE asks
from diffzoo.data.llava_qa import exchange
from diffzoo.demo_vlm_report import (TOWER_RUN, compare_pope, loss_figure, pope_correct, pope_questions, pope_table,
                                     scenes_epochs, tower_report, tower_table)



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
                              'image_folder': str(paths['images']), 'max_length': 128},  # 64 image positions
                     'train': {'projector': True, 'language_model': 'full'}, 'lr': 3e-3},
        'finetune': {'data': {'type': 'conversations', 'json': str(paths['conversations']), 'format': 'chat_template',
                              'image_folder': str(paths['images']), 'max_length': 224},  # and the text
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
    from diffzoo.train.vlm.trainer import PROGRESS_EVERY
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
    print('\n' + pope_table(results, comparison, *names, towers=learned))
    print(f'\n  results: {vlm / "results.json"}')
    print(f'  figure:  {figure}')
    print(f'  done in {summary["seconds"]}s')
    return 0


if __name__ == '__main__':
    sys.exit(main())
