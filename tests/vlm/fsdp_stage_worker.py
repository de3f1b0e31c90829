"""One stage's training, run by tests/vlm/test_fsdp.py in its own process (`train`) or sharded with FSDP2 over
several (torchrun, gloo on CPU): the stage's model, what it trains and its batches as `diffzoo.train.vlm.stage` builds
them, sharded with `fully_shard` directly (accelerate shards on GPUs only), and saved and loaded with the stage's own
pieces (`whole_tensor` gathers a shard, `copy_tensors` fills one).

    python tests/vlm/fsdp_stage_worker.py RECIPE.yaml OUT.safetensors STEPS [--from-stage STAGE.safetensors]
        [--then OUT2.safetensors STEPS2]

`--then` resumes in the same processes: a model built and sharded anew loads OUT and trains STEPS2 more steps.
Every process trains on the same batches, so the averaged gradient of a sharded run is the one-process run's."""
import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import yaml  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from diffzoo.train.vlm.stage import whole_tensor  # noqa: E402
from diffzoo.vlm.conversations import ConversationCollator, load_conversations  # noqa: E402
from diffzoo.vlm.factory import load_vlm  # noqa: E402
from diffzoo.vlm.recipe import check  # noqa: E402
from diffzoo.vlm.parts import find_decoder  # noqa: E402
from diffzoo.vlm.plan import apply_plan, training_plan  # noqa: E402
from diffzoo.vlm.stages import copy_tensors  # noqa: E402


def train(recipe_path: str, out: str, steps: int, from_stage: str = None) -> None:
    """`steps` steps of the stage from its start (or from `from_stage`'s tensors), its trained tensors to `out`;
    sharded over the process group's ranks when one is initialized."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    recipe = check(yaml.safe_load(Path(recipe_path).read_text()))
    torch.manual_seed(recipe['seed'])
    vlm = load_vlm(recipe['model'], differential=recipe['differential'])
    model = apply_plan(vlm.model, training_plan(recipe))
    if world > 1:  # FSDP2 as the 7B recipes shard: each decoder layer, then the whole model
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh('cpu', (world,))
        for layer in find_decoder(model.language_model).layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    if from_stage:
        copy_tensors(model, load_file(from_stage), from_stage, '')
    data = recipe['data']
    conversations, _ = load_conversations(data['json'], data['image_folder'])
    collate = ConversationCollator(vlm.tokenizer, vlm.transform, data['format'], data['max_length'],
                                   image_aspect=data['image_aspect'])
    optimizer = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=recipe['lr'],
                                  weight_decay=0.0)
    model.train()
    size = recipe['batch_size']
    for step in range(steps):
        start = step * size % len(conversations)
        batch = collate(conversations[start:start + size])
        batch = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    state = {name: whole_tensor(q) for name, q in model.named_parameters() if q.requires_grad}  # every rank gathers
    if world == 1 or dist.get_rank() == 0:
        save_file(state, out)
    if world > 1:
        kinds = {type(q).__name__ for q in model.parameters()}
        print(f'rank {dist.get_rank()}: parameters {sorted(kinds)}', flush=True)
        dist.barrier()  # `out` written before any rank reads it


if __name__ == '__main__':
    p = argparse.ArgumentParser()
    p.add_argument('recipe')
    p.add_argument('out')
    p.add_argument('steps', type=int)
    p.add_argument('--from-stage')
    p.add_argument('--then', nargs=2, metavar=('OUT2', 'STEPS2'))
    a = p.parse_args()
    if int(os.environ.get('WORLD_SIZE', 1)) > 1:
        dist.init_process_group('gloo')
    train(a.recipe, a.out, a.steps, a.from_stage)
    if a.then:
        train(a.recipe, a.then[0], int(a.then[1]), a.out)
    if dist.is_initialized():
        dist.destroy_process_group()
