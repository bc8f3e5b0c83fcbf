"""Fused ops for the passes LipsFormer adds to a transformer block, as ``torch.library`` custom ops: one op forward
and one backward each, a Triton kernel on CUDA (:mod:`lipsformer.layers.triton_kernels`), the plain composition of
aten ops elsewhere. ``torch.compile`` sees each as one node (``register_fake``); eager mode calls the same
implementation without the dispatcher (:mod:`lipsformer.layers.fused_op`).

- :func:`residual_center_norm`: ``CN(x + m * h)``, a weighted residual (its branch output ``h`` already scaled by
  alpha, ``m`` the per-sample DropPath factor, the branch's last bias optionally added here) with the CenterNorm
  after it; without ``h``, CenterNorm alone. It keeps the centred sum for backward, as CenterNorm's autograd does.
- :func:`gelu_residual`: ``x + m * alpha * GELU(u)``, the conv blocks' residuals, keeping only ``u`` (optionally
  adding the bias of the map before to ``u``).
- :func:`qk_normalize`: SCSA's cosine normalisation of q and k (q times the temperature), written contiguous, keeping
  the outputs and the row norms.
- :func:`gelu_and_grad`: ``GELU(u)`` and ``grad * GELU'(u)`` in one pass over ``u``, for the backward of
  :func:`lipsformer.layers.gelu.gelu_linear`, which recomputes the GELU rather than keep it (a backward op only).

A DropPath factor is timm's: the per-sample draw ``bernoulli(keep)`` (0 or 1, the same random stream as
``timm.layers.DropPath``) divided by ``keep``. Backward runs the fused backward op; under ``create_graph`` (a
gradient penalty) or a ``torch.func`` transform (batched gradients) it computes the same formulas in aten ops, which
autograd differentiates again (exactly, but for what a saved output hides: CenterNorm's weight gradient is not
differentiated with respect to its input, and SCSA's normalisation is differentiable once).
CSwin's stripes have ops of their own in :mod:`lipsformer.layers.stripes`, the conv blocks' depth-wise convolution
in :mod:`lipsformer.layers.conv_blocks`, the linear maps' folded scales (``scale_rows``) in
:mod:`lipsformer.layers.gelu`, on the same helpers. ``LAUNCHES`` says how many CUDA kernels an op is (the
backward ops that produce per-channel sums add their blocks' partial sums in a second one).
:func:`fusable` decides where the ops run at all: eager mode, outside tracing, exporting, compiling and
``torch.func`` transforms, where the plain composition runs (the compiler fuses it itself, the exporters need aten
ops), and not when :func:`use_fused_ops` turned them off.
"""
import contextlib
import os
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .fused_op import fused_op

_ENABLED = [os.environ.get("LIPSFORMER_FUSED_OPS", "1") != "0"]
# CUDA kernels each op launches (one unless listed)
LAUNCHES = {"residual_center_norm_backward": 2, "gelu_residual_backward": 2, "stripe_qkv_backward": 2,
            "depthwise_conv_backward": 2, "conv_residual_backward": 3}


@contextlib.contextmanager
def use_fused_ops(enabled: bool):
    """Turn the fused ops on or off (process-wide) inside the block; ``LIPSFORMER_FUSED_OPS=0`` starts them off."""
    was = _ENABLED[0]
    _ENABLED[0] = bool(enabled)
    try:
        yield
    finally:
        _ENABLED[0] = was


def fusable(*tensors: Optional[Tensor]) -> bool:
    """Whether the fused ops run for these tensors: turned on, eager mode on plain tensors (no tracer's proxies,
    fake or functional tensors), not compiling or exporting, no ``torch.func`` transform, no ``torch.jit`` trace; and
    not for a CPU inference pass, where the op would run the same plain composition behind one more dispatch (in a
    CPU training step its backward formulas take fewer passes than autograd's)."""
    if not _ENABLED[0] or torch.jit.is_tracing() or torch.compiler.is_compiling():
        return False
    if torch._C._are_functorch_transforms_active():
        return False
    if not all(t is None or type(t) in (Tensor, torch.nn.Parameter) for t in tensors):
        return False
    return torch.is_grad_enabled() or tensors[0].device.type != "cpu"


