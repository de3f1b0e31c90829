"""`python -m diffzoo.bench --smoke`: one CLI run on CPU, checked for structure and arithmetic, never for speed."""
import contextlib
import gc
import io
import json
import statistics
import time

import pytest
import torch

from diffzoo.bench import attention, end_to_end
from diffzoo.bench.__main__ import main, parser
from diffzoo.bench.measure import time_steps
from diffzoo.bench.report import block_ratio, evaluate_targets

pytestmark = pytest.mark.slow  # the bench runs models, layers and trainings

SMOKE_MODELS = ('diffclip-tiny', 'clip-tiny-baseline')


@pytest.fixture(scope='module')
def smoke(tmp_path_factory):
    """The CLI's `main` run once in this process (a subprocess would import torch and open_clip again)."""
    out = tmp_path_factory.mktemp('bench') / 'smoke.json'
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(['--smoke', '--device', 'cpu', '--out', str(out)])
    assert code == 0, stderr.getvalue()[-3000:]
    return json.loads(out.read_text()), stdout.getvalue()


def _positive_stats(stats):
    assert stats['n'] == len(stats['values']) >= 1
    assert 0 < stats['min'] <= stats['q1'] <= stats['median'] <= stats['q3'] <= stats['max']


def test_json_has_every_section_and_the_environment(smoke):
    results, _ = smoke
    assert {'environment', 'config', 'models', 'layers', 'steps', 'data', 'targets'} <= results.keys()
    env = results['environment']
    for key in ('torch', 'timm', 'open_clip', 'device', 'torch_threads'):
        assert env[key]
    assert results['config']['device'] == 'cpu' and results['config']['smoke']


def test_model_rows_are_positive_and_ratios_use_the_same_run_baseline(smoke):
    results, _ = smoke
    models = results['models']
    rows = {r['model']: r for r in models['rows']}
    assert tuple(rows) == SMOKE_MODELS and models['baseline'] == 'clip-tiny-baseline'
    base = rows['clip-tiny-baseline']
    blocks, steps = results['config']['blocks'], results['config']['block_steps']
    assert (models['blocks'], models['block_steps']) == (blocks, steps) == (2, 2)
    for r in rows.values():
        for stats in (r['train']['step_s'], r['train']['samples_per_s'], r['infer']['call_s'],
                      r['infer']['images_per_s']):
            _positive_stats(stats)
            assert stats['n'] == blocks * steps
        # every step's time is kept, block by block: the summary is of them all
        for kind, key in (('train', 'step_s'), ('infer', 'call_s')):
            assert [len(b) for b in r[kind]['blocks']] == [steps] * blocks
            assert r[kind][key]['values'] == [t for b in r[kind]['blocks'] for t in b]
            assert r[kind]['allocator_per_block'] is None  # the caching allocator's counts: CUDA only
        assert r['train']['peak_bytes'] == r['train']['state_bytes'] + r['train']['transient_bytes']
        assert r['train']['transient_bytes'] > 0 and r['infer']['transient_bytes'] > 0
        # AdamW's two moments make training state about 3x the parameters alone
        assert r['train']['state_bytes'] > 2.5 * r['infer']['state_bytes']
        # a time ratio is the median of the per-block ratios (block medians, blocks of one round paired)
        for kind, q in (('train', 'train_time'), ('infer', 'infer_time')):
            per_block = [statistics.median(a) / statistics.median(b)
                         for a, b in zip(r[kind]['blocks'], base[kind]['blocks'])]
            spread = r['ratio_spread'][q]
            assert spread['values'] == pytest.approx(per_block)
            assert r['ratios'][q] == spread['median'] == pytest.approx(statistics.median(per_block))
            assert spread['unsteady'] == (spread['q3'] - spread['q1'] > 0.03 * spread['median'])
        assert r['ratios']['train_memory'] == pytest.approx(r['train']['peak_bytes'] / base['train']['peak_bytes'])
        assert r['train']['sdpa_backends'], 'the profiled step names an SDPA backend'
    assert base['ratios'] == {k: pytest.approx(1.0) for k in base['ratios']}


