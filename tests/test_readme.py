"""The examples of README.md and docs/*.md, run: every `python -m diffzoo…` command they name answers --help
and takes every flag they give it, the shell commands that run offline run for real (the quick start as a
whole in tests/test_demo.py), and their Python blocks run (with the substitutions listed below, on CPU, nothing downloaded). An
example that needs weights, a dataset or a GPU is in SKIPPED with the reason; a new example that is in
neither list fails the test until it is placed."""
import contextlib
import os
import re
import subprocess
import sys

import pytest

from tests.pages import README, ROOT, TEXTS, blocks, commands

# shell commands run as written (from a scratch directory)
RUN = {
    'python -m diffzoo.train recipes': 'clip-b16-baseline-cc3m',
    'python -m diffzoo.train.vlm recipes': 'paligemma-3b-vqav2-diff',
    'python -m diffzoo.bench.gpu --help': 'the project\'s GPU checks in one time-boxed run',
    'python -m diffzoo.bench.gpu OUT --plan': 'total      600 s',
}
WEIGHTS, DATA, GPU = 'needs pretrained weights', 'needs a dataset', 'needs a GPU'
QUICK = 'the quick start, run as a whole by tests/test_demo.py::test_the_quick_start_runs_as_written'
SKIPPED = {
    'make demo': 'trains two models for minutes (tests/test_demo.py runs the demo on a small corpus)',
    'make test': 'the whole test suite',
    'python -m diffzoo.convert official-diffclip checkpoint_best.pt diffclip_b16_cc12m.safetensors':
        f'{WEIGHTS}: the official checkpoint (tests/clip/test_official_checkpoint.py converts a synthetic one)',
    'python -m diffzoo.convert official-diffclip checkpoint_best.pt diffclip-b16-cc12m/': f'{WEIGHTS} (as above)',
    'python -m diffzoo.convert publish diffclip-b16-cc12m/ --repo me/diffclip-b16-cc12m':
        'uploads to the Hugging Face hub',
    'scripts/download_cc3m.sh Train_GCC-training.tsv /data/cc3m': f'{DATA}: downloads CC3M',
    'python -m diffzoo.data check /data/cc3m': f'{DATA}: CC3M shards',
    'python -m diffzoo.data retry /data/cc3m failed.tsv': f'{DATA}: a CC3M download',
    'scripts/download_cc3m.sh failed.tsv /data/cc3m --extend': f'{DATA}: downloads CC3M',
    'export CC3M_SHARDS=/data/cc3m': 'sets the variable the next command reads',
    'scripts/train.sh diffclip-b16-cc3m': f'{GPU} and {DATA} (CC3M)',
    'torchrun --nproc-per-node 8 scripts/train.sh -- diffclip-b16-cc3m --logs /runs':
        f'8 GPUs and {DATA} (CC3M); tests/train/test_train_sh.py runs the form on 2 CPU processes',
    'scripts/train.sh clip-b16-baseline-cc3m --max_batch_per_gpu 256 -- --grad-checkpointing':
        f'{GPU} and {DATA} (CC3M)',
    'python -m diffzoo.train plot-lambda runs/diffclip-b16-cc3m': 'needs a training run (runs/diffclip-b16-cc3m)',
    'python -m diffzoo.eval --model diffclip-b16,runs/diffclip-b16-cc3m/checkpoints/epoch_40.pt '
    '--model clip-b16-baseline,runs/clip-b16-baseline-cc3m/checkpoints/epoch_40.pt --dataset imagenet1k '
    "--dataset cifar10 --dataset wds/mscoco_captions --dataset-root '/data/{dataset}'":
        f'needs trained checkpoints and {DATA}s (ImageNet, CIFAR-10, COCO)',
    'python -m diffzoo.eval --run-dir demo/runs/diffclip-tiny-4000x4 --every-checkpoint --dataset synthetic '
    '--dataset-root demo/data':
        '`make demo`\'s corpus and DiffCLIP run; tests/test_demo.py::test_the_quick_start_runs_as_written runs it on '
        'its smaller demo',
    'python -m diffzoo.analysis.overlays office.jpg --model diffclip-b16,cc3m --model clip-b16-baseline,cc3m '
    '--query mug --query lamp --entropy': f'{WEIGHTS} (cc3m) and an image',
    'python -m diffzoo.train.vlm --recipe paligemma-3b-vqav2-diff': f'{WEIGHTS} (PaliGemma), {DATA} (VQAv2), {GPU}',
    'torchrun --nproc-per-node 8 -m diffzoo.train.vlm --recipe paligemma-3b-vqav2-baseline --data.fraction 1':
        f'8 GPUs, {WEIGHTS} (PaliGemma), {DATA} (VQAv2)',
    'python -m diffzoo.train.vlm --recipe diffclip-b16-qwen2.5-0.5b-pretrain':
        f'{WEIGHTS} (DiffCLIP, Qwen2.5-0.5B), {DATA} (LLaVA 558K), {GPU} (tests/vlm/test_stages.py runs a chain)',
    'python -m diffzoo.train.vlm chain diffclip-b16-qwen2.5-0.5b-pretrain diffclip-b16-qwen2.5-0.5b-finetune':
        f'{WEIGHTS} (DiffCLIP, Qwen2.5-0.5B), {DATA} (LLaVA 558K and COCO instructions), {GPU} (tests/vlm/test_stages.py '
        f'runs a chain)',
    'python -m diffzoo.bench.eramv': 'a minute of FLOP counting on the meta device (tests/bench tests its tables)',
    'python -m diffzoo.train.vlm --recipe diffclip-b16-qwen2.5-0.5b-finetune':
        f'{WEIGHTS}, {DATA} (LLaVA COCO instructions), {GPU}, the pretrain stage',
    'torchrun --nproc-per-node 8 -m diffzoo.train.vlm chain eramv-vicuna-7b-pretrain eramv-vicuna-7b-continue '
    'eramv-vicuna-7b-finetune': f'8 GPUs, {WEIGHTS} (CLIP ViT-L/14-336, Vicuna-7B), {DATA} (558K, the 707K QA mix, '
                                f'665K); tests/vlm/test_stages.py runs a chain',
    'python -m diffzoo.data llava-qa /data/eramv_qa.json --image-root /data --vqav2 /data/vqav2 --gqa /data/gqa '
    '--chartqa /data/chartqa': f'{DATA}s (VQAv2, GQA, ChartQA; tests/data/test_llava_qa.py converts all seven)',
    'python -m diffzoo.eval.lmm --model diffclip-b16-qwen2.5-0.5b-finetune --stage '
    'runs/vlm/diffclip-b16-qwen2.5-0.5b-finetune --task pope --task mme --data /data/bench --out bench/diffclip':
        f'a trained stage and {DATA}s (POPE, MME); tests/eval/test_lmm.py runs every task on a model',
    'lmms-eval --model diffzoo --model_args recipe=RECIPE,stage=RUN --tasks pope,mme --batch_size 8 '
    '--output_path bench/lmms --log_samples':
        f'a trained stage and lmms-eval\'s {DATA}s from the hub; tests/eval/test_lmms_eval.py runs the command on a '
        f'local POPE task',
    'python -m diffzoo.eval.vqa --predictions val_answers.json --annotations v2_mscoco_val2014_annotations.json':
        f'{DATA}: VQAv2 annotations',
    'python -m diffzoo.eval.needle build --source val2014 --out needle/2x2 --m 1 --n 2 --size 224':
        f'{DATA}: COCO val2014',
    'python -m diffzoo.eval.needle run --haystacks needle/2x2 --recipe paligemma-3b-vqav2-diff '
    '--adapter runs/vlm/paligemma-3b-vqav2-diff/adapter --protocol two_step --out needle/2x2/diff':
        f'{WEIGHTS} (PaliGemma and a trained adapter), haystacks',
    'python -m diffzoo.analysis --model paligemma-3b-vqav2-diff --adapter runs/vlm/paligemma-3b-vqav2-diff/adapter '
    '--model paligemma-3b-vqav2-baseline --images val_images/ --prompts "answer en what is on the table?" '
    '--out analysis/': f'{WEIGHTS} (PaliGemma and a trained adapter), images',
    'python -m diffzoo.analysis --model diffclip-b16,cc3m --model clip-b16-baseline,cc3m --images val_images/':
        f'{WEIGHTS} (cc3m), images',
    'python -m diffzoo.bench --device cuda': GPU,
    'python -m diffzoo.bench --device cpu --sections model layer': 'minutes of timing (--smoke runs in tests/bench)',
    'python -m diffzoo.bench --device cuda --sections model --compile --model diffclip-b16 clip-b16-baseline': GPU,
    'python -m diffzoo.bench --device cuda --split-kernel triton --model diffclip-b16 diffclip-b16@two_calls '
    'clip-b16-baseline': GPU,
    'python -m diffzoo.bench.tune --write': GPU,
    'python -m diffzoo.bench.gpu OUT': GPU,
    'python -m diffzoo.bench.gpu OUT bench compile': GPU,
    'python -m diffzoo.bench.gpu OUT data': GPU,
    'python -m diffzoo.bench.data_profile --out data_profile.json': GPU + ' (its default device; '
                                                                     'tests/bench/test_data_profile.py runs it on the CPU)',
    'python -m diffzoo.bench.gpu OUT tune extras stages': GPU,
    'python -m pip install -q --no-index --no-deps --target /tmp/site wheels/*.whl':
        'wheels of open_clip and webdataset downloaded for a GPU machine',
    'PYTHONPATH=/tmp/site python -m diffzoo.bench.gpu OUT': GPU,
    'python -m diffzoo.bench.gpu OUT commands --b16-backends device open_clip --limit commands=300': GPU,
    'python -m diffzoo.bench.gpu OUT --device cpu': 'every step at tiny sizes, ~20 minutes on 2 cores '
                                                      '(tests/bench/test_gpu_check.py runs the dry run of cheap steps)',
    'source .venv/bin/activate': 'activates the environment make built (the quick start test runs the rest in it)',
    'python -m diffzoo.demo --train 1000 --epochs 3 --out quick': QUICK,
    'scripts/train.sh diffclip-tiny --train_data quick/data/train --epochs 4 --name first': QUICK,
    'python -m diffzoo.eval --run-dir runs/first --dataset synthetic --dataset-root quick/data': QUICK,
    'python -m diffzoo.train plot-lambda runs/first': QUICK,
    'LAION_VIT_B16=/models/open_clip_pytorch_model.bin CC3M_SHARDS=/data/cc3m scripts/train.sh '
    'vit-b16-laion2b-diff-duplicate-cc3m': f'{GPU}, {WEIGHTS} (LAION ViT-B-16) and {DATA} (CC3M); '
                                           f'tests/train/test_recipe.py resolves the recipe',
}

