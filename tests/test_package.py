import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_carries_configs_recipes_and_dataset_cards(tmp_path):
    subprocess.run([sys.executable, '-m', 'pip', 'wheel', '--quiet', '--no-deps', '-w', str(tmp_path), str(ROOT)],
                   check=True, capture_output=True)
    wheel, = tmp_path.glob('diffzoo-*.whl')
    names = zipfile.ZipFile(wheel).namelist()
    configs = {Path(n).name for n in names if n.startswith('diffzoo/model_configs/')}
    assert configs == {p.name for p in (ROOT / 'model_configs').glob('*.json')}
    assert len(configs) == 17 and 'ViT-B-16-diffzoo-duplicate.json' in configs
    recipes = {n[len('diffzoo/recipes/'):] for n in names if n.startswith('diffzoo/recipes/')}
    assert recipes == {p.relative_to(ROOT / 'recipes').as_posix() for p in (ROOT / 'recipes').rglob('*.yaml')}
    assert 'vlm/paligemma-3b-vqav2-diff.yaml' in recipes
    cards = {Path(n).name for n in names if n.startswith('diffzoo/data/cards/')}
    assert cards == {'cc3m.yaml', 'cc12m.yaml'}
    assert {'diffzoo/train/launch.py', 'diffzoo/data/shards.py', 'diffzoo/eval/synthetic.py',
            'diffzoo/layers/kernels/split_triton.py', 'diffzoo/eval/needle/cli.py', 'diffzoo/analysis/cli.py'} <= set(names)
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / 'diffzoo').rglob('*.py')}
    assert modules - set(names) == set()  # every subpackage listed in pyproject.toml's packages


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / 'README.md').read_text()
    assert 'make test' in readme and 'make demo' in readme
    assert 'make test' in (ROOT / '.ci' / 'run').read_text()


def test_every_console_script_answers_help(capsys, monkeypatch):
    """The console scripts pyproject.toml declares are installed, and each one's function answers --help
    (called in this process: a new interpreter per script would spend most of its time importing torch)."""
    import tomllib
    from importlib.metadata import entry_points
    scripts = tomllib.loads((ROOT / 'pyproject.toml').read_text())['project']['scripts']
    assert {'diffzoo-train', 'diffzoo-train-vlm', 'diffzoo-eval', 'diffzoo-clip-benchmark'} <= set(scripts)
    installed = {ep.name: ep for ep in entry_points(group='console_scripts') if ep.name.startswith('diffzoo-')}
    assert set(installed) == set(scripts)
    for name in scripts:
        assert (Path(sys.executable).parent / name).is_file(), name
        assert installed[name].value == scripts[name]
        main = installed[name].load()
        monkeypatch.setattr(sys, 'argv', [name, '--help'])  # CLIP_benchmark's main reads sys.argv
        try:
            code = main() if name == 'diffzoo-clip-benchmark' else main(['--help'])
        except SystemExit as exc:  # argparse's --help
            code = exc.code
        assert code in (0, None) and capsys.readouterr().out.strip(), name
