"""The Python parts of `python -m diffzoo.bench.gpu`, each run as its own time-boxed process:

  env OUT.json [--device cuda]          environment as the bench records it, package versions, nvidia-smi,
                                        /dev/shm, and a one-process all_reduce over NCCL (gloo on CPU)
  corpus DIR --train N --per-shard P    the synthetic corpus's train split in parallel processes: the same
                                        shards `python -m diffzoo.data synthetic` writes with that --per-shard
                                        (sample i depends only on seed, split and i), in a fraction of the time
  assets DIR                            a tiny random PaliGemma with its processor and a VQAv2-layout set
                                        (diffzoo.vlm.tiny's, the VLM tests' own), and a random Gemma
                                        directory for `python -m diffzoo.bench.eramv --model`
  stage-assets DIR                      the LLaVA-style stages' tiny Qwen2-style LM and JSON sets (diffzoo.vlm.tiny)
  vlm OUT.json -- ARGS                  `python -m diffzoo.train.vlm ARGS` (its main, in this process), then the
                                        device it trained on and CUDA's peak memory, to OUT.json
  dispatch JUNIT.xml OUT.json           which rows of `split_kernel="auto"`'s table (kernels.TRITON_ON_CUDA) the
                                        kernel tests' bench-shape cases in JUNIT.xml support, per dtype
"""
import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

PACKAGES = ('torch', 'triton', 'torchvision', 'timm', 'open_clip_torch', 'transformers', 'peft', 'accelerate',
            'webdataset', 'braceexpand', 'pandas', 'tensorboard', 'matplotlib', 'pyyaml', 'safetensors',
            'huggingface_hub', 'tokenizers', 'ftfy', 'regex', 'numpy', 'pillow', 'pyarrow')


def versions() -> dict:
    """Installed versions of the packages the steps use (None: not installed); no package is imported."""
    found = {}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def nvidia_smi() -> str:
    try:
        smi = subprocess.run(['nvidia-smi', '--query-gpu=name,memory.total,driver_version,clocks.max.sm,power.limit',
                              '--format=csv,noheader'], capture_output=True, text=True, timeout=10)
        return smi.stdout.strip() or smi.stderr.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return f'unavailable: {exc}'


def collective_check(device) -> dict:
    """One process, world size 1: NCCL (gloo on CPU) initialised and an all_reduce checked."""
    import torch
    import torch.distributed as dist
    backend = 'nccl' if device.type == 'cuda' else 'gloo'
    check = {'backend': backend}
    start = time.perf_counter()
    try:
        with socket.socket() as s:
            s.bind(('127.0.0.1', 0))
            port = s.getsockname()[1]
        dist.init_process_group(backend, init_method=f'tcp://127.0.0.1:{port}', rank=0, world_size=1)
        x = torch.arange(4.0, device=device)
        dist.all_reduce(x)
        if device.type == 'cuda':
            torch.cuda.synchronize()
        check.update(ok=x.tolist() == [0.0, 1.0, 2.0, 3.0], backend_used=dist.get_backend(),
                     nccl_version='.'.join(map(str, torch.cuda.nccl.version())) if backend == 'nccl' else None)
        dist.destroy_process_group()
    except Exception as exc:  # recorded, not fatal: the other commands still run
        check.update(ok=False, error=f'{type(exc).__name__}: {exc}'[:500])
    check['seconds'] = round(time.perf_counter() - start, 2)
    return check


def cmd_env(a) -> int:
    import torch

    from diffzoo.bench.measure import environment
    device = torch.device(a.device)
    found = versions()
    out = {'packages': found, 'missing_packages': [k for k, v in found.items() if v is None],
           'cuda_available': torch.cuda.is_available(), 'cuda_devices': torch.cuda.device_count()}
    try:
        out['environment'] = environment(device)
    except Exception as exc:  # noqa: BLE001  no usable device: say so, describe the rest
        out['environment'] = dict(environment(torch.device('cpu')), device=f'{a.device} unusable',
                                  error=f'{type(exc).__name__}: {exc}'[:300])
    try:  # data-loader workers hand batches over in /dev/shm
        shm = os.statvfs('/dev/shm')
        out['dev_shm_gb'] = round(shm.f_frsize * shm.f_blocks / 2 ** 30, 1)
    except OSError:
        out['dev_shm_gb'] = None
    out['nvidia_smi'] = nvidia_smi()
    check = out['collective_check'] = collective_check(device)
    Path(a.out).write_text(json.dumps(out, indent=1) + '\n')
    env = out['environment']
    print(f'device {env["device"]}, torch {env["torch"]}, cuda {env.get("cuda")}, {env["cpu_count"]} CPUs; '
          f'{check["backend"]} all_reduce {"ok" if check["ok"] else "FAILED"} ({check["seconds"]} s)')
    if out['missing_packages']:
        print(f'not installed: {", ".join(out["missing_packages"])}')
    return 0 if check['ok'] else 1


