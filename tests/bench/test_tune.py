"""`python -m diffzoo.bench.tune` and the launch table it writes: the program checked under Triton's
interpreter on CPU (its times are the interpreter's, never read as speed), the table's lookups by
architecture, head widths and token class."""
import json

import pytest

from diffzoo.bench import tune
from diffzoo.layers.kernels import HAS_TRITON, INTERPRETED

pytestmark = pytest.mark.skipif(not (HAS_TRITON and INTERPRETED),
                                reason='needs Triton with TRITON_INTERPRET=1 (conftest sets it without a GPU)')


def test_token_classes_and_the_committed_sm90_table():
    from diffzoo.layers.kernels import split_triton as st
    assert [st.token_class(n) for n in (1, 77, 128, 129, 197, 256, 257, 577, 1024, 1025, 4096)] == \
        ['128', '128', '128', '256', '256', '256', '1024', '1024', '1024', 'any', 'any']
    table = json.loads(st.CONFIGS.read_text())
    rows = table['configs']['sm_90']['64x128']
    assert set(rows) == set(st.KERNELS) and all(set(r) == {'128', '256', '1024', 'any'} for r in rows.values())
    assert table['measured']['sm_90']['device'].startswith('NVIDIA H')
    for kernel, by_class in rows.items():
        for n in (77, 197, 577, 4096):
            launch = st.launch_config(kernel, n, 64, 128, 'sm_90')
            expected = st.Launch(**by_class[st.token_class(n)])
            if expected.one_tile:
                expected = expected._replace(block_n=st._pow2(n))
            assert launch == expected
    # other head widths, or an architecture the table lacks, take the defaults
    assert st.launch_config('fwd', 197, 16, 32, 'sm_90') == st.default_launch('fwd', 197)
    assert st.launch_config('dkdv', 77, 64, 128, 'sm_80') == st.default_launch('dkdv', 77)


def test_a_one_tile_launch_covers_the_row_or_gives_way_to_the_default(monkeypatch):
    from diffzoo.layers.kernels import split_triton as st
    one_tile = {'block_m': 32, 'block_n': 256, 'warps': 8, 'stages': 1, 'one_tile': True}
    monkeypatch.setattr(st, '_table', lambda: {'sm_90': {'64x128': {'fwd': {'256': one_tile, '1024': one_tile}}}})
    assert st.launch_config('fwd', 130, 64, 128, 'sm_90') == st.Launch(32, 256, 8, 1, True)
    assert st.launch_config('fwd', 300, 64, 128, 'sm_90') == st.default_launch('fwd', 300)  # 300 keys: not one tile


@pytest.mark.slow  # interpreted kernels: seconds per launch
def test_tuning_checks_every_candidate_and_keeps_the_fastest(tmp_path, capsys):
    out = tmp_path / 'tune.json'
    assert tune.main(['--device', 'cpu', '--tokens', '20', '--tokens-per-batch', '20', '--limit', '1',
                      '--out', str(out)]) == 0
    result = json.loads(out.read_text())
    assert result['environment']['arch'] == 'sm_90'  # the interpreter runs sm_90's launches
    (row,) = result['classes']
    assert (row['tokens'], row['causal'], row['batch']) == (20, True, 1)
    for kernel in ('fwd', 'dq', 'dkdv'):
        tried = [c for c in row['candidates'] if c['kernel'] == kernel]
        assert len(tried) == 2 and sum(c['default'] for c in tried) == 1  # one candidate and the default
        assert all(c['error'] is None and c['ms'] > 0 for c in tried)  # every one matched the default's outputs
        best = row['best'][kernel]
        assert best['ms'] == min(c['ms'] for c in tried)
        assert best['launch'] in [c['launch'] for c in tried if c['ms'] == best['ms']]
    assert row['chain']['bwd_ms'] > 0 and row['sdpa']['fwd_ms'] > 0
    assert 'chain fwd' in capsys.readouterr().out


def test_write_table_merges_the_choices_under_the_architecture(tmp_path):
    table = tmp_path / 'launch_configs.json'
    table.write_text(json.dumps({'configs': {'sm_80': {'64x128': {'fwd': {'128': {'block_m': 1}}}}},
                                 'measured': {}}))
    launch = {'block_m': 64, 'block_n': 64, 'warps': 4, 'stages': 2, 'one_tile': False}
    rows = [{'tokens': 197, 'causal': False, 'batch': 256, 'best': {k: {'launch': launch} for k in ('fwd', 'dq')}}]
    env = {'arch': 'sm_90', 'device': 'NVIDIA H200', 'date': '2026-11-26', 'torch': 't', 'triton': 'tr'}
    tune.write_table(rows, env, 'python -m diffzoo.bench.tune --write', table)
    written = json.loads(table.read_text())
    assert written['configs']['sm_80'] == {'64x128': {'fwd': {'128': {'block_m': 1}}}}  # other GPUs kept
    assert written['configs']['sm_90']['64x128'] == {'fwd': {'256': launch}, 'dq': {'256': launch}}
    assert written['measured']['sm_90']['classes'] == {'256': 'N=197 B=256'}


@pytest.mark.parametrize('argv, message', [
    (['--device', 'cuda'], '--device cuda times compiled kernels'),
    (['--device', 'cpu', '--write'], 'writes no table'),
])
def test_bad_settings_are_refused_by_name(argv, message, capsys):
    assert tune.main(argv) == 2
    assert message in capsys.readouterr().err
