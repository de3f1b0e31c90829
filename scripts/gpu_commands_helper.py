"""The Python parts of scripts/gpu_commands.sh (run from the repository root, PYTHONPATH=.):

  env OUT.json [--device cuda]          environment as the bench records it, package versions, nvidia-smi,
                                        and a one-process all_reduce over NCCL (gloo on CPU)
  corpus DIR --train N --per-shard P    the synthetic corpus's train split in parallel processes: the same
                                        shards `python -m diffzoo.data synthetic` writes with that --per-shard
                                        (sample i depends only on seed, split and i), in a fraction of the time
  assets DIR                            a tiny random PaliGemma with its processor and a VQAv2-layout set
                                        (tests/vlm/models.py's, the VLM tests' own), and a
                                        random Gemma directory for `python -m diffzoo.bench.eramv --model`
  vlm OUT.json -- ARGS                  `python -m diffzoo.train.vlm ARGS` (its main, in this process), then the
                                        device it trained on and CUDA's peak memory, to OUT.json
  summary WORK OUT.json                 commands.json from the steps' records and logs, and a table
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path


# ----------------------------------------------------------------------------------------------- env
PACKAGES = ('torch', 'triton', 'torchvision', 'timm', 'open_clip_torch', 'transformers', 'peft', 'accelerate',
            'webdataset', 'braceexpand', 'pandas', 'tensorboard', 'matplotlib', 'pyyaml', 'safetensors',
            'huggingface_hub', 'tokenizers', 'ftfy', 'regex', 'numpy', 'pillow', 'pyarrow')


def cmd_env(a) -> int:
    from importlib import metadata
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    import torch
    import torch.distributed as dist

    from diffzoo.bench.measure import environment
    device = torch.device(a.device)
    out = {'packages': versions, 'missing_packages': [k for k, v in versions.items() if v is None],
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
    try:
        smi = subprocess.run(['nvidia-smi', '--query-gpu=name,memory.total,driver_version,clocks.max.sm,power.limit',
                              '--format=csv,noheader'], capture_output=True, text=True, timeout=10)
        out['nvidia_smi'] = smi.stdout.strip() or smi.stderr.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        out['nvidia_smi'] = f'unavailable: {exc}'
    # one process, world size 1: NCCL (gloo on CPU) initialised and an all_reduce checked
    backend = 'nccl' if device.type == 'cuda' else 'gloo'
    check = {'backend': backend}
    start = time.perf_counter()
    try:
        import socket
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
    except Exception as exc:  # recorded, not fatal: the other steps still run
        check.update(ok=False, error=f'{type(exc).__name__}: {exc}'[:500])
    check['seconds'] = round(time.perf_counter() - start, 2)
    out['collective_check'] = check
    Path(a.out).write_text(json.dumps(out, indent=1) + '\n')
    env = out['environment']
    print(f'device {env["device"]}, torch {env["torch"]}, cuda {env.get("cuda")}, {env["cpu_count"]} CPUs; '
          f'{backend} all_reduce {"ok" if check["ok"] else "FAILED"} ({check["seconds"]} s)')
    if out['missing_packages']:
        print(f'not installed: {", ".join(out["missing_packages"])}')
    return 0 if check['ok'] else 1


# -------------------------------------------------------------------------------------------- corpus
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


# -------------------------------------------------------------------------------------------- assets
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
    from tests.vlm.models import write_paligemma, write_vqav2_split  # the VLM tests' tiny PaliGemma and VQAv2 set
    out = Path(a.out_dir)
    start = time.perf_counter()
    write_paligemma(out / 'paligemma')
    write_vqav2_split(out / 'vqav2', 'train', a.vqa_train, seed=0)
    write_vqav2_split(out / 'vqav2', 'val', a.vqa_val, seed=1)
    write_language_model(out / 'lm', a.lm_hidden, a.lm_layers, a.lm_heads)
    print(f'{out}: paligemma/ (tiny, with processor), vqav2/ ({a.vqa_train} + {a.vqa_val} scenes, two questions '
          f'each), lm/ (Gemma, hidden {a.lm_hidden}, {a.lm_layers} layers) in {time.perf_counter() - start:.1f} s')
    return 0


# ----------------------------------------------------------------------------------------------- vlm
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


# ------------------------------------------------------------------------------------------- summary
RUNNING_RE = re.compile(r'Running (with a single process|in distributed mode with multiple processes)\. '
                        r'Device:? ([\w:]+)')
STEP_RE = re.compile(r'Train Epoch: \d+ \[.*?\] Data \(t\): ([\d.]+) Batch \(t\): ([\d.]+), '
                     r'([\d.e+-]+)/s, ([\d.e+-]+)/s/gpu')  # diffzoo.bench.end_to_end.STEP_RE


def _read(path: Path) -> str:
    try:
        return path.read_text(errors='replace')
    except OSError:
        return ''


def _train_run(log: Path, warmup: int) -> dict:
    """What a train.sh run's out.log says: device, process group, steps and images/s (the bench's way)."""
    text = _read(log)
    if not text:
        return {'log': str(log), 'found': False}
    running = RUNNING_RE.search(text)
    row = {'log': str(log), 'found': True, 'device': running[2] if running else None,
           'process_group': None if running is None else ('none (one process)' if 'single' in running[1] else 'yes')}
    backend = re.search(r'dist_backend: (\S+)', text)
    row['dist_backend'] = backend[1] if backend else None
    try:
        from diffzoo.bench.end_to_end import summarise
        row.update(summarise(log.parent.name, log, warmup))
    except Exception as exc:  # noqa: BLE001  too few steps, or the bench module unavailable: the bare figures
        steps = [float(m[4]) for m in STEP_RE.finditer(text)]
        row.update(steps=len(steps), summary_error=f'{type(exc).__name__}: {exc}'[:300])
        if steps[warmup:]:
            timed = sorted(steps[warmup:])
            row['images_per_s_per_gpu'] = {'median': timed[len(timed) // 2], 'n': len(timed)}
    return row


def cmd_summary(a) -> int:
    work, out = Path(a.work), Path(a.out)
    steps = []
    for line in _read(work / 'steps.tsv').splitlines():
        name, rc, seconds, limit, what = (line.split('\t') + [''] * 5)[:5]
        rc = None if rc == 'skipped' else int(rc)
        steps.append({'step': name, 'rc': rc, 'ok': rc == 0, 'timed_out': rc in (124, 137),
                      'seconds': float(seconds) if seconds else None, 'timeout_s': int(limit) if limit else None,
                      'command': what})
    env = json.loads(_read(work / 'env.json') or '{}')
    result = {'status': 'complete', 'device': a.device, 'budget_s': a.budget, 'total_s': a.total,
              'settings': dict(kv.split('=', 1) for kv in a.setting), 'steps': steps,
              'environment': env.get('environment'), 'packages': env.get('packages'),
              'missing_packages': env.get('missing_packages'), 'nvidia_smi': env.get('nvidia_smi'),
              'cuda_available': env.get('cuda_available'), 'dev_shm_gb': env.get('dev_shm_gb'),
              'collective_check': env.get('collective_check')}

    # 1. train.sh diffclip-tiny
    tiny = _train_run(work / 'runs' / 'diffclip-tiny' / 'out.log', warmup=1)
    stdout = _read(work / '1-train-tiny.log')
    tiny['nccl_lines'] = len(re.findall(r'NCCL INFO', stdout))
    tiny['nccl_used'] = tiny['nccl_lines'] > 0
    if not tiny['nccl_used'] and (tiny.get('process_group') or '').startswith('none'):
        tiny['nccl_note'] = ('one process: open_clip_train creates no process group when WORLD_SIZE is 1 '
                             '(open_clip_train.distributed.is_using_distributed), so no NCCL communicator exists; '
                             'collective_check shows NCCL itself working on this machine')
    result['train_tiny'] = tiny

    # 2. B/16 recipes and the ratio, as diffzoo.bench.end_to_end reports it
    rows = [_train_run(work / 'runs-b16' / r / 'out.log', warmup=a.warmup) for r in a.b16_recipes]
    ratio = None
    try:
        ratio = rows[1]['images_per_s_per_gpu']['median'] / rows[0]['images_per_s_per_gpu']['median']
    except (KeyError, TypeError, ZeroDivisionError, IndexError):
        pass
    result['train_b16'] = {'recipes': a.b16_recipes, 'rows': rows, 'train_time_ratio': ratio,
                           'corpus': _read(work / '2-corpus.log').strip().splitlines()[-1:]}

    # 3. VLM stage
    vlm_dir = work / 'vlm' / a.vlm_recipe
    vlm = {'recipe': a.vlm_recipe, 'run_dir': str(vlm_dir),
           'results': json.loads(_read(vlm_dir / 'results.json') or 'null'),
           'log': [json.loads(l) for l in _read(vlm_dir / 'log.jsonl').splitlines() if l.strip()]}
    vlm['ran_on'] = json.loads(_read(work / 'vlm-device.json') or 'null')
    settings = json.loads(_read(vlm_dir / 'recipe.json') or '{}')
    vlm['settings'] = {k: settings.get(k) for k in ('device', 'precision', 'batch_size', 'max_steps', 'differential',
                                                    'lora')}
    result['vlm'] = vlm

    # 4. eRAM-V
    result['eramv'] = json.loads(_read(work / 'eramv.json') or 'null')
    out.write_text(json.dumps(result, indent=1, default=str) + '\n')

    # the table
    def fmt(x, spec='.1f', none='-'):
        return none if x is None else format(x, spec)

    results = vlm['results'] or {}
    check = env.get('collective_check') or {}
    notes = {
        '0-env': (f'{(env.get("environment") or {}).get("device")}, {check.get("backend")} all_reduce '
                  f'{"ok" if check.get("ok") else "FAILED"}, /dev/shm {env.get("dev_shm_gb")} GB'),
        '1-train-tiny': (f'{tiny.get("steps", 0)} steps on {tiny.get("device")}, process group '
                         f'{tiny.get("process_group")}, NCCL {"yes" if tiny.get("nccl_used") else "no"}'),
        '3-vlm': (f'{results.get("steps")} steps on {(vlm["ran_on"] or {}).get("device")} '
                  f'({vlm["settings"].get("precision")}), final loss {fmt(results.get("final_loss"), ".3f")}, '
                  f'VQA accuracy {fmt(results.get("vqa_accuracy"), ".1f")} (random model)'),
    }
    for name in ('1-corpus-tiny', '2-corpus', '3-assets'):
        lines = [line.strip() for line in _read(work / f'{name}.log').splitlines()
                 if re.search(r'train: [\d,]+ scenes$', line) or name != '1-corpus-tiny' and line.strip()]
        notes[name] = lines[-1][:120] if lines else ''
    for recipe, row in zip(a.b16_recipes, rows):
        ips = (row.get('images_per_s_per_gpu') or {}).get('median')
        share = (row.get('data_share') or {}).get('median')
        notes[f'2-train-{recipe}'] = (f'{row.get("steps", 0)} steps on {row.get("device")}, {fmt(ips)} images/s/gpu '
                                      f'(median), data wait {fmt(share * 100 if share is not None else None)} %')
    e = result['eramv'] or {}
    if e.get('full') and e.get('eramv'):
        notes['4-eramv'] = ' | '.join(
            f'{k}: TTFT {fmt(e[k]["ttft_s"] * 1e3 if "ttft_s" in e[k] else None, ".1f")} ms, '
            f'{fmt(e[k].get("tokens_per_s"))} tok/s, x FLOPs {fmt(e[k].get("flops_ratio"), ".2f")}'
            for k in ('full', 'eramv'))
    width = max([len(s['step']) for s in steps] + [4]) + 2
    print(f'\n{"step":<{width}}{"rc":>5}{"s":>8}  result')
    for s in steps:
        rc = 'skip' if s['rc'] is None else str(s['rc'])
        print(f'{s["step"]:<{width}}{rc:>5}{fmt(s["seconds"]):>8}  {notes.get(s["step"], "")}')
    if ratio is not None:
        print(f'B/16 train-time ratio (baseline images/s / differential images/s, medians): {ratio:.3f}')
    print(f'total {fmt(a.total)} s of a {a.budget} s budget; failed or skipped: '
          f'{", ".join(s["step"] for s in steps if not s["ok"]) or "none"}')
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = []
    if '--' in argv:
        argv, rest = argv[:argv.index('--')], argv[argv.index('--') + 1:]
    p = argparse.ArgumentParser(prog='scripts/gpu_commands_helper.py', description=__doc__,
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
    v = sub.add_parser('vlm')
    v.add_argument('out')
    m = sub.add_parser('summary')
    m.add_argument('work')
    m.add_argument('out')
    m.add_argument('--device', default='cuda')
    m.add_argument('--b16-recipes', nargs=2, required=True)
    m.add_argument('--vlm-recipe', required=True)
    m.add_argument('--warmup', type=int, default=3)
    m.add_argument('--budget', type=int, default=0)
    m.add_argument('--total', type=float, default=None)
    m.add_argument('--setting', action='append', default=[], metavar='KEY=VALUE', help='recorded as given')
    a = p.parse_args(argv)
    if a.command == 'vlm':
        return cmd_vlm(a, rest)
    return {'env': cmd_env, 'corpus': cmd_corpus, 'assets': cmd_assets, 'summary': cmd_summary}[a.command](a)


if __name__ == '__main__':
    sys.exit(main())
