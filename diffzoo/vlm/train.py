"""python -m diffzoo.vlm.train --recipe NAME|PATH [--key value …]: LoRA fine-tuning on VQAv2.

A recipe (YAML; shipped ones in recipes/vlm/, `base:` to extend one) names the model, the
differential settings, LoRA, the data and the optimisation; `--key value` overrides any key, with
dots for nested ones (`--data.fraction 0.1`, `--lr 2e-5`, `--differential null` for the baseline):

    model:        {paligemma: DIR} a local PaliGemma checkpoint (transformers + its processor), or
                  {vision: NAME[,PRETRAINED], language_model: DIR} a build_vlm model (tokenizer from DIR),
                  with integration: eramv (and anchors, inject_layers, post_mlp) for eRAM-V
    differential: {variant, lambda_init, layers, mlp} for differentialize, or null (vanilla baseline)
    lora:         {r, alpha, dropout, mlp}; train_projector: true|false (build_vlm models)
    data:         {root, split, fraction, seed, val_split, val_fraction} (diffzoo.vlm.data)
    lr, batch_size (per process), grad_accum, epochs, max_steps, weight_decay, precision (fp32|bf16),
    log_every, save_every (optimizer steps), eval_max_new_tokens, workers, seed, output

Optimiser: Adam (`weight_decay` 0) over the trainable parameters only: LoRA, λ, sub-norm (and a
build_vlm projector when asked). Under torchrun each process takes its share of the data
(DistributedSampler) and DDP averages gradients. The run directory `<output>/<recipe>` gets
`log.jsonl` (one line per logged step), `checkpoint/` (adapter + differential parameters +
optimizer state, rewritten every `save_every` steps; a rerun resumes from it), `adapter/` at the
end, `results.json` (VQA accuracy on the validation subset, trainable-parameter counts) and
`loss.png`.
"""
import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

from diffzoo.flags import YamlLoader, parse_pairs
from diffzoo.train.recipe import expand_env

RECIPE_DIR = ('recipes', 'vlm')
# keys a resumed run may change: how long it runs and what it logs, not what it trains
RESUMABLE_CHANGES = ('max_steps', 'epochs', 'log_every', 'save_every', 'eval_max_new_tokens', 'workers')


def _shipped(name: str) -> Path:
    from importlib import resources
    return Path(str(resources.files('diffzoo').joinpath(*RECIPE_DIR, f'{name}.yaml')))


def recipe_names() -> List[str]:
    from importlib import resources
    folder = resources.files('diffzoo').joinpath(*RECIPE_DIR)
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith('.yaml') and not p.name.startswith('_'))


def _merge(base: Dict, top: Dict) -> Dict:
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_recipe(name_or_path: str, _seen=()) -> Dict:
    """The recipe with its `base:` chain merged underneath (nested keys merged, later files win)."""
    import yaml
    path = Path(name_or_path)
    if not path.is_file():
        path = _shipped(Path(name_or_path).stem)
        if not path.is_file():
            raise ValueError(f'no VLM recipe {name_or_path!r}: not a file, and not a shipped recipe '
                             f'({", ".join(recipe_names())})')
    path = path.resolve()
    if path in _seen:
        raise ValueError(f'recipe {path} extends itself through `base`')
    with open(path) as f:
        data = yaml.load(f, Loader=YamlLoader) or {}
    base = data.pop('base', None)
    if base:
        base_path = path.parent / base
        data = _merge(load_recipe(str(base_path if base_path.is_file() else base), _seen + (path,)), data)
    return data


def apply_overrides(recipe: Dict, tokens: List[str]) -> Dict:
    """--key value pairs onto the recipe; dotted keys reach nested mappings."""
    recipe = json.loads(json.dumps(recipe))
    for key, value in parse_pairs(tokens).items():
        node, parts = recipe, key.split('.')
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[parts[-1]] = value
    return recipe