def defer_bias(x: Tensor) -> bool:
    """Whether a linear map leaves its bias to the fused op after it (``h_bias`` of :func:`residual_center_norm`,
    ``u_bias`` of :func:`gelu_residual`), whose backward sums the bias's gradient with its own partial sums: in a
    training step where the fused ops run for ``x``. Elsewhere the map adds it: without a backward there is nothing
    to save, and the plain composition (``torch.compile``, the fused ops off) gains nothing by it (compiled, inductor
    generates more kernels for it)."""
    return torch.is_grad_enabled() and fusable(x)


def _kernels(t: Tensor):
    """The Triton kernels for a CUDA tensor (None elsewhere, or where Triton is not installed)."""
    if t.device.type != "cuda":
        return None
    try:
        from . import triton_kernels
    except ImportError:  # a CUDA torch without Triton: the plain composition
        return None
    return triton_kernels


def math_backward() -> bool:
    """Backward computes in aten ops (differentiable, batchable): a double backward (``create_graph``) or a
    ``torch.func`` transform is on."""
    return torch.is_grad_enabled() or torch._C._are_functorch_transforms_active()


def drop_factor(mask: Optional[Tensor], keep: float, x: Tensor) -> Optional[Tensor]:
    """The per-sample DropPath factor ``mask / keep`` shaped to broadcast over ``x`` (B, ...), as timm's DropPath
    computes it."""
    if mask is None:
        return None
    factor = mask if keep == 1.0 else mask.div(keep)
    return factor.view((x.shape[0],) + (1,) * (x.dim() - 1))


def autocast_dtype(device: str) -> Optional[torch.dtype]:
    """The dtype autocast computes in on ``device`` where it is on, else None."""
    if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return None


def sum_dtype(t: Tensor) -> torch.dtype:
    """Per-channel gradient sums of a backward op: float32, or the gradient's dtype where that is wider."""
    return torch.promote_types(t.dtype, torch.float32)


def _biased(t: Tensor, bias: Optional[Tensor]) -> Tensor:
    """``t`` with the bias a linear map left to the op after it (:func:`defer_bias`) added, or ``t``."""
    return t if bias is None else t + bias


# -- CN(x + m * h) ---------------------------------------------------------------------------------------------------
def _residual_sum(x: Tensor, h: Optional[Tensor], mask: Optional[Tensor], keep: float,
                  h_bias: Optional[Tensor] = None) -> Tensor:
    if h is None:
        return x
    h = _biased(h, h_bias)
    factor = drop_factor(mask, keep, x)
    return x + h if factor is None else torch.addcmul(x, h, factor)


def residual_center_norm_plain(x, h, mask, keep, weight, bias, scale, h_bias=None):
    """``CN(x + m * (h + h_bias))`` in aten ops (what the op computes everywhere but CUDA)."""
    s = _residual_sum(x, h, mask, keep, h_bias)
    z = s - s.mean(-1, keepdim=True)
    return torch.addcmul(bias, z, weight * scale)


