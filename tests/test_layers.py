"""The Lipschitz building blocks against their equations."""
import contextlib
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lipsformer.layers import (AttentionKernel, CenterNorm, ConvBlocks, WeightedResidual, dot_attention, init_weights,
                               l2_attention, scsa, largest_singular_value, window_partition, window_reverse)
from conftest import OpNames
from lipsformer.layers.fused import use_fused_ops


@pytest.fixture(autouse=True, params=["fused", "plain"])
def fused_ops(request):
    """Every test runs with the fused ops on and off (the plain composition of aten ops, as under torch.compile),
    but for those that test the fused ops themselves (marked ``fused_only``)."""
    if request.param == "plain" and request.node.get_closest_marker("fused_only"):
        pytest.skip("tests the fused ops themselves")
    with use_fused_ops(request.param == "fused"):
        yield request.param


# -- CenterNorm (eq. 2) -------------------------------------------------------------------------
def test_centernorm_output_has_zero_channel_mean():
    x = torch.randn(4, 5, 32) * 3 + 7
    y = CenterNorm(32)(x)
    torch.testing.assert_close(y.mean(-1), torch.zeros(4, 5), atol=1e-5, rtol=0)


def test_centernorm_matches_equation_with_affine():
    norm = CenterNorm(6)
    with torch.no_grad():
        norm.weight.copy_(torch.arange(1.0, 7.0))
        norm.bias.copy_(torch.linspace(-1, 1, 6))
    x = torch.randn(3, 6)
    expected = norm.weight * 6 / 5 * (x - x.mean(-1, keepdim=True)) + norm.bias
    torch.testing.assert_close(norm(x), expected)


@pytest.mark.parametrize("dim", [2, 8, 96])
def test_centernorm_jacobian_spectral_norm_is_d_over_d_minus_1(dim):
    x = torch.randn(dim, dtype=torch.float64)
    jac = torch.autograd.functional.jacobian(CenterNorm(dim).double(), x)
    assert torch.linalg.matrix_norm(jac, ord=2).item() == pytest.approx(dim / (dim - 1), rel=1e-12)


