"""CSwin's stripes as two fused ops (:mod:`lipsformer.layers.fused`'s pattern: ``torch.library`` custom ops, a Triton
kernel each way on CUDA in :mod:`lipsformer.layers.triton_kernels`, the plain composition elsewhere, one node each for
``torch.compile``):

- :func:`stripe_qkv`, the gather: from the qkv projection, each branch's q and k normalised as SCSA does (q times the
  temperature) and v, in its stripes, (windows, tokens, heads, d) contiguous, where SDPA takes them as transposed
  views and LePE takes v as a channels-last map; backward writes the projection's gradient from both branches' in one
  pass.
- :func:`stripe_merge`: each branch's attention output plus its LePE, back into the map's channels; backward writes
  each branch's part of the gradient once, in the layout both the attention's and the LePE's backward read.

:class:`lipsformer.models.lipsformer_cswin.CrossShapedAttention` runs them where :func:`fusable` says the fused ops
run and its SCSA is the released form (a fixed temperature, v as it is).
"""
from typing import List, Tuple

import torch
from torch import Tensor

from . import fused  # fused._kernels looked up on the module, where the tests replace it
from .conv_blocks import dw_conv, dw_conv_grads
from .fused import DifferentiableOnce, math_backward, qk_normalize_backward_math, qk_normalize_math, sum_dtype
from .fused_op import fused_op
from .windows import window_partition, window_reverse


def _windows(windows: List[int]) -> List[Tuple[int, int]]:
    """The flat ``[h0, w0, h1, w1]`` of an op's schema as (height, width) pairs."""
    return [(windows[i], windows[i + 1]) for i in range(0, len(windows), 2)]


def _kernels(t: Tensor):
    """The stripes' Triton kernels where the fused ops run theirs (:func:`lipsformer.layers.fused._kernels`)."""
    if fused._kernels(t) is None:
        return None
    from . import triton_stripes
    return triton_stripes


def _windows_nhwc(t: Tensor, window: Tuple[int, int]) -> Tensor:
    """A branch's (windows, tokens, heads, d) as (windows, wh, ww, C_b): a view."""
    return t.reshape(t.shape[0], window[0], window[1], -1)


def lepe_map(t: Tensor, window: Tuple[int, int]) -> Tensor:
    """A branch's (windows, tokens, heads, d) as LePE's (windows, C_b, wh, ww) map, channels last: a view."""
    return _windows_nhwc(t, window).permute(0, 3, 1, 2)


def _lepe(v: Tensor, weight: Tensor, bias: Tensor, window: Tuple[int, int]) -> Tensor:
    """LePE (a depth-wise 3x3 convolution inside each window) of a branch's v, in v's layout and dtype, contiguous."""
    return dw_conv(_windows_nhwc(v, window), weight.to(v.dtype), bias.to(v.dtype)).contiguous().view(v.shape)


@fused_op("lipsformer::stripe_qkv")
def _sqkv(qkv: Tensor, w0: Tensor, b0: Tensor, w1: Tensor, b1: Tensor, windows: List[int], heads: int,
          q_scale: float, eps: float) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """From a (B, H, W, 3 * C) projection laid out (q, k, v) x (branches) x (heads, d): for each branch (one or two),
    its windows' q and k normalised (q times ``q_scale``), v, and v's LePE (the depth-wise 3x3 ``w``, ``b``), each
    (windows, tokens, heads, d) contiguous (empty for an absent second branch); and the rows' ``1 / norm``,
    (branches, 2, windows * tokens * heads)."""
    kernels = _kernels(qkv)
    wins = _windows(windows)
    lepe_weights = [w0, b0, w1, b1][:2 * len(wins)]
    if kernels is not None:
        return kernels.stripe_qkv(qkv, lepe_weights, wins, heads, q_scale, eps)
    B, H, W, _ = qkv.shape
    parts = qkv.view(B, H, W, 3, len(wins), heads, -1).unbind(4)
    outs, norms = [], []
    for b, (part, window) in enumerate(zip(parts, wins)):
        q, k, v = window_partition(part, window).unbind(2)  # each (windows, tokens, heads, d)
        qn, kn, rq, rk = qk_normalize_math(q, k, q_scale, eps)
        v = v.clone(memory_format=torch.contiguous_format)
        outs += [qn, kn, v, _lepe(v, *lepe_weights[2 * b:2 * b + 2], window)]
        norms.append(torch.stack((rq.flatten(), rk.flatten())))
    outs += [qkv.new_empty(0) for _ in range(8 - len(outs))]  # distinct: outputs may not alias
    return (*outs, torch.stack(norms))


