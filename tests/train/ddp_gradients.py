"""Run under torchrun (gloo, CPU): is a DDP step of open_clip_train, as diffzoo launches it, the
single-process step on the global batch? Rank 0 writes the relative gradient errors to argv[1].

open_clip_train wraps the model as `torch.nn.parallel.DistributedDataParallel(model, device_ids=[device])`
through its own module's `torch` and, with the recipes' `--local-loss --gather-with-grad`, computes each rank's
loss against features gathered from every rank. Both run here exactly so, inside `diffzoo.train.seams.installed()`.
"""
import json
import sys

import open_clip
import open_clip_train.main
import torch
import torch.distributed as dist

from diffzoo.train import seams


def gradients(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def clip_loss(model, images, texts, **kwargs):
    out = model(images, texts)
    return open_clip.ClipLoss(**kwargs)(out['image_features'], out['text_features'], out['logit_scale'])


def main(out_path):
    dist.init_process_group('gloo')
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = open_clip.create_model('diffclip-tiny', output_dict=True)
    per_rank = 4
    images = torch.randn(per_rank * world, 3, 64, 64)  # the global batch, the same on every rank
    texts = torch.randint(1, 49407, (per_rank * world, 32))

    clip_loss(model, images, texts).backward()
    reference = gradients(model)
    model.zero_grad(set_to_none=True)

    with seams.installed():
        ddp = open_clip_train.main.torch.nn.parallel.DistributedDataParallel(model, device_ids=[torch.device('cpu')])
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    clip_loss(ddp, images[mine], texts[mine], local_loss=True, gather_with_grad=True, rank=rank,
              world_size=world).backward()
    errors = {n: ((g - reference[n]).norm() / reference[n].norm().clamp_min(1e-12)).item()
              for n, g in gradients(model).items()}
    if rank == 0:
        with open(out_path, 'w') as f:
            json.dump({'world_size': world, 'parameters': len(reference), 'errors': errors}, f)
    dist.destroy_process_group()


if __name__ == '__main__':
    main(sys.argv[1])
