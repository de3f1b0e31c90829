"""LLaVA-style stages on one CUDA GPU (or the CPU, where the FSDP stage is refused by name): the suite's tiny
DiffCLIP tower and Qwen2-style LM (tests/vlm/models.py), LLaVA-format JSON over drawn scenes, stage 1 → 2 → 3
of `python -m diffzoo.train.vlm` in bf16, and stage 3 again under FSDP2 through torchrun; per stage its exit
status, seconds, loss per step and summary lines, to OUT/stages.json.

    python scripts/gpu_stages.py OUT
"""
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, for tests.vlm.models
from tests.vlm.models import write_chat_language_model, write_llava_sets  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL = dict(type='build_vlm', vision='diffclip-tiny', select_layer=-2, projector='mlp2x_gelu', sequence_mask='causal')
STAGES = {  # name: (data JSON, format, train, init_from, lr, extra keys)
    'stage1': ('pretrain.json', 'plain', dict(projector=True), None, 3e-3, {}),
    'stage2': ('qa.json', 'vicuna_v1', dict(projector=True, vision=True), 'stage1', 1e-3, {}),
    'stage3': ('instruct.json', 'chat_template', dict(projector=True, language_model='full', gradient_checkpointing=True),
               'stage2', 3e-3, {}),
    'stage3-fsdp': ('instruct.json', 'chat_template', dict(projector=True, language_model='full'), 'stage2', 3e-3,
                    dict(fsdp=dict(version=2))),
}


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix='diffzoo-stages-'))
    write_chat_language_model(root / 'lm')
    write_llava_sets(root, 64)
    report = {}
    for name, (json_name, fmt, train, init_from, lr, extra) in STAGES.items():
        recipe = dict(model=dict(MODEL, language_model=str(root / 'lm')), attention=dict(type='differential',
                      lambda_init=0.5), data=dict(type='conversations', json=str(root / json_name), format=fmt,
                      image_folder=str(root / 'images'), max_length=64), train=train, init_from=init_from, lr=lr,
                      global_batch_size=16, batch_size=8, max_steps=16, warmup_ratio=0.03, lr_scheduler='cosine',
                      log_every=1, save_every=8, report_to='none', device='cuda', precision='bf16',
                      output=str(root / 'runs'), **extra)
        (root / f'{name}.yaml').write_text(yaml.safe_dump(recipe))
        launcher = [sys.executable, '-m', 'torch.distributed.run', '--nproc-per-node', '1'] if extra else [sys.executable]
        start = time.time()
        done = subprocess.run([*launcher, '-m', 'diffzoo.train.vlm', '--recipe', str(root / f'{name}.yaml')], cwd=root,
                              capture_output=True, text=True, timeout=150,
                              env={**os.environ, 'PYTHONPATH': os.pathsep.join(filter(None, (str(ROOT), os.environ.get('PYTHONPATH'))))})
        log = root / 'runs' / name / 'log.jsonl'
        report[name] = {
            'rc': done.returncode, 'seconds': round(time.time() - start, 1),
            'losses': [round(json.loads(line)['loss'], 4) for line in log.read_text().splitlines()] if log.exists() else [],
            'lines': [line for line in done.stdout.splitlines() if line.startswith(('stage', 'FSDP', 'resuming'))],
            'stderr_tail': done.stderr[-1500:] if done.returncode else ''}
        print(name, json.dumps(report[name])[:1500], flush=True)
    (out / 'stages.json').write_text(json.dumps(report, indent=1) + '\n')


if __name__ == '__main__':
    main(Path(sys.argv[1]))
