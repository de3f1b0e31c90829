"""`python -m diffzoo.bench.lambda_error`: the Triton kernel's dL/dλ row by row against fp64, under Triton's interpreter."""
import pytest
import torch

from diffzoo.bench import lambda_error
from diffzoo.layers import kernels

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not kernels.HAS_TRITON or (not torch.cuda.is_available() and not kernels.INTERPRETED),
    reason='needs Triton, and a GPU or TRITON_INTERPRET=1 set before diffzoo is imported')]
DEVICE = torch.device('cuda' if torch.cuda.is_available() else 'cpu')


def test_reference_rows_sum_to_autograd_s_dlambda_in_fp64():
    """−Σ ρ2 over the rows is dL/dλ: autograd through D = A1V − λ·A2V and the sub-norm, fp64, same inputs."""
    a = lambda_error.layer_inputs(2, 40, 128, 1, torch.float16, DEVICE, seed=1)
    q, k, v = (t.double() for t in (a['q'], a['k'], a['v']))
    lam = a['lam'].double().clone().requires_grad_(True)
    maps = torch.softmax(q @ k.transpose(-1, -2) * a['scale'], -1)  # (B, 2, N, N)
    D = (maps[:, 0:1] - lam * maps[:, 1:2]) @ v  # (B, 1, N, 2d)
    y = torch.nn.functional.rms_norm(D.transpose(1, 2), [v.shape[-1]], a['weight'].double(), a['eps'])
    (y.flatten(-2) * a['dy'].double()).sum().backward()
    assert -lambda_error.reference_rows(a).sum().item() == pytest.approx(lam.grad.item(), rel=1e-9, abs=1e-9)


def test_the_kernel_s_dlambda_rows_are_closer_to_fp64_than_two_calls_at_vit_b_head_widths():
    """One differential head of ViT-B's widths (q/k 64, v 128), fp16, 300 tokens (the online-softmax path):
    the kernel's per-row error in dL/dλ is below two_calls' (SDPA's outputs rounded to fp16 before the
    difference), and so is its error of the sum."""
    result = lambda_error.measure(2, 300, 128, 1, torch.float16, DEVICE, seed=0)
    kernel, two_calls = result['kernel'], result['two_calls']
    assert result['rows'] == 2 * 300
    assert 0 < kernel['row_rms'] < two_calls['row_rms'] / 2, (kernel, two_calls)
    assert abs(kernel['dlambda_error']) <= 2 * abs(two_calls['dlambda_error']) + 1e-3 * abs(result['dlambda'])
    # the op's own fp32 sum of the rows differs from their fp64 sum by that sum's rounding at most
    rows = lambda_error.kernel_rows(lambda_error.layer_inputs(2, 300, 128, 1, torch.float16, DEVICE, seed=0))
    bound = rows.numel() * torch.finfo(torch.float32).eps * rows.abs().sum().item()
    assert abs(kernel['dlambda_error_as_op'] - kernel['dlambda_error']) <= bound, (kernel, bound)


def test_as_test_draws_the_gpu_tests_own_layer_and_inputs_and_takes_the_layer_whole(tmp_path):
    """--as-test: the layer and the inputs are those of tests/layers/test_kernels.py's bench-shape test at the same
    tokens and batch, bit for bit; the layer whole runs the same op as the rows (the kernel's dL/dλ in the layer is
    its op's, to an fp32 sum's rounding), and the fp32 reference is far nearer fp64 than the 16-bit inputs are."""
    import json

    from diffzoo.bench.lambda_rounding import tests_layer
    from tests.layers import test_kernels as gpu_test
    n, batch = 16, 2
    torch.manual_seed(n + batch)
    theirs = gpu_test._layer(768, 6)
    ours = tests_layer(768, 6, n + batch, DEVICE)
    assert all(torch.equal(a, b) for a, b in zip(theirs.state_dict().values(), ours.state_dict().values()))
    torch.manual_seed(n + batch + 1000)
    x = gpu_test._bf16_exact(torch.randn(batch, n, 768, device=DEVICE))
    grad = gpu_test._bf16_exact(torch.randn(batch, n, 768, device=DEVICE))
    drawn = lambda_error.draw(batch, n, 768, DEVICE, n + batch + 1000)
    assert torch.equal(drawn[0], x) and torch.equal(drawn[1], grad)

    out = tmp_path / 'as-test.json'
    assert lambda_error.main(['--device', DEVICE.type, '--tokens', str(n), '--batch', str(batch), '--seeds', '2',
                              '--as-test', '--out', str(out)]) == 0
    result = json.loads(out.read_text())
    assert [d['seed'] for d in result['draws']] == [n + batch, n + batch + 1000]
    for d in result['draws']:
        layer = d['layer']
        assert abs(layer['kernel_in_layer_minus_op']) <= 1e-5 * abs(layer['dlambda']) + 1e-6, layer
        fp64 = layer['against_fp64']
        assert abs(fp64['fp32 reference']) * 10 < abs(fp64['16-bit inputs']), fp64
    test = result['summary']['layer']['against_fp32_reference']
    assert result['summary']['layer']['test_rule_holds'] == (test['triton'] <= 2 * test['two_calls'])
