"""The saved-outputs op's chain through torch.compile (`sub_norm.COMPILED`) against plain autograd in fp64.

The reference is the op's formula written with ordinary differentiable torch calls in fp64; the
compiled chain's error in each dtype must stay within twice the eager chain's (plus one unit of
the dtype at the tensor's scale, as the compiled chain keeps fp32 between passes that eager rounds).
"""
import pytest
import torch
import torch.nn.functional as F

from diffzoo.layers.kernels import sub_norm

DEVICE = 'cuda' if torch.cuda.is_available() else 'cpu'


def _reference(o1, o2, lam, weight, eps, proj):
    """RMSNorm(A1V − λ·A2V) · weight, then the projection, by plain autograd."""
    diff = torch.cat(o1, -1) - lam * torch.cat(o2, -1)  # (B, N, h, D)
    y = F.rms_norm(diff, (diff.shape[-1],), weight, eps)
    return y if proj is None else F.linear(y.flatten(-2), *proj)


def _grads(compiled, monkeypatch, inputs, dtype, with_proj, grad):
    monkeypatch.setattr(sub_norm, 'COMPILED', compiled)
    o1, o2, lam, weight, proj = [[t.detach().to(dtype).requires_grad_() for t in x] if isinstance(x, list)
                                 else x for x in inputs]
    lam = lam.detach().clone().requires_grad_()  # λ stays fp32, as the layers pass it
    weight = weight.detach().to(dtype).requires_grad_()
    linear = None
    if with_proj:
        linear = torch.nn.Linear(proj[0].shape[1], proj[0].shape[0], device=DEVICE, dtype=dtype)
        with torch.no_grad():
            linear.weight.copy_(proj[0])
            linear.bias.copy_(proj[1])
    y = sub_norm.sub_normed_difference(o1, o2, lam, weight, 1e-5, *((linear.weight, linear.bias) if with_proj else ()))
    y.backward(grad.to(y.dtype))
    extra = [linear.weight.grad, linear.bias.grad] if with_proj else []
    return [y] + [t.grad for t in o1 + o2] + [lam.grad, weight.grad] + extra


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
@pytest.mark.parametrize('parts, with_proj', [(2, True), (1, False)])
def test_compiled_chain_is_as_accurate_as_eager(monkeypatch, dtype, parts, with_proj):
    torch.manual_seed(0)
    B, N, h, D = 2, 9, 3, 16
    widths = [D] if parts == 1 else [D // 2, D // 2]
    rnd = lambda *s: torch.randn(*s, device=DEVICE, dtype=torch.float64).to(dtype).double()  # dtype-exact
    o1, o2 = [rnd(B, N, h, w) for w in widths], [rnd(B, N, h, w) for w in widths]
    lam, weight = torch.tensor(0.3, device=DEVICE), rnd(D)
    proj = [rnd(h * D, h * D) * 0.1, rnd(h * D)] if with_proj else None
    grad = rnd(B, N, h * D) if with_proj else rnd(B, N, h, D)

    leaves = [t.clone().requires_grad_() for t in o1 + o2] + [lam.double().requires_grad_(), weight.clone().requires_grad_()]
    proj64 = [p.clone().requires_grad_() for p in proj] if with_proj else None
    ref = _reference(leaves[:parts], leaves[parts:2 * parts], leaves[-2], leaves[-1], 1e-5, proj64)
    ref.backward(grad)
    reference = [ref] + [t.grad for t in leaves] + ([p.grad for p in proj64] if with_proj else [])

    inputs = (o1, o2, lam, weight, proj)
    eager = _grads(False, monkeypatch, inputs, dtype, with_proj, grad)
    compiled = _grads(True, monkeypatch, inputs, dtype, with_proj, grad)
    unit = torch.finfo(dtype).eps
    for name, r, e, c in zip(['out', *(f'part{i}' for i in range(2 * parts)), 'lambda', 'weight', 'proj.weight',
                              'proj.bias'], reference, eager, compiled):
        err_e, err_c = (e.double() - r).abs().max().item(), (c.double() - r).abs().max().item()
        bound = 2 * err_e + unit * r.abs().max().item() + 1e-12
        assert err_c <= bound, f'{name}: compiled error {err_c:.3g} > {bound:.3g} (eager {err_e:.3g})'