def _write_shard(job):
    """One shard of the train split, as diffzoo.data.synthetic.write_split writes it (its write_shard)."""
    from diffzoo.data.synthetic import write_shard
    directory, start, config = job
    return write_shard(directory, 'train', start, config)


def cmd_corpus(a) -> int:
    import multiprocessing

    import webdataset  # noqa: F401  imported once here, before the fork, not once per process

    from diffzoo.data.shards import write_sizes
    from diffzoo.data.synthetic import CorpusConfig
    config = CorpusConfig(train=a.train, val=1, image_size=a.image_size, per_shard=a.per_shard, seed=a.seed)
    directory = Path(a.out_dir) / 'train'
    directory.mkdir(parents=True, exist_ok=True)
    for old in directory.glob('*.tar'):
        old.unlink()
    jobs = [(str(directory), start, config) for start in range(0, a.train, a.per_shard)]
    processes = max(1, min(a.processes or os.cpu_count() or 1, len(jobs)))
    start = time.perf_counter()
    with multiprocessing.get_context('fork').Pool(processes) as pool:
        written = sum(pool.imap_unordered(_write_shard, jobs))
    report = write_sizes(directory)
    seconds = time.perf_counter() - start
    print(f'{report.total:,} scenes of {a.image_size} px in {len(jobs)} shards of {a.per_shard}, '
          f'{processes} processes, {seconds:.1f} s ({written / seconds:,.0f} scenes/s): {directory}')
    return 0 if report.total == a.train else 1


def write_language_model(directory: Path, hidden: int, layers: int, heads: int) -> None:
    """A random Gemma (MQA, as PaliGemma's) of this size, saved as a local checkpoint: what
    `python -m diffzoo.bench.eramv --model VISION DIR` loads (it feeds random prompt ids, so no tokenizer)."""
    import torch
    import transformers
    torch.manual_seed(0)
    config = transformers.GemmaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=4 * hidden,
                                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=1,
                                      head_dim=hidden // heads, max_position_embeddings=1024, pad_token_id=0,
                                      bos_token_id=1, eos_token_id=2)
    transformers.GemmaForCausalLM(config).save_pretrained(directory)


def cmd_assets(a) -> int:
    from diffzoo.vlm.tiny import write_paligemma, write_vqav2_split
    out = Path(a.out_dir)
    start = time.perf_counter()
    write_paligemma(out / 'paligemma')
    write_vqav2_split(out / 'vqav2', 'train', a.vqa_train, seed=0)
    write_vqav2_split(out / 'vqav2', 'val', a.vqa_val, seed=1)
    write_language_model(out / 'lm', a.lm_hidden, a.lm_layers, a.lm_heads)
    print(f'{out}: paligemma/ (tiny, with processor), vqav2/ ({a.vqa_train} + {a.vqa_val} scenes, two questions '
          f'each), lm/ (Gemma, hidden {a.lm_hidden}, {a.lm_layers} layers) in {time.perf_counter() - start:.1f} s')
    return 0


def cmd_stage_assets(a) -> int:
    from diffzoo.vlm.tiny import write_chat_language_model, write_llava_sets
    out = Path(a.out_dir)
    start = time.perf_counter()
    write_chat_language_model(out / 'lm')
    write_llava_sets(out, a.scenes)
    print(f'{out}: lm/ (Qwen2-style, byte-level BPE), pretrain.json, qa.json, instruct.json over {a.scenes} '
          f'scenes in {time.perf_counter() - start:.1f} s')
    return 0