@fused_op("lipsformer::residual_center_norm")
def _rcn(x: Tensor, h: Optional[Tensor], mask: Optional[Tensor], keep: float, weight: Tensor, bias: Tensor,
         scale: float, save: bool, h_bias: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """(the output, the centred sum where ``save``, else an empty tensor)."""
    kernels = _kernels(x)
    if kernels is not None:
        return kernels.residual_center_norm(x, h, mask, keep, weight, bias, scale, h_bias,
                                            *empty_rcn(x, h, mask, weight, bias, save, h_bias))
    s = _residual_sum(x, h, mask, keep, h_bias)
    z = s - s.mean(-1, keepdim=True)
    return torch.addcmul(bias, z, weight * scale), z if save else z.new_empty(0)


def empty_rcn(x, h, mask, weight, bias, save, h_bias=None):
    """The outputs of :func:`residual_center_norm`'s op, uninitialised: their shapes and dtypes (those of the
    plain composition: the sum's promoted dtype, then the affine map's)."""
    zdtype = x.dtype if h is None else torch.promote_types(x.dtype, h.dtype)
    if h_bias is not None and h is not None:
        zdtype = torch.promote_types(zdtype, h_bias.dtype)
    if mask is not None and h is not None:
        zdtype = torch.promote_types(zdtype, mask.dtype)
    ydtype = torch.promote_types(torch.promote_types(zdtype, weight.dtype), bias.dtype)
    return x.new_empty(x.shape, dtype=ydtype), x.new_empty(x.shape if save else (0,), dtype=zdtype)


@_rcn.register_fake
def _(x, h, mask, keep, weight, bias, scale, save, h_bias=None):
    return empty_rcn(x, h, mask, weight, bias, save, h_bias)


def _rcn_backward_math(grad, z, mask, keep, weight, scale, h_bias_sum=False):
    grad_z = grad * (weight * scale)
    grad_s = grad_z - grad_z.mean(-1, keepdim=True)
    rows, flat_z = grad.reshape(-1, grad.shape[-1]), z.reshape(-1, z.shape[-1])
    factor = drop_factor(mask, keep, grad_s)
    grad_h = grad_s * factor if factor is not None else None
    sums = [(rows * flat_z).sum(0) * scale, rows.sum(0)]
    if h_bias_sum:
        sums.append((grad_h if grad_h is not None else grad_s).reshape(-1, grad.shape[-1]).sum(0))
    return grad_s, grad_h, torch.stack(sums)


@fused_op("lipsformer::residual_center_norm_backward")
def _rcn_backward(grad: Tensor, z: Tensor, mask: Optional[Tensor], keep: float, weight: Tensor, scale: float,
                  h_bias_sum: bool = False) -> Tuple[Tensor, Tensor, Tensor]:
    """(the gradient of the sum ``x + m * h``, that of ``h`` where a mask scales it (else an empty tensor), and the
    weight's and bias's gradients stacked, (2, C), summed in float32 at least; with ``h_bias_sum`` a third row,
    the gradient of a bias added to ``h``)."""
    kernels = _kernels(grad)
    if kernels is not None:
        return kernels.residual_center_norm_backward(grad, z, mask, keep, weight, scale,
                                                     *empty_rcn_backward(grad, mask, weight, h_bias_sum))
    grad_s, grad_h, sums = _rcn_backward_math(grad, z, mask, keep, weight, scale, h_bias_sum)
    return grad_s, grad_h if grad_h is not None else grad_s.new_empty(0), sums.to(sum_dtype(grad))


def empty_rcn_backward(grad, mask, weight, h_bias_sum=False):
    """The outputs of :func:`residual_center_norm`'s backward op, uninitialised."""
    dtype = torch.promote_types(grad.dtype, weight.dtype)
    grad_h = grad.new_empty(grad.shape if mask is not None else (0,), dtype=dtype)
    sums = grad.new_empty((3 if h_bias_sum else 2, grad.shape[-1]), dtype=sum_dtype(grad))
    return grad.new_empty(grad.shape, dtype=dtype), grad_h, sums


@_rcn_backward.register_fake
def _(grad, z, mask, keep, weight, scale, h_bias_sum=False):
    return empty_rcn_backward(grad, mask, weight, h_bias_sum)


def _rcn_setup(ctx, inputs, output):
    ctx.set_materialize_grads(False)  # no zeros for outputs nothing uses
    x, h, mask, keep, weight, bias, scale, save, h_bias = inputs
    ctx.save_for_backward(output[1], mask, weight)
    ctx.keep, ctx.scale = keep, scale
    ctx.dtypes = (x.dtype, None if h is None else h.dtype, bias.dtype, None if h_bias is None else h_bias.dtype)
    ctx.mark_non_differentiable(output[1])


def _rcn_grad(ctx, grad, _):
    if grad is None:
        return (None,) * 9
    z, mask, weight = ctx.saved_tensors
    x_dtype, h_dtype, b_dtype, hb_dtype = ctx.dtypes
    h_bias_sum = hb_dtype is not None
    if math_backward():
        grad_s, grad_h, sums = _rcn_backward_math(grad, z, mask, ctx.keep, weight, ctx.scale, h_bias_sum)
    else:
        grad_s, grad_h, sums = _rcn_backward(grad.contiguous(), z, mask, ctx.keep, weight, ctx.scale, h_bias_sum)
    grad_h = (grad_h if mask is not None else grad_s) if h_dtype is not None else None
    return (grad_s.to(x_dtype), None if grad_h is None else grad_h.to(h_dtype), None, None,
            sums[0].to(weight.dtype), sums[1].to(b_dtype), None, None, sums[2].to(hb_dtype) if h_bias_sum else None)


_rcn.register_autograd(_rcn_grad, _rcn_setup)


def residual_center_norm(x: Tensor, h: Optional[Tensor], mask: Optional[Tensor], keep: float, weight: Tensor,
                         bias: Tensor, scale: float, h_bias: Optional[Tensor] = None) -> Tensor:
    """``CN(x + m * (h + h_bias))`` over the last dimension, ``m = mask / keep`` per sample (``mask`` None:
    ``m = 1``; ``h`` None: CenterNorm of ``x``; ``h_bias`` None: no bias, else per channel, a branch's last bias
    added here, whose gradient the backward sums with CenterNorm's own), CenterNorm's affine map ``weight * scale``,
    ``bias``."""
    h_bias = None if h is None else h_bias
    if not fusable(x, h, mask, weight, bias, h_bias):
        return residual_center_norm_plain(x, h, mask, keep, weight, bias, scale, h_bias)
    save = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, h, weight, bias, h_bias))
    h = None if h is None else h.contiguous()
    return _rcn(x.contiguous(), h, mask, float(keep), weight, bias, float(scale), save, h_bias)[0]