# Python blocks, by the README section they stand in: (code run before the block, {text: replacement}), or a reason
PYTHON = {
    'In Python': ('', {"pretrained='cc12m'": 'pretrained=None', 'pretrained=True': 'pretrained=False'}),
    'open_clip': ("from PIL import Image\nimage = Image.new('RGB', (320, 240), 'gray')\n",
                  {"pretrained='cc12m'": 'pretrained=None'}),  # the cc12m weights are downloaded: random init
    'timm': ("import timm, torch, diffzoo\n"  # checkpoint_path= reads a local file: a timm B/16 with a 512-class head
             "torch.save(timm.create_model('vit_diff_base_patch16_224', num_classes=512).state_dict(), "
             "'checkpoint_best.pt')\n",
             {'pretrained=True': 'pretrained=False'}),  # DiffCLIP's weights are downloaded: random init
    'Any timm or open_clip model, made differential': (
        '', {"pretrained=True": 'pretrained=False', "pretrained='laion2b_s34b_b88k'": 'pretrained=None'}),
    'Vision-language models: Differential PaliGemma':
        f'{WEIGHTS}: PaliGemma-3B, a DiffCLIP checkpoint and a language model folder',
    'Saving and reloading a differential model or its adapter': (
        # a tiny Llama stands in for the model, its LoRA fine-tune and the pretrained base the block names
        "import transformers\nfrom diffzoo.vlm import add_lora, differentialize\n"
        "config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, "
        "num_attention_heads=4, num_key_value_heads=2)\n"
        "base = transformers.LlamaForCausalLM(config)\nbase.save_pretrained('base')\n"
        "model = differentialize(transformers.LlamaForCausalLM.from_pretrained('base'), variant='split')\n"
        "peft_model = add_lora(differentialize(transformers.LlamaForCausalLM.from_pretrained('base'), "
        "variant='split'), r=4, alpha=8)\n", {}),
    'The attention layer': ("import open_clip, torch, diffzoo\nmodel = open_clip.create_model('diffclip-tiny')\n"
                            'images = torch.randn(2, 3, 64, 64)\n', {}),
}


