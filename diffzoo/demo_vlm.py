"""`make demo-vlm`: DiffCLIP's Table 3 in miniature — a small VLM on each of the demo's two towers, POPE side by side.

    python -m diffzoo.demo_vlm [--out demo] [--scenes 2400] [--pope-scenes 300] [--steps 1000]

1. towers  the demo's CLIP and DiffCLIP (`python -m diffzoo.demo`'s runs under OUT; trained first when absent).
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
4. POPE    both VLMs on the same questions (`python -m diffzoo.eval.lmm --task pope`): accuracy, precision,
           recall, F1 and yes-ratio per split, side by side, with the stages' loss curves.

Everything goes under OUT/vlm: `lm/`, `data/`, `recipes/`, `runs/` (each stage's run directory), `pope/<tower>/`
(predictions and rows) and `results.json`. A re-run reuses what is finished. Nothing is tuned for either
tower; the numbers are whatever this seed gives.
"""
import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Dict, List

from diffzoo.data.llava_qa import SHORT_ANSWER as SHORT  # LLaVA-1.5's short-answer prompt, as POPE asks
from diffzoo.data.llava_qa import exchange


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


def main(argv: List[str] = None) -> int:
    parser = argparse.ArgumentParser(prog='python -m diffzoo.demo_vlm', description=__doc__.split('\n\n')[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split('\n\n', 2)[2])
    parser.add_argument('--out', default='demo', help="the demo's output directory (default ./demo)")
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

    from diffzoo import demo_steps
    from diffzoo.eval.lmm import cli as lmm
    from diffzoo.train.vlm import main as train_vlm
    out, vlm = Path(args.out), Path(args.out) / 'vlm'
    start = time.time()
    print(f'[1/4] towers: {args.baseline} and {args.model} (the demo\'s runs under {out / "runs"})', flush=True)
    demo_steps.make_data(out, args)
    try:
        towers = {name: demo_steps.train(name, out, args) for name in (args.baseline, args.model)}
    except demo_steps.TrainingFailed as exc:
        print(f'error: {exc}', file=sys.stderr)
        return 1
    print(f'[2/4] data: {args.scenes} train scenes (captions, presence questions), POPE on {args.pope_scenes} '
          f'val scenes', flush=True)
    paths = write_sets(vlm / 'data', args.scenes, args.pope_scenes)
    texts = [t['value'] for f in ('captions', 'conversations') for r in json.loads(paths[f].read_text())
             for t in r['conversations']]
    lm = write_language_model(vlm / 'lm', texts + [SHORT, 'Is there a in the image?'])
    results = {}
    for tower, checkpoint in towers.items():
        print(f'[3/4] stages on {tower}: projector and LM on captions, then on conversations', flush=True)
        recipes = stage_recipes(tower, checkpoint, lm, paths, vlm, args.steps)
        code = train_vlm(['chain', *map(str, recipes)])
        if code:
            return code
        print(f'[4/4] POPE on {tower}', flush=True)
        code = lmm.main(['--model', str(recipes[-1]), '--stage', str(vlm / 'runs' / recipes[-1].stem), '--task', 'pope',
                         '--data-for', f'pope={paths["pope"]}', '--out', str(vlm / 'pope' / tower),
                         '--batch-size', '32', '--max-new-tokens', '4'])
        if code:
            return code
        results[tower] = json.loads((vlm / 'pope' / tower / 'results.json').read_text())['results']['pope']['scores']
    table = [f'{"POPE":<12} {"":<10}' + ''.join(f'{t:>22}' for t in results)]
    for split in next(iter(results.values())):
        for metric in ('accuracy', 'precision', 'recall', 'f1', 'yes_ratio'):
            table.append(f'{split:<12} {metric:<10}' + ''.join(f'{100 * results[t][split][metric]:>22.1f}'
                                                               for t in results))
    summary = {'pope': results, 'towers': {t: str(c) for t, c in towers.items()}, 'seconds': round(time.time() - start),
               'loss_curves': {r.stem: str(vlm / 'runs' / r.stem / 'loss.png') for t in towers
                               for r in (vlm / 'recipes').glob(f'{t}-*.yaml')}}
    (vlm / 'results.json').write_text(json.dumps(summary, indent=1) + '\n')
    print('\n' + '\n'.join(table))
    print(f'\n  results: {vlm / "results.json"}')
    for name, png in sorted(summary['loss_curves'].items()):
        print(f'  figure:  {png}')
    print(f'  done in {summary["seconds"]}s')
    return 0


if __name__ == '__main__':
    sys.exit(main())