@pytest.mark.fused_only
@pytest.mark.parametrize("residual", [False, True])
def test_centernorm_backward_is_exact_and_keeps_what_autograd_keeps(residual):
    """CenterNorm, alone and as ``CN(x + m * h)`` after a weighted residual with DropPath draws (one fused op
    forward and one backward): float64 gradients of every input against finite differences and against autograd of
    eq. 2; one activation kept, as autograd keeps; an input-gradient penalty (create_graph) differentiates exactly as
    through the plain expression."""
    from lipsformer.layers.fused import residual_center_norm
    norm = CenterNorm(6).double()
    with torch.no_grad():
        norm.weight.copy_(torch.randn(6))
        norm.bias.copy_(torch.randn(6))
    x = torch.randn(2, 3, 4, 6, dtype=torch.float64, requires_grad=True)
    h = torch.randn(2, 3, 4, 6, dtype=torch.float64, requires_grad=True) if residual else None
    mask = torch.tensor([1.0, 0.0], dtype=torch.float64) if residual else None

    def fused(t, w, b):
        return residual_center_norm(t, h, mask, 0.8, w, b, 6 / 5)

    def plain(t, w=norm.weight, b=norm.bias):
        s = t if h is None else t + h * (mask / 0.8).view(2, 1, 1, 1)
        return w * 6 / 5 * (s - s.mean(-1, keepdim=True)) + b

    assert torch.autograd.gradcheck(fused, (x, norm.weight, norm.bias))
    def penalty_grads(f):
        gx, = torch.autograd.grad(f(x).pow(2).sum(), x, create_graph=True)
        return torch.autograd.grad(gx.pow(2).sum(), (x, norm.weight))
    for got, want in zip(penalty_grads(lambda t: fused(t, norm.weight, norm.bias)), penalty_grads(plain)):
        torch.testing.assert_close(got, want)
    out = norm.residual(x, h, mask, 0.8) if residual else norm(x)
    assert type(out.grad_fn).__name__ == "lipsformer_residual_center_normBackward"  # the op's own node
    torch.testing.assert_close(out, plain(x))
    g = torch.randn_like(out)
    inputs = tuple(t for t in (x, h, norm.weight, norm.bias) if t is not None)
    for got, want in zip(torch.autograd.grad(out, inputs, g), torch.autograd.grad(plain(x), inputs, g)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    params = {p.untyped_storage().data_ptr() for p in norm.parameters()} | (
        {mask.untyped_storage().data_ptr()} if residual else set())
    kept = _saved_storages(lambda: fused(x, norm.weight, norm.bias))[1] - params
    assert len(kept) == 1 and x.untyped_storage().data_ptr() not in kept


def test_centernorm_rejects_one_channel():
    with pytest.raises(ValueError, match="at least 2 channels"):
        CenterNorm(1)


# -- attention kernels ----------------------------------------------------------------------------
def _qkv(b=2, h=3, n=10, d=8):
    return (torch.randn(b, h, n, d, dtype=torch.float64) for _ in range(3))


def _explicit_scsa(q, k, v, tau, bias=None, nu=None, eps=1e-12):
    qn = q / torch.sqrt((q ** 2).sum(-1, keepdim=True) + eps)
    kn = k / torch.sqrt((k ** 2).sum(-1, keepdim=True) + eps)
    if nu is not None:
        v = nu * v / torch.sqrt((v ** 2).sum(-1, keepdim=True) + eps)
    logits = tau * torch.einsum("bhid,bhjd->bhij", qn, kn)
    if bias is not None:
        logits = logits + bias
    return torch.einsum("bhij,bhjd->bhid", torch.softmax(logits, -1), v)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("nu", [None, 0.7])
def test_scsa_equals_explicit_softmax_formula(fused, with_bias, nu):
    q, k, v = _qkv()
    bias = torch.randn(3, 10, 10, dtype=torch.float64) if with_bias else None
    out = scsa(q, k, v, 10.0, bias, nu=nu, fused=fused)
    torch.testing.assert_close(out, _explicit_scsa(q, k, v, 10.0, bias, nu=nu))


@pytest.mark.fused_only
@pytest.mark.parametrize("scale", [1.0, 10.0, 0.3])
def test_qk_normalize_keeps_its_contiguous_outputs_and_has_exact_gradients(scale):
    """SCSA's q and k normalised by one fused op: float64 gradients against finite differences and against autograd
    of the plain expression; the outputs are contiguous from transposed inputs, and backward keeps those outputs and
    the row norms, not the inputs (so the projection that q and k are views of is not kept). It is differentiable
    once: a double backward says so."""
    from lipsformer.layers.fused import l2_normalize, qk_normalize
    q = torch.randn(2, 5, 3, 4, dtype=torch.float64).transpose(1, 2).requires_grad_()
    k = torch.randn(2, 5, 3, 4, dtype=torch.float64).transpose(1, 2).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: qk_normalize(a, b, 1e-12, scale), (q, k))
    gq, = torch.autograd.grad(qk_normalize(q, k, 1e-12, scale)[0].pow(2).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiable once"):
        gq.pow(2).sum().backward()
    qn, kn = qk_normalize(q, k, 1e-12, scale)
    assert qn.is_contiguous() and kn.is_contiguous()
    plain = (l2_normalize(q, 1e-12, scale), l2_normalize(k, 1e-12, 1.0))
    torch.testing.assert_close(plain[0], q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + 1e-12) * scale)
    for a, b in zip((qn, kn), plain):
        torch.testing.assert_close(a, b)
    g = (torch.randn_like(qn), torch.randn_like(kn))
    for got, want in zip(torch.autograd.grad((qn, kn), (q, k), g), torch.autograd.grad(plain, (q, k), g)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    _, kept = _saved_storages(lambda: qk_normalize(q, k, 1e-12, scale))
    assert not {q.untyped_storage().data_ptr(), k.untyped_storage().data_ptr()} & kept and len(kept) == 4


def test_scsa_learnable_tau_gets_gradient_and_matches_fixed():
    q, k, v = _qkv()
    tau = torch.tensor(12.0, dtype=torch.float64, requires_grad=True)
    out = scsa(q, k, v, tau)
    torch.testing.assert_close(out, scsa(q, k, v, 12.0))
    out.sum().backward()
    assert tau.grad is not None and tau.grad.abs() > 0


def test_scsa_is_scale_invariant_in_q_and_k():
    q, k, v = _qkv()
    torch.testing.assert_close(scsa(q * 5, k * 0.1, v, 10.0), scsa(q, k, v, 10.0))


@pytest.mark.parametrize("with_bias", [False, True])
def test_dot_attention_fused_equals_explicit(with_bias):
    q, k, v = _qkv()
    bias = torch.randn(3, 10, 10, dtype=torch.float64) if with_bias else None
    logits = q @ k.transpose(-2, -1) / math.sqrt(8) + (0 if bias is None else bias)
    expected = torch.softmax(logits, -1) @ v
    torch.testing.assert_close(dot_attention(q, k, v, bias), expected)
    torch.testing.assert_close(dot_attention(q, k, v, bias, fused=False), expected)


@pytest.mark.parametrize("shape, permute", [((10, 10, 3), (2, 0, 1)), ((16, 16, 2), (2, 0, 1)), ((1, 1, 8), (2, 0, 1)),
                                            ((3, 1, 10), (0, 1, 2))])
def test_fused_mask_has_the_values_and_the_layout_cuda_kernels_take(shape, permute):
    from lipsformer.layers.attention import fused_mask
    bias = torch.randn(shape).permute(permute).unsqueeze(0)
    for align in (1, 16):
        mask = fused_mask(bias, align)
        assert torch.equal(mask, bias) and mask.stride(-1) == 1
        assert all(s % align == 0 for s, d in zip(mask.stride()[:-1], mask.shape[:-1]) if d > 1)
    aligned = torch.zeros(2, 16, 32)[..., :16]
    assert fused_mask(aligned, 16) is aligned  # already in the layout: no copy


def test_swin_position_bias_reaches_sdpa_with_unit_last_stride(monkeypatch):
    """CUDA's fused SDPA kernels refuse an attn_mask whose last stride is not 1 and fall back to the math kernel
    (seen on an H100: Swin's bias, a permuted view, has stride = heads). Every mask SDPA receives has stride 1."""
    import timm

    import lipsformer  # noqa: F401
    import lipsformer.layers.attention as attention
    strides, sdpa = [], F.scaled_dot_product_attention

    def recording(q, k, v, attn_mask=None, **kw):
        strides.append(None if attn_mask is None else attn_mask.stride(-1))
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", recording)
    model = timm.create_model("lipsformer_swin_t", img_size=32, embed_dim=16, depths=(1, 1, 1, 1),
                              num_heads=(1, 2, 4, 8), window_size=2, num_classes=3).eval()
    with torch.no_grad():
        model(torch.randn(1, 3, 32, 32))
    assert len(strides) == 4 and strides == [1, 1, 1, 1]


@pytest.mark.parametrize("fused", [True, False])
def test_l2_attention_equals_kim_eq8(fused):
    q, k, v = _qkv()
    logits = -torch.cdist(q, k) ** 2 / math.sqrt(8)  # Kim et al. eq. 8, D/H = head dim 8
    torch.testing.assert_close(l2_attention(q, k, v, fused=fused), torch.softmax(logits, -1) @ v)


def test_attention_kernel_tied_qk_projects_two_and_shares_q():
    kernel = AttentionKernel("l2", tied_qk=True)
    assert kernel.num_proj == 2
    qv = torch.randn(2, 5, 2, 3, 8)  # (B, N, P, heads, d)
    q, k, v = kernel.split(qv)
    assert q.shape == (2, 3, 5, 8)
    assert torch.equal(q, qv[:, :, 0].transpose(1, 2)) and k is q and torch.equal(v, qv[:, :, 1].transpose(1, 2))


@pytest.mark.parametrize("kwargs, match", [
    (dict(kind="cosine"), "attn must be one of"),
    (dict(kind="dot", learn_tau=True), "attn='scsa' only"),
    (dict(kind="scsa", tied_qk=True), "attn='l2' only"),
    (dict(kind="scsa", tau=0.0), "tau must be positive"),
])
def test_attention_kernel_rejects_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AttentionKernel(**kwargs)


def test_attention_kernel_learn_tau_is_a_parameter():
    kernel = AttentionKernel("scsa", tau=12.0, learn_tau=True)
    assert [n for n, _ in kernel.named_parameters()] == ["tau"]
    assert list(AttentionKernel("scsa").parameters()) == []


# -- weighted residual, conv blocks ---------------------------------------------------------------
def test_weighted_residual_scales_branch_per_channel():
    res = WeightedResidual(4, alpha_init=0.25)
    x, fx = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    torch.testing.assert_close(res(x, fx), x + 0.25 * fx)
    torch.testing.assert_close(res(x, fx, gelu=True), x + 0.25 * F.gelu(fx))
    assert res.alpha.shape == (4,)


@pytest.mark.parametrize("gelu", [False, True])
def test_weighted_residual_drop_path_is_timms_with_the_same_random_draws(gelu):
    """The per-sample mask folded into alpha is timm's DropPath on the branch: same seed, same samples dropped,
    same output and gradients; in eval mode nothing is dropped."""
    from timm.layers import drop_path
    res = WeightedResidual(6, alpha_init=0.3, drop_path=0.5).double().train()
    x = torch.randn(16, 3, 3, 6, dtype=torch.float64, requires_grad=True)
    fx = torch.randn(16, 3, 3, 6, dtype=torch.float64, requires_grad=True)
    branch = F.gelu(fx) if gelu else fx
    outs = []
    for fn in (lambda: res(x, fx, gelu=gelu), lambda: x + drop_path(res.alpha * branch, 0.5, training=True)):
        torch.manual_seed(3)
        out = fn()
        outs.append((out, *torch.autograd.grad(out.sin().sum(), (x, fx, res.alpha))))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b)
    dropped = (outs[0][0] - x).abs().sum((1, 2, 3)) == 0
    assert 0 < dropped.sum() < 16  # some samples kept, some dropped
    torch.testing.assert_close(res.eval()(x, fx, gelu=gelu), x + res.alpha * branch)