def _run(argv, cwd, timeout=300):
    env = dict(os.environ, HF_HUB_OFFLINE='1')  # nothing is downloaded
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)


def test_every_shell_command_is_run_or_skipped_with_a_reason():
    found = commands()
    assert found, 'no ```bash blocks found in README.md'
    unplaced = [c for c in found if c not in RUN and c not in SKIPPED]
    assert not unplaced, f'README commands in neither RUN nor SKIPPED of {__file__}: {unplaced}'
    assert not (set(RUN) | set(SKIPPED)) - set(found), 'RUN/SKIPPED name commands the README no longer has'
    assert all(SKIPPED.values())


def test_every_link_between_the_pages_leads_to_a_file():
    """A relative link, read from the page's own folder as a Markdown viewer reads it (docs/x.md links SCALING.md,
    not docs/SCALING.md), names a file or folder of the repository."""
    dead = [f'{page}: ({target})' for page, text in TEXTS.items()
            for target in re.findall(r'\]\(([^)#\s]+)', text)
            if '://' not in target and not (ROOT / page).parent.joinpath(target).exists()]
    assert not dead, dead


def test_every_python_block_is_run_or_skipped_with_a_reason():
    headings = [heading for heading, _ in blocks('python')]
    assert headings and set(headings) == set(PYTHON), (headings, list(PYTHON))


