"""Every tracer PyTorch offers takes `DifferentialAttention`: TorchScript, torch.fx, torch.compile(fullgraph=True)
and torch.export, for each variant, λ_init form, path and mask. The models built from the layer are traced in
tests/models, tests/clip and tests/vlm (ONNX in tests/clip/test_tracing.py).

The rules that keep the layer so, which these tests hold it to:
- no Python branch in `forward` (or the methods it calls) on a tensor's value, or on the dtype, shape or
  device of an argument that may be a symbolic value (`attn_mask` is one);
- choices are made at construction (the variant's head counts and qkv split are plain ints, v2 is told by
  `lambda_proj is not None`, which TorchScript resolves statically), by attributes set from outside
  (`fused_attn`, `split_kernel`), or inside the kernel functions of `diffzoo.layers.kernels`, which torch.fx
  records as leaves and which run their choices on real tensors when the graph runs;
- what TorchScript cannot compile sits behind `torch.jit.is_scripting()`: scripted, a `split_kernel="triton"`
  layer selects the `auto` SDPA kernel by itself, the saved-outputs op runs its forward chain under ordinary
  autograd (same numbers, more memory), and the output projection is not folded into it. An fx graph runs the
  same kernels as eager mode, the Triton one included (it sits inside a leaf); torch.compile and torch.export
  see it as one custom op. `DIFFZOO_COMPILED_SUB_NORM=1` (opt-in) compiles the saved-outputs op's chains in
  eager mode and in fx graphs; inside torch.compile and TorchScript they run as written."""
import warnings

import pytest
import torch
import torch.fx

from diffzoo.layers import VARIANTS, DifferentialAttention

B, N, DIM, HEADS = 2, 9, 64, 4
CASES = [(variant, lambda_init) for variant in VARIANTS for lambda_init in (0.8, 'depth')]


def _masks():
    bool_mask = torch.rand(B, 1, N, N) > 0.3
    bool_mask[..., 0] = True  # every query sees at least one key
    return {
        'none': (None, False),
        'is_causal': (None, True),
        'bool': (bool_mask, False),
        'per_head_additive': (torch.randn(B, HEADS, N, N), False),
    }


def _layer(variant, lambda_init, fused=True, **kw):
    m = DifferentialAttention(DIM, num_heads=HEADS, qkv_bias=True, variant=variant, lambda_init=lambda_init,
                              depth=3, **kw)
    if variant == 'v2':  # a non-zero λ projection, so per-token λ is exercised
        torch.nn.init.normal_(m.lambda_proj.weight, std=0.5)
    m.fused_attn = fused
    return m


def _outputs(module, params, x, mask, is_causal):
    """Output, input gradient and parameter gradients of one forward/backward of `module`."""
    x = x.detach().clone().requires_grad_(True)
    out = module(x, mask, is_causal)
    out.square().sum().backward()
    grads = [x.grad] + [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return [out.detach()] + grads


@pytest.mark.parametrize('fused', [True, False], ids=['fused', 'explicit'])
@pytest.mark.parametrize('variant, lambda_init', CASES)
def test_torchscript_matches_eager_with_and_without_masks(variant, lambda_init, fused):
    """Scripted, the fused path runs the saved-outputs op's forward chain under ordinary autograd
    (its output projection unfolded): the same numbers to fp32 rounding, gradients included."""
    m = _layer(variant, lambda_init, fused)
    scripted = torch.jit.script(m)
    params = list(m.parameters())
    x = torch.randn(B, N, DIM)
    for name, (mask, is_causal) in _masks().items():
        eager = _outputs(m, params, x, mask, is_causal)
        script = _outputs(scripted, params, x, mask, is_causal)
        for a, b in zip(eager, script):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5 * max(1., a.abs().max().item()), msg=name)


@pytest.mark.parametrize('fused', [True, False], ids=['fused', 'explicit'])
@pytest.mark.parametrize('variant, lambda_init', CASES)
def test_fx_trace_runs_the_eager_kernels_exactly_with_and_without_masks(variant, lambda_init, fused):
    """torch.fx records the kernel functions as leaves (the mask and is_causal stay graph inputs), so
    a traced layer gives eager mode's numbers bit for bit, forward and backward, and scripts too."""
    m = _layer(variant, lambda_init, fused)
    traced = torch.fx.symbolic_trace(m)
    called = {n.target.__name__ for n in traced.graph.nodes if n.op == 'call_function' and callable(n.target)}
    expected = ({'v2_attention'} if variant == 'v2' else {f'{variant}_attention'}) if fused \
        else {'add_mask', 'explicit_output'}
    assert expected <= called, called
    params = list(m.parameters())
    x = torch.randn(B, N, DIM)
    for name, (mask, is_causal) in _masks().items():
        for a, b in zip(_outputs(m, params, x, mask, is_causal), _outputs(traced, params, x, mask, is_causal)):
            assert torch.equal(a, b), name
    mask, is_causal = _masks()['bool']
    torch.testing.assert_close(torch.jit.script(traced)(x, mask, is_causal), m(x, mask, is_causal),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize('variant', VARIANTS)
def test_compile_fullgraph_and_export_with_masks(variant):
    """No graph break (fullgraph=True; AOTAutograd traces the backward too) and an exported program
    equal to eager, with a boolean and a per-head additive mask as graph inputs."""
    m = _layer(variant, 'depth')
    params = list(m.parameters())
    compiled = torch.compile(m, fullgraph=True, backend='aot_eager')
    x = torch.randn(B, N, DIM)
    for name in ('bool', 'per_head_additive'):
        mask, _ = _masks()[name]
        eager = _outputs(m, params, x, mask, False)
        for a, b in zip(eager, _outputs(compiled, params, x, mask, False)):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5 * max(1., a.abs().max().item()), msg=name)
        exported = torch.export.export(m.eval(), (x, mask))
        assert torch.equal(exported.module()(x, mask), m(x, mask)), name
        m.train()
    torch._dynamo.reset()


def test_a_scripted_triton_layer_selects_the_sdpa_kernel_by_itself():
    """TorchScript cannot compile the Triton custom op: a scripted split_kernel='triton' layer runs
    the auto SDPA kernel, with no warning and the eager layer's numbers."""
    m = _layer('split', 0.8, split_kernel='triton').eval()
    x = torch.randn(B, N, DIM)
    with warnings.catch_warnings():
        warnings.filterwarnings('error', message='split_kernel')
        out = torch.jit.script(m)(x)
    m.split_kernel = 'auto'
    torch.testing.assert_close(out, m(x), rtol=1e-5, atol=1e-5)
