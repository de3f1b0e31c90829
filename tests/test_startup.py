"""diffzoo._startup's start of a command: running as its own process (`main()` without an argv, as `python -m` and
the console scripts call it), a command imports torch, open_clip and the rest with the garbage collector off, then
freezes what the imports made and switches the collector back on; `main(argv)` called by Python code (a notebook,
these tests) leaves the caller's collector as it is. The collector's calls are recorded, not run: the test
process's collector is not the one in question."""
import gc
import sys

import pytest

from diffzoo._startup import startup_imports
from diffzoo.train import launch, vlm

RUNNER = 'diffzoo.train.runner'  # the training command's imports: open_clip, open_clip_train, torch
IMPORTED = (RUNNER, 'open_clip', 'open_clip_train.main', 'transformers')


@pytest.fixture
def collector(monkeypatch):
    """The calls to gc.disable, gc.freeze and gc.enable, each with which of IMPORTED were imported by then."""
    calls = []
    for name in ('disable', 'freeze', 'enable'):
        monkeypatch.setattr(gc, name, lambda name=name: calls.append((name, [m for m in IMPORTED if m in sys.modules])))
    monkeypatch.setattr(gc, 'isenabled', lambda: True)
    return calls


def test_the_training_command_imports_with_the_collector_off_in_its_own_process_only(collector, tmp_path,
                                                                                       monkeypatch, capsys):
    argv = ['--recipe', 'diffclip-tiny', '--train_data', str(tmp_path / 'missing'), '--logs', str(tmp_path)]
    assert launch.main(argv) == 2 and collector == []
    # diffzoo.train.runner imported again, now inside the command (its libraries stay: this process has them)
    monkeypatch.delitem(sys.modules, RUNNER)
    monkeypatch.delattr(sys.modules['diffzoo.train'], 'runner')
    monkeypatch.setattr(sys, 'argv', ['python -m diffzoo.train', *argv])
    assert launch.main() == 2  # the same error, after its imports
    assert collector == [('disable', list(IMPORTED[1:])), ('freeze', list(IMPORTED)), ('enable', list(IMPORTED))]
    assert capsys.readouterr().err.count('missing') >= 2


def test_an_import_that_fails_still_freezes_and_switches_the_collector_back_on(collector):
    with pytest.raises(ImportError), startup_imports(True):
        import diffzoo.no_such_module  # noqa: F401
    assert [name for name, _ in collector] == ['disable', 'freeze', 'enable']


def test_help_and_recipe_errors_answer_before_the_imports(collector, monkeypatch, capsys):
    for argv in (['--help'], ['torchrun', '--nproc-per-node', '1']):  # torchrun without `--`: its usage line
        monkeypatch.setattr(sys, 'argv', ['python -m diffzoo.train', *argv])
        launch.main()
    monkeypatch.setattr(sys, 'argv', ['python -m diffzoo.train.vlm', '--recipe', 'no-such-recipe'])
    assert vlm.main() == 2 and 'no-such-recipe' in capsys.readouterr().err
    assert collector == []
