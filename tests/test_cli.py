"""One CLI convention (STYLE rule 13): every console script answers --help without importing the libraries of its
work (open_clip_train's loop, webdataset, img2dataset, CLIP_benchmark, lmms-eval, peft) beyond what
`import diffzoo` imports, the libraries it registers its models with; and it registers them whichever library is
imported first."""
import multiprocessing
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = tomllib.loads((ROOT / 'pyproject.toml').read_text())['project']['scripts']
REGISTERS_WITH = ('torch', 'timm', 'open_clip')  # what `import diffzoo` imports (transformers: where installed)
HEAVY = ('open_clip_train.main', 'open_clip_train.data', 'webdataset', 'img2dataset', 'clip_benchmark', 'lmms_eval',
         'peft')  # (open_clip_train.params, its parser, reads the recipes' flags)
# still import a heavy library before their --help answers
HEAVY_AT_IMPORT = {
    'diffzoo-clip-benchmark': "the help is CLIP_benchmark's own parser, built in clip_benchmark.cli.get_parser_args "
                              '(choices from clip_benchmark.models); clip_benchmark.cli imports its datasets and models '
                              'at its top, so only a copy of that parser could answer without them',
}


def _module(entry_point: str) -> str:
    module = entry_point.split(':')[0]
    return module[:-len('.__main__')] if module.endswith('.__main__') else module


def test_the_scripts_known_to_import_a_heavy_library_are_scripts():
    assert set(HEAVY_AT_IMPORT) <= set(SCRIPTS)  # their --help runs in tests/test_readme.py, heavy as it is


@pytest.mark.slow
@pytest.mark.parametrize('script', [name for name in SCRIPTS if name not in HEAVY_AT_IMPORT])
def test_help_imports_no_heavy_library(script, commands):
    module = _module(SCRIPTS[script])
    done = commands.run(module, ['--help'], watch=HEAVY)  # a process of its own, forked after `import diffzoo`
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith('usage: '), done.stdout[:500]
    assert done.imported == [], f'python -m {module} --help imported {done.imported}'


@pytest.mark.slow
def test_import_diffzoo_imports_the_libraries_it_registers_with_and_no_other_heavy_one():
    libraries = (*REGISTERS_WITH, *HEAVY)
    code = f'import sys, diffzoo\nprint(sorted(m for m in {libraries!r} if m in sys.modules))'
    done = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=300, check=True)
    assert done.stdout.strip() == str(sorted(REGISTERS_WITH))


REGISTERED = ("timm.create_model('vit_diff_micro_patch8_64')\n"
              "model = open_clip.create_model('diffclip-tiny')\n"
              "assert isinstance(model.visual.trunk.blocks[0].attn, diffzoo.DifferentialAttention)\n"
              "assert not [f for f in sys.meta_path if type(f).__module__.startswith('diffzoo')]  # no import hook\n")


IMPORT_ORDERS = [
    'import diffzoo\nimport timm\nimport open_clip',
    'import timm\nimport diffzoo\nimport open_clip',
    'import timm, open_clip, diffzoo',  # both already imported (importing open_clip first imports timm too)
    'import diffzoo.eval.models\nimport timm, open_clip',  # a diffzoo module first
]
# what each import-order process starts with: the libraries below timm and open_clip (the seconds of their import),
# and this module, which holds the function each process runs (with pytest, which it imports)
PRELOADED = ['torch', 'torchvision', 'torchvision.models.feature_extraction', __name__]


def _import_in_order(imports: str) -> str:
    """In a fresh process: `imports`, then `import diffzoo`, then the models of both libraries built."""
    imported = sorted({m.split('.')[0] for m in sys.modules} & {'timm', 'open_clip', 'transformers', 'diffzoo'})
    assert not imported, f'the process started with {imported} imported'
    exec(f'import sys\n{imports}\nimport diffzoo\n{REGISTERED}', {'__name__': '__import_order__'})
    return 'registered'


@pytest.fixture(scope='module')
def import_orders():
    """A fresh process for each import order, all started at once, each forked from a server that has imported
    only PRELOADED (multiprocessing's forkserver); {imports: its result}."""
    context = multiprocessing.get_context('forkserver')
    context.set_forkserver_preload(PRELOADED)
    with context.Pool(len(IMPORT_ORDERS), maxtasksperchild=1) as pool:  # one order per process
        yield {imports: pool.apply_async(_import_in_order, (imports,)) for imports in IMPORT_ORDERS}


@pytest.mark.slow
@pytest.mark.parametrize('imports', IMPORT_ORDERS)
def test_import_diffzoo_registers_the_models_in_either_order(import_orders, imports):
    assert import_orders[imports].get(timeout=300) == 'registered'


