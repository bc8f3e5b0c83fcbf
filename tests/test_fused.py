"""The fused ops (lipsformer.layers.fused): their Triton kernels, run on the CPU by Triton's interpreter, against the
plain composition in float64, forward and backward, in float32 and bfloat16; the ops through autograd with those
kernels in a training step of both families; one node each for torch.compile; the models the same with the fused
ops on and off.

Triton decides at its import whether it interprets (its own library functions are compiled or interpreted then),
so the kernel tests run in a process of their own started with ``TRITON_INTERPRET=1``
(:func:`test_the_kernels_under_the_interpreter`); in any other process they are skipped. That process records each
launch, and each kernel as launched is compiled for a GPU that is not here
(:func:`test_every_kernel_compiles_for_a_hopper_gpu`)."""
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import List, Optional, Sequence

import pytest
import timm
import torch
from torch import Tensor

from conftest import TINY, OpNames, family
from lipsformer.layers import fused, gelu, stripes
from lipsformer.layers.fused import use_fused_ops
from triton_targets import SPECS_ENV, compile_for, kernels, record_launches, richest, specializations, wrap_launches

TOL = {torch.float32: dict(rtol=1e-5, atol=2e-5), torch.bfloat16: dict(rtol=2e-2, atol=4e-2)}
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
if INTERPRETING and os.environ.get(SPECS_ENV):
    record_launches(os.environ[SPECS_ENV])


@pytest.fixture(scope="module")
def interpreter_run(tmp_path_factory):
    """This file's kernel tests, run once in a process of their own under Triton's interpreter, which records each
    launch's specialization (tests/triton_targets.py): the finished process and the file of specializations."""
    pytest.importorskip("triton")
    if INTERPRETING:
        pytest.skip("this process is the interpreter's")
    specs = tmp_path_factory.mktemp("triton") / "launches.jsonl"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                           "kernels and not interpreter"], capture_output=True, text=True, cwd=Path(__file__).parent,
                          env=dict(os.environ, TRITON_INTERPRET="1", **{SPECS_ENV: str(specs)}), timeout=600)
    return proc, specs


def test_the_kernels_under_the_interpreter(interpreter_run):
    proc, _ = interpreter_run
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert " passed" in proc.stdout and " skipped" not in proc.stdout, proc.stdout[-2000:]


@pytest.mark.slow
def test_every_kernel_compiles_for_a_hopper_gpu(interpreter_run):
    """Each kernel as the interpreter launched it (the specialization with the most branches and bfloat16 pointers)
    compiles to a cubin for sm_90 (H100, H200) with Triton's compiler and ptxas, which need no GPU: the interpreter
    computes with numpy and runs code a GPU compiler refuses. Every ``@triton.jit`` function of the kernel modules
    is launched by a test or called by a kernel that is."""
    from lipsformer.layers import triton_depthwise, triton_kernels, triton_stripes
    proc, specs = interpreter_run
    assert proc.returncode == 0, proc.stdout[-4000:]
    jitted = {**kernels(triton_kernels), **kernels(triton_stripes), **kernels(triton_depthwise)}
    specs = specializations(specs)
    launched = {spec["name"] for spec in specs}
    called = {name for name in jitted if any(re.search(rf"\b{name}\(", f.src) for other, f in jitted.items()
                                             if other != name)}
    assert set(jitted) == launched | called, set(jitted) - launched - called
    for spec in richest(specs):
        compiled = compile_for(spec, 90)
        assert "cubin" in compiled.asm, spec["name"]


def _doubled(v):
    return v * 2


