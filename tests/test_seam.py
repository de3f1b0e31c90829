import re
import types
from pathlib import Path

import pytest

pytest.importorskip('clip_benchmark')  # the eval extra, whose seams the tables hold (absent on some GPU machines)

from diffzoo import seam  # noqa: E402
from diffzoo.clip import seams as clip_seams  # noqa: E402
from diffzoo.eval import seams as clip_benchmark_seams  # noqa: E402
from diffzoo.models import seams as timm_seams  # noqa: E402
from diffzoo.seam import ORIGINAL, LibraryChanged, Seam  # noqa: E402
from diffzoo.train import seams as train_seams  # noqa: E402

ARCHITECTURE = Path(__file__).resolve().parents[1] / 'docs' / 'architecture.md'
TABLES = {
    'open_clip': clip_seams.SEAMS,
    'timm': timm_seams.SEAMS,
    'CLIP_benchmark': clip_benchmark_seams.SEAMS,
    'open_clip_train': train_seams.table('events', lambda_lr_scale=1.0, data_backend='device'),  # every row
}


def _library():
    module = types.ModuleType('library')

    def load(path, device='cpu'):
        return ('load', path, device)

    def save(obj, path):
        return ('save', obj, path)
    module.load, module.save, module.load_again, module.registry = load, save, load, {'a': 1}
    return module


def save_whole(obj, path):  # a drop-in of diffzoo's own for `save`
    return ('whole', obj, path)


def _table(module):
    def loader(original):
        def load(path, device='cpu'):
            return ('wrapped',) + original(path, device)
        return load
    wrap = seam.wrapping(loader)
    return (Seam(module, 'load', wrap, 'why load', ('path', 'device')),
            Seam(module, 'load_again', wrap, 'a second reference to load', ('path', 'device')),
            Seam(module, 'save', seam.constant(save_whole), 'why save', ('obj', 'path')),
            Seam(module, 'registry', lambda r: seam.standing_in(types.SimpleNamespace(**r, b=2), r), 'why registry',
                 holds=lambda r: isinstance(r, dict), what='a dict'))


def _names(module):
    return [module.load, module.load_again, module.save, module.registry]


def test_a_table_holds_for_its_block_and_what_was_there_is_back_after_it_even_after_an_error():
    module = _library()
    before = _names(module)
    with pytest.raises(KeyError):
        with seam.patched(_table(module)):
            assert module.load('x') == ('wrapped', 'load', 'x', 'cpu')
            assert module.load_again is module.load  # one replacement for one function's two references
            assert getattr(module.load, ORIGINAL) is before[0] and module.load.__name__ == 'load'
            assert module.save is save_whole and module.registry.b == 2
            raise KeyError('the run fails')
    assert _names(module) == before


@pytest.mark.parametrize('name, changed, message', [
    ('save', lambda obj, where: None, r"library\.save\('obj', 'where'\) no longer takes \('obj', 'path'\)"),
    ('registry', [1], r'library\.registry is no longer a dict'),
    ('load', None, r'has no library\.load'),
])
def test_every_row_is_checked_before_any_name_is_replaced(name, changed, message):
    module = _library()
    if changed is None:
        delattr(module, name)
    else:
        setattr(module, name, changed)
    before = module.__dict__.copy()
    with pytest.raises(LibraryChanged, match=message):
        seam.apply(_table(module))
    assert module.__dict__ == before


def test_applying_again_wraps_the_library_s_own_function_and_keep_keeps_a_replacement_in_place():
    module = _library()
    original = module.load
    seam.apply(_table(module))
    first = module.load
    seam.apply(_table(module), keep=True)  # as install() applies the tables for the process: idempotent
    assert module.load is first
    held = seam.apply(_table(module))
    assert module.load is not first and getattr(module.load, ORIGINAL) is original  # never a wrapper of a wrapper
    seam.undo(held)
    assert module.load is first


def test_restore_gives_back_the_library_s_own_values():
    module = _library()
    before = _names(module)
    seam.apply(_table(module))
    seam.restore(_table(module))
    assert [module.load, module.load_again, module.registry] == [before[0], before[1], before[3]]
    assert module.save is save_whole  # a drop-in of diffzoo's own stands in for nothing: only its block's end undoes it


@pytest.mark.parametrize('library', TABLES)
def test_every_row_says_in_one_line_what_the_library_cannot_do_without_it(library):
    rows = TABLES[library]
    assert rows and all(row.reason.strip() and '\n' not in row.reason for row in rows)
    assert len({(row.module, row.name) for row in rows}) == len(rows)  # one row a name


def test_docs_list_every_row_with_its_reason():
    text = ARCHITECTURE.read_text()
    listed = [line for line in text.splitlines() if re.match(r'- `[\w.]+`: ', line)]
    expected = [line for rows in TABLES.values() for line in seam.describe(rows)]
    assert listed == expected, 'docs/architecture.md: list the rows as diffzoo.seam.describe writes them'


def test_the_installed_tables_are_the_libraries_own_functions_wrapped_once():
    clip_benchmark_seams.install()  # (on import of diffzoo.eval.benchmark)
    for rows in (clip_seams.SEAMS, timm_seams.SEAMS, clip_benchmark_seams.SEAMS):
        for row in rows:
            current = getattr(row.module, row.name)
            original = getattr(current, ORIGINAL)
            assert not hasattr(original, ORIGINAL), row.where
