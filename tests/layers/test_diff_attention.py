import math
import pickle
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from timm.layers import Attention, DiffAttention

from diffzoo.layers import VARIANTS, DifferentialAttention, capture_attention_maps, diff_attn_layer, resolve_lambda_init
from diffzoo.layers.kernels import SPLIT_KERNELS, sub_normed_difference
from tests.layers.helpers import saved_bytes

B, N, DIM, HEADS = 2, 9, 64, 4


def _masks():
    causal = torch.full((N, N), float('-inf')).triu(1)
    bool_mask = torch.rand(B, 1, N, N) > 0.3
    bool_mask[..., 0] = True  # every query sees at least one key
    additive = torch.randn(B, HEADS, N, N)
    return {
        'none': dict(),
        'is_causal': dict(is_causal=True),
        'causal_additive': dict(attn_mask=causal),
        'bool': dict(attn_mask=bool_mask),
        'per_head_additive': dict(attn_mask=additive),
    }


def _layer(variant, lambda_init=0.8, depth=2, **kw):
    m = DifferentialAttention(DIM, num_heads=HEADS, qkv_bias=True, variant=variant,
                              lambda_init=lambda_init, depth=depth, **kw)
    if variant == 'v2':  # non-zero λ projection so per-token λ is exercised
        torch.nn.init.normal_(m.lambda_proj.weight, std=0.5)
    return m


def _run(m, x, fused, mask_kw):
    m.fused_attn = fused
    x = x.detach().clone().requires_grad_(True)
    out = m(x, **mask_kw)
    out.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    return out.detach(), x.grad, grads


def _assert_fused_matches_explicit(m, mask_kw):
    """Output, input gradient and every parameter gradient agree between the fused and explicit paths."""
    x = torch.randn(B, N, DIM)
    out_f, gx_f, g_f = _run(m, x, True, mask_kw)
    out_e, gx_e, g_e = _run(m, x, False, mask_kw)
    torch.testing.assert_close(out_f, out_e, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx_f, gx_e, rtol=1e-5, atol=1e-5)
    assert g_f.keys() == g_e.keys()
    for name in g_f:  # fp32 rounding scales with the gradient's magnitude
        atol = 1e-5 * max(1., g_e[name].abs().max().item())
        torch.testing.assert_close(g_f[name], g_e[name], rtol=1e-5, atol=atol, msg=name)


@pytest.mark.parametrize('variant', VARIANTS)
@pytest.mark.parametrize('mask', list(_masks()))
@pytest.mark.parametrize('lambda_init', [0.8, 'depth'])
def test_fused_and_explicit_agree(variant, mask, lambda_init):
    _assert_fused_matches_explicit(_layer(variant, lambda_init), _masks()[mask])


@pytest.mark.parametrize('kernel', SPLIT_KERNELS)
@pytest.mark.parametrize('mask', list(_masks()))
def test_every_split_kernel_matches_the_explicit_path(kernel, mask):
    m = _layer('split', split_kernel=kernel)
    assert m.split_kernel == kernel
    _assert_fused_matches_explicit(m, _masks()[mask])


@pytest.mark.parametrize('variant', ['split', 'duplicate'])
def test_scale_norm_and_a_hooked_or_wrapped_proj_take_the_unfolded_path(variant):
    """The fused op applies `proj` itself only when it is a plain Linear: a scale norm, a hook or a
    wrapper around `proj` is honoured, and every path gives the explicit path's numbers."""
    _assert_fused_matches_explicit(_layer(variant, scale_norm=True), {})
    m = _layer(variant)
    calls = []
    handle = m.proj.register_forward_hook(lambda mod, args, out: calls.append(out.shape))
    _assert_fused_matches_explicit(m, {})
    assert calls == [(B, N, DIM)] * 2  # fused and explicit forward both ran the hook
    handle.remove()

    class Wrapped(torch.nn.Linear):  # e.g. an adapter wrapping the projection
        def forward(self, x):
            return super().forward(x) * 2

    x = torch.randn(B, N, DIM)
    plain = m(x)
    wrapped = Wrapped(DIM, DIM)
    wrapped.load_state_dict(m.proj.state_dict())
    m.proj = wrapped
    assert m._folded_proj() == (None, None)
    torch.testing.assert_close(m(x), 2 * plain)
    _assert_fused_matches_explicit(m, {})


