"""One CLI convention (STYLE rule 13): every console script answers --help without importing torch, timm,
open_clip or transformers; `import diffzoo` registers its models whichever library is imported first."""
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = tomllib.loads((ROOT / 'pyproject.toml').read_text())['project']['scripts']
HEAVY = ('torch', 'timm', 'open_clip', 'transformers')
# still import a heavy library before their --help answers
HEAVY_AT_IMPORT = {
    'diffzoo-clip-benchmark': "the help is CLIP_benchmark's own parser, built in clip_benchmark.cli.get_parser_args "
                              '(choices from clip_benchmark.models, which imports torch); clip_benchmark.cli imports '
                              'torch at its top, so only a copy of that parser could answer without torch',
}
# runs `python -m MODULE --help`, then lists the heavy libraries it imported
PROBE = ('import runpy, sys\n'
         'sys.argv = [sys.argv[1], "--help"]\n'
         'try:\n'
         '    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)\n'
         'except SystemExit as exc:\n'
         '    code = exc.code\n'
         'else:\n'
         '    code = 0\n'
         f'print("HEAVY", sorted(m for m in sys.modules if m.split(".")[0] in {set(HEAVY)!r}))\n'
         'sys.exit(code)\n')


def _module(entry_point: str) -> str:
    module = entry_point.split(':')[0]
    return module[:-len('.__main__')] if module.endswith('.__main__') else module


@pytest.mark.slow
@pytest.mark.parametrize('script', [
    pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=HEAVY_AT_IMPORT[name]))
    if name in HEAVY_AT_IMPORT else name for name in SCRIPTS])
def test_help_imports_no_heavy_library(script):
    module = _module(SCRIPTS[script])
    done = subprocess.run([sys.executable, '-c', PROBE, module], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith('usage: '), done.stdout[:500]
    heavy = done.stdout.rsplit('HEAVY ', 1)[1].strip()
    assert heavy == '[]', f'python -m {module} --help imported {heavy}'


@pytest.mark.slow
def test_import_diffzoo_imports_no_heavy_library():
    code = f'import sys, diffzoo; print(sorted(m for m in sys.modules if m.split(".")[0] in {set(HEAVY)!r}))'
    done = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=300, check=True)
    assert done.stdout.strip() == '[]'


REGISTERED = ("timm.create_model('vit_diff_micro_patch8_64')\n"
              "model = open_clip.create_model('diffclip-tiny')\n"
              "assert isinstance(model.visual.trunk.blocks[0].attn, diffzoo.DifferentialAttention)\n"
              "assert diffzoo._hook not in sys.meta_path  # removed once both libraries are registered\n"
              "print('registered')\n")


IMPORT_ORDERS = [
    'import diffzoo\nimport timm\nimport open_clip',
    'import diffzoo\nimport open_clip\nimport timm',
    'import timm\nimport diffzoo\nimport open_clip',
    'import open_clip\nimport diffzoo\nimport timm',
    'import timm, open_clip, diffzoo',
    'import diffzoo.layers\nimport timm, open_clip',  # a diffzoo module importing timm itself
    'import diffzoo.eval.models\nimport timm, open_clip',  # … and open_clip
]


@pytest.fixture(scope='module')
def import_orders():
    """A fresh interpreter for each import order, all started at once (each spends seconds importing
    open_clip, mostly waiting on files); {imports: its process}."""
    return {imports: subprocess.Popen([sys.executable, '-c', f'import sys\n{imports}\nimport diffzoo\n{REGISTERED}'],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for imports in IMPORT_ORDERS}


@pytest.mark.slow
@pytest.mark.parametrize('imports', IMPORT_ORDERS)
def test_import_diffzoo_registers_the_models_in_either_order(import_orders, imports):
    process = import_orders[imports]
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == 0 and 'registered' in stdout, stderr[-3000:]


def test_public_names_are_imported_on_use():
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
def test_usage_errors_go_to_stderr_with_exit_2(module, argv, message):
    done = subprocess.run([sys.executable, '-m', module, *argv], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert done.returncode == 2 and done.stdout == ''
    assert done.stderr.startswith('usage: ') and message in done.stderr, done.stderr[-2000:]