# -- x + m * h, a residual's sum without a norm after it ------------------------------------------------------------
@fused_op("lipsformer::residual_add")
def _radd(x: Tensor, h: Tensor, mask: Tensor, keep: float) -> Tensor:
    kernels = _kernels(x)
    if kernels is not None:
        return kernels.dropped(x, h, mask, keep, x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, h.dtype)))
    return torch.addcmul(x, h, drop_factor(mask, keep, x))


@_radd.register_fake
def _(x, h, mask, keep):
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, h.dtype))


@fused_op("lipsformer::drop_scale")
def _drop_scale(grad: Tensor, mask: Tensor, keep: float) -> Tensor:
    """``m * grad``: the gradient of :func:`residual_add`'s ``h``."""
    kernels = _kernels(grad)
    if kernels is not None:
        return kernels.dropped(None, grad, mask, keep, torch.empty_like(grad))
    return grad * drop_factor(mask, keep, grad)


@_drop_scale.register_fake
def _(grad, mask, keep):
    return torch.empty_like(grad)


def _radd_setup(ctx, inputs, output):
    x, h, mask, keep = inputs
    ctx.save_for_backward(mask)
    ctx.keep, ctx.dtypes = keep, (x.dtype, h.dtype)


def _radd_grad(ctx, grad):
    mask, = ctx.saved_tensors
    if math_backward():
        grad_h = grad * drop_factor(mask, ctx.keep, grad)
    else:
        grad_h = _drop_scale(grad.contiguous(), mask, ctx.keep)
    return grad.to(ctx.dtypes[0]), grad_h.to(ctx.dtypes[1]), None, None


_radd.register_autograd(_radd_grad, _radd_setup)


def residual_add(x: Tensor, h: Tensor, mask: Tensor, keep: float) -> Tensor:
    """``x + m * h``, ``m = mask / keep`` per sample (a DropPath draw): one kernel forward, and one for ``h``'s
    gradient (aten's ``addcmul`` takes two), where the fused ops run."""
    if not fusable(x, h, mask) or x.shape != h.shape:
        return torch.addcmul(x, h, drop_factor(mask, keep, x))
    return _radd(x.contiguous(), h.contiguous(), mask, float(keep))


