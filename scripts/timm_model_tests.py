"""Run timm's own tests/test_models.py on diffzoo's models, as a timm user would.

    python scripts/timm_model_tests.py PATH/TO/pytorch-image-models [pytest arguments …]

PATH is a checkout of timm (github.com/huggingface/pytorch-image-models) whose tests/ match the
installed timm closely enough. Its tests/ folder is copied into a temporary directory beside a
conftest.py that imports diffzoo and scripts/timm_converted_models.py, and pytest runs test_models.py
there with `-k "vit_diff or diff_vit or _diffzoo_"` (every registered differential ViT, its baseline
twin and the alias, and timm's ViT, DeiT, SigLIP and EVA converted by diffzoo.differentialize in each
variant) unless the arguments give a -k of their own. The pretrained-loading cases read DiffCLIP's hub
repositories: an offline Hugging Face cache (HF_HUB_OFFLINE=1) holds a random checkpoint in the
official layout for each of them, written here, so nothing is downloaded. Exit status: pytest's.
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFTEST = f'''import sys
sys.path.insert(0, {str(ROOT / 'scripts')!r})
import diffzoo  # noqa: E402,F401  registers the vit_diff* models with timm
import timm_converted_models  # noqa: E402,F401  registers the converted timm models
'''


def write_hub_cache(cache: Path) -> None:
    """An offline hub cache with one official-layout DiffCLIP checkpoint for every tagged repository."""
    sys.path.insert(0, str(ROOT))
    import timm

    import diffzoo  # noqa: F401
    from tests.clip import official_reference
    from tests.factory import hub_cache

    checkpoint = cache.parent / 'official' / 'checkpoint_best.pt'
    checkpoint.parent.mkdir(parents=True)
    official_reference.save_official_checkpoint(checkpoint, official_reference.random_official_state_dict(seed=1))
    repos = {timm.get_pretrained_cfg(name).hf_hub_id for name in timm.list_pretrained('vit_diff*')}
    for repo in sorted(repos):
        hub_cache(cache, repo, checkpoint)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('timm_repo', type=Path, help='a checkout of pytorch-image-models (its tests/ are run)')
    parser.add_argument('pytest_args', nargs=argparse.REMAINDER, help='passed to pytest after the defaults')
    args = parser.parse_args(argv)
    tests = args.timm_repo / 'tests' / 'test_models.py'
    if not tests.is_file():
        parser.error(f'{args.timm_repo}: no tests/test_models.py; pass the root of a pytorch-image-models checkout')
    with tempfile.TemporaryDirectory(prefix='timm-tests-') as tmp:
        work = Path(tmp)
        shutil.copytree(args.timm_repo / 'tests', work / 'tests')
        (work / 'conftest.py').write_text(CONFTEST)
        write_hub_cache(work / 'hub')
        env = {**os.environ, 'HF_HUB_OFFLINE': '1', 'HF_HUB_CACHE': str(work / 'hub'), 'HF_HOME': str(work / 'home')}
        select = [] if '-k' in args.pytest_args else ['-k', 'vit_diff or diff_vit or _diffzoo_']
        command = [sys.executable, '-m', 'pytest', '-p', 'no:cacheprovider', '-o', 'addopts=', '-W', 'ignore::pytest.PytestUnknownMarkWarning',
                   'tests/test_models.py', *select, *args.pytest_args]
        return subprocess.call(command, cwd=work, env=env)


if __name__ == '__main__':
    sys.exit(main())