def test_per_block_ratios_flag_a_spread_over_three_percent():
    base = [[0.100, 0.100, 0.101]] * 4
    steady = block_ratio([[0.100, 0.101, 0.102], [0.101, 0.101, 0.100], [0.100, 0.102, 0.101], [0.101] * 3], base)
    assert steady['median'] == pytest.approx(1.0, abs=0.011) and not steady['unsteady']
    # two of four blocks 10 % slower: the median moves little, the interquartile range flags the row
    unsteady = block_ratio([[0.100] * 3, [0.110] * 3, [0.100] * 3, [0.111] * 3], base)
    assert unsteady['rel_iqr'] > 0.03 and unsteady['unsteady']
    assert unsteady['values'] == pytest.approx([1.0, 1.1, 1.0, 1.11])


def test_time_steps_times_each_of_consecutive_calls_on_the_cpu():
    calls = []
    times = time_steps(lambda: (calls.append(1), time.sleep(0.02 * len(calls))), torch.device('cpu'), 3)
    assert len(calls) == len(times) == 3
    assert [t >= 0.02 * (i + 1) for i, t in enumerate(times)] == [True] * 3 and times[2] < 1


def test_layer_rows_exist_for_every_variant_and_token_count(smoke):
    results, _ = smoke
    layers = results['layers']
    tokens, causal_tokens = results['config']['tokens'], results['config']['causal_tokens']
    assert causal_tokens and layers['causal_tokens'] == causal_tokens
    assert {(r['variant'], r['tokens'], r['causal']) for r in layers['rows']} == {
        (v, n, c) for v in attention.variants(torch.device('cpu'))
        for n, c in [(n, False) for n in tokens] + [(n, True) for n in causal_tokens]}
    assert 'split-triton' not in attention.variants(torch.device('cpu'))  # the interpreter is not timed
    by = {(r['variant'], r['tokens'], r['causal']): r for r in layers['rows']}
    for r in layers['rows']:
        _positive_stats(r['fwd_bwd_s'])
        _positive_stats(r['fwd_s'])
        assert r['peak_bytes'] > 0
        assert r['nn_bytes'] == r['batch'] * r['score_maps'] * r['tokens'] ** 2 * 4  # fp32
        base = by['sdpa', r['tokens'], r['causal']]  # each ratio against the baseline with the same masking
        assert r['ratios']['fwd_bwd_time'] == pytest.approx(r['fwd_bwd_s']['median'] / base['fwd_bwd_s']['median'])
    assert by['split-explicit', tokens[0], False]['sdpa_backends'] == ['explicit matmul + softmax']
    assert by['sdpa', tokens[0], False]['sdpa_backends'], 'the fused baseline names an SDPA backend'
    # at the larger token count the explicit path holds fp32 N×N maps: more memory than the fused path
    n = max(tokens)
    assert by['split-explicit', n, False]['peak_bytes'] > by['split-fused', n, False]['peak_bytes']
    assert by['split-explicit', n, False]['materialises_nn'] is True