def test_a_kernel_the_interpreter_runs_can_fail_to_compile():
    """What the compile check above catches: a kernel calling a Python function (not ``@triton.jit``) runs under the
    interpreter and is refused by the compiler."""
    triton = pytest.importorskip("triton")
    if INTERPRETING:
        pytest.skip("this process is the interpreter's")
    import triton.language as tl

    @triton.jit
    def doubles(x_ptr, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(x_ptr + i, _doubled(tl.load(x_ptr + i)))

    spec = dict(signature={"x_ptr": "*fp32", "BLOCK": "constexpr"}, constexprs={"BLOCK": 16}, options={})
    with pytest.raises(Exception, match="_doubled"):
        compile_for(spec, 90, doubles)


@pytest.fixture(scope="module")
def interpreted():
    """lipsformer.layers.triton_kernels as the interpreter runs it: its kernels take CPU tensors."""
    if not INTERPRETING:
        pytest.skip("the kernels run in a process started with TRITON_INTERPRET=1 (test_the_kernels_under_the_"
                    "interpreter)")
    from lipsformer.layers import triton_kernels
    return triton_kernels


@pytest.fixture(scope="module")
def interpreted_stripes(interpreted):
    """lipsformer.layers.triton_stripes as the interpreter runs it."""
    from lipsformer.layers import triton_stripes
    return triton_stripes


def _close(got, want, dtype):
    for g, w in zip(got, want):
        assert g.shape == w.shape
        torch.testing.assert_close(g.double(), w.double(), **TOL[dtype])


def _reference(op, *args):
    """The plain composition (the op's CPU implementation) on float64 copies."""
    return op(*(a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("residual, dropped, biased", [(False, False, False), (True, False, False),
                                                        (True, True, False), (True, False, True), (True, True, True)])
def test_residual_center_norm_kernels_match_the_plain_ops(interpreted, dtype, residual, dropped, biased):
    x = torch.randn(3, 4, 5, 24, dtype=dtype)
    h = torch.randn_like(x) if residual else None
    mask = torch.tensor([1.0, 0.0, 1.0], dtype=dtype) if dropped else None
    w, b = torch.randn(24), torch.randn(24)
    h_bias = torch.randn(24, dtype=dtype) if biased else None  # a branch's last bias, in the branch's dtype
    args = (x, h, mask, 0.7, w, b, 24 / 23, True, h_bias)
    y, z = interpreted.residual_center_norm(*args[:7], h_bias, *fused.empty_rcn(x, h, mask, w, b, True, h_bias))
    want = _reference(fused._rcn, *args)
    assert y.dtype == torch.float32 and z.dtype == (dtype if not residual else x.dtype)
    _close((y, z), want, dtype)
    g = torch.randn_like(x)
    got = interpreted.residual_center_norm_backward(g, z, mask, 0.7, w, 24 / 23,
                                                    *fused.empty_rcn_backward(g, mask, w, biased))
    want = _reference(fused._rcn_backward, g, want[1], mask, 0.7, w, 24 / 23, biased)
    assert got[2].shape == (3 if biased else 2, 24)
    _close([t for t in got if t.numel()], [t for t in want if t.numel()], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dropped, biased", [(False, False), (True, False), (True, True)])
def test_gelu_residual_kernels_match_the_plain_ops(interpreted, dtype, dropped, biased):
    x, u = torch.randn(3, 4, 5, 200, dtype=dtype), torch.randn(3, 4, 5, 200, dtype=dtype)  # two column blocks
    alpha = torch.randn(200)
    mask = torch.tensor([0.0, 1.0, 1.0], dtype=dtype) if dropped else None
    u_bias = torch.randn(200) if biased else None  # the bias of the map before, a float32 parameter
    _close([interpreted.gelu_residual(x, u, alpha, mask, 0.6, u_bias, fused.empty_gelu_residual(x, u, alpha, u_bias))],
           [_reference(fused._gr, x, u, alpha, mask, 0.6, u_bias)], dtype)
    g = torch.randn_like(x)
    got = interpreted.gelu_residual_backward(g, u, alpha, mask, 0.6, u_bias, torch.float32)
    assert got[1].shape == ((2, 200) if biased else (200,))
    _close(got, _reference(fused._gr_backward, g, u, alpha, mask, 0.6, u_bias), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_residual_add_kernels_match_the_plain_ops(interpreted, dtype):
    x, h = torch.randn(3, 4, 5, 200, dtype=dtype), torch.randn(3, 4, 5, 200, dtype=dtype)  # two column blocks
    mask = torch.tensor([1.0, 0.0, 1.0], dtype=dtype)
    _close([interpreted.dropped(x, h, mask, 0.6, torch.empty_like(x))], [_reference(fused._radd, x, h, mask, 0.6)],
           dtype)
    g = torch.randn_like(x)
    _close([interpreted.dropped(None, g, mask, 0.6, torch.empty_like(g))],
           [_reference(fused._drop_scale, g, mask, 0.6)], dtype)


def test_residual_add_is_one_op_each_way_with_exact_gradients():
    """``x + m * h`` with a DropPath draw: float64 gradients and second derivatives exact, the values addcmul's; one
    op forward and one backward (aten's addcmul takes two ``mul``s backward)."""
    x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    h = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([0.0, 1.0], dtype=torch.float64)
    add = lambda x, h: fused.residual_add(x, h, mask, 0.7)  # noqa: E731
    assert torch.autograd.gradcheck(add, (x, h)) and torch.autograd.gradgradcheck(add, (x, h))
    torch.testing.assert_close(add(x, h), x + (mask / 0.7).view(2, 1, 1) * h, rtol=0, atol=1e-15)

    with OpNames() as forward:
        out = add(x, h)
    ones = torch.ones_like(out)
    with OpNames() as backward:
        torch.autograd.grad(out, (x, h), ones)
    assert forward.names == {"residual_add": 1} and backward.names == {"drop_scale": 1}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_and_grad_kernels_match_the_plain_ops(interpreted, dtype):
    u, g = torch.randn(3, 5, 700, dtype=dtype) * 3, torch.randn(3, 5, 700, dtype=dtype)  # more than one block
    got = interpreted.gelu_and_grad(g, u)
    assert [t.dtype for t in got] == [dtype, dtype]
    _close(got, _reference(fused._gg, g, u), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_normalize_kernels_match_the_plain_ops_on_strided_views(interpreted, dtype):
    qkv = torch.randn(2, 7, 3, 3, 8, dtype=dtype)  # (windows, tokens, q/k/v, heads, d), as the projection lays out
    q, k = (t.transpose(1, 2) for t in qkv.unbind(2)[:2])
    got = interpreted.qk_normalize(q, k, 10.0, 1e-12)
    want = _reference(fused._qkn, q, k, 10.0, 1e-12)
    assert got[0].is_contiguous() and got[1].is_contiguous()
    _close(got, want, dtype)
    gq, gk = torch.randn(2, 3, 7, 8, dtype=dtype), torch.randn(2, 3, 7, 8, dtype=dtype)
    _close(interpreted.qk_normalize_backward(gq, gk, *got, 10.0),  # both from the kernel's outputs
           _reference(fused._qkn_backward, gq, gk, *got, 10.0), dtype)


STRIPES = {"two branches": [(6, 2), (2, 4)], "one": [(6, 4)]}  # CSwin's stripes of a 6x4 map; full attention


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("branches", list(STRIPES))
def test_stripe_kernels_match_the_plain_ops(interpreted_stripes, dtype, branches):
    """CSwin's gather (q, k, v into each branch's stripes, q and k normalised, and v's LePE) and merge (attention
    plus LePE back to the map), forward and backward (the LePE weights' gradients summed), against the plain
    composition; the gradients given in the strides autograd hands them (transposed views)."""
    windows = STRIPES[branches]
    flat = [s for w in windows for s in w]
    heads, d, nb = 2, 3, len(windows)
    kernels = interpreted_stripes
    qkv = torch.randn(2, 6, 4, 3 * nb * heads * d, dtype=dtype)
    lepe = [t for _ in windows for t in (torch.randn(heads * d, 1, 3, 3), torch.randn(heads * d))]
    params = lepe + [qkv.new_empty(0)] * (4 - len(lepe))
    got = kernels.stripe_qkv(qkv, lepe, windows, heads, 12.0, 1e-12)
    want = _reference(stripes._sqkv, qkv, *params, flat, heads, 12.0, 1e-12)
    assert all(t.is_contiguous() for t in got) and len(got) == 9
    _close([t for t in got if t.numel()], [t for t in want if t.numel()], dtype)
    # q, k, v's gradients in the strides SDPA gives them (transposed views), the LePE's contiguous
    grads = [t.new_empty(0) if not t.numel() else torch.randn_like(t) if i % 4 == 3 else
             torch.randn(t.shape[0], t.shape[2], t.shape[1], d, dtype=dtype).transpose(1, 2)
             for i, t in enumerate(got[:8])]
    outs = [got[i] for i in (0, 1, 2, 4, 5, 6)]
    weights = [lepe[0], lepe[2] if nb == 2 else qkv.new_empty(0)]
    got_grad = kernels.stripe_qkv_backward(grads, outs, weights, got[8], windows, 6, 4, 12.0, torch.float32)
    want_grad = _reference(stripes._sqkv_backward, *grads, *outs, *weights, got[8], flat, 6, 4, 12.0)
    assert got_grad[1].dtype == torch.float32 and got_grad[1].shape == (nb, 10 * heads * d)
    _close(got_grad, want_grad, dtype)
    attn = [torch.randn(2 * 24 // (wh * ww), wh * ww, heads, d, dtype=dtype).transpose(1, 2) for wh, ww in windows]
    lepe = [torch.randn(2 * 24 // (wh * ww), wh, ww, heads * d, dtype=dtype).permute(0, 3, 1, 2)
            for wh, ww in windows]
    empty = [qkv.new_empty(0)] * 2
    args = [attn[0], lepe[0], *((attn[1], lepe[1]) if nb == 2 else empty), flat, 6, 4]
    _close([kernels.stripe_merge(attn, lepe, windows, 6, 4)], [_reference(stripes._smerge, *args)], dtype)
    g = torch.randn(2, 6, 4, nb * heads * d, dtype=dtype)
    got = kernels.stripe_merge_backward(g, windows, heads)
    want = _reference(stripes._smerge_backward, g, flat, heads)
    _close([t for t in got if t.numel()], [t for t in want if t.numel()], dtype)


@pytest.mark.parametrize("branches", list(STRIPES))
def test_stripe_ops_have_exact_gradients_and_a_double_backward_says_it_cannot(branches):
    """float64: the gather and merge against finite differences (their CPU forward and fused backward ops); the
    gather is differentiable once, as SCSA's normalisation is."""
    from lipsformer.layers.stripes import stripe_merge, stripe_qkv
    windows = STRIPES[branches]
    qkv = torch.randn(2, 6, 4, 3 * len(windows) * 2 * 3, dtype=torch.float64, requires_grad=True)
    lepes = [torch.nn.Conv2d(6, 6, 3, padding=1, groups=6).double() for _ in windows]
    params = [p for conv in lepes for p in conv.parameters()]
    params += [qkv.new_empty(0)] * (4 - len(params))
    flat_windows = [s for w in windows for s in w]
    # the op itself: q, k, v and each LePE against finite differences in the projection and the LePE parameters
    assert torch.autograd.gradcheck(
        lambda t, *p: torch.ops.lipsformer.stripe_qkv(t, *p, flat_windows, 2, 12.0, 1e-12)[:8], (qkv, *params))
    assert torch.autograd.gradcheck(
        lambda t: [u for part in stripe_qkv(t, lepes, windows, 2, 12.0, 1e-12) for u in part], (qkv,))
    # in the layouts SDPA and a channels-last convolution give them: those of the gradients' views
    parts = [(torch.randn(48 // (wh * ww), wh * ww, 2, 3, dtype=torch.float64).transpose(1, 2).requires_grad_(),
              torch.randn(48 // (wh * ww), wh, ww, 6, dtype=torch.float64).permute(0, 3, 1, 2).requires_grad_())
             for wh, ww in windows]
    flat = [t for part in parts for t in part]
    assert torch.autograd.gradcheck(lambda *t: stripe_merge(list(t[::2]), list(t[1::2]), windows, 6, 4), flat)
    for _ in range(2):  # leaves: each keeps a gradient of its own, twice the first after two passes
        stripe_merge(list(flat[::2]), list(flat[1::2]), windows, 6, 4).sum().backward()
    assert all(t.grad.eq(2.0).all() for t in flat)
    q = stripe_qkv(qkv, lepes, windows, 2, 12.0, 1e-12)[0][0]
    g, = torch.autograd.grad(q.pow(2).sum(), qkv, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiable once"):
        g.pow(2).sum().backward()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_maps", [1, 2])
def test_scale_rows_kernels_match_the_plain_ops(interpreted, dtype, n_maps):
    """One map without a bias (rows longer than a block, the weight also times a constant), or two in one launch:
    that one and a shorter one with a bias (a block's two branches), forward and backward."""
    maps = [(torch.randn(6, 1500, dtype=dtype), torch.empty(0, dtype=dtype), torch.randn(6, dtype=dtype), 0.5),
            (torch.randn(3, 40, dtype=dtype), torch.randn(3, dtype=dtype), torch.randn(3, dtype=dtype), 1.0)][:n_maps]
    lists = [list(m) for m in zip(*maps)]
    double = [[t.double() for t in ts] for ts in lists[:3]] + lists[3:]
    got = interpreted.scale_rows(*lists)
    empty = (torch.empty(0), torch.empty(0), torch.empty(0), 1.0)
    flat = [a.double() if isinstance(a, torch.Tensor) else a for m in maps + [empty] * (2 - n_maps) for a in m]
    _close([t for t in got if t.numel()], [t for t in gelu._sr(*flat) if t.numel()], dtype)
    grads = [[torch.randn_like(w) for w in lists[0]], [torch.randn_like(b) for b in lists[1]]]
    got = interpreted.scale_rows_backward(*grads, *lists)
    want = gelu._sr_backward(*[[t.double() for t in ts] for ts in grads], *double)
    _close([t for t in got if t.numel()], [t for t in want if t.numel()], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k, skip, epilogue", [(7, True, "RESIDUAL"), (3, False, "GELU"), (3, True, "NONE")])
def test_depthwise_conv_kernels_match_the_plain_ops(interpreted, dtype, k, skip, epilogue):
    """The conv blocks' depth-wise convolution on a (B, H, W, C) map (two blocks of channels; a map smaller than the
    kernel one way) with each epilogue (the residual's with a DropPath draw), forward and backward (the skip's
    gradient in float32, as under autocast, added to the input's; the weight's and bias's gradients summed)."""
    from lipsformer.layers import conv_blocks, triton_depthwise
    x = torch.randn(2, 5, 9, 70, dtype=dtype)
    w, b, alpha = torch.randn(70, 1, k, k), torch.randn(70), torch.randn(70)
    mask = torch.tensor([1.0, 0.0], dtype=dtype)
    mode = conv_blocks.Epilogue[epilogue]
    args = (x, w, b, alpha, mask, 0.7, mode)
    got = triton_depthwise.depthwise_conv(*args, dtype, *conv_blocks._empty_dwc(x, alpha, mode, dtype))
    want = _reference(conv_blocks._dwc, *args, torch.float64)
    assert all(t.is_contiguous() for t in got) and got[0].dtype == (torch.float32 if epilogue == "RESIDUAL" else dtype)
    _close([t for t in got if t.numel()], [t for t in want if t.numel()], dtype)
    g = torch.randn_like(x)
    s = torch.randn(x.shape) if skip else None
    grads = triton_depthwise.depthwise_conv_backward(g, x, w, s, torch.float32)
    assert grads[0].dtype == (torch.float32 if skip else dtype) and grads[1].shape == (70 * k * k + 70,)
    _close(grads, _reference(conv_blocks._dwc_backward, g, x, w, s), dtype)
    if epilogue == "RESIDUAL":  # its backward in one op: the residual's, the convolution's, one sum for all three
        u = got[1]
        grads = triton_depthwise.conv_residual_backward(g, x, w, u, alpha, mask, 0.7, torch.float32)
        assert grads[1].shape == (70 * k * k + 2 * 70,)
        grad_u, grad_alpha = interpreted.gelu_residual_backward(g, u, alpha, mask, 0.7, None, torch.float32)
        grad_x, sums = _reference(conv_blocks._dwc_backward, grad_u, x, w, g)  # from u's gradient in u's dtype
        _close(grads, (grad_x, torch.cat((grad_alpha, sums))), dtype)


# aten ops that launch no kernel themselves: allocations, views, metadata, and conversions whose copy (if any) shows
# as an op inside them
_NO_KERNEL = {"aten::empty", "aten::empty_like", "aten::new_empty", "aten::empty_strided", "aten::promote_types",
              "aten::view", "aten::as_strided", "aten::reshape", "aten::_reshape_alias", "aten::select",
              "aten::slice", "aten::unsqueeze", "aten::squeeze", "aten::expand", "aten::permute", "aten::t",
              "aten::transpose", "aten::detach", "aten::alias", "aten::resize_", "aten::to", "aten::contiguous",
              "aten::lift_fresh", "aten::unbind", "aten::split", "aten::chunk"}


def _launched(event) -> list:
    """The kernels a profiler event launches: a Triton launch, or an aten op that launches (one kernel, whatever
    it calls on the CPU); inside ops that launch none (a fused op's range, its eager entry's ``autograd.Function``
    ``lipsformer_<op>``), what they call."""
    if event.name.startswith("triton::"):
        return [event.name]
    if event.name in _NO_KERNEL or event.name.startswith(("lipsformer::", "lipsformer_")):
        return [k for child in event.cpu_children for k in _launched(child)]
    return [event.name]


@pytest.mark.parametrize("name", ["lipsformer_swin_t", "lipsformer_cswin_t"])
def test_a_training_step_through_the_kernels_equals_the_plain_ops(interpreted, name, monkeypatch):
    """Both families' training step (DropPath on) with every fused op running its Triton kernel, the depth-wise
    convolution's included (as on a GPU): the loss and every gradient as with the ops' plain composition, in
    float32, and alike through the custom ops (a dispatch mode). Inside each op (a profiler range named as the op),
    the kernels it launches (Triton launches and aten ops that launch one, found in the profiler's tree) are what
    ``fused.LAUNCHES`` says, which the step-cost tool counts for it; whatever else the step launches is outside the
    ops, where the tool sees it."""
    from torch.profiler import profile, record_function
    from triton.runtime.interpreter import GridExecutor

    from lipsformer.layers import conv_blocks
    monkeypatch.setattr(conv_blocks, "_float32_cpu", lambda x, weight: False)  # the GPU's depth-wise convolution
    model = timm.create_model(name, num_classes=5, drop_path_rate=0.3, init="xavier", **TINY[family(name)]).train()
    x = torch.randn(2, 3, 32, 32)

    def step():
        model.zero_grad()
        torch.manual_seed(5)
        loss = model(x).square().mean()
        loss.backward()
        return [loss] + [p.grad.clone() for p in model.parameters()]

    plain = step()  # the fused ops' CPU implementation: the plain composition forward

    def launch(fn, values, run):
        with record_function("triton::" + fn.__name__):
            return run()

    monkeypatch.setattr(GridExecutor, "__call__", wrap_launches(launch))
    monkeypatch.setattr(fused, "_kernels", lambda t: interpreted)
    with profile() as prof:
        through_kernels = step()
    with OpNames():  # through the custom ops, which refuse outputs that alias inputs
        dispatched = step()
    for a, b, c in zip(through_kernels, plain, dispatched):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(c, a, rtol=0, atol=0)
    ops = [e for e in prof.events() if e.name.startswith("lipsformer::")]
    launched = [(e.name.split("::")[1], _launched(e)) for e in ops]
    assert {"residual_center_norm_backward", "depthwise_conv", "conv_residual_backward"} <= {op for op, _ in launched}
    wrong = {op: k for op, k in launched if len(k) != fused.LAUNCHES.get(op, 1)}
    assert not wrong, wrong


@pytest.mark.parametrize("name", ["lipsformer_swin_t", "lipsformer_cswin_t"])
def test_eager_mode_calls_the_fused_ops_directly_and_a_dispatch_mode_sees_each(name, monkeypatch):
    """Both families' training step (DropPath on, the GPU's depth-wise route): in eager mode no fused op goes
    through the dispatcher, whose torch.library wrappers cost the host more than twice a direct call (docs/speed.md),
    and the profiler sees each call as a range named as the op; under a dispatch mode (the step-cost tool's count)
    every one does, each seen as one op; the loss and every gradient bit for bit alike."""
    from torch.profiler import profile

    from lipsformer.layers import conv_blocks
    from lipsformer.layers.fused_op import FusedOp
    monkeypatch.setattr(conv_blocks, "_float32_cpu", lambda x, weight: False)
    ops = [v for m in (fused, stripes, conv_blocks, gelu) for v in vars(m).values() if isinstance(v, FusedOp)]
    assert len(ops) == 18
    names, dispatched = {op: op.name.removeprefix("lipsformer_") for op in ops}, Counter()
    for op in ops:
        monkeypatch.setattr(op, "op", lambda *a, real=op.op, short=names[op]: dispatched.update([short]) or real(*a))
    model = timm.create_model(name, num_classes=5, drop_path_rate=0.3, init="xavier", **TINY[family(name)]).train()
    x = torch.randn(2, 3, 32, 32)

    def step():
        model.zero_grad()
        torch.manual_seed(5)
        model(x).square().mean().backward()
        return [p.grad.clone() for p in model.parameters()]

    direct = step()
    assert not dispatched
    with OpNames() as mode:
        moded = step()
    assert dispatched == Counter({k: n for k, n in mode.names.items() if k in names.values()})
    assert {"residual_center_norm", "residual_center_norm_backward", "depthwise_conv", "scale_rows"} <= set(dispatched)
    if name == "lipsformer_cswin_t":
        assert {"stripe_qkv", "stripe_merge_backward", "residual_add", "drop_scale"} <= set(dispatched)
    seen, dispatched = dispatched, Counter()
    with profile() as prof:
        profiled = step()
    assert not dispatched
    ranges = Counter(e.name.split("::")[1] for e in prof.events() if e.name.startswith("lipsformer::"))
    # and a fused op that another's CPU implementation calls, which a dispatch mode does not see
    assert set(ranges) == set(seen) and all(ranges[op] >= n for op, n in seen.items())
    for a, b, c in zip(direct, moded, profiled):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
        torch.testing.assert_close(c, a, rtol=0, atol=0)


LISTS = [List[Tensor], Sequence[Tensor], Optional[List[Tensor]], List[Optional[Tensor]], list[Tensor] | None]


@pytest.mark.parametrize("i", range(len(LISTS)), ids=[str(a) for a in LISTS])
def test_a_differentiable_fused_op_refuses_a_list_of_tensors(i):
    """An ``autograd.Function`` does not see the tensors in a list, so eager mode's entry could not differentiate
    them: registering autograd on such an op says so, in each form an op's schema takes a list of tensors."""
    from lipsformer.layers.fused_op import fused_op

    def listed(ts, x: torch.Tensor) -> torch.Tensor:
        return x.clone()
    listed.__annotations__["ts"] = LISTS[i]
    op = fused_op(f"lipsformer_tests::listed_{i}")(listed)
    with pytest.raises(TypeError, match="does not see the tensors in a list"):
        op.register_autograd(lambda ctx, grad: None, lambda ctx, inputs, output: None)


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # vmap's loop over an op without a batching rule
def test_a_torch_func_transform_takes_the_custom_op():
    """Under ``torch.func.vmap`` a fused op goes through the dispatcher, whose custom op batches (eager mode's
    ``autograd.Function`` takes no transform)."""
    x, h, mask = torch.randn(3, 2, 4), torch.randn(3, 2, 4), torch.tensor([1.0, 0.0])
    got = torch.func.vmap(lambda a, b: fused._radd(a, b, mask, 0.5))(x, h)
    torch.testing.assert_close(got, torch.stack([torch.addcmul(a, b, (mask / 0.5).view(2, 1)) for a, b in zip(x, h)]))


def test_torch_compile_sees_each_fused_op_as_one_node():
    seen = []

    def backend(gm, example_inputs):
        seen.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward

    x, h, w, b = torch.randn(2, 3, 8), torch.randn(2, 3, 8), torch.randn(8), torch.randn(8)
    q, k, mask = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 5, 4), torch.tensor([1.0, 0.0])
    o, qkv = torch.randn(5, 1, 5, 2), torch.randn(1, 4, 4, 12)
    lepe = [torch.randn(2, 1, 3, 3), torch.randn(2)] * 2
    calls = {
        "residual_center_norm": lambda: torch.ops.lipsformer.residual_center_norm(x, h, mask, 0.5, w, b, 8 / 7, False),
        "gelu_residual": lambda: torch.ops.lipsformer.gelu_residual(x, h, w, mask, 0.5),
        "residual_add": lambda: torch.ops.lipsformer.residual_add(x, h, mask, 0.5),
        "qk_normalize": lambda: torch.ops.lipsformer.qk_normalize(q, k, 10.0, 1e-12),
        "scale_rows": lambda: torch.ops.lipsformer.scale_rows(w.view(2, 4), b[:2], b[2:4], 1.0, *[b[:0]] * 3, 1.0),
        "stripe_qkv": lambda: torch.ops.lipsformer.stripe_qkv(qkv, *lepe, [4, 2, 2, 4], 1, 12.0, 1e-12),
        "stripe_merge": lambda: torch.ops.lipsformer.stripe_merge(  # a 5x5 map's stripes, 1 wide, 1 head of 2
            o, o.view(5, 2, 5, 1), o, o.view(5, 2, 1, 5), [5, 1, 1, 5], 5, 5),
    }
    for name, call in calls.items():
        torch._dynamo.reset()
        seen.clear()
        torch.compile(call, backend=backend, fullgraph=True)()
        ops = [t for t in seen[0] if "getitem" not in t]
        assert ops == [f"lipsformer.{name}"], (name, ops)
    torch._dynamo.reset()


@pytest.mark.parametrize("name", ["lipsformer_swin_t", "lipsformer_cswin_t"])
def test_models_compute_the_same_with_the_fused_ops_on_and_off(name):
    """float64, DropPath drawing the same masks: logits, loss and every gradient to rounding; evaluation outputs bit
    for bit (the CPU implementation is the plain composition)."""
    model = timm.create_model(name, num_classes=5, drop_path_rate=0.4, **TINY[family(name)]).double()
    x = torch.randn(3, 3, 32, 32, dtype=torch.float64)

    def step():
        model.train().zero_grad()
        torch.manual_seed(2)
        out = model(x)
        out.square().mean().backward()
        return [out] + [p.grad.clone() for p in model.parameters()]

    on = step()
    with use_fused_ops(False):
        off = step()
        evaluated = model.eval()(x)
    for a, b in zip(on, off):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert torch.equal(model.eval()(x), evaluated)