# -- x + m * alpha * GELU(u + b) -------------------------------------------------------------------------------------
def gelu_residual_plain(x, u, alpha, mask, keep, u_bias=None):
    factor = drop_factor(mask, keep, x)
    return torch.addcmul(x, F.gelu(_biased(u, u_bias)), alpha if factor is None else alpha * factor)


@fused_op("lipsformer::gelu_residual")
def _gr(x: Tensor, u: Tensor, alpha: Tensor, mask: Optional[Tensor], keep: float, u_bias: Optional[Tensor] = None
        ) -> Tensor:
    kernels = _kernels(x)
    if kernels is not None:
        return kernels.gelu_residual(x, u, alpha, mask, keep, u_bias, empty_gelu_residual(x, u, alpha, u_bias))
    return gelu_residual_plain(x, u, alpha, mask, keep, u_bias)


def empty_gelu_residual(x, u, alpha, u_bias=None):
    """The output of :func:`gelu_residual`'s op, uninitialised."""
    dtype = torch.promote_types(torch.promote_types(x.dtype, u.dtype), alpha.dtype)
    return x.new_empty(x.shape, dtype=dtype if u_bias is None else torch.promote_types(dtype, u_bias.dtype))


@_gr.register_fake
def _(x, u, alpha, mask, keep, u_bias=None):
    return empty_gelu_residual(x, u, alpha, u_bias)


def _gr_backward_math(grad, u, alpha, mask, keep, u_bias=None):
    factor = drop_factor(mask, keep, grad)
    v = _biased(u, u_bias)
    grad_u = torch.ops.aten.gelu_backward(grad * (alpha if factor is None else alpha * factor), v).to(u.dtype)
    g = grad if factor is None else grad * factor
    sums = (g * F.gelu(v)).reshape(-1, u.shape[-1]).sum(0)
    return grad_u, sums if u_bias is None else torch.stack((sums, grad_u.reshape(-1, u.shape[-1]).sum(0)))