def test_causal_layer_rows_attend_causally():
    """The layer the causal rows time, called as they call it, equals the explicit causal reference."""
    layer = attention.build('split-fused', 128, torch.device('cpu'))
    x = torch.randn(2, 9, 128)
    explicit = attention.build('split-explicit', 128, torch.device('cpu'))
    explicit.load_state_dict(layer.state_dict())
    torch.testing.assert_close(layer(x, is_causal=True), explicit(x, is_causal=True), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(layer(x, is_causal=True), layer(x), atol=1e-3)


def test_materialises_verdict():
    assert attention.materialises(peak=10, nn_bytes=100, baseline_peak=50) is False
    assert attention.materialises(peak=200, nn_bytes=100, baseline_peak=50) is True
    assert attention.materialises(peak=120, nn_bytes=100, baseline_peak=50) is None
    # N×N smaller than the baseline's activations: an excess may be linear-size copies
    assert attention.materialises(peak=500, nn_bytes=100, baseline_peak=300) is None


def test_data_rows_report_per_worker_throughput(smoke):
    results, _ = smoke
    rows = {r['workers']: r for r in results['data']['rows']}
    assert set(rows) == {1, results['config']['workers']}
    for w, r in rows.items():
        assert r['images_timed'] > 0 and r['images_per_s'] > 0
        assert r['images_per_s_per_worker'] == pytest.approx(r['images_per_s'] / w)


def test_data_accounting_cost_is_measured_on_the_real_training_loader(smoke):
    results, stdout = smoke
    a = results['data']['accounting']
    assert (a['shards'], a['per_shard'], a['epoch_samples']) == (16, 20, 16 * 20)  # sizes.json, as open_clip reads it
    assert a['slowdown'] == pytest.approx(a['plain_samples_per_s']['median'] / a['accounted_samples_per_s']['median'])
    for row in a['reads']['accounted']:
        assert row['journal_samples'] >= a['batches_timed'] * a['batch']  # every batch trained is in the journal
        assert row['journal_bytes'] > 0
    assert a['journal_bytes_per_epoch'] == pytest.approx(a['journal_bytes_per_sample'] * 320)
    assert a['stages']['accounted_cpu_s_per_sample'] > a['stages']['plain_cpu_s_per_sample'] > 0
    targets = {t['target']: t for t in results['targets']}
    assert targets['training loader samples/s, plain / with data accounting']['ratio'] == a['slowdown']
    assert targets["data accounting's own CPU per sample, as a slowdown of a worker core"]['ratio'] == a['stage_slowdown']
    assert 'Training loader with and without data accounting' in stdout


def test_data_backend_device_worker_cpu_is_measured_against_open_clips_pipeline(smoke):
    results, stdout = smoke
    w = results['data']['worker_cpu']
    assert w['open_clip_cpu_s_per_sample'] > 0 and w['device_cpu_s_per_sample'] > 0 and w['device'] == 'cpu'
    assert w['ratio'] == pytest.approx(w['device_cpu_s_per_sample'] / w['open_clip_cpu_s_per_sample'])
    assert w['samples'] > 0 and w['device_s_per_batch'] > 0 and w['device_batched'] is False  # the CPU's default
    assert w['device_s_per_batch'] == w['device_s_per_batch_per_image'] and w['device_s_per_batch_batched'] > 0
    targets = {t['target']: t for t in results['targets']}
    assert targets["data_backend device: worker CPU per sample vs open_clip's pipeline"]['ratio'] == w['ratio']
    assert 'Worker CPU per sample' in stdout


def test_targets_follow_the_run_settings(smoke):
    results, _ = smoke
    targets = {t['target']: t for t in results['targets']}
    cpu_time = targets['CPU fp32 training step time']
    assert cpu_time['status'] in ('PASS', 'MISS')
    assert cpu_time['ratio'] == pytest.approx(
        {r['model']: r for r in results['models']['rows']}['diffclip-tiny']['ratios']['train_time'])
    assert cpu_time['status'] == ('PASS' if cpu_time['ratio'] <= 1.10 else 'MISS')
    gpu = targets['GPU 16-bit b256 training step time']
    assert gpu['status'] == 'n/a' and gpu['limit'] == 1.00 and 'needs device cuda, precision bf16/fp16' in gpu['detail']
    assert 'needs 197' in targets['attention layer fwd+bwd at 197 tokens vs SDPA']['detail']
    # the same results at 4096 tokens: PASS only when the peak stays under one N×N set
    row = dict(results['layers']['rows'][0], variant='split-fused', tokens=4096, peak_bytes=10, nn_bytes=100)
    fake = dict(results, layers=dict(results['layers'], rows=[row]))
    no_nn = {t['target']: t for t in evaluate_targets(fake, 'diffclip-tiny')}[
        'no N×N matrix on the default path at 4096 tokens']
    assert no_nn['status'] == 'PASS' and no_nn['ratio'] == pytest.approx(0.1)


def test_profile_rows_split_the_step_and_compare_with_the_baseline(smoke, tmp_path_factory):
    results, stdout = smoke
    prof = results['profile']
    rows = {r['model']: r for r in prof['rows']}
    assert tuple(rows) == SMOKE_MODELS and prof['baseline'] == 'clip-tiny-baseline'
    for r in rows.values():
        assert r['attention_ms'] > 0 and r['gemm_ms'] > 0 and r['other_ms'] > 0
        assert r['total_ms'] == pytest.approx(r['attention_ms'] + r['gemm_ms'] + r['other_ms'])
        assert all(k['name'].startswith('aten::') for c in r['top'].values() for k in c)
    diff, base = rows['diffclip-tiny'], rows['clip-tiny-baseline']
    assert diff['vs_baseline']['attention_time'] == pytest.approx(diff['attention_ms'] / base['attention_ms'])
    assert diff['vs_baseline']['other_ms_more'] == pytest.approx(diff['other_ms'] - base['other_ms'])
    assert any('scaled_dot_product' in k['name'] for k in diff['top']['attention'])
    assert 'One training step profiled' in stdout


def test_steps_section_compares_the_slowest_profiled_step_with_the_fastest(smoke, tmp_path_factory):
    """Per model, --steps consecutive steps timed, then as many profiled; each profiled step's aten ops are its own
    (attributed by their host time); the comparison names the slowest and the fastest and splits their
    difference; the text summary lies beside the JSON."""
    results, stdout = smoke
    section = results['steps']
    steps = results['config']['steps']
    assert [m['model'] for m in section['rows']] == list(SMOKE_MODELS)
    for m in section['rows']:
        for run in ('timed', 'profiled'):
            rows = m[run]['rows']
            assert [r['step'] for r in rows] == list(range(steps))
            assert m[run]['time_s']['values'] == [r['time_s'] for r in rows]
            for r in rows:
                assert r['time_s'] > 0 and r['gc_count'] >= 0 and r['compiles'] == [] and r['allocator'] is None
        profiled = m['profiled']['rows']
        for r in profiled:
            ops = r['gpu']['by_name']
            assert ops['aten::addmm']['count'] > 0 and sum(o['ms'] for o in ops.values()) < r['host_s'] * 1e3
        # every step runs the same ops, as often
        assert len({tuple(sorted((k, v['count']) for k, v in r['gpu']['by_name'].items())) for r in profiled}) == 1
        cmp = m['slow_vs_fast']
        times = [r['time_s'] for r in profiled]
        assert (cmp['slow'], cmp['fast']) == (times.index(max(times)), times.index(min(times)))
        assert cmp['delta_ms'] == pytest.approx((max(times) - min(times)) * 1e3)
        assert f'step {cmp["slow"]} ' in cmp['verdict'] and 'largest part' in cmp['verdict']
    text = (tmp_path_factory.getbasetemp() / 'bench0' / section['summary']).read_text()
    assert all(m in text for m in SMOKE_MODELS) and 'slowest vs fastest profiled step' in text


def test_the_model_section_s_ratio_is_set_against_the_steps_section_s_consecutive_steps(smoke):
    results, stdout = smoke
    medians = {m['model']: m['timed']['time_s']['median'] for m in results['steps']['rows']}
    rows = {r['model']: r for r in results['models']['rows']}
    for a in results['steps_agreement']:
        consecutive = medians[a['model']] / medians['clip-tiny-baseline']
        assert a['consecutive_ratio'] == pytest.approx(consecutive)
        assert a['difference'] == pytest.approx(rows[a['model']]['ratios']['train_time'] / consecutive - 1)
        assert a['agrees'] == (abs(a['difference']) <= 0.02)
    assert [a['model'] for a in results['steps_agreement']] == list(SMOKE_MODELS)
    assert "the model section's blocks against the steps section's consecutive steps" in stdout


def test_the_step_recorder_tags_garbage_collections_with_the_step():
    from diffzoo.bench.step_profile import Recorder
    with Recorder() as rec:
        rec.step = 3
        gc.collect()
        rec.step = 4
    assert rec.of(3)['gc_count'] >= 1 and rec.of(3)['gc_oldest'] == 2 and rec.of(3)['gc_ms'] > 0
    assert rec.of(4)['gc_count'] == 0
    before = len(rec.collections)
    gc.collect()  # after the recorder: not recorded
    assert len(rec.collections) == before


def test_categories():
    from diffzoo.bench.profile import category
    assert category('_diff_attn_bwd_dkdv') == category('aten::_scaled_dot_product_flash_attention_for_cpu') == 'attention'
    assert category('sm90_xmma_gemm_bf16bf16_bf16f32') == category('aten::addmm') == 'gemm'
    assert category('aten::add_') == category('vectorized_elementwise_kernel') == 'other'


def test_cli_prints_the_tables_and_target_lines(smoke):
    _, stdout = smoke
    for heading in ('Whole model', 'Attention layer alone', 'Data pipeline', 'Targets'):
        assert heading in stdout
    for model in SMOKE_MODELS:
        assert model in stdout
    assert 'split-explicit' in stdout and 'results: ' in stdout
    # a smoke run's ratios judge nothing: no PASS/MISS verdicts, a line saying why; no profiler notes
    assert not any(line.strip().startswith(('PASS', 'MISS')) for line in stdout.splitlines())
    assert 'Targets: not judged in --smoke' in stdout and 'other vs base:' in stdout


@pytest.mark.parametrize('argv, message', [
    (['--model', 'no-such-model'], '--model/--baseline no-such-model'),
    (['--batch', '0'], '--batch 0'),
    (['--device', 'tpu'], '--device tpu'),
    (['--sections', 'layer', '--compile'], '--compile'),
    (['--split-kernel', 'flash'], '--split-kernel flash'),
    (['--model', 'diffclip-tiny@flash'], '--model diffclip-tiny@flash: the kernel after @'),
    (['--model', 'nothing@two_calls'], '--model/--baseline nothing@two_calls'),
    (['--variants', 'split-nope'], '--variants split-nope'),
])
def test_bad_input_is_named(argv, message, capsys, tmp_path):
    assert main(['--smoke', '--out', str(tmp_path / 'x.json')] + argv) == 2
    err = capsys.readouterr().err
    assert err.startswith('error: ') and message in err
    assert not (tmp_path / 'x.json').exists()


def test_end_to_end_section_trains_both_recipes_through_train_sh(tmp_path):
    """`--sections train`: one epoch of each tiny recipe through scripts/train.sh, read from
    open_clip_train's own per-step log lines."""
    out = tmp_path / 'train.json'
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(['--smoke', '--device', 'cpu', '--sections', 'train', '--out', str(out)])
    assert code == 0, stderr.getvalue()[-3000:]
    train = json.loads(out.read_text())['train']
    assert [r['recipe'] for r in train['rows']] == ['diffclip-tiny', 'clip-tiny-baseline']
    steps = -(-train['samples'] // train['batch_per_gpu'])  # one epoch, one process
    every = end_to_end.log_every(steps, train['warmup_steps'])
    for r in train['rows']:  # whole windows of `every` steps after the warm-up; the epoch's last may be shorter
        assert r['steps'] == steps and r['windows'] >= 2 and r['steps_timed'] == r['windows'] * every
        assert steps - train['warmup_steps'] - every < r['steps_timed'] <= steps - train['warmup_steps']
        _positive_stats(r['images_per_s_per_gpu'])
        assert 0 <= r['data_share']['min'] <= r['data_share']['max'] < 1
        assert 0 <= r['data_wait_at_loader'] < 1  # diffzoo's own line: the loop's time inside the loader
        assert r['loader_bound'] == (r['data_wait_at_loader'] > train['loader_bound_share'])
    diff, base = train['rows']
    assert train['train_time_ratio'] == pytest.approx(
        base['images_per_s_per_gpu']['median'] / diff['images_per_s_per_gpu']['median'])
    assert 'scripts/train.sh end to end' in stdout.getvalue()


def test_end_to_end_log_lines_are_open_clip_train_s_windows_of_steps(tmp_path):
    """The parser reads the lines open_clip_train's train_one_epoch logs every 3 steps (its format string, filled
    in; two processes of 8 images a step; two epochs of 8 steps, each counting its samples from 0): each line is a
    window of the steps since the line before, its means and images/s per GPU from them, and summarise keeps the
    whole windows after the warm-up (not an epoch's last, shorter one)."""
    def line(epoch, samples, data_s, batch_s, last_s):  # open_clip's images/s are of the window's last step alone
        return (f'2026-11-24,14:00:00 | INFO | Train Epoch: {epoch} [{samples:>3}/128 ({100 * samples / 128:.0f}%)] '
                f'Data (t): {data_s:.3f} Batch (t): {batch_s:.3f}, {16 / last_s:#g}/s, {8 / last_s:#g}/s/gpu '
                f'LR: 0.000100 Logit Scale: 14.286 Contrastive_loss: 2.0794 (2.0794)')
    epoch = [(16, 2.0, 3.0, 3.0), (64, 0.01, 0.25, 0.2), (112, 0.03, 0.5, 0.4), (128, 0.0, 0.2, 0.2)]
    log = '\n'.join([line(0, *w) for w in epoch] + [line(1, *w) for w in epoch])
    windows = end_to_end.parse_steps(log)
    assert [(w['epoch'], w['first_step'], w['steps']) for w in windows] == [
        (0, 0, 1), (0, 1, 3), (0, 4, 3), (0, 7, 1), (1, 8, 1), (1, 9, 3), (1, 12, 3), (1, 15, 1)]
    assert [w['images_per_s_per_gpu'] for w in windows[:4]] == pytest.approx([8 / 3.0, 32.0, 16.0, 40.0])
    assert [(w['data_s'], w['batch_s']) for w in windows[:4]] == [(2.0, 3.0), (0.01, 0.25), (0.03, 0.5), (0.0, 0.2)]
    path = tmp_path / 'out.log'
    path.write_text(log)
    row = end_to_end.summarise('r', path, warmup=1)
    assert (row['steps'], row['windows'], row['steps_timed']) == (16, 4, 12)
    assert row['images_per_s_per_gpu']['median'] == pytest.approx(24.0)
    assert row['data_share']['values'] == pytest.approx([0.04, 0.06, 0.04, 0.06])
    assert row['logging_share'] == pytest.approx(1 / 3) and not row['loader_bound']
    assert end_to_end.log_every(84, 5) == 19 and end_to_end.log_every(4, 1) == 1


def test_model_flag_repeats_and_is_the_one_spelling(capsys):
    assert parser().parse_args(['--model', 'a', 'b', '--model', 'c']).models == ['a', 'b', 'c']
    with pytest.raises(SystemExit):
        parser().parse_args(['--models', 'd'])  # retired
    assert 'unrecognized arguments: --models' in capsys.readouterr().err


def test_a_model_named_with_a_kernel_runs_it_beside_the_run_s_kernel_and_variants_pick_layer_rows(tmp_path):
    """NAME@KERNEL builds NAME with that split kernel on every differential layer, as its own row against
    the same baseline; --variants measures those layer rows and the sdpa baseline only."""
    from diffzoo.bench.whole_model import build
    from diffzoo.layers import DifferentialAttention
    layers = [m for m in build('diffclip-tiny@two_calls', 2, torch.device('cpu'), 'four_calls').model.modules()
              if isinstance(m, DifferentialAttention)]
    assert layers and {m.split_kernel for m in layers} == {'two_calls'}
    out = tmp_path / 'b.json'
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(['--smoke', '--device', 'cpu', '--sections', 'layer', 'model', '--split-kernel', 'four_calls',
                     '--model', 'diffclip-tiny', 'diffclip-tiny@two_calls', 'clip-tiny-baseline',
                     '--variants', 'split-fused', '--out', str(out)]) == 0
    results = json.loads(out.read_text())
    rows = {r['model']: r for r in results['models']['rows']}
    assert set(rows) == {'diffclip-tiny', 'diffclip-tiny@two_calls', 'clip-tiny-baseline'}
    assert rows['clip-tiny-baseline']['ratios']['train_time'] == 1.0
    assert {r['variant'] for r in results['layers']['rows']} == {'sdpa', 'split-fused'}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the caching allocator's counts need CUDA")
def test_on_cuda_each_block_counts_the_allocators_driver_calls():
    """On CUDA every block of every model carries the cudaMalloc and cudaFree calls and retries made during it:
    the first model's first block allocates its step's memory (no warm-up ran), and no count is negative."""
    from diffzoo.bench.whole_model import build, time_blocks
    cuda = torch.device('cuda')
    subjects = [build(name, 4, cuda, 'auto', 'bf16') for name in ('diffclip-tiny', 'clip-tiny-baseline')]
    torch.cuda.empty_cache()
    timed = time_blocks(subjects, 'train', 'bf16', 2, 2, 0, cuda)
    for name, row in timed.items():
        assert len(row['allocator']) == 2 and all(set(a) == {'num_device_alloc', 'num_device_free',
                                                              'num_alloc_retries'} for a in row['allocator'])
        assert all(v >= 0 for a in row['allocator'] for v in a.values())
    assert timed['diffclip-tiny']['allocator'][0]['num_device_alloc'] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason='kernels on the GPU timeline need CUDA')
def test_steps_on_cuda_give_each_step_its_kernels_and_split_its_time():
    """On the GPU each profiled step's kernels are the ones its host range launched: the same kernels, as often,
    in every step, their busy time within the step's time, and the comparison splits kernel time from idle time."""
    from diffzoo.bench.step_profile import profile_steps
    m = profile_steps('diffclip-tiny', 8, 'bf16', 4, 1, torch.device('cuda'), 'auto')
    rows = m['profiled']['rows']
    for r in rows:
        gpu = r['gpu']
        assert gpu['kernels'] > 50 and 0 < gpu['busy_ms'] <= r['time_s'] * 1e3 * 1.05 and gpu['gaps_ms'] >= 0
        assert set(r['allocator']) == {'num_device_alloc', 'num_device_free', 'num_alloc_retries'}
    assert len({tuple(sorted((k, v['count']) for k, v in r['gpu']['by_name'].items())) for r in rows}) == 1
    assert {'GPU kernel time', 'GPU idle, waiting for the host'} <= set(m['slow_vs_fast']['parts_ms'])