# every `python -m diffzoo.X` (and `torchrun … -m diffzoo.X`) the README names; `python -m diffzoo.…` is prose
NAMED = sorted(set(re.findall(r'(?:python|torchrun[^`\n]*?) -m (diffzoo(?:\.\w+)+)', README)))


# answered in this process: their commands run as processes elsewhere (tests/eval/test_clip_benchmark.py), and
# clip_benchmark's import alone is most of a process's 10 s
IN_PROCESS = {'diffzoo.clip_benchmark'}


@pytest.mark.slow
@pytest.mark.parametrize('module', NAMED)
def test_every_command_named_answers_help(module, tmp_path, monkeypatch, capsys, commands):
    if module in IN_PROCESS:
        import importlib
        monkeypatch.setattr(sys, 'argv', [module, '--help'])
        with pytest.raises(SystemExit) as done:
            importlib.import_module(module).main()
        out = capsys.readouterr().out
        assert done.value.code in (0, None) and out.startswith('usage: '), out[:300]
        return
    done = commands.run(module, ['--help'], tmp_path)
    assert done.returncode == 0 and done.stdout.startswith('usage: '), (done.stdout[:300], done.stderr[-2000:])


@pytest.mark.slow
@pytest.mark.parametrize('command', list(RUN))
def test_shell_command_runs(command, tmp_path, commands):
    argv = command.split()
    if argv[:3] == ['python', '-m', argv[2]] and argv[2].startswith('diffzoo'):
        done = commands.run(argv[2], argv[3:], tmp_path)
    else:
        done = _run([sys.executable, *argv[1:]] if argv[0] == 'python' else argv, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert RUN[command] in done.stdout, done.stdout[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize('heading', [h for h, v in PYTHON.items() if isinstance(v, tuple)])
def test_python_block_runs(heading, tmp_path):
    prelude, substitutions = PYTHON[heading]
    code = next(code for h, code in blocks('python') if h == heading)
    for text, replacement in substitutions.items():
        assert text in code, f'README block under "{heading}" no longer has {text!r}'
        code = code.replace(text, replacement)
    with contextlib.chdir(tmp_path):  # in this process (diffzoo imported, HF_HUB_OFFLINE set by conftest)
        exec(compile(prelude + code, f'README.md: {heading}', 'exec'), {'__name__': '__readme__'})


def _documented_flags():
    """{(module, subcommand or None): flags} for every `python -m diffzoo.X [SUB] … --flag` and
    `scripts/train.sh RECIPE … --flag` in the pages (flags after a lone -- are open_clip_train's own)."""
    found = {}
    for command in commands():
        argv = [a for a in command.split() if not re.match(r'^[A-Z_0-9]+=', a)]  # VAR=value prefixes
        argv = argv[:argv.index('--')] if '--' in argv else argv
        if argv and argv[0].endswith('train.sh'):
            module, rest = 'diffzoo.train', argv[2:]
        elif '-m' in argv and argv[argv.index('-m') + 1].startswith('diffzoo'):
            module, rest = argv[argv.index('-m') + 1], argv[argv.index('-m') + 2:]
        else:
            continue
        sub = rest[0] if rest and not rest[0].startswith('-') and module != 'diffzoo.train' else None
        if module == 'diffzoo.train' and rest and rest[0] in ('plot-lambda', 'recipes'):
            sub = rest[0]
        flags = {a.split('=')[0] for a in rest if a.startswith('--')}
        found.setdefault((module, sub), set()).update(flags)
    return found


def _recipe_key(module: str, flag: str) -> bool:
    """A `--key` override of a diffzoo.train / diffzoo.train.vlm recipe (dashes or underscores, dotted)."""
    key = flag[2:].replace('-', '_').split('.')[0]
    if module == 'diffzoo.train':
        from diffzoo.train.recipe import valid_keys
        return key in valid_keys() or key == 'recipe'
    if module == 'diffzoo.train.vlm':
        from diffzoo.vlm.recipe import VLM_RECIPE
        return key in VLM_RECIPE.keys or key == 'recipe'
    return False


@pytest.mark.slow
def test_every_documented_flag_is_taken_by_its_command(tmp_path, commands):
    """A flag the pages give a command is in that command's --help (or is a recipe key of the trainers):
    renaming or dropping a documented flag fails here."""
    missing = []
    for (module, sub), flags in sorted(_documented_flags().items(), key=str):
        done = commands.run(module, [*([sub] if sub else []), '--help'], tmp_path)
        if done.returncode and sub:  # a positional that is not a subcommand with a help of its own (chain A B)
            done = commands.run(module, ['--help'], tmp_path)
        assert done.returncode == 0, (module, sub, done.stderr[-1500:])
        missing += [f'{module}{" " + sub if sub else ""} {f}' for f in sorted(flags)
                    if not re.search(re.escape(f) + r'\b', done.stdout) and not _recipe_key(module, f)]
    assert not missing, f'documented flags the commands do not take: {missing}'


# `make` installs diffzoo editable through setuptools' import hook, which Python consults after the folders of
# sys.path: a folder named diffzoo in the current directory (the clone itself, seen from the folder holding it) wins
# as an empty namespace package (pypa/setuptools#3557); an editable install as a sys.path entry
# (`pip install -e . --config-settings editable_mode=compat`) or a regular one does not have the problem
EDITABLE_HOOK = any(name.startswith('__editable___diffzoo') for name in sys.modules)


@pytest.mark.slow
@pytest.mark.xfail(EDITABLE_HOOK, strict=True, reason='setuptools\' editable hook comes after the current directory '
                   '(pypa/setuptools#3557); README.md, "In Python", says so')
def test_import_diffzoo_from_the_folder_that_holds_the_clone(tmp_path):
    """Python started in the folder holding the clone, named diffzoo as `git clone …/diffzoo` names it:
    `import diffzoo` is the installed package and open_clip knows its models."""
    (tmp_path / 'diffzoo').symlink_to(ROOT, target_is_directory=True)
    # the child stops at the first wrong answer: a namespace package (no __file__) registers nothing, and open_clip's
    # import would only take seconds to show it
    done = _run([sys.executable, '-c', 'import diffzoo; print(diffzoo.__file__); assert diffzoo.__file__; '
                 'import open_clip; print("diffclip-tiny" in open_clip.list_models())'], tmp_path)
    location, *registered = done.stdout.split()
    assert location.endswith(os.path.join('diffzoo', '__init__.py')), (location, done.stderr[-2000:])
    assert done.returncode == 0 and registered == ['True'], done.stdout + done.stderr[-2000:]


def test_the_demo_run_the_pages_name_is_where_make_demo_writes_it(monkeypatch):
    """`make demo` (python -m diffzoo.demo, its defaults) writes OUT/runs/MODEL-SCENESxEPOCHS and OUT/data: the
    run and corpus docs/evaluation.md evaluates (the quick start test runs that command on a smaller demo)."""
    import logging

    from diffzoo import demo, demo_steps
    seen = []
    monkeypatch.setattr(demo_steps, 'run', lambda args: seen.append(args) or 0)
    level = logging.getLogger().level
    try:
        assert demo.main([]) == 0
    finally:
        logging.getLogger().setLevel(level)
    args = seen[0]
    run_dir, data = f'{args.out}/runs/{args.model}-{args.train}x{args.epochs}', f'{args.out}/data'
    page = TEXTS['docs/evaluation.md']
    assert f'--run-dir {run_dir} ' in page and f'--dataset-root {data}' in page