def cmd_vlm(a, argv) -> int:
    """`python -m diffzoo.train.vlm ARGV` (its `main`, in this process), then where it ran: CUDA's peak memory
    in this process shows that the model trained on the GPU."""
    import torch

    from diffzoo.train.vlm import main as train_vlm
    print(f'python -m diffzoo.train.vlm {" ".join(argv)}', flush=True)
    start = time.perf_counter()
    rc = train_vlm(argv)
    info = {'rc': rc, 'seconds': round(time.perf_counter() - start, 2), 'cuda_available': torch.cuda.is_available()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        info.update(device=torch.cuda.get_device_name(),
                    cuda_peak_memory_mb=round(torch.cuda.max_memory_allocated() / 2 ** 20, 1))
    else:
        info.update(device='cpu', cuda_peak_memory_mb=0.0)
    print(f'trained on {info["device"]} (CUDA peak memory {info["cuda_peak_memory_mb"]} MB)', flush=True)
    Path(a.out).write_text(json.dumps(info, indent=1) + '\n')
    return rc


BENCH_SHAPES = re.compile(r'test_bench_shapes_within_twice_sdpa\[(\d+)-(\w+)-(bf16|fp16)-(\d+)\]')


def cmd_dispatch(a) -> int:
    """Per dtype: the bench-shape cases that passed and failed (tokens, mask, batch), the most tokens up to which
    every case passed, and whether that supports the table's row (or would extend it)."""
    import xml.etree.ElementTree as ET

    import torch

    from diffzoo.layers.kernels import TRITON_ON_CUDA
    cases = {}
    for case in ET.parse(a.junit).getroot().iter('testcase'):
        found = BENCH_SHAPES.search(case.get('name', ''))
        if found:
            n, mask, dtype, batch = int(found[1]), found[2], found[3], int(found[4])
            outcome = next((child.tag for child in case if child.tag in ('failure', 'error', 'skipped')), 'passed')
            cases.setdefault(dtype, []).append({'tokens': n, 'mask': mask, 'batch': batch, 'outcome': outcome})
    table = {{torch.bfloat16: 'bf16', torch.float16: 'fp16'}[dtype]: most for dtype, most in TRITON_ON_CUDA}
    report = {}
    for dtype in ('bf16', 'fp16'):
        ran = sorted((c for c in cases.get(dtype, []) if c['outcome'] != 'skipped'),
                     key=lambda c: (c['tokens'], c['batch']))  # skipped: no GPU there, a dry run
        bad = [c for c in ran if c['outcome'] != 'passed']
        first_bad = min((c['tokens'] for c in bad), default=None)
        up_to = max((c['tokens'] for c in ran if first_bad is None or c['tokens'] < first_bad), default=0)
        row = table.get(dtype, 0)
        verdict = ('no bench-shape case ran' if not ran else
                   f'the row (to {row} tokens) is supported' if up_to >= row else
                   f'the row (to {row} tokens) is not supported: every case passed only to {up_to} tokens')
        if ran and up_to > row:
            verdict += f'; every case passed to {up_to} tokens, so the row could extend to {up_to}'
        report[dtype] = {'table_most_tokens': row, 'passed_up_to': up_to, 'supports_row': bool(ran) and up_to >= row,
                         'cases': ran, 'not_passed': bad, 'verdict': verdict}
        print(f'{dtype}: {verdict}')
    Path(a.out).write_text(json.dumps(report, indent=1) + '\n')
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = []
    if '--' in argv:
        argv, rest = argv[:argv.index('--')], argv[argv.index('--') + 1:]
    p = argparse.ArgumentParser(prog='python -m diffzoo.bench.gpu.tasks', description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest='command', required=True)
    e = sub.add_parser('env')
    e.add_argument('out')
    e.add_argument('--device', default='cuda')
    c = sub.add_parser('corpus')
    c.add_argument('out_dir')
    c.add_argument('--train', type=int, required=True)
    c.add_argument('--per-shard', type=int, required=True)
    c.add_argument('--image-size', type=int, default=128)
    c.add_argument('--seed', type=int, default=0)
    c.add_argument('--processes', type=int, default=0)
    s = sub.add_parser('assets')
    s.add_argument('out_dir')
    s.add_argument('--vqa-train', type=int, default=48)
    s.add_argument('--vqa-val', type=int, default=8)
    s.add_argument('--lm-hidden', type=int, default=256)
    s.add_argument('--lm-layers', type=int, default=8)
    s.add_argument('--lm-heads', type=int, default=4)
    g = sub.add_parser('stage-assets')
    g.add_argument('out_dir')
    g.add_argument('--scenes', type=int, default=64)
    v = sub.add_parser('vlm')
    v.add_argument('out')
    d = sub.add_parser('dispatch')
    d.add_argument('junit')
    d.add_argument('out')
    a = p.parse_args(argv)
    if a.command == 'vlm':
        return cmd_vlm(a, rest)
    return {'env': cmd_env, 'corpus': cmd_corpus, 'assets': cmd_assets, 'stage-assets': cmd_stage_assets,
            'dispatch': cmd_dispatch}[a.command](a)


if __name__ == '__main__':
    sys.exit(main())