@fused_op("lipsformer::gelu_residual_backward")
def _gr_backward(grad: Tensor, u: Tensor, alpha: Tensor, mask: Optional[Tensor], keep: float,
                 u_bias: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """(the gradient of ``u``, alpha's summed in float32 at least: (C), or with ``u_bias`` (2, C), alpha's and
    ``u_bias``'s)."""
    kernels = _kernels(grad)
    if kernels is not None:
        return kernels.gelu_residual_backward(grad, u, alpha, mask, keep, u_bias, sum_dtype(grad))
    grad_u, sums = _gr_backward_math(grad, u, alpha, mask, keep, u_bias)
    return grad_u, sums.to(sum_dtype(grad))


@_gr_backward.register_fake
def _(grad, u, alpha, mask, keep, u_bias=None):
    return u.new_empty(u.shape), u.new_empty((u.shape[-1],) if u_bias is None else (2, u.shape[-1]),
                                             dtype=sum_dtype(grad))


def _gr_setup(ctx, inputs, output):
    ctx.set_materialize_grads(False)  # no zeros for outputs nothing uses
    x, u, alpha, mask, keep, u_bias = inputs
    ctx.save_for_backward(u, alpha, mask, u_bias)
    ctx.keep, ctx.x_dtype = keep, x.dtype


def gelu_residual_grads(grad: Tensor, u: Tensor, alpha: Tensor, mask: Optional[Tensor], keep: float,
                        u_bias: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """The gradients of ``u`` and ``alpha`` through ``x + m * alpha * GELU(u + u_bias)`` (alpha's summed in float32
    at least; with ``u_bias`` stacked with its gradient, (2, C)): the fused backward op, or aten ops where a double
    backward or a transform needs them."""
    if math_backward():
        return _gr_backward_math(grad, u, alpha, mask, keep, u_bias)
    return _gr_backward(grad.contiguous(), u, alpha, mask, float(keep), u_bias)


def _gr_grad(ctx, grad):
    if grad is None:
        return (None,) * 6
    u, alpha, mask, u_bias = ctx.saved_tensors
    grad_u, sums = gelu_residual_grads(grad, u, alpha, mask, ctx.keep, u_bias)
    if u_bias is None:
        return grad.to(ctx.x_dtype), grad_u, sums.to(alpha.dtype), None, None, None
    return grad.to(ctx.x_dtype), grad_u, sums[0].to(alpha.dtype), None, None, sums[1].to(u_bias.dtype)


_gr.register_autograd(_gr_grad, _gr_setup)


def gelu_residual(x: Tensor, u: Tensor, alpha: Tensor, mask: Optional[Tensor] = None, keep: float = 1.0,
                  u_bias: Optional[Tensor] = None) -> Tensor:
    """``x + m * alpha * GELU(u + u_bias)``, ``alpha`` per channel (the last dimension; any other shape that
    broadcasts runs the plain ops), ``m = mask / keep`` per sample (``mask`` None: 1), ``u_bias`` per channel or None
    (the bias of the map before, added here so that backward sums its gradient with alpha's); backward keeps ``u``
    (and the small ``alpha``, ``mask`` and ``u_bias``) only."""
    if not fusable(x, u, alpha, mask, u_bias) or alpha.shape != x.shape[-1:]:
        return gelu_residual_plain(x, u, alpha, mask, keep, u_bias)
    return _gr(x.contiguous(), u.contiguous(), alpha, mask, float(keep), u_bias)


# -- GELU(u) and grad * GELU'(u), in a backward that recomputes the GELU ---------------------------------------------
def gelu_and_grad_plain(grad_h, u):
    return F.gelu(u), torch.ops.aten.gelu_backward(grad_h.to(u.dtype), u)


@fused_op("lipsformer::gelu_and_grad")
def _gg(grad_h: Tensor, u: Tensor) -> Tuple[Tensor, Tensor]:
    kernels = _kernels(u)
    if kernels is not None:
        return kernels.gelu_and_grad(grad_h, u)
    return gelu_and_grad_plain(grad_h, u)


@_gg.register_fake
def _(grad_h, u):
    return torch.empty_like(u), torch.empty_like(u)


def gelu_and_grad(grad_h: Tensor, u: Tensor) -> Tuple[Tensor, Tensor]:
    """``(GELU(u), grad_h * GELU'(u))`` in ``u``'s dtype: what a backward that recomputes a GELU needs for the next
    weight's gradient and for ``u``'s, reading ``u`` once. Not differentiable: under ``create_graph`` or a
    ``torch.func`` transform the plain ops run."""
    if not fusable(grad_h, u) or math_backward() or grad_h.shape != u.shape:
        return gelu_and_grad_plain(grad_h, u)
    return _gg(grad_h.contiguous(), u.contiguous())


# -- SCSA's q and k --------------------------------------------------------------------------------------------------
def l2_normalize(x: Tensor, eps: float, scale: float = 1.0) -> Tensor:
    r"""Smoothed l2 row normalisation of LipsFormer eq. 6, times ``scale``: :math:`s\,x / \sqrt{\|x\|^2 + \epsilon}`
    (SCSA's q and k go through one fused op, :func:`qk_normalize`)."""
    return x * (torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps) * scale)


@fused_op("lipsformer::qk_normalize")
def _qkn(q: Tensor, k: Tensor, q_scale: float, eps: float) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(q and k normalised, contiguous, and their rows' ``1 / norm``)."""
    kernels = _kernels(q)
    if kernels is not None:
        return kernels.qk_normalize(q, k, q_scale, eps)
    return qk_normalize_math(q, k, q_scale, eps)


def qk_normalize_math(q: Tensor, k: Tensor, q_scale: float, eps: float) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """SCSA's normalisation in aten ops (what :func:`qk_normalize`'s op and CSwin's gather compute on the CPU): q
    and k normalised into new contiguous tensors, q times ``q_scale``, and their rows' ``1 / norm``."""
    outs = []
    for t, s in ((q, q_scale), (k, 1.0)):
        r = torch.rsqrt(t.pow(2).sum(-1, keepdim=True) + eps)
        out = torch.empty(t.shape, dtype=t.dtype, device=t.device)  # contiguous, whatever t's strides
        torch.mul(t, r * s, out=out)
        outs.append((out, r))
    (qn, rq), (kn, rk) = outs
    return qn, kn, rq, rk


@_qkn.register_fake
def _(q, k, q_scale, eps):
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device),
            q.new_empty(q.shape[:-1] + (1,)), k.new_empty(k.shape[:-1] + (1,)))


