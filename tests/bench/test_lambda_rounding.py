"""`python -m diffzoo.bench.lambda_rounding`: dL/dλ's error per sample under each path's fp16 rounding, against the
tests' layer in fp64."""
import copy
import json

import pytest
import torch

from diffzoo.bench import lambda_rounding


def test_the_model_without_rounding_is_the_fp64_layer_s_dlambda():
    """−Σ dD·(A2V) per head in fp64 equals dL/dλ that autograd gives the real layer in fp64, read off λ_q1."""
    m64 = copy.deepcopy(lambda_rounding.tests_layer(128, 2, 3, torch.device('cpu'))).double()
    torch.manual_seed(1)
    x, grad = torch.randn(1, 50, 128, dtype=torch.float64), torch.randn(1, 50, 128, dtype=torch.float64)
    truth = lambda_rounding.layer_dlambda(m64, x, grad)
    assert abs(truth) > 1e-3
    assert lambda_rounding.modelled_dlambda(m64, x[0], grad[0], 'exact') == pytest.approx(truth, rel=1e-10)


def test_fp16_rounding_costs_dlambda_far_more_than_the_fp32_reference_and_the_summary_reads_the_draws(tmp_path):
    out = tmp_path / 'rounding.json'
    assert lambda_rounding.main(['--tokens', '64', '--dim', '128', '--heads', '2', '--draws', '3',
                                 '--out', str(out)]) == 0
    result = json.loads(out.read_text())
    s = result['summary']
    assert set(s) == set(lambda_rounding.PATHS) and len(result['draws']) == 3
    assert s['fp32']['rms'] * 10 < s['inputs']['rms']
    errors = [d['two_calls'] for d in result['draws']]
    assert s['two_calls']['rms'] == pytest.approx((sum(e * e for e in errors) / 3) ** 0.5)
    assert s['two_calls']['batch_256_rms'] == pytest.approx(16 * s['two_calls']['rms'])


def test_cuda_asked_for_without_a_gpu_is_refused(capsys):
    if torch.cuda.is_available():
        pytest.skip('a GPU is here')
    assert lambda_rounding.main(['--device', 'cuda']) == 2
    assert 'no CUDA device here' in capsys.readouterr().err


@pytest.mark.slow  # the Triton interpreter
def test_a_batch_in_one_call_errs_as_its_samples_alone_sum_and_the_summary_reads_the_draws(tmp_path):
    """--batch: per draw, the error of one call on B samples, the sum of the samples' errors called alone, and what
    the call adds: here (the interpreter, IEEE arithmetic) within the rounding of fp32 sums of dL/dλ's size, which
    each path's own error exceeds several times over."""
    out = tmp_path / 'batch.json'
    assert lambda_rounding.main(['--tokens', '64', '--dim', '128', '--heads', '2', '--batch', '3', '--draws', '2',
                                 '--triton', '--out', str(out)]) == 0
    result = json.loads(out.read_text())
    assert result['batch'] == 3 and len(result['draws']) == 2
    for draw in result['draws']:
        for kernel in ('two_calls', 'triton'):
            row = draw[kernel]
            assert row['interaction'] == pytest.approx(row['batch'] - row['samples'])
            rounding = 16 * torch.finfo(torch.float32).eps * abs(draw['dlambda'])
            assert abs(row['interaction']) < rounding < abs(row['samples']) / 4
    s = result['summary']['triton']
    assert s['batch'] == pytest.approx((sum(d['triton']['batch'] ** 2 for d in result['draws']) / 2) ** 0.5)
    assert lambda_rounding.main(['--batch', '0']) == 2