def test_conv_blocks_d_equals_released_formula():
    torch.manual_seed(1)
    blocks = ConvBlocks(6, "D", alpha_init=0.3)
    x = torch.randn(2, 5, 5, 6)
    nchw = x.permute(0, 3, 1, 2)
    dw = lambda conv, t: F.conv2d(t, conv.weight, conv.bias, padding=3, groups=6)  # noqa: E731
    y = nchw + 0.3 * F.gelu(F.conv2d(F.gelu(dw(blocks.dw1, nchw)), blocks.pw.weight, blocks.pw.bias))
    y = y + 0.3 * F.gelu(dw(blocks.dw2, y))
    torch.testing.assert_close(blocks(x), y.permute(0, 2, 3, 1))


@pytest.mark.parametrize("config, modules", [
    ("A", []), ("B", ["dw1", "res1"]), ("C", ["dw1", "pw", "res1"]), ("D", ["dw1", "pw", "res1", "dw2", "res2"])])
def test_conv_block_configurations_of_table_3(config, modules):
    blocks = ConvBlocks(8, config)
    assert [n for n, _ in blocks.named_children()] == modules
    x = torch.randn(1, 7, 7, 8)
    out = blocks(x)
    assert out.shape == x.shape
    if config == "A":
        assert out is x


def test_conv_blocks_rejects_unknown_configuration():
    with pytest.raises(ValueError, match="conv_blocks must be one of"):
        ConvBlocks(8, "E")


@pytest.mark.parametrize("k, shape, chunk", [
    (7, (2, 9, 11, 8), None), (3, (2, 9, 11, 8), None),
    (7, (5, 4, 6, 3), 2 * 4 * 6 * 3),  # two images per convolution, and a last group of one
    (5, (3, 2, 3, 4), 1)])  # kernel larger than the map
