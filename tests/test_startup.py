"""diffzoo._startup's gc.freeze: a command running as its own process (`main()` without an argv, as `python -m`
and the console scripts call it) freezes what its imports made, once they are done; `main(argv)` called by Python
code (a notebook, these tests) leaves the caller's collector as it is. gc.freeze is recorded, not run: the test
process's collector is not the one in question."""
import gc
import sys

import pytest

from diffzoo.train import launch, vlm


@pytest.fixture
def freezes(monkeypatch):
    calls = []
    monkeypatch.setattr(gc, 'freeze', lambda: calls.append([m for m in ('open_clip', 'open_clip_train.main',
                                                                         'transformers') if m in sys.modules]))
    return calls


def test_the_training_command_freezes_its_imports_in_its_own_process_only(freezes, tmp_path, monkeypatch, capsys):
    argv = ['--recipe', 'diffclip-tiny', '--train_data', str(tmp_path / 'missing'), '--logs', str(tmp_path)]
    assert launch.main(argv) == 2 and freezes == []
    monkeypatch.setattr(sys, 'argv', ['python -m diffzoo.train', *argv])
    assert launch.main() == 2  # the same error, after its imports
    assert freezes == [['open_clip', 'open_clip_train.main', 'transformers']]
    assert capsys.readouterr().err.count('missing') >= 2


def test_help_and_recipe_errors_answer_before_any_freeze(freezes, monkeypatch, capsys):
    for argv in (['--help'], ['torchrun', '--nproc-per-node', '1']):  # torchrun without `--`: its usage line
        monkeypatch.setattr(sys, 'argv', ['python -m diffzoo.train', *argv])
        launch.main()
    monkeypatch.setattr(sys, 'argv', ['python -m diffzoo.train.vlm', '--recipe', 'no-such-recipe'])
    assert vlm.main() == 2 and 'no-such-recipe' in capsys.readouterr().err
    assert freezes == []