@_sqkv.register_fake
def _(qkv, w0, b0, w1, b1, windows, heads, q_scale, eps):
    B, H, W, C3 = qkv.shape
    wins = _windows(windows)
    d = C3 // (3 * len(wins) * heads)
    outs = [qkv.new_empty(B * (H // wh) * (W // ww), wh * ww, heads, d) for wh, ww in wins for _ in range(4)]
    outs += [qkv.new_empty(0) for _ in range(8 - len(outs))]  # distinct: outputs may not alias
    return (*outs, qkv.new_empty(len(wins), 2, B * H * W * heads))


def _sqkv_backward_math(grads, outs, weights, norms, windows, H, W, q_scale):
    """The projection's gradient, (B, H, W, 3 * C), and the LePE weights' and biases' (branches, 10 * C_b: the
    weight's (C_b, 9) row-major, then the bias's), from the gradients of :func:`_sqkv`'s q, k, v and LePE."""
    parts, sums = [], []
    for b, window in enumerate(windows):
        gq, gk, gv, gl = grads[4 * b:4 * b + 4]
        qn, kn, v = outs[3 * b:3 * b + 3]
        rq, rk = (r.view(qn.shape[:-1] + (1,)) for r in norms[b])
        gx = qk_normalize_backward_math(gq, gk, qn, kn, rq, rk, q_scale)
        g_in, lepe_sums = dw_conv_grads(_windows_nhwc(gl, window), _windows_nhwc(v, window), weights[b], None)
        gv = gv + g_in.reshape(gv.shape)
        parts.append(window_reverse(torch.stack((*gx, gv), 2), window, H, W))  # (B, H, W, 3, heads, d)
        sums.append(lepe_sums)
    return torch.stack(parts, 4).flatten(3), torch.stack(sums)  # (B, H, W, 3 * branches * heads * d)


@fused_op("lipsformer::stripe_qkv_backward")
def _sqkv_backward(gq0: Tensor, gk0: Tensor, gv0: Tensor, gl0: Tensor, gq1: Tensor, gk1: Tensor, gv1: Tensor,
                   gl1: Tensor, qn0: Tensor, kn0: Tensor, v0: Tensor, qn1: Tensor, kn1: Tensor, v1: Tensor, w0: Tensor,
                   w1: Tensor, norms: Tensor, windows: List[int], H: int, W: int, q_scale: float
                   ) -> Tuple[Tensor, Tensor]:
    """(the projection's gradient, the LePE weights' and biases' gradients summed in float32 at least)."""
    kernels = _kernels(qn0)
    wins = _windows(windows)
    grads, outs, weights = (gq0, gk0, gv0, gl0, gq1, gk1, gv1, gl1), (qn0, kn0, v0, qn1, kn1, v1), (w0, w1)
    if kernels is not None:
        return kernels.stripe_qkv_backward(grads, outs, weights, norms, wins, H, W, q_scale, sum_dtype(gq0))
    grad, sums = _sqkv_backward_math(grads, outs, weights, norms, wins, H, W, q_scale)
    return grad, sums.to(sum_dtype(gq0))


@_sqkv_backward.register_fake
def _(gq0, gk0, gv0, gl0, gq1, gk1, gv1, gl1, qn0, kn0, v0, qn1, kn1, v1, w0, w1, norms, windows, H, W, q_scale):
    n, heads, d = qn0.shape[0] * qn0.shape[1], qn0.shape[2], qn0.shape[3]
    nb = norms.shape[0]
    return (qn0.new_empty(n // (H * W), H, W, 3 * nb * heads * d),
            qn0.new_empty(nb, 10 * heads * d, dtype=sum_dtype(gq0)))


def _sqkv_setup(ctx, inputs, output):
    ctx.set_materialize_grads(False)  # no zeros for outputs nothing uses
    qkv, w0, b0, w1, b1, windows, heads, q_scale, eps = inputs
    q0, k0, v0, _, q1, k1, v1, _, norms = output
    ctx.save_for_backward(q0, k0, v0, q1, k1, v1, w0, w1, norms)
    ctx.windows, ctx.H, ctx.W, ctx.q_scale = windows, qkv.shape[1], qkv.shape[2], q_scale
    ctx.shapes = [t.shape for t in output[:8]]
    ctx.dtypes = (w0.dtype, b0.dtype, w1.dtype, b1.dtype)
    ctx.mark_non_differentiable(norms)


def _sqkv_grad(ctx, *grads):
    saved = ctx.saved_tensors
    outs, weights, norms = saved[:6], saved[6:8], saved[8]
    wins = _windows(ctx.windows)
    grads = [torch.zeros(shape, dtype=outs[0].dtype, device=norms.device) if g is None else g
             for g, shape in zip(grads[:8], ctx.shapes)]
    grads[3::4] = [g.contiguous() for g in grads[3::4]]  # the LePE's, read at the neighbours
    if torch._C._are_functorch_transforms_active():
        grad, sums = _sqkv_backward_math(grads, outs, weights, norms, wins, ctx.H, ctx.W, ctx.q_scale)
    else:
        with torch.no_grad():
            grad, sums = _sqkv_backward(*grads, *outs, *weights, norms, ctx.windows, ctx.H, ctx.W, ctx.q_scale)
        if torch.is_grad_enabled():  # create_graph: as qk_normalize, differentiable once
            grad, sums = DifferentiableOnce.apply((grad, sums), *grads)
    lepe = []
    for b in range(2):
        if b < len(wins):
            w_dtype, b_dtype = ctx.dtypes[2 * b:2 * b + 2]
            Cb = weights[b].shape[0]
            lepe += [sums[b, :9 * Cb].view(weights[b].shape).to(w_dtype), sums[b, 9 * Cb:].to(b_dtype)]
        else:
            lepe += [None, None]
    return (grad, *lepe, None, None, None, None)


_sqkv.register_autograd(_sqkv_grad, _sqkv_setup)


def stripe_qkv(qkv: Tensor, lepes: List[torch.nn.Conv2d], windows: List[Tuple[int, int]], heads: int,
               q_scale: float, eps: float) -> List[Tuple[Tensor, Tensor, Tensor, Tensor]]:
    """CSwin's gather, for a (B, H, W, 3 * C) projection laid out (q, k, v) x (branches) x (heads, d) and one or two
    branches of ``windows`` (each branch a window size that divides H and W) with their LePE convolutions (depth-wise
    3x3 with a bias, :func:`lepe_fusable`): per branch ``(q, k, v, lepe)``, each (windows, tokens, heads, d)
    contiguous, q and k as SCSA normalises them (:func:`qk_normalize`) and ``lepe`` the LePE of v, in one pass. The
    caller decides where it runs (:func:`fusable`)."""
    flat = [int(s) for w in windows for s in w]
    params = [t for conv in lepes for t in (conv.weight, conv.bias)]
    params += [qkv.new_empty(0) for _ in range(4 - len(params))]
    outs = _sqkv(qkv.contiguous(), *params, flat, int(heads), float(q_scale), float(eps))
    return [tuple(outs[4 * b:4 * b + 4]) for b in range(len(windows))]


def lepe_fusable(conv: torch.nn.Module) -> bool:
    """Whether a LePE convolution is one the gather computes: ``nn.Conv2d``'s own forward, depth-wise 3x3, stride 1,
    padding 1, with a bias, no hooks."""
    return (type(conv) is torch.nn.Conv2d and conv.kernel_size == (3, 3) and conv.stride == (1, 1)
            and conv.padding == (1, 1) and conv.dilation == (1, 1) and conv.groups == conv.in_channels
            == conv.out_channels and conv.bias is not None and conv.padding_mode == "zeros"
            and not (conv._forward_hooks or conv._forward_pre_hooks))


def _smerge_math(outs, lepes, windows, H, W):
    parts = []
    for o, lepe, window in zip(outs, lepes, windows):
        n = o.shape[0]
        tokens = o.transpose(1, 2).reshape(n, o.shape[2], -1) + lepe.flatten(2).transpose(1, 2)
        parts.append(window_reverse(tokens, window, H, W))
    return parts[0].contiguous() if len(parts) == 1 else torch.cat(parts, -1)


@fused_op("lipsformer::stripe_merge")
def _smerge(o0: Tensor, lepe0: Tensor, o1: Tensor, lepe1: Tensor, windows: List[int], H: int, W: int) -> Tensor:
    """(B, H, W, C) from each branch's attention output (windows, heads, tokens, d) plus its LePE (windows, C_b,
    wh, ww), the branches' channels side by side (an absent second branch: empty tensors)."""
    wins = _windows(windows)
    outs, lepes = (o0, o1)[:len(wins)], (lepe0, lepe1)[:len(wins)]
    kernels = _kernels(o0)
    if kernels is not None:
        return kernels.stripe_merge(outs, lepes, wins, H, W)
    return _smerge_math(outs, lepes, wins, H, W)


@_smerge.register_fake
def _(o0, lepe0, o1, lepe1, windows, H, W):
    nb = len(windows) // 2
    n = o0.shape[0] * o0.shape[2]
    return o0.new_empty(n // (H * W), H, W, nb * o0.shape[1] * o0.shape[3],
                        dtype=torch.promote_types(o0.dtype, lepe0.dtype))


@fused_op("lipsformer::stripe_merge_backward")
def _smerge_backward(grad: Tensor, windows: List[int], heads: int) -> Tuple[Tensor, Tensor]:
    """Each branch's part of the map's gradient, (windows, tokens, heads, d) contiguous (an absent second branch:
    empty): the gradient of its attention output and, viewed as a map, of its LePE."""
    wins = _windows(windows)
    kernels = _kernels(grad)
    if kernels is not None:
        return kernels.stripe_merge_backward(grad, wins, heads)
    B, H, W, C = grad.shape
    parts = grad.view(B, H, W, len(wins), heads, -1).unbind(3)
    outs = [window_partition(g, w).clone(memory_format=torch.contiguous_format) for g, w in zip(parts, wins)]
    return outs[0], outs[1] if len(outs) > 1 else grad.new_empty(0)


@_smerge_backward.register_fake
def _(grad, windows, heads):
    B, H, W, C = grad.shape
    wins = _windows(windows)
    outs = [grad.new_empty(B * (H // wh) * (W // ww), wh * ww, heads, C // (len(wins) * heads)) for wh, ww in wins]
    return outs[0], outs[1] if len(outs) > 1 else grad.new_empty(0)


def _smerge_setup(ctx, inputs, output):
    o0, lepe0, o1, lepe1, windows, H, W = inputs
    ctx.windows, ctx.heads = windows, o0.shape[1]
    ctx.dtypes = (o0.dtype, lepe0.dtype, o1.dtype, lepe1.dtype)
    ctx.leaves = (o0.is_leaf and lepe0.is_leaf, o1.is_leaf and lepe1.is_leaf)


def _smerge_grad(ctx, grad):
    wins = _windows(ctx.windows)
    if math_backward():
        B, H, W, C = grad.shape
        gs = [window_partition(g, w) for g, w in zip(grad.view(B, H, W, len(wins), ctx.heads, -1).unbind(3), wins)]
    else:
        gs = _smerge_backward(grad.contiguous(), ctx.windows, ctx.heads)[:len(wins)]
    out = []
    for g, (wh, ww), (o_dtype, l_dtype), leaf in zip(gs, wins, (ctx.dtypes[:2], ctx.dtypes[2:]), ctx.leaves):
        # one buffer, two views: the attention's gradient (windows, heads, tokens, d) and the LePE's as a
        # channels-last map (windows, C_b, wh, ww); each is read once, by its own backward. Two leaf inputs would
        # keep them as their .grad, which later backward passes add into: there, the LePE's gets a copy
        lepe = lepe_map(g, (wh, ww))
        out += [g.transpose(1, 2).to(o_dtype), (lepe.clone() if leaf else lepe).to(l_dtype)]
    out += [None, None] * (2 - len(wins))
    return (*out, None, None, None)


_smerge.register_autograd(_smerge_grad, _smerge_setup)


def stripe_merge(outs: List[Tensor], lepes: List[Tensor], windows: List[Tuple[int, int]], H: int, W: int) -> Tensor:
    """CSwin's merge: (B, H, W, C) from each branch's attention output (windows, heads, tokens, d) and LePE
    (windows, C_b, wh, ww), in one pass; backward one pass giving each branch one buffer that both take views of.
    The caller decides where it runs (:func:`fusable`)."""
    flat = [int(s) for w in windows for s in w]
    empty = outs[0].new_empty(0)
    o1, l1 = (outs[1], lepes[1]) if len(outs) > 1 else (empty, empty)
    return _smerge(outs[0], lepes[0], o1, l1, flat, int(H), int(W))