def _distributed():
    """(rank, world size, local rank), initialising the process group under torchrun."""
    world = int(os.environ.get('WORLD_SIZE', '1'))
    if world == 1:
        return 0, 1, 0
    import torch.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group('nccl' if torch.cuda.is_available() else 'gloo')
    return dist.get_rank(), world, int(os.environ.get('LOCAL_RANK', '0'))


def build_model(recipe: Dict, device: torch.device):
    """(model, collate for training, collate for evaluation, tokenizer-or-processor, kind)."""
    import transformers
    from .data import PaliGemmaCollator, VLMCollator
    from .model import build_vlm
    spec = recipe['model']
    if spec.get('paligemma'):
        model = transformers.PaliGemmaForConditionalGeneration.from_pretrained(spec['paligemma'])
        processor = transformers.AutoProcessor.from_pretrained(spec['paligemma'])
        return (model.to(device), PaliGemmaCollator(processor), PaliGemmaCollator(processor, train=False),
                processor, 'paligemma')
    if 'vision' not in spec or 'language_model' not in spec:
        raise ValueError('recipe model: give {paligemma: DIR} or {vision: NAME, language_model: DIR}')
    lm = transformers.AutoModelForCausalLM.from_pretrained(spec['language_model'])
    tokenizer = transformers.AutoTokenizer.from_pretrained(spec['language_model'])
    eramv = {k: spec[k] for k in ('anchors', 'inject_layers', 'post_mlp') if k in spec}
    model = build_vlm(spec['vision'], lm, spec.get('integration', 'full'), **eramv)
    transform = image_transform(spec['vision'], model)
    max_length = int(recipe.get('max_length', 64))
    return (model.to(device), VLMCollator(tokenizer, transform, max_length),
            VLMCollator(tokenizer, transform, max_length, train=False), tokenizer, 'build_vlm')


def image_transform(vision: str, model):
    """The vision tower's evaluation transform: open_clip's preprocess or timm's data config."""
    if vision.startswith('timm:'):
        import timm.data
        config = timm.data.resolve_data_config({}, model=model.vision.tower)
        return timm.data.create_transform(**config)
    import open_clip
    _, _, preprocess = open_clip.create_model_and_transforms(vision.partition(',')[0])
    return preprocess


def prepare(model, recipe: Dict, resume_dir: Optional[Path]):
    """Differential + LoRA (or the checkpoint's adapter when resuming); returns the model to train."""
    from .differential import differentialize
    from .lora import add_lora, load_adapter
    from .model import VisionLanguageModel
    lora = recipe.get('lora') or {}
    train_projector = bool(recipe.get('train_projector', False))
    if resume_dir is not None:
        model = load_adapter(model, resume_dir, trainable=True)
    else:
        if recipe.get('differential'):
            differentialize(model.language_model if isinstance(model, VisionLanguageModel) else model,
                            **recipe['differential'])
        model = add_lora(model, r=int(lora.get('r', 32)), alpha=int(lora.get('alpha', 64)),
                         dropout=float(lora.get('dropout', 0.0)), mlp=bool(lora.get('mlp', False)),
                         train_projector=train_projector)
    if isinstance(model, VisionLanguageModel):
        from .lora import projection_parameters
        for p in model.vision.parameters():
            p.requires_grad_(False)
        for p in projection_parameters(model):
            p.requires_grad_(train_projector)
    return model


def _to(batch: Dict, device: torch.device) -> Dict:
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}


@torch.no_grad()
def evaluate_vqa(model, samples, collate, tokenizer, kind: str, device, batch_size: int, max_new_tokens: int,
                 autocast) -> Dict:
    """Greedy answers on `samples` and their VQA accuracy (diffzoo.vlm.vqa)."""
    from .vqa import vqa_accuracy
    model.eval()
    scores, answers = [], []
    for i in range(0, len(samples), batch_size):
        chunk = samples[i:i + batch_size]
        batch = _to(collate(chunk), device)
        with autocast():
            if kind == 'paligemma':
                out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False)
                out = out[:, batch['input_ids'].shape[1]:]
                texts = tokenizer.batch_decode(out, skip_special_tokens=True)
            else:
                out = model.generate(batch['pixel_values'], batch['input_ids'], batch['attention_mask'],
                                     max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id)
                texts = tokenizer.batch_decode(out, skip_special_tokens=True)
        for s, text in zip(chunk, texts):
            text = text.strip()
            answers.append({'question_id': s.question_id, 'answer': text})
            scores.append(vqa_accuracy(text, s.answers))
    model.train()
    return {'vqa_accuracy': 100 * sum(scores) / max(1, len(scores)), 'questions': len(scores), 'answers': answers}


