import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_carries_configs_recipes_and_dataset_cards(tmp_path):
    subprocess.run([sys.executable, '-m', 'pip', 'wheel', '--quiet', '--no-deps', '-w', str(tmp_path), str(ROOT)],
                   check=True, capture_output=True)
    wheel, = tmp_path.glob('diffzoo-*.whl')
    names = zipfile.ZipFile(wheel).namelist()
    configs = {Path(n).name for n in names if n.startswith('diffzoo/model_configs/')}
    assert configs == {p.name for p in (ROOT / 'model_configs').glob('*.json')}
    assert len(configs) == 16
    recipes = {n[len('diffzoo/recipes/'):] for n in names if n.startswith('diffzoo/recipes/')}
    assert recipes == {p.relative_to(ROOT / 'recipes').as_posix() for p in (ROOT / 'recipes').rglob('*.yaml')}
    assert 'vlm/paligemma-3b-vqav2-diff.yaml' in recipes
    cards = {Path(n).name for n in names if n.startswith('diffzoo/data/cards/')}
    assert cards == {'cc3m.yaml', 'cc12m.yaml'}
    assert {'diffzoo/train/launch.py', 'diffzoo/data/shards.py', 'diffzoo/eval/synthetic.py'} <= set(names)


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / 'README.md').read_text()
    assert 'make test' in readme and 'make demo' in readme
    assert 'make test' in (ROOT / '.ci' / 'run').read_text()