def qk_normalize_backward_math(grad_q, grad_k, qn, kn, rq, rk, q_scale):
    """The gradients of q and k through :func:`qk_normalize_math`, in aten ops, from its outputs."""
    grads = []
    for g, out, r, s in ((grad_q, qn, rq, q_scale), (grad_k, kn, rk, 1.0)):
        # d(s x r)/dx g = s r (g - out (out . g) / s^2): the output and 1 / norm are all it needs
        dot = (out * g).sum(-1, keepdim=True)
        grads.append(torch.addcmul(g, out, dot, value=-1.0 / (s * s)) * (r * s))
    return grads[0], grads[1]


@fused_op("lipsformer::qk_normalize_backward")
def _qkn_backward(grad_q: Tensor, grad_k: Tensor, qn: Tensor, kn: Tensor, rq: Tensor, rk: Tensor, q_scale: float
                  ) -> Tuple[Tensor, Tensor]:
    kernels = _kernels(qn)
    if kernels is not None:
        return kernels.qk_normalize_backward(grad_q, grad_k, qn, kn, rq, rk, q_scale)
    return qk_normalize_backward_math(grad_q, grad_k, qn, kn, rq, rk, q_scale)


@_qkn_backward.register_fake
def _(grad_q, grad_k, qn, kn, rq, rk, q_scale):
    return torch.empty_like(qn), torch.empty_like(kn)


def _qkn_setup(ctx, inputs, output):
    ctx.set_materialize_grads(False)  # no zeros for outputs nothing uses
    q, k, q_scale, eps = inputs
    qn, kn, rq, rk = output
    ctx.save_for_backward(qn, kn, rq, rk)
    ctx.q_scale = q_scale
    ctx.mark_non_differentiable(rq, rk)


class DifferentiableOnce(torch.autograd.Function):
    """``values`` (copies) as a function of ``inputs``, whose derivative raises: what a backward computed without a
    graph returns under ``create_graph``."""

    @staticmethod
    def forward(ctx, values, *inputs):
        return tuple(t.clone() for t in values)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("SCSA's fused q and k normalisation is differentiable once (it keeps 1 / norm, which "
                           "carries no graph): a double backward through SCSA needs "
                           "lipsformer.layers.fused.use_fused_ops(False)")


def _qkn_grad(ctx, grad_q, grad_k, _rq, _rk):
    qn, kn, rq, rk = ctx.saved_tensors
    grad_q = torch.zeros_like(qn) if grad_q is None else grad_q
    grad_k = torch.zeros_like(kn) if grad_k is None else grad_k
    if torch._C._are_functorch_transforms_active():
        gq, gk = qk_normalize_backward_math(grad_q, grad_k, qn, kn, rq, rk, ctx.q_scale)
    else:
        with torch.no_grad():
            gq, gk = _qkn_backward(grad_q.contiguous(), grad_k.contiguous(), qn, kn, rq, rk, ctx.q_scale)
        if torch.is_grad_enabled():  # create_graph: a second derivative would miss 1 / norm's
            gq, gk = DifferentiableOnce.apply((gq, gk), grad_q, grad_k)
    return gq, gk, None, None


_qkn.register_autograd(_qkn_grad, _qkn_setup)


def qk_normalize(q: Tensor, k: Tensor, eps: float, q_scale: float = 1.0) -> Tuple[Tensor, Tensor]:
    """``(q_scale * q / sqrt(|q|^2 + eps), k / sqrt(|k|^2 + eps))`` per row, contiguous where fused."""
    if not fusable(q, k) or q_scale <= 0:
        return l2_normalize(q, eps, q_scale), l2_normalize(k, eps, 1.0)
    qn, kn, _, _ = _qkn(q, k, float(q_scale), float(eps))
    return qn, kn