def plot_loss(log: List[Dict], path: Path) -> None:
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot([r['step'] for r in log], [r['loss'] for r in log])
    ax.set_xlabel('optimizer step')
    ax.set_ylabel('answer-token loss')
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(recipe: Dict, name: str) -> Dict:
    from torch.utils.data import DataLoader, DistributedSampler
    from .data import load_vqav2
    from .lora import save_adapter, trainable_parameters
    rank, world, local_rank = _distributed()
    cuda = torch.cuda.is_available() and recipe.get('device', 'auto') != 'cpu'
    device = torch.device(f'cuda:{local_rank}' if cuda else 'cpu')
    seed = int(recipe.get('seed', 0))
    torch.manual_seed(seed)
    out_dir = Path(recipe.get('output', 'runs/vlm')) / name
    ckpt = out_dir / 'checkpoint'
    resume = ckpt if (ckpt / 'state.pt').is_file() else None
    data = recipe['data']
    train_set = load_vqav2(data['root'], data.get('split', 'train'), float(data.get('fraction', 1.0)),
                           int(data.get('seed', seed)))
    val_set = load_vqav2(data['root'], data.get('val_split', 'val'), float(data.get('val_fraction', 1.0)),
                         int(data.get('seed', seed))) if data.get('val_split', 'val') else []
    model, collate, eval_collate, tokenizer, kind = build_model(recipe, device)
    model = prepare(model, recipe, resume).to(device)
    counts = trainable_parameters(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=float(recipe['lr']), weight_decay=float(recipe.get('weight_decay', 0.0)))
    batch_size, accum = int(recipe.get('batch_size', 4)), int(recipe.get('grad_accum', 1))
    sampler = DistributedSampler(train_set, world, rank, shuffle=True, seed=seed) if world > 1 else None
    order = torch.Generator()  # reseeded every epoch, so a resumed run sees the same batches
    loader = DataLoader(train_set, batch_size=batch_size, shuffle=sampler is None, sampler=sampler,
                        collate_fn=collate, num_workers=int(recipe.get('workers', 0)), drop_last=True,
                        generator=order)
    steps_per_epoch = len(loader) // accum
    if steps_per_epoch == 0:
        raise ValueError(f'{len(train_set)} training samples make no optimizer step at batch {batch_size} × '
                         f'accumulation {accum} × {world} processes; lower batch_size or raise data.fraction')
    max_steps = recipe.get('max_steps') or steps_per_epoch * int(recipe.get('epochs', 1))
    step, log = 0, []
    if resume is not None:
        state = torch.load(resume / 'state.pt', map_location='cpu', weights_only=True)
        changed = sorted(k for k in set(state['recipe']) | set(recipe)
                         if k not in RESUMABLE_CHANGES and state['recipe'].get(k) != recipe.get(k))
        if changed:
            raise ValueError(f'{resume}: the checkpoint was trained with other settings for {changed}; resume with '
                             f'the same recipe (only {", ".join(RESUMABLE_CHANGES)} may change) or set --output elsewhere')
        optimizer.load_state_dict(state['optimizer'])
        step, log = state['step'], state['log']
        if rank == 0:
            print(f'resuming {name} from step {step} ({resume})', flush=True)
    train_model = model
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel
        train_model = DistributedDataParallel(model, device_ids=[local_rank] if cuda else None)
    precision = recipe.get('precision', 'bf16' if cuda else 'fp32')

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == 'bf16')

    log_every, save_every = int(recipe.get('log_every', 10)), int(recipe.get('save_every', 500))
    if rank == 0:
        print(f'{name}: {len(train_set)} training questions, {max_steps} steps of {batch_size} × {accum} × {world}; '
              f'trainable {counts}', flush=True)
        out_dir.mkdir(parents=True, exist_ok=True)

    def save_checkpoint():  # written beside, then swapped in: a crash leaves the previous checkpoint whole
        partial, previous = ckpt.with_name('checkpoint.partial'), ckpt.with_name('checkpoint.previous')
        shutil.rmtree(partial, ignore_errors=True)
        save_adapter(model, partial)
        torch.save({'step': step, 'optimizer': optimizer.state_dict(), 'log': log, 'recipe': recipe}, partial / 'state.pt')
        if ckpt.exists():
            ckpt.rename(previous)
        partial.rename(ckpt)
        shutil.rmtree(previous, ignore_errors=True)

    model.train()
    epoch, t0, window = step // steps_per_epoch, time.time(), []
    while step < max_steps:
        if sampler is not None:
            sampler.set_epoch(epoch)
        order.manual_seed(seed + epoch)
        optimizer.zero_grad(set_to_none=True)
        skip = (step % steps_per_epoch) * accum  # batches of this epoch already trained on (resume)
        for i, batch in enumerate(loader):
            if i < skip:
                continue
            if i >= steps_per_epoch * accum:  # a remainder short of a whole optimizer step is left out
                break
            with autocast():
                loss = train_model(**_to(batch, device)).loss
            (loss / accum).backward()
            window.append(loss.item())
            if (i + 1) % accum:
                continue
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step % log_every == 0 or step == max_steps:
                record = {'step': step, 'epoch': epoch, 'loss': sum(window) / len(window),
                          'samples_per_s': len(window) * batch_size * world / (time.time() - t0)}
                log.append(record)
                window, t0 = [], time.time()
                if rank == 0:
                    print(f'step {step}/{max_steps}  loss {record["loss"]:.4f}  {record["samples_per_s"]:.1f} samples/s',
                          flush=True)
                    with open(out_dir / 'log.jsonl', 'a') as f:
                        f.write(json.dumps(record) + '\n')
            if rank == 0 and (step % save_every == 0 or step == max_steps):
                save_checkpoint()
            if step >= max_steps:
                break
        epoch += 1
    results = {'recipe': name, 'steps': step, 'trainable_parameters': counts}
    if rank == 0:
        save_adapter(model, out_dir / 'adapter')
        if val_set:
            print(f'evaluating on {len(val_set)} validation questions', flush=True)
            scored = evaluate_vqa(model, val_set, eval_collate, tokenizer, kind, device, batch_size,
                                  int(recipe.get('eval_max_new_tokens', 8)), autocast)
            (out_dir / 'val_answers.json').write_text(json.dumps(scored.pop('answers')) + '\n')
            results.update(scored)
        results['final_loss'] = log[-1]['loss'] if log else None
        (out_dir / 'results.json').write_text(json.dumps(results, indent=1) + '\n')
        if log:
            plot_loss(log, out_dir / 'loss.png')
        acc = f'{results["vqa_accuracy"]:.2f}' if 'vqa_accuracy' in results else 'n/a'
        print(f'\n{name}: {step} steps, final loss {results["final_loss"]:.4f}, VQA accuracy {acc}\n'
              f'  {out_dir / "results.json"}\n  {out_dir / "loss.png"}\n  {out_dir / "adapter"}', flush=True)
    if world > 1:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return results


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog='python -m diffzoo.vlm.train', description=__doc__.split('\n')[0])
    parser.add_argument('--recipe', required=True, help='a YAML file or a shipped name')
    args, rest = parser.parse_known_args(argv)
    try:
        recipe = expand_env(apply_overrides(load_recipe(args.recipe), rest))
        run(recipe, Path(args.recipe).stem)
    except (ValueError, FileNotFoundError) as exc:
        print(f'error: {exc}', file=sys.stderr)
        return 2
    return 0


if __name__ == '__main__':
    sys.exit(main())