def test_depthwise_conv_has_the_modules_outputs_and_gradients(monkeypatch, k, shape, chunk):
    """_DepthwiseConv, which a float32 CPU training step takes, in float64 against the nn.Conv2d it stands for (a
    map that is not square, so that H and W cannot be swapped unnoticed): outputs equal, gradients of input, weight
    and bias to float64 rounding, in eager mode (the weight gradient by swapped-role convolutions, in groups of
    images) and through the compiler's sums (:func:`_dw_weight_grad`, run eagerly here)."""
    from lipsformer.layers import conv_blocks
    if chunk is not None:  # elements per convolution and thread
        monkeypatch.setattr(conv_blocks, "_DW_GRAD_CHUNK", chunk)
        monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    C = shape[-1]
    conv = nn.Conv2d(C, C, k, padding=k // 2, groups=C).double()
    x, g = torch.randn(*shape, dtype=torch.float64, requires_grad=True), torch.randn(*shape, dtype=torch.float64)
    ref = conv(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)
    want = torch.autograd.grad(ref, (x, conv.weight, conv.bias), g)
    for compiled in (False, True):
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: compiled)
        out = conv_blocks._DepthwiseConv.apply(x, conv.weight, conv.bias)
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
        for got, expected in zip(torch.autograd.grad(out, (x, conv.weight, conv.bias), g), want):
            torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    if x.numel() < 100:  # and against finite differences, where that is cheap
        monkeypatch.undo()
        assert torch.autograd.gradcheck(conv_blocks._DepthwiseConv.apply, (x, conv.weight, conv.bias), fast_mode=True)


def test_conv_blocks_take_the_fast_depthwise_conv_only_for_a_float32_cpu_training_step(monkeypatch):
    from lipsformer.layers import conv_blocks
    taken = []
    real = conv_blocks._DepthwiseConv.apply
    monkeypatch.setattr(conv_blocks._DepthwiseConv, "apply", lambda *a: taken.append(1) or real(*a))
    x = torch.randn(1, 7, 7, 8)

    def takes(blocks=None, x=x, **autocast) -> bool:
        blocks = blocks or ConvBlocks(8, "D")
        taken.clear()
        with torch.autocast("cpu", **autocast) if autocast else contextlib.nullcontext():
            out, _, passed = blocks._dw(blocks.dw1, x)
        assert torch.equal(passed, x)
        assert torch.allclose(out.float(), blocks.dw1(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1).float(), atol=1e-2)
        return bool(taken)

    assert takes()  # eager
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert takes()  # and traced by torch.compile
    assert not takes(dtype=torch.bfloat16)
    assert not takes(ConvBlocks(8, "D").eval())  # torch.export and the ONNX exporter trace here
    assert not takes(ConvBlocks(8, "D").double(), x.double())
    frozen = ConvBlocks(8, "D")
    frozen.dw1.weight.requires_grad_(False)
    assert not takes(frozen)
    assert not takes(ConvBlocks(8, "D", kernel_size=4))  # even: the flipped kernel would not transpose it
    hooked = ConvBlocks(8, "D")
    hooked.dw1.register_forward_hook(lambda *a: None)
    assert not takes(hooked)
    with torch.no_grad():
        assert not takes()