@pytest.mark.parametrize('parts', [1, 2])
@pytest.mark.parametrize('with_proj', [False, True])
def test_sub_normed_difference_backward_matches_finite_differences(parts, with_proj):
    """The hand-written backward (difference and normed heads recomputed) against gradcheck, fp64."""
    torch.manual_seed(0)
    b, n, h, width = 2, 3, 2, 4
    o = [torch.randn(b, n, h, width // parts, dtype=torch.float64, requires_grad=True) for _ in range(2 * parts)]
    lam = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(width, dtype=torch.float64, requires_grad=True)
    proj = torch.nn.Linear(h * width, 5, dtype=torch.float64) if with_proj else None
    proj_args = (proj.weight, proj.bias) if with_proj else ()

    def f(lam, weight, *o):
        return sub_normed_difference(list(o[:parts]), list(o[parts:]), lam, weight, 1e-6, *proj_args)

    assert torch.autograd.gradcheck(f, (lam, weight, *o))
    if with_proj:
        proj.zero_grad()
        out = f(lam, weight, *o)
        out.square().sum().backward()
        diff = torch.cat(o[:parts], -1) - lam * torch.cat(o[parts:], -1)
        normed = F.rms_norm(diff, (width,), weight, 1e-6).flatten(-2).detach()
        grad_out = 2 * out.detach()
        torch.testing.assert_close(proj.weight.grad, grad_out.reshape(-1, 5).t() @ normed.reshape(-1, h * width))
        torch.testing.assert_close(proj.bias.grad, grad_out.reshape(-1, 5).sum(0))


@pytest.mark.parametrize('kernel', ['auto', 'four_calls'])
def test_fused_split_saves_one_activation_more_than_sdpa_attention(kernel):
    """Training memory: SDPA keeps A1V and A2V (its backward needs them); the difference, the
    normed heads and the projection input are recomputed, so the layer saves one (B, N, C) more
    than timm's SDPA Attention and never an N×N map."""
    b, n, dim = 4, 64, 128
    x = torch.randn(b, n, dim, requires_grad=True)
    plain = saved_bytes(Attention(dim, num_heads=4, qkv_bias=True), x)
    diff = saved_bytes(DifferentialAttention(dim, num_heads=2, qkv_bias=True, split_kernel=kernel), x)
    activation = b * n * dim * 4
    params = 4 * (dim // 4) * 4 + dim // 2 * 4  # λ vectors and the sub-norm weight
    row_stats = 4 * b * 2 * n * 4  # SDPA's log-sum-exp per query row: at most 4 calls of 2 heads
    assert diff - plain <= activation + params + row_stats, (diff - plain) / activation


def test_split_matches_formula_written_out():
    m = _layer('split', 0.8)
    x = torch.randn(B, N, DIM)
    h, d = HEADS, DIM // HEADS // 2
    q, k, v = F.linear(x, m.qkv.weight, m.qkv.bias).chunk(3, -1)
    q = q.view(B, N, h, 2, d)
    k = k.view(B, N, h, 2, d)
    v = v.view(B, N, h, 2 * d).transpose(1, 2)
    a1 = torch.einsum('bihd,bjhd->bhij', q[..., 0, :], k[..., 0, :]).div(math.sqrt(d)).softmax(-1)
    a2 = torch.einsum('bihd,bjhd->bhij', q[..., 1, :], k[..., 1, :]).div(math.sqrt(d)).softmax(-1)
    lam = (torch.exp(m.lambda_q1 @ m.lambda_k1) - torch.exp(m.lambda_q2 @ m.lambda_k2) + 0.8)
    o = (a1 - lam * a2) @ v
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-5) * m.sub_norm.weight * (1 - 0.8)
    expected = F.linear(o.transpose(1, 2).reshape(B, N, DIM), m.proj.weight, m.proj.bias)
    torch.testing.assert_close(m(x), expected, rtol=1e-5, atol=1e-5)


def test_duplicate_uses_one_map_from_the_undivided_heads():
    m = _layer('duplicate', 'depth', depth=5)
    x = torch.randn(B, N, DIM)
    q, k, v = (t.view(B, N, HEADS, DIM // HEADS).transpose(1, 2)
               for t in F.linear(x, m.qkv.weight, m.qkv.bias).chunk(3, -1))
    lam = m.compute_lambda(x)
    o = (1 - lam) * F.scaled_dot_product_attention(q, k, v)
    o = m.sub_norm(o) * (1 - resolve_lambda_init('depth', 5))
    expected = m.proj(o.transpose(1, 2).reshape(B, N, DIM))
    torch.testing.assert_close(m(x), expected, rtol=1e-5, atol=1e-5)


def test_v2_pairs_query_heads_on_shared_kv_with_token_lambda():
    m = _layer('v2')
    x = torch.randn(B, N, DIM)
    d = DIM // HEADS
    q, k, v = F.linear(x, m.qkv.weight, m.qkv.bias).split([2 * DIM, DIM, DIM], -1)
    q = q.view(B, N, 2 * HEADS, d).transpose(1, 2)
    k = k.view(B, N, HEADS, d).transpose(1, 2)
    v = v.view(B, N, HEADS, d).transpose(1, 2)
    lam = torch.sigmoid(m.lambda_proj(x)).transpose(1, 2).unsqueeze(-1)  # (B, h, N, 1)
    heads = []
    for i in range(HEADS):
        o1 = F.scaled_dot_product_attention(q[:, 2 * i], k[:, i], v[:, i])
        o2 = F.scaled_dot_product_attention(q[:, 2 * i + 1], k[:, i], v[:, i])
        heads.append(o1 - lam[:, i] * o2)
    expected = m.proj(torch.stack(heads, 1).transpose(1, 2).reshape(B, N, DIM))
    torch.testing.assert_close(m(x), expected, rtol=1e-5, atol=1e-5)
    names = dict(m.named_parameters())
    assert 'lambda_q1' not in names and 'sub_norm.weight' not in names
    assert names['qkv.weight'].shape == (4 * DIM, DIM)
    assert lam.std() > 0  # λ differs by token and head


@pytest.mark.parametrize('variant', VARIANTS)
def test_explicit_maps_rows_sum_to_one_minus_lambda(variant):
    m = _layer(variant)
    x = torch.randn(B, N, DIM)
    model = torch.nn.Sequential(m)
    with capture_attention_maps(model) as maps:
        model(x)
    assert m.fused_attn, 'fused path restored after capture'
    attn = maps['0']
    assert attn.shape == (B, HEADS, N, N) and attn.dtype == torch.float32
    lam = m.compute_lambda(x)
    expected = (1 - lam).expand(B, HEADS, N, 1).squeeze(-1) if variant == 'v2' else (1 - lam).expand(B, HEADS, N)
    torch.testing.assert_close(attn.sum(-1), expected, rtol=1e-5, atol=1e-5)


def test_lambda_init_policies():
    assert resolve_lambda_init(0.8, 7) == 0.8
    assert resolve_lambda_init('depth', 0) == pytest.approx(0.2)
    assert resolve_lambda_init('depth', 3) == pytest.approx(0.8 - 0.6 * math.exp(-0.9))
    for depth in range(4):
        m = DifferentialAttention(DIM, HEADS, depth=depth, lambda_init='depth')
        assert m.lambda_init == pytest.approx(0.8 - 0.6 * math.exp(-0.3 * depth))
    with pytest.raises(ValueError, match='lambda_init'):
        DifferentialAttention(DIM, HEADS, lambda_init='layer')


BAD_LAMBDA_INITS = [1.0, 1, 1.5, -0.1, float('nan'), float('inf'), float('-inf'), True, False, None, 'layer', [0.8]]


@pytest.mark.parametrize('lambda_init', BAD_LAMBDA_INITS, ids=repr)
def test_lambda_init_outside_zero_one_is_refused_by_name(lambda_init):
    """At 1 the (1 − λ_init) sub-norm scale zeroes every head; NaN/inf reach the outputs; bools are no numbers."""
    message = rf"lambda_init={re.escape(repr(lambda_init))}: expected a number in \[0, 1\) or 'depth'.*lambda_init=0\.8"
    diff_attn_layer('split', 0.0)  # cached first: False (== 0) is still refused
    with pytest.raises(ValueError, match=message):
        resolve_lambda_init(lambda_init, 0)
    with pytest.raises(ValueError, match=message):
        DifferentialAttention(DIM, HEADS, lambda_init=lambda_init)
    with pytest.raises(ValueError, match=message):
        diff_attn_layer('split', lambda_init)


@pytest.mark.parametrize('depth', [-1, 1.5, 2.0, True, None], ids=repr)
def test_depth_policy_refuses_a_depth_that_is_no_block_index(depth):
    with pytest.raises(ValueError, match=rf"depth={re.escape(repr(depth))}: lambda_init='depth' needs"):
        resolve_lambda_init('depth', depth)
    with pytest.raises(ValueError, match=rf'depth={re.escape(repr(depth))}'):
        DifferentialAttention(DIM, HEADS, depth=depth, lambda_init='depth')


def test_lambda_init_bounds_and_number_types_accepted():
    assert resolve_lambda_init(0, 3) == 0.0 and isinstance(resolve_lambda_init(0, 3), float)
    assert resolve_lambda_init(0.999, 0) == 0.999
    assert resolve_lambda_init(np.float32(0.5), 0) == 0.5
    assert resolve_lambda_init('depth', np.int64(2)) == pytest.approx(0.8 - 0.6 * math.exp(-0.6))
    assert DifferentialAttention(DIM, HEADS, lambda_init=0).lambda_init == 0.0


@pytest.mark.parametrize('variant, fused, kernel', [
    *[('split', True, k) for k in SPLIT_KERNELS], ('split', False, 'auto'),
    *[(v, f, 'auto') for v in ('duplicate', 'v2') for f in (True, False)],
])
def test_an_empty_batch_gives_an_empty_output_like_timm_attention(variant, fused, kernel):
    baseline = Attention(DIM, num_heads=HEADS)
    m = _layer(variant, split_kernel=kernel)
    m.fused_attn = fused
    for layer in (baseline, m):
        x = torch.randn(0, N, DIM, requires_grad=True)
        out = layer(x)
        assert out.shape == (0, N, DIM) and out.dtype == x.dtype
        out.square().sum().backward()
        assert x.grad.shape == (0, N, DIM)
        assert all(p.grad is not None and not p.grad.any() for p in layer.parameters()), 'no rows: zero gradients'


def test_bad_configuration_is_named():
    with pytest.raises(ValueError, match='num_heads=3'):
        DifferentialAttention(64, num_heads=3)
    with pytest.raises(ValueError, match="variant='diff2'"):
        DifferentialAttention(64, num_heads=4, variant='diff2')
    with pytest.raises(ValueError, match="split_kernel='flash'"):
        DifferentialAttention(64, num_heads=4, split_kernel='flash')


@pytest.mark.parametrize('kw', [dict(), dict(qkv_bias=True, qk_norm=True, scale_norm=True), dict(dual_lambda=True)],
                         ids=['plain', 'norms', 'dual_lambda'])
def test_split_is_built_as_timm_builds_diff_attention(kw):
    """The split layout is timm's: the same parameters in the same order, and from the same seed the same
    initial values (timm's order of initialisation)."""
    torch.manual_seed(0)
    ours = DifferentialAttention(DIM, num_heads=HEADS, depth=2, **kw)
    torch.manual_seed(0)
    timms = DiffAttention(DIM, num_heads=HEADS, depth=2, **kw)
    assert [(n, p.shape) for n, p in ours.named_parameters()] == [(n, p.shape) for n, p in timms.named_parameters()]
    for (name, a), b in zip(ours.state_dict().items(), timms.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_each_variant_builds_its_projections_once(monkeypatch):
    """Each variant's projections are built once, at their layout's widths (qkv, proj, then v2's W_λ), and
    λ is initialised once."""
    built, resets = [], []
    linear_init, reset = torch.nn.Linear.__init__, DifferentialAttention.reset_parameters
    monkeypatch.setattr(torch.nn.Linear, '__init__',
                        lambda self, i, o, *a, **k: built.append(o) or linear_init(self, i, o, *a, **k))
    monkeypatch.setattr(DifferentialAttention, 'reset_parameters', lambda self: resets.append(1) or reset(self))
    widths = {'split': [3 * DIM, DIM], 'duplicate': [3 * DIM, DIM], 'v2': [4 * DIM, DIM, HEADS]}
    for variant in VARIANTS:
        built.clear(), resets.clear()
        DifferentialAttention(DIM, num_heads=HEADS, variant=variant)
        assert built == widths[variant] and resets == [1], variant


@pytest.mark.parametrize('variant', VARIANTS)
def test_bf16_autocast_keeps_softmax_lambda_and_norm_in_fp32(variant):
    m = _layer(variant)
    x = torch.randn(B, N, DIM, requires_grad=True)
    ref = m(x)
    ref.square().sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    for fused in (True, False):
        m.fused_attn = fused
        m.zero_grad()
        with torch.autocast('cpu', dtype=torch.bfloat16):
            out = m(x)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), ref, rtol=0.05, atol=0.05)
        out.float().square().sum().backward()
        for name, p in m.named_parameters():
            assert p.grad.dtype == p.dtype, name
            scale = ref_grads[name].abs().max()
            torch.testing.assert_close(p.grad / scale, ref_grads[name] / scale, rtol=0.05, atol=0.05, msg=name)


def test_bound_classes_are_cached_named_and_pickle():
    cls = diff_attn_layer('split', 0.8)
    assert cls is diff_attn_layer('split', 0.8)
    assert cls.__name__ == 'DifferentialAttention_split_lambda_0p8'
    m = cls(DIM, num_heads=HEADS, depth=9)
    assert m.lambda_init == 0.8 and m.variant == 'split'
    m2 = pickle.loads(pickle.dumps(m))
    x = torch.randn(1, N, DIM)
    torch.testing.assert_close(m(x), m2(x))
    assert diff_attn_layer('v2', 'depth')(DIM, num_heads=HEADS).variant == 'v2'


def test_capture_reads_timm_attention_too_and_can_keep_the_graph():
    model = torch.nn.Sequential(_layer('split'), Attention(DIM, num_heads=HEADS))
    x = torch.randn(B, N, DIM)
    with capture_attention_maps(model, detach=False) as maps:
        model(x)
    assert all(m.fused_attn for m in model), 'fused paths restored after capture'
    assert set(maps) == {'0', '1'} and maps['1'].shape == (B, HEADS, N, N)
    torch.testing.assert_close(maps['1'].sum(-1), torch.ones(B, HEADS, N))  # softmax rows
    assert maps['0'].requires_grad and maps['1'].requires_grad
    maps['1'].sum().backward()  # reaches the parameters that made the map
    assert model[1].qkv.weight.grad is not None
    with pytest.raises(ValueError, match='no DifferentialAttention or timm Attention layer'):
        with capture_attention_maps(torch.nn.Linear(2, 2)):
            pass


@pytest.mark.slow
@pytest.mark.parametrize('kernel', SPLIT_KERNELS)
def test_torch_compile_traces_the_fused_path_without_graph_breaks(kernel):
    import torch._dynamo
    m = _layer('split', split_kernel=kernel)
    x = torch.randn(B, N, DIM, requires_grad=True)
    # fullgraph: a graph break raises, naming its reason; aot_eager traces the autograd.Function's backward too
    compiled = torch.compile(m, backend='aot_eager', fullgraph=True)
    compiled(x).square().sum().backward()
    grad = x.grad.clone()
    x.grad = None
    m(x).square().sum().backward()
    torch.testing.assert_close(grad, x.grad, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()


FP64 = dict(rtol=0, atol=1e-12)


def _fp64_masks():
    return {name: {k: (v.double() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in kw.items()}
            for name, kw in _masks().items()}


def _exact_lambda_vectors(m):
    """λ vectors with λ_q1 ⟂ λ_k1 and λ_q2 ⟂ λ_k2 (non-zero, disjoint supports): λ = λ_init exactly.
    timm's DiffAttention rounds λ to fp32 (`.float()` in `_compute_lambda`); an fp32-exact λ keeps
    the comparison about everything else."""
    d = m.lambda_q1.shape[0]
    with torch.no_grad():
        for q, k in ((m.lambda_q1, m.lambda_k1), (m.lambda_q2, m.lambda_k2)):
            v = torch.randn(d, dtype=q.dtype)
            q.copy_(v).narrow(0, d // 2, d - d // 2).zero_()
            k.copy_(v).narrow(0, 0, d // 2).zero_()


@pytest.mark.parametrize('path', ['explicit', 'auto', *SPLIT_KERNELS[:-1]])
@pytest.mark.parametrize('timm_fused, mask', [
    *[(fused, mask) for fused in (True, False) for mask in ('none', 'is_causal', 'causal_additive')],
    (True, 'per_head_additive'),  # timm's explicit path cannot broadcast (B, h, N, N) onto its 2h maps
])
def test_fp64_split_agrees_with_timm_diff_attention(path, timm_fused, mask):
    """In fp64 nothing is rounded to fp32: the output and input gradient equal timm's DiffAttention
    (the same parameters, loaded by name) to 1e-12, on the fused path (every SDPA kernel) and the
    explicit one, against timm's fused and explicit paths. λ_init 0.75 and the λ vectors make λ exact
    in fp32, which timm rounds λ to."""
    torch.manual_seed(0)
    m = DifferentialAttention(DIM, num_heads=HEADS, qkv_bias=True, lambda_init=0.75, depth=2,
                              split_kernel='auto' if path == 'explicit' else path).double()
    with torch.no_grad():
        m.sub_norm.weight.normal_(1, 0.3)  # random, so a rounded folded weight would show
    _exact_lambda_vectors(m)
    ref = DiffAttention(DIM, num_heads=HEADS, qkv_bias=True, depth=2).double()
    ref.load_state_dict(m.state_dict())
    ref.lambda_init = 0.75
    m.fused_attn, ref.fused_attn = path != 'explicit', timm_fused
    assert m.compute_lambda(None).item() == 0.75 and ref._compute_lambda().item() == 0.75
    x = torch.randn(B, N, DIM, dtype=torch.float64)
    mask_kw = _fp64_masks()[mask]
    results = []
    for layer in (m, ref):
        xi = x.clone().requires_grad_(True)
        out = layer(xi, **mask_kw)
        out.square().sum().backward()
        results.append((out.detach(), xi.grad))
    (out, grad), (out_ref, grad_ref) = results
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, out_ref, **FP64)
    torch.testing.assert_close(grad, grad_ref, **FP64)


def _unilm_fp64(m, x, variant, lambda_init):
    """The Differential Transformer (unilm), Differential PaliGemma (duplicate) and Diff-Transformer V2
    formulas, one head at a time in fp64 with Python-float λ, from the layer's weights."""
    C, h = DIM, HEADS
    W, b = m.qkv.weight.detach(), m.qkv.bias.detach()
    proj = lambda o: o @ m.proj.weight.detach().T + m.proj.bias.detach()  # noqa: E731
    if variant == 'v2':
        q, k, v = (x @ W.T + b).split([2 * C, C, C], -1)
        d = C // h
        lam = torch.sigmoid(x @ m.lambda_proj.weight.detach().T)  # (B, N, h): unilm has no bias
        heads = []
        for i in range(h):
            ki, vi = k[..., i * d:(i + 1) * d], v[..., i * d:(i + 1) * d]
            a1 = (q[..., 2 * i * d:(2 * i + 1) * d] @ ki.transpose(-2, -1) / math.sqrt(d)).softmax(-1)
            a2 = (q[..., (2 * i + 1) * d:(2 * i + 2) * d] @ ki.transpose(-2, -1) / math.sqrt(d)).softmax(-1)
            heads.append(a1 @ vi - lam[..., i:i + 1] * (a2 @ vi))
        return proj(torch.cat(heads, -1))
    q, k, v = (x @ W.T + b).chunk(3, -1)
    lq1, lk1, lq2, lk2 = (p.detach().tolist() for p in (m.lambda_q1, m.lambda_k1, m.lambda_q2, m.lambda_k2))
    lam = (math.exp(sum(a * c for a, c in zip(lq1, lk1))) - math.exp(sum(a * c for a, c in zip(lq2, lk2)))
           + lambda_init)
    dv = C // h
    weight = m.sub_norm.weight.detach() * (1 - lambda_init)
    heads = []
    for i in range(h):
        vi = v[..., i * dv:(i + 1) * dv]
        if variant == 'duplicate':
            qi, ki = q[..., i * dv:(i + 1) * dv], k[..., i * dv:(i + 1) * dv]
            a1 = a2 = (qi @ ki.transpose(-2, -1) / math.sqrt(dv)).softmax(-1)
        else:
            d = dv // 2
            q1, q2 = q[..., 2 * i * d:(2 * i + 1) * d], q[..., (2 * i + 1) * d:(2 * i + 2) * d]
            k1, k2 = k[..., 2 * i * d:(2 * i + 1) * d], k[..., (2 * i + 1) * d:(2 * i + 2) * d]
            a1 = (q1 @ k1.transpose(-2, -1) / math.sqrt(d)).softmax(-1)
            a2 = (q2 @ k2.transpose(-2, -1) / math.sqrt(d)).softmax(-1)
        o = (a1 - lam * a2) @ vi
        heads.append(o / torch.sqrt(o.pow(2).mean(-1, keepdim=True) + 1e-5) * weight)
    return proj(torch.cat(heads, -1)), lam


@pytest.mark.parametrize('variant', VARIANTS)
@pytest.mark.parametrize('lambda_init', [0.8, 'depth'])
@pytest.mark.parametrize('fused', [True, False])
def test_fp64_output_and_lambda_match_the_reference_formulas(variant, lambda_init, fused):
    """fp64 end to end: λ (random λ vectors, λ_init 0.8 or by depth, neither exact in fp32), the
    folded sub-norm weight and the maps are not rounded to fp32; every variant matches its paper's
    formula written out in fp64 to 1e-12."""
    torch.manual_seed(0)
    m = DifferentialAttention(DIM, num_heads=HEADS, qkv_bias=True, variant=variant, lambda_init=lambda_init,
                              depth=3).double()
    m.fused_attn = fused
    with torch.no_grad():
        if variant == 'v2':
            m.lambda_proj.weight.normal_(0, 0.5)
        else:
            m.sub_norm.weight.normal_(1, 0.3)
    x = torch.randn(B, N, DIM, dtype=torch.float64)
    expected = _unilm_fp64(m, x, variant, resolve_lambda_init(lambda_init, 3))
    if variant != 'v2':
        expected, lam = expected
        assert m.compute_lambda(x).dtype == torch.float64
        assert abs(m.compute_lambda(x).item() - lam) < 1e-15
        assert abs(float(torch.tensor(lam, dtype=torch.float32)) - lam) > 1e-12  # fp32 would show
    torch.testing.assert_close(m(x), expected, **FP64)


def test_duplicate_lambda_vectors_are_head_dim_wide():
    """Differential PaliGemma: λ_q, λ_k ∈ R^{d_head} with d_head = C / h (timm's split layout has C / 2h),
    N(0, 0.1) as in every variant; λ = exp(λq1·λk1) − exp(λq2·λk2) + λ_init over the full width."""
    torch.manual_seed(0)
    m = DifferentialAttention(512, num_heads=2, variant='duplicate', lambda_init=0.8)
    names = ('lambda_q1', 'lambda_k1', 'lambda_q2', 'lambda_k2')
    for name in names:
        p = getattr(m, name)
        assert p.shape == (256,) and p.dtype == torch.float32, name
        assert 0.08 < p.std().item() < 0.12, name
    assert m.sub_norm.weight.shape == (256,) and m.head_dim == 256
    assert DifferentialAttention(512, num_heads=2, variant='split').lambda_q1.shape == (128,)  # timm's split
    dd = DifferentialAttention(512, num_heads=2, variant='duplicate', dual_lambda=True)
    assert dd.lambda_q1 is None and dd.lambda_a is not None
    q1, k1, q2, k2 = (getattr(m, n).detach().double().tolist() for n in names)
    lam = math.exp(sum(a * b for a, b in zip(q1, k1))) - math.exp(sum(a * b for a, b in zip(q2, k2))) + 0.8
    assert m.compute_lambda(None).item() == pytest.approx(lam, rel=1e-6)
    # the second half of every vector counts: zeroing it changes λ
    with torch.no_grad():
        for name in names:
            getattr(m, name)[128:] = 0
    assert abs(m.compute_lambda(None).item() - lam) > 1e-4


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_low_precision_lambda_vectors_take_their_dot_products_in_fp32(dtype):
    """A layer cast to bf16 or fp16 keeps λ's formula in fp32 (`diffzoo.layers.lambdas`): the products and sums
    of its λ vectors are fp32, as diffzoo.vlm's layers take them, not rounded in the vectors' dtype."""
    torch.manual_seed(0)
    m = DifferentialAttention(512, num_heads=2, variant='duplicate', lambda_init=0.8).to(dtype)
    q1, k1, q2, k2 = (getattr(m, n).detach().double() for n in ('lambda_q1', 'lambda_k1', 'lambda_q2', 'lambda_k2'))
    lam = math.exp(float(q1 @ k1)) - math.exp(float(q2 @ k2)) + 0.8
    assert m.lambda_q1.dtype == dtype and m.compute_lambda(None).dtype == torch.float32
    assert m.compute_lambda(None).item() == pytest.approx(lam, rel=1e-6)


def test_duplicate_checkpoint_with_half_width_lambdas_loads_zero_padded():
    """A duplicate-variant state dict with C / 2h-wide λ vectors (diffzoo before they were d_head wide)
    loads zero-padded: λ and the output are those of the half-width formula."""
    torch.manual_seed(0)
    m = _layer('duplicate')
    state = {k: v.clone() for k, v in m.state_dict().items()}
    half = DIM // HEADS // 2
    for name in ('lambda_q1', 'lambda_k1', 'lambda_q2', 'lambda_k2'):
        state[name] = torch.randn(half) * 0.3
    m.load_state_dict(state)
    assert m.lambda_q1.shape == (2 * half,) and not m.lambda_q1[half:].any()
    lam = (math.exp(float(state['lambda_q1'].double() @ state['lambda_k1'].double()))
           - math.exp(float(state['lambda_q2'].double() @ state['lambda_k2'].double())) + 0.8)
    assert m.compute_lambda(None).item() == pytest.approx(lam, rel=1e-6)
    with pytest.raises(RuntimeError, match='lambda_q1'):  # other widths are still refused
        m.load_state_dict({**state, 'lambda_q1': torch.zeros(half + 1)})


@pytest.mark.parametrize('lam', [0.3, 0.999, 1.0 + 1e-3, 1.7])
@pytest.mark.parametrize('fused', [True, False])
def test_duplicate_lambda_reaches_the_output_only_through_epsilon_and_sign(lam, fused):
    """RMSNorm_ε((1 − λ)·x) = sign(1 − λ)·RMSNorm_{ε/(1 − λ)²}(x): the duplicate layer equals
    attention with that effective ε and sign, in fp64, for λ < 1, near 1 (where ε/(1 − λ)² dominates
    mean(x²)) and above 1 (the sign flips)."""
    torch.manual_seed(0)
    m = DifferentialAttention(DIM, num_heads=HEADS, qkv_bias=True, variant='duplicate', lambda_init=0.5).double()
    m.fused_attn = fused
    eps = m.sub_norm.eps
    with torch.no_grad():  # λ = exp(a) − exp(0) + 0.5 with a = λ_q1·λ_k1
        for p in (m.lambda_q1, m.lambda_k1, m.lambda_q2, m.lambda_k2):
            p.zero_()
        m.lambda_q1[0], m.lambda_k1[0] = math.log(lam + 0.5), 1.0
        m.sub_norm.weight.normal_(1, 0.3)
        m.proj.bias.zero_()  # a linear output projection: the sign passes through it
    assert m.compute_lambda(None).item() == pytest.approx(lam, rel=1e-12)
    x = torch.randn(B, N, DIM, dtype=torch.float64)
    d = DIM // HEADS
    q, k, v = (t.view(B, N, HEADS, d).transpose(1, 2) for t in m.qkv(x).chunk(3, -1))
    av = (q @ k.transpose(-2, -1) / math.sqrt(d)).softmax(-1) @ v  # (B, h, N, d), one map: A = A1 = A2
    weight = m.sub_norm.weight * 0.5  # (1 − λ_init)
    c = 1 - lam
    direct = F.rms_norm(c * av, (d,), weight, eps)
    effective = math.copysign(1, c) * F.rms_norm(av, (d,), weight, eps / c ** 2)
    torch.testing.assert_close(direct, effective, **FP64)  # the identity itself
    expected = m.proj(effective.transpose(1, 2).reshape(B, N, DIM))
    torch.testing.assert_close(m(x), expected, **FP64)
    plain = m.proj(F.rms_norm(av, (d,), weight, eps).transpose(1, 2).reshape(B, N, DIM))
    gap = (m(x) - math.copysign(1, c) * plain).abs().max().item()
    if abs(c) > 0.5:
        assert gap < 1e-3  # ε/(1 − λ)² ≪ mean(x²): λ has (almost) no effect beyond the sign
    else:
        assert gap > 0.1  # near λ = 1 the effective ε is what λ changes


def test_v2_lambda_projection_follows_unilm_by_default_and_zeros_by_name():
    """unilm's Differential Transformer V2: W_λ has no bias and nn.Linear's default init; the earlier
    diffzoo projection (bias, zero weight and bias, λ = 0.5 at start) is `lambda_proj_init='zeros'`."""
    torch.manual_seed(0)
    m = DifferentialAttention(DIM, num_heads=HEADS, variant='v2')
    assert m.lambda_proj.bias is None and m.lambda_proj_init == 'unilm'
    bound = 1 / math.sqrt(DIM)  # kaiming_uniform(a=√5): U(−1/√fan_in, 1/√fan_in)
    w = m.lambda_proj.weight
    assert w.abs().max() <= bound and w.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.2)
    m.lambda_proj.weight.data.zero_()
    m.init_weights()  # timm's ViT init calls this after its own Linear init: the rule is restored
    assert w.abs().max() <= bound and w.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.2)
    x = torch.randn(B, N, DIM)
    assert m.compute_lambda(x).std() > 0  # λ varies by token and head from the start

    old = DifferentialAttention(DIM, num_heads=HEADS, variant='v2', lambda_proj_init='zeros')
    assert old.lambda_proj.bias is not None
    assert not old.lambda_proj.weight.any() and not old.lambda_proj.bias.any()
    torch.testing.assert_close(old.compute_lambda(x), torch.full((B, HEADS, N, 1), 0.5))
    cls = diff_attn_layer('v2', 0.8, 'zeros')
    assert cls.__name__ == 'DifferentialAttention_v2_lambda_0p8_lambda_proj_zeros'
    assert cls is diff_attn_layer('v2', 0.8, 'zeros') and cls is not diff_attn_layer('v2', 0.8)
    assert cls(DIM, num_heads=HEADS).lambda_proj.bias is not None
    for bad in ('zero', None):
        with pytest.raises(ValueError, match=rf"lambda_proj_init={re.escape(repr(bad))}: expected one of"):
            DifferentialAttention(DIM, num_heads=HEADS, variant='v2', lambda_proj_init=bad)
        with pytest.raises(ValueError, match=rf"lambda_proj_init={re.escape(repr(bad))}"):
            diff_attn_layer('v2', 0.8, bad)