def test_public_names():
    import diffzoo
    from diffzoo import DifferentialAttention, capture_attention_maps, diff_attn_layer, layers, models
    assert DifferentialAttention is layers.DifferentialAttention and models.vit_diff
    assert capture_attention_maps is layers.capture_attention_maps and diff_attn_layer is layers.diff_attn_layer
    assert set(diffzoo.__all__) <= set(dir(diffzoo))
    with pytest.raises(AttributeError, match='no attribute'):
        diffzoo.no_such_name


@pytest.mark.parametrize('module, argv, message', [
    ('diffzoo.analysis', ['--images', 'x'], 'pass --model once'),
    ('diffzoo.bench', ['--reps', 'many'], "--reps: invalid int value: 'many'"),
    ('diffzoo.bench.eramv', ['--anchors', '8'], '--anchors apply to a model pair'),
    ('diffzoo.eval', ['--no-such-flag'], 'unrecognized arguments: --no-such-flag'),
    ('diffzoo.eval.vqa', [], 'required: --predictions, --annotations'),
    ('diffzoo.eval.needle', ['run'], 'required: --haystacks'),
    ('diffzoo.data', ['synthetic'], 'required: out_dir'),
    ('diffzoo.convert', ['official-diffclip', 'x'], 'required: dst'),
    ('diffzoo.train.vlm', [], '--recipe is required'),
])
def test_usage_errors_go_to_stderr_with_exit_2(module, argv, message, commands):
    done = commands.run(module, argv)
    assert done.returncode == 2 and done.stdout == ''
    assert done.stderr.startswith('usage: ') and message in done.stderr, done.stderr[-2000:]


@pytest.mark.parametrize('module, argv, message', [
    ('diffzoo.data', ['synthetic', '{file}'], "argument out_dir: '{file}': a file; give a folder to write in"),
    ('diffzoo.data', ['retry', '{tmp}', '{tmp}'], "argument out: '{tmp}': a folder; give the file to write"),
    ('diffzoo.data', ['llava-qa', '{file}/qa.json', '--image-root', '{tmp}'],
     "argument out: '{file}/qa.json': {file} is a file, so nothing can be written under it"),
    ('diffzoo.convert', ['official-diffclip', '{file}', '{file}'], "argument dst: '{file}': a file; give a folder"),
    ('diffzoo.convert', ['official-diffclip', '{file}', ''], "argument dst: '': an empty path"),
    ('diffzoo.convert', ['publish', '{tmp}', '--local-dir', '{file}'], "argument --local-dir: '{file}': a file"),
    ('diffzoo.analysis', ['--model', 'diffclip-tiny', '--images', '{file}', '--out', '{file}'],
     "argument --out: '{file}': a file; give a folder to write in"),
    ('diffzoo.eval', ['--model', 'diffclip-tiny', '--dataset', 'dummy', '--output', '{tmp}'],
     "argument --output: '{tmp}': a folder; give the file to write"),
    ('diffzoo.eval.lmm', ['--model', 'x.yaml', '--task', 'pope', '--data', '{tmp}', '--out', '{file}/o'],
     "argument --out: '{file}/o': {file} is a file"),
    ('diffzoo.eval.needle', ['build', '--source', '{tmp}', '--out', '{file}'], "argument --out: '{file}': a file"),
    ('diffzoo.eval.vqa', ['--predictions', '{file}', '--annotations', '{file}', '--output', '{tmp}'],
     "argument --output: '{tmp}': a folder"),
])
def test_an_output_that_cannot_be_written_is_refused_before_any_work(module, argv, message, commands, tmp_path):
    """An output path that is a folder where a file goes, a file where a folder goes, under a file, or empty: the
    parser names it (exit 2) before the command works, instead of a traceback after its work."""
    (tmp_path / 'file.pt').write_text('')
    paths = {'tmp': str(tmp_path), 'file': str(tmp_path / 'file.pt')}
    done = commands.run(module, [a.format(**paths) for a in argv])
    assert done.returncode == 2 and message.format(**paths) in done.stderr, done.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ['file.pt']


def test_chain_help_answers_and_the_stage_help_says_its_whole_first_paragraph(capsys):
    """`chain --help` printed an error; the --help description stopped mid-sentence at the docstring's first line."""
    from diffzoo.train.vlm import main
    assert main(['chain', '--help']) == 0
    out = capsys.readouterr().out
    assert out.startswith('usage: python -m diffzoo.train.vlm chain STAGE') and 'checked before the first' in out
    with pytest.raises(SystemExit) as done:
        main(['--help'])
    assert done.value.code == 0
    assert 'LoRA fine-tuning of a VLM on VQAv2, or\none LLaVA-style stage' in capsys.readouterr().out