@pytest.mark.fused_only
def test_the_fused_depthwise_conv_takes_the_skips_gradient_with_exact_gradients(monkeypatch):
    """Where the fused ops run a training step (a GPU's; here float64 on the CPU, the ops' plain composition), a conv
    block's depth-wise convolution is one node with its input passed on to the skip (and GELU(u) where a 1x1
    convolution follows), or with its residual: float64 gradients (and second derivatives, through the aten
    composition) exact; in the blocks, backward has no ``add`` for the two gradients of each convolution's input, and
    the gradients are autograd's."""
    from lipsformer.layers import conv_blocks
    x = torch.randn(2, 4, 5, 3, dtype=torch.float64, requires_grad=True)
    conv = nn.Conv2d(3, 3, 3, padding=1, groups=3).double()
    alpha = torch.randn(3, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([0.0, 1.0], dtype=torch.float64)
    parts = (x, conv.weight, conv.bias)
    for gelu in (False, True):
        conv_only = lambda x, w, b: [t for i, t in enumerate(conv_blocks._FusedDepthwise.apply(x, w, b, gelu))  # noqa
                                     if i != 1]  # GELU(u) is a value, not differentiated
        assert torch.autograd.gradcheck(conv_only, parts)
        assert torch.autograd.gradgradcheck(conv_only, parts)
        u, h, passed = conv_blocks._FusedDepthwise.apply(*parts, gelu)
        ref = conv(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)
        torch.testing.assert_close(u, ref, rtol=0, atol=0)
        assert torch.equal(passed, x) and u.is_contiguous() and (torch.equal(h, F.gelu(u)) if gelu else not h.numel())
    residual = lambda x, w, b, a: conv_blocks._FusedConvResidual.apply(x, w, b, a, mask, 0.7)  # noqa: E731
    assert torch.autograd.gradcheck(residual, (*parts, alpha))
    assert torch.autograd.gradgradcheck(residual, (*parts, alpha))
    torch.testing.assert_close(residual(*parts, alpha), x + (mask / 0.7).view(2, 1, 1, 1) * alpha * F.gelu(ref))

    torch.manual_seed(0)
    blocks = ConvBlocks(8, "D").double()
    inp = torch.randn(2, 5, 5, 8, dtype=torch.float64, requires_grad=True)
    counts, grads = [], []
    for fuse in (True, False):
        if not fuse:  # the module, and x itself to the skip: autograd adds the two gradients
            monkeypatch.setattr(ConvBlocks, "_fused", lambda self, conv, x: False)
        out = blocks(inp)
        with OpNames() as ops:
            grads.append(torch.autograd.grad(out, [inp, *blocks.parameters()], torch.ones_like(out)))
        counts.append(ops.names)
    assert counts[0]["depthwise_conv_backward"] == counts[0]["conv_residual_backward"] == 1
    assert counts[0]["add"] == counts[1]["add"] - 2
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


# -- init --------------------------------------------------------------------------------------------
def test_spectral_init_gives_unit_largest_singular_value():
    model = nn.Sequential(nn.Linear(16, 48), nn.Conv2d(3, 8, 4, 4), nn.Conv2d(8, 8, 7, groups=8), nn.Linear(48, 5))
    init_weights(model, "spectral")
    for m in model:
        assert largest_singular_value(m.weight) == pytest.approx(1.0, abs=1e-5)
        assert torch.count_nonzero(m.bias) == 0


@pytest.mark.parametrize("threads", [1, 2])
def test_spectral_init_of_a_shared_weight_is_its_last_draw_divided_once(threads):
    """Norms are computed beside the draws (one thread: inline): a weight two modules share is drawn twice, as in
    Xavier mode, and divided once by the norm of its last draw, whatever the thread count."""
    first, second = nn.Linear(300, 200), nn.Linear(300, 200)
    second.weight = first.weight
    _assert_spectral_is_the_xavier_draws_divided(nn.Sequential(first, nn.Linear(200, 300), second), threads)


def _assert_spectral_is_the_xavier_draws_divided(model: nn.Sequential, threads: int, norm=largest_singular_value):
    """The spectral init of ``model`` (seed 0, ``threads`` torch threads) equals, weight by weight and bit for bit,
    its Xavier init with the same seed divided by ``norm``."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(0)
        init_weights(model, "spectral")
    finally:
        torch.set_num_threads(previous)
    spectral = [m.weight.clone() for m in model]
    torch.manual_seed(0)
    init_weights(model, "xavier")
    for m, got in zip(model, spectral):
        assert torch.equal(got, m.weight / norm(m.weight, certified=False))


def test_spectral_init_main_thread_computes_the_norms_no_worker_has_started(monkeypatch):
    """Once the drawing is over the main thread takes the queued norms from the end of the queue. Held here: the one
    worker waits in its first norm until the main thread has computed all the others (it would otherwise race the
    main thread for the next ones), and the model still equals the Xavier draws divided weight by weight."""
    import threading
    from lipsformer.layers import init as init_module
    real, main = init_module.largest_singular_value, threading.main_thread()
    model = nn.Sequential(*(nn.Linear(120 + i, 130 + i) for i in range(4)))
    by_main, others_taken = [], threading.Event()

    def held(w, certified):
        if threading.current_thread() is main:
            by_main.append(w)
            if len(by_main) == len(model) - 1:
                others_taken.set()
        else:
            assert others_taken.wait(30)
        return real(w, certified=certified)

    monkeypatch.setattr(init_module, "largest_singular_value", held)
    _assert_spectral_is_the_xavier_draws_divided(model, threads=2, norm=real)  # two threads: one worker
    assert [w is m.weight for w, m in zip(by_main, reversed(model[1:]))] == [True] * 3


def test_init_rejects_unknown_mode():
    with pytest.raises(ValueError, match="init must be one of"):
        init_weights(nn.Linear(2, 2), "orthogonal")


# -- windows -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("window", [(2, 2), (4, 1), (1, 6), (4, 6)])
def test_window_partition_round_trip_and_order(window):
    x = torch.arange(2 * 4 * 6 * 3.0).view(2, 4, 6, 3)
    windows = window_partition(x, window)
    assert windows.shape == (2 * (4 // window[0]) * (6 // window[1]), window[0] * window[1], 3)
    torch.testing.assert_close(windows[0].view(*window, 3), x[0, :window[0], :window[1]])
    torch.testing.assert_close(window_reverse(windows, window, 4, 6), x)


def test_kim_values_are_x_a_h_w_v_plus_bias():
    """Kim et al.'s Lipschitz L2 form: values X A_h W^{V,h} with A_h = W^{Q,h} W^{Q,h T} / sqrt(d), per head."""
    from lipsformer.layers import AttentionKernel
    dim, heads, d = 8, 2, 4
    qkv = torch.nn.Linear(dim, 2 * dim).double()
    x = torch.randn(3, dim, dtype=torch.double)
    q = (x @ qkv.weight[:dim].T + qkv.bias[:dim]).view(3, heads, d).transpose(0, 1).unsqueeze(0)
    values = AttentionKernel.kim_values(q, qkv, heads)[0]
    for h in range(heads):
        w_q = qkv.weight[h * d:(h + 1) * d].T  # W^{Q,h}: (D, d)
        w_v = qkv.weight[dim + h * d: dim + (h + 1) * d].T
        expected = x @ (w_q @ w_q.T / d ** 0.5) @ w_v + qkv.bias[dim + h * d: dim + (h + 1) * d]
        assert torch.allclose(values[h], expected, atol=1e-12)


# -- GELU fused with its consumer (memory) ------------------------------------------------------------
def _saved_storages(fn, *inputs):
    """Distinct storages autograd keeps for backward while ``fn`` runs, parameters excluded."""
    seen = set()

    def pack(t):
        seen.add(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*inputs)
    return out, seen


@pytest.mark.fused_only
def test_gelu_linear_and_gelu_residual_gradients_are_exact_and_keep_only_the_input():
    from lipsformer.layers.fused import gelu_residual
    from lipsformer.layers.gelu import gelu_linear
    u = torch.randn(2, 3, 4, 5, dtype=torch.float64, requires_grad=True)
    x = torch.randn(2, 3, 4, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, dtype=torch.float64, requires_grad=True)
    s = torch.randn(5, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([0.0, 1.0], dtype=torch.float64)  # a DropPath draw, divided by keep 0.7
    dropped = lambda x, u, s: gelu_residual(x, u, s, mask, 0.7)  # noqa: E731
    assert torch.autograd.gradcheck(gelu_linear, (u, w, b))
    assert torch.autograd.gradcheck(gelu_linear, (u, w, None))
    assert torch.autograd.gradcheck(gelu_residual, (x, u, s))
    assert torch.autograd.gradcheck(dropped, (x, u, s))
    assert torch.autograd.gradgradcheck(gelu_linear, (u, w, b))  # double backward (gradient penalties) is exact
    assert torch.autograd.gradgradcheck(dropped, (x, u, s))
    # batched gradients (autograd's legacy vmap: jacobian(vectorize=True)) run through the backward passes
    for f in (lambda t: gelu_linear(t, w, b), lambda t: dropped(x, t, s)):
        out = f(u)
        eye = torch.eye(out.numel(), dtype=out.dtype)[:7].view(7, *out.shape)
        batched, = torch.autograd.grad(out, u, eye, is_grads_batched=True, retain_graph=True)
        for i in range(7):
            torch.testing.assert_close(batched[i], torch.autograd.grad(out, u, eye[i], retain_graph=True)[0])
    torch.testing.assert_close(gelu_linear(u, w, b), F.linear(F.gelu(u), w, b), rtol=0, atol=0)
    torch.testing.assert_close(gelu_residual(x, u, s), x + F.gelu(u) * s)
    torch.testing.assert_close(dropped(x, u, s), x + F.gelu(u) * s * (mask / 0.7).view(2, 1, 1, 1))
    # under torch.func (the Lipschitz estimators' jvp / vjp) the plain ops run, with exact derivatives
    tangent = torch.randn_like(u)
    for fused, plain in ((lambda t: gelu_linear(t, w, b), lambda t: F.linear(F.gelu(t), w, b)),
                         (lambda t: gelu_residual(x, t, s), lambda t: x + F.gelu(t) * s)):
        torch.testing.assert_close(torch.func.jvp(fused, (u,), (tangent,)), torch.func.jvp(plain, (u,), (tangent,)))
    # autograd alone keeps GELU's input and output; the fused ops keep the input only
    params = {t.untyped_storage().data_ptr() for t in (w, b, s)}
    for fused, plain in ((lambda: gelu_linear(u, w, b), lambda: F.linear(F.gelu(u), w, b)),
                         (lambda: gelu_residual(x, u, s), lambda: x + F.gelu(u) * s)):
        assert len(_saved_storages(fused)[1] - params) == 1
        assert len(_saved_storages(plain)[1] - params) == 2


@pytest.mark.fused_only
def test_a_branch_first_linear_map_adds_the_skips_gradient_inside_its_product(monkeypatch):
    """skip_linear(x, W, b) = (linear(x), x) as one node: float64 gradients (and second derivatives) of both outputs
    exact; in a block, the MLP's fc1 takes the skip's gradient into its input gradient's ``addmm`` (an ``add`` fewer
    in backward), with the same gradients as autograd's sum; under autocast the map's dtype and values are
    autocast's."""
    from lipsformer.layers import LipsBlock, residual
    from lipsformer.layers.gelu import skip_linear
    x = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, dtype=torch.float64, requires_grad=True)
    for bias in (b, None):
        assert torch.autograd.gradcheck(skip_linear, (x, w, bias))
        assert torch.autograd.gradgradcheck(skip_linear, (x, w, bias))
    y, passed = skip_linear(x, w, b)
    assert torch.equal(y, F.linear(x, w, b)) and torch.equal(passed, x) and passed.grad_fn is y.grad_fn
    (g,) = torch.autograd.grad(y, x, torch.ones_like(y))  # the skip unused: the map's gradient alone
    torch.testing.assert_close(g, torch.ones(2, 3, 4, dtype=torch.float64) @ w)

    torch.manual_seed(0)
    block = LipsBlock(8, nn.Identity()).double()
    inp = torch.randn(2, 4, 4, 8, dtype=torch.float64, requires_grad=True)
    counts, grads = [], []
    for tap in (True, False):
        if not tap:  # the skip takes x itself: autograd adds the two gradients
            monkeypatch.setattr(residual, "skip_linear", lambda x, w, b: (F.linear(x, w, b), x))
        out = block(inp)
        with OpNames() as ops:
            grads.append(torch.autograd.grad(out, [inp, *block.parameters()], torch.ones_like(out)))
        counts.append(ops.names)
    assert counts[1]["add"] - counts[0]["add"] == 1 and counts[0]["addmm"] - counts[1]["addmm"] == 1
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    x32, w32, b32 = (t.detach().float().requires_grad_() for t in (x, w, b))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, passed = skip_linear(x32, w32, b32)
        want = F.linear(x32, w32, b32)
    assert y.dtype == torch.bfloat16 and passed.dtype == torch.float32 and torch.equal(y, want)
    gy, gx = torch.randn_like(y), torch.randn_like(x32)
    got = torch.autograd.grad((y, passed), (x32, w32, b32), (gy, gx))
    plain = torch.autograd.grad((want, x32), (x32, w32, b32), (gy, gx))
    for a, p in zip(got, plain):
        assert a.dtype == p.dtype == torch.float32
        torch.testing.assert_close(a, p, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("gelu", [False, True])
def test_linear_with_a_folded_output_scale_has_exact_gradients_and_keeps_no_output(gelu):
    """fused_linear(u, W, b, s) = s * linear(act(u), W, b): float64 gradients of every input (s included) against
    finite differences and against autograd of the plain expression; backward keeps u, the parameters and the scaled
    weight only (no activation besides u)."""
    from lipsformer.layers.gelu import fused_linear
    act = F.gelu if gelu else (lambda t: t)
    u = torch.randn(2, 3, 4, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, dtype=torch.float64, requires_grad=True)
    s = torch.randn(6, dtype=torch.float64, requires_grad=True)
    for bias in (b, None):
        for scale in (s, None):
            fused = lambda *a: fused_linear(*a, gelu=gelu)  # noqa: E731
            assert torch.autograd.gradcheck(fused, (u, w, bias, scale))
            plain = F.linear(act(u), w, bias) * (1 if scale is None else scale)
            out = fused(u, w, bias, scale)
            torch.testing.assert_close(out, plain)
            inputs = [t for t in (u, w, bias, scale) if t is not None]
            g = torch.randn_like(out)
            for got, want in zip(torch.autograd.grad(out, inputs, g), torch.autograd.grad(plain, inputs, g)):
                torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    params = {t.untyped_storage().data_ptr() for t in (w, b, s)}
    sizes = {}

    def pack(t):
        sizes[t.untyped_storage().data_ptr()] = t.numel()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fused_linear(u, w, b, s, gelu=gelu)
    kept = {ptr: n for ptr, n in sizes.items() if ptr not in params}  # u, and the scaled weight (a weight's size)
    assert sorted(kept.values()) == sorted([u.numel(), w.numel()]) and u.untyped_storage().data_ptr() in kept


@pytest.mark.parametrize("name", ["lipsformer_swin_t", "lipsformer_cswin_t"])
def test_residual_weights_folded_into_the_branches_change_nothing_but_what_backward_keeps(name, monkeypatch):
    """LipsBlock folds each weighted residual's alpha into its branch's last linear map (ScaledOutput). In float64,
    with DropPath drawing the same masks, outputs and every gradient equal those of ``res(x, branch(x))``; backward
    keeps fewer bytes per image (no branch output for alpha's gradient; it keeps each scaled weight, which does not
    grow with the batch)."""
    import timm

    from conftest import TINY, family
    from lipsformer.layers import LipsBlock
    model = timm.create_model(name, num_classes=5, drop_path_rate=0.5, **TINY[family(name)]).double().train()
    x = torch.randn(8, 3, 32, 32, dtype=torch.float64)

    def run(x):
        model.zero_grad()
        torch.manual_seed(1)
        total = 0

        def pack(t):
            nonlocal total
            if not isinstance(t, nn.Parameter):
                total += t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(x)
        out.square().mean().backward()
        return out, [p.grad.clone() for p in model.parameters()], total

    folded, folded_half = run(x), run(x[:4])
    monkeypatch.setattr(LipsBlock, "_out_scales", lambda self: [None, None])  # norm(res(x, branch(x)))
    plain, plain_half = run(x), run(x[:4])
    torch.testing.assert_close(folded[0], plain[0], rtol=1e-12, atol=1e-12)
    for a, b in zip(folded[1], plain[1]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert folded[2] - folded_half[2] < plain[2] - plain_half[2]  # bytes kept for 4 more images


@pytest.mark.fused_only
def test_a_branchs_last_bias_leaves_its_map_only_for_a_fused_op_that_sums_its_gradient(monkeypatch):
    """split_bias: in a training step where the fused ops run, the bias goes to the residual's sum unless the
    branch's output dropout is on (dropout applies to the biased output); the map keeps it without a backward,
    with the fused ops off and under torch.compile (the plain composition gains nothing by it)."""
    from lipsformer.layers.block import GeluMlp
    from lipsformer.layers.fused import use_fused_ops
    from lipsformer.layers.residual import FoldedMap, split_bias
    folded, x = FoldedMap(torch.ones(8, 16), torch.ones(8)), torch.randn(2, 16)
    for mlp in (GeluMlp(16, 8, act_layer=nn.GELU).train(), GeluMlp(16, 8, act_layer=nn.GELU, drop=0.2).eval()):
        scale, bias = split_bias(mlp, folded, x)
        assert scale.weight is folded.weight and scale.bias is None and bias is folded.bias
    mlp = GeluMlp(16, 8, act_layer=nn.GELU).train()
    kept = [split_bias(GeluMlp(16, 8, act_layer=nn.GELU, drop=0.2).train(), folded, x)]
    with torch.no_grad():
        kept.append(split_bias(mlp, folded, x))
    with use_fused_ops(False):
        kept.append(split_bias(mlp, folded, x))
    alpha = torch.ones(8)  # a scale not folded (a map with hooks): nothing to split
    assert split_bias(mlp, alpha, x)[0] is alpha
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    kept.append(split_bias(mlp, folded, x))
    assert all(scale is folded and bias is None for scale, bias in kept)


@pytest.mark.fused_only
def test_fused_gelus_give_way_to_the_plain_ops_under_torch_compile(monkeypatch):
    """torch.compile decides itself what backward keeps and fuses the plain ops itself; the custom functions would
    only slow its tracing."""
    from lipsformer.layers.fused import gelu_residual
    from lipsformer.layers.gelu import gelu_linear
    u, x = torch.randn(3, 4, requires_grad=True), torch.randn(3, 4)
    w, s = torch.randn(5, 4), torch.randn(4)
    assert type(gelu_linear(u, w).grad_fn).__name__ == "_FusedLinearBackward"
    assert "gelu_residual" in type(gelu_residual(x, u, s).grad_fn).__name__
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert type(gelu_linear(u, w).grad_fn).__name__ == "MmBackward0"
    assert type(gelu_residual(x, u, s).grad_fn).__name__ == "AddcmulBackward0"


def test_gelu_linear_under_bf16_autocast_matches_autograd_and_returns_float32_grads():
    from lipsformer.layers.gelu import gelu_linear
    u = torch.randn(4, 7, 8, requires_grad=True)
    lin = nn.Linear(8, 16)
    grads = []
    for fn in (lambda: gelu_linear(u, lin.weight, lin.bias), lambda: lin(F.gelu(u))):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fn()
        assert out.dtype == torch.bfloat16
        grads.append(torch.autograd.grad(out.float().square().sum(), (u, lin.weight, lin.bias)))
    for fused, plain in zip(*grads):
        assert fused.dtype == plain.dtype == torch.float32
        torch.testing.assert_close(fused, plain, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("name", ["lipsformer_swin_t", "lipsformer_cswin_t"])
def test_models_with_fused_gelus_train_like_the_plain_ops(name, monkeypatch):
    """Same loss and gradients as with the plain ops (``records_grad`` off routes every call to them)."""
    import timm

    from lipsformer.layers import gelu
    from conftest import TINY, family
    model = timm.create_model(name, num_classes=5, drop_path_rate=0.0, **TINY[family(name)]).double().train()
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)

    def grads():
        model.zero_grad()
        model(x).square().mean().backward()
        return [p.grad.clone() for p in model.parameters()]

    fused = grads()
    monkeypatch.setattr(gelu, "records_grad", lambda *t: False)
    plain = grads()
    for a, b in zip(fused, plain):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("shape", [(40, 24), (24, 40), (96, 1, 7, 7), (16, 16, 1, 1), (8, 3, 4, 4), (1, 50),
                                   (300, 1200), (1200, 300)])
@pytest.mark.parametrize("spectrum", ["gaussian", "clustered"])
def test_largest_singular_value_agrees_with_the_exact_svd(shape, spectrum):
    """One spectral-norm function for the init and the bounds: the Gram matrix's top eigenvalue in float64
    (certified), or Lanczos (the init) within 1e-4 relative, also when the top singular values nearly coincide."""
    w = torch.randn(shape)
    if spectrum == "clustered":
        u, s, v = torch.linalg.svd(w.flatten(1), full_matrices=False)
        s = torch.ones_like(s)
        s[1:] -= torch.rand(len(s) - 1) * 1e-3  # the top values within 1e-3 of each other
        w = (u * s @ v).view(shape)
    exact = float(torch.linalg.svdvals(w.double().flatten(1))[0])
    assert largest_singular_value(w) == pytest.approx(exact, rel=1e-10)
    assert largest_singular_value(w, certified=False) == pytest.approx(exact, rel=1e-4)
    assert largest_singular_value(w.half()) == pytest.approx(float(torch.linalg.svdvals(
        w.half().double().flatten(1))[0]), rel=1e-10)


def test_largest_singular_value_uses_power_iteration_above_the_exact_size(monkeypatch):
    from lipsformer.layers import spectral
    u, _, v = torch.linalg.svd(torch.randn(60, 40, dtype=torch.double), full_matrices=False)
    w = u @ torch.diag(torch.linspace(3.0, 0.1, 40, dtype=torch.double)) @ v  # gap 3 vs 2.92: slow but sure
    monkeypatch.setattr(spectral, "EXACT_MAX_DIM", 16)
    estimate = largest_singular_value(w, iters=2000)
    assert estimate <= 3.0 * (1 + 1e-12) and estimate == pytest.approx(3.0, rel=1e-4)


def test_a_block_draws_its_residuals_drop_path_in_one_kernel_on_the_same_stream():
    """A training block's four DropPath draws are the rows of one ``bernoulli_`` (one kernel, not four); on the CPU
    the rows are the draws each residual would make itself, in order, so the block's output is the same. A compiled
    block takes them as factors ``mask / keep``: one division for the four."""
    from lipsformer.layers import LipsBlock

    torch.manual_seed(0)
    block = LipsBlock(8, nn.Identity(), drop_path=0.5).train()
    x = torch.randn(32, 4, 4, 8)
    torch.manual_seed(5)
    with OpNames() as ops:
        out = block(x)
    assert ops.names["bernoulli_"] == 1
    torch.manual_seed(5)
    alone = block.body(x, (None,) * 4)  # each residual draws its own, in order
    torch.testing.assert_close(out, alone, rtol=0, atol=0)
    torch.manual_seed(5)
    masks = [d[0] for d in block.drop_draws(x)]
    assert all(m.shape == (32,) for m in masks) and 0 < sum(float(m.sum()) for m in masks) < 128
    torch.manual_seed(5)
    with OpNames() as ops:
        factors = block.drop_draws(x, factors=True)
    assert ops.names["bernoulli_"] == 1 and ops.names["div"] == 1
    for (factor, one), mask in zip(factors, masks):
        assert one == 1.0 and torch.equal(factor, mask / 0.5)
    assert all(d == (None, 1.0) for d in block.eval().drop_draws(x))
    assert block.drop_draws(x, factors=True) == (None,) * 4
