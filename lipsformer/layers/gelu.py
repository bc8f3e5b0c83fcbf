"""GELU fused with the operation that consumes it, keeping only the pre-activation for backward; linear maps with
a per-output-channel scale folded in, keeping no output for the scale's gradient; a residual branch's first linear
map, which adds the skip's gradient inside its input gradient's matrix product (:func:`skip_linear`).

Autograd would keep both the GELU's input (for its derivative) and its output (for the weight gradient of the
next layer, or the gradient of a residual weight). These functions keep the input alone and recompute the GELU
in backward, one elementwise pass, which saves a whole activation per use: the 4C-wide MLP hidden layer, and
three C-wide tensors in every conv block. The forward values are those of ``F.gelu`` followed by the plain op.

Under autocast the forward's matmul runs in the autocast dtype; backward works in the gradient's dtype and
returns gradients in each input's own dtype, as autograd does through autocast's casts.
"""
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from timm.layers import register_notrace_function
from torch import Tensor

from . import fused  # fused._kernels looked up on the module, where the tests replace it
from .fused import autocast_dtype, fusable, gelu_and_grad, math_backward
from .fused_op import fused_op


# -- linear maps' rows scaled ---------------------------------------------------------------------------------------
# A map is (weight, bias, scale, input_scale); an op takes one or two (a block's two branches: one launch), the second
# as empty tensors where it takes one; a bias travels as an empty tensor where the map has none.
Map = Tuple[Tensor, Optional[Tensor], Tensor, float]


def _scaled_plain(weight, bias, scale, input_scale):
    w = weight * scale.unsqueeze(1)
    return w if input_scale == 1.0 else w * input_scale, bias * scale if bias is not None else None


def _some(bias: Tensor) -> Optional[Tensor]:
    return bias if bias.numel() else None


def _none_empty(t: Optional[Tensor], like: Tensor) -> Tensor:
    return t if t is not None else like.new_empty(0)


def _maps(w0, b0, s0, c0, w1, b1, s1, c1) -> List[Tuple[Tensor, Tensor, Tensor, float]]:
    """The op's one or two maps, (weight, bias or empty, scale, input_scale) each."""
    return [(w0, b0, s0, c0)] + ([(w1, b1, s1, c1)] if w1.numel() else [])


@fused_op("lipsformer::scale_rows")
def _sr(w0: Tensor, b0: Tensor, s0: Tensor, c0: float, w1: Tensor, b1: Tensor, s1: Tensor, c1: float
        ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """For each map ``weight * scale[:, None] * input_scale`` and ``bias * scale`` (empty without a bias; the second
    map's outputs empty where the op takes one map)."""
    maps = _maps(w0, b0, s0, c0, w1, b1, s1, c1)
    kernels = fused._kernels(w0)
    if kernels is not None:
        out = kernels.scale_rows(*[list(t) for t in zip(*maps)])
    else:
        out = []
        for w, b, s, c in maps:
            w, b = _scaled_plain(w, _some(b), s, c)
            out += [w, _none_empty(b, w)]
    return (*out, *[w1.new_empty(0) for _ in range(4 - len(out))])  # distinct: outputs may not alias


@_sr.register_fake
def _(w0, b0, s0, c0, w1, b1, s1, c1):
    return torch.empty_like(w0), torch.empty_like(b0), torch.empty_like(w1), torch.empty_like(b1)


def _sr_backward_math(grad_w, grad_b, weight, bias, scale, input_scale):
    grad_w = grad_w if input_scale == 1.0 else grad_w * input_scale
    grad_s = (grad_w * weight).sum(1)
    if bias is not None:
        grad_s = grad_s + grad_b * bias
    return grad_w * scale.unsqueeze(1), grad_b * scale if bias is not None else None, grad_s.to(scale.dtype)


@fused_op("lipsformer::scale_rows_backward")
def _sr_backward(grads_w: List[Tensor], grads_b: List[Tensor], weights: List[Tensor], biases: List[Tensor],
                 scales: List[Tensor], input_scales: List[float]) -> List[Tensor]:
    """From the scaled maps' gradients, for each map: the weight's, the bias's (empty without one) and the scale's
    (``input_scale * rowsum(W * grad_W') + b * grad_b'``)."""
    kernels = fused._kernels(grads_w[0])
    if kernels is not None:
        return kernels.scale_rows_backward(grads_w, grads_b, weights, biases, scales, input_scales)
    out = []
    for gw, gb, w, b, s, c in zip(grads_w, grads_b, weights, biases, scales, input_scales):
        gw, gb, gs = _sr_backward_math(gw, gb, w, _some(b), s, c)
        out += [gw, _none_empty(gb, w), gs]
    return out


@_sr_backward.register_fake
def _(grads_w, grads_b, weights, biases, scales, input_scales):
    return [t for w, b, s in zip(weights, biases, scales)
            for t in (torch.empty_like(w), torch.empty_like(b), torch.empty_like(s))]


def scale_rows_backward(grads: Sequence[Tuple[Tensor, Optional[Tensor]]], maps: Sequence[Map]
                        ) -> List[Tuple[Tensor, Optional[Tensor], Tensor]]:
    """The gradients of :func:`scale_rows`'s weight, bias (None without one) and scale, for each map from the
    gradients of its scaled weight and bias (None: zeros), by the fused backward op, or in aten ops where a double
    backward or a transform needs them."""
    grads = [(torch.zeros_like(w) if gw is None else gw, torch.zeros_like(b) if b is not None and gb is None else gb)
             for (gw, gb), (w, b, _, _) in zip(grads, maps)]
    tensors = [t for (gw, gb), (w, b, s, _) in zip(grads, maps) for t in (gw, gb, w, b, s)]
    if math_backward() or not fusable(*tensors):
        return [_sr_backward_math(gw, gb, *m) for (gw, gb), m in zip(grads, maps)]
    out = _sr_backward([gw for gw, _ in grads], [_none_empty(gb, gw) for gw, gb in grads], [m[0] for m in maps],
                       [_none_empty(m[1], m[0]) for m in maps], [m[2] for m in maps], [float(m[3]) for m in maps])
    return [(gw, gb if m[1] is not None else None, gs) for gw, gb, gs, m in zip(out[0::3], out[1::3], out[2::3], maps)]


def _sr_setup(ctx, inputs, output):
    ctx.set_materialize_grads(False)  # no zeros for outputs nothing uses
    w0, b0, s0, c0, w1, b1, s1, c1 = inputs
    ctx.save_for_backward(w0, b0, s0, w1, b1, s1)
    ctx.input_scales = (c0, c1)


def _sr_grad(ctx, gw0, gb0, gw1, gb1):
    w0, b0, s0, w1, b1, s1 = ctx.saved_tensors
    maps = [(w, _some(b), s, c) for w, b, s, c in _maps(w0, b0, s0, ctx.input_scales[0], w1, b1, s1,
                                                        ctx.input_scales[1])]
    out = scale_rows_backward([(gw0, gb0), (gw1, gb1)][:len(maps)], maps)
    grads = [g for gw, gb, gs in out for g in (gw, gb, gs, None)]
    return (*grads, *[None] * (8 - len(grads)))


_sr.register_autograd(_sr_grad, _sr_setup)


def scale_rows(maps: Sequence[Map]) -> List[Tuple[Tensor, Optional[Tensor]]]:
    """For each of one or two linear maps ``(weight, bias, scale, input_scale)``: ``weight * scale[:, None] *
    input_scale`` and ``bias * scale`` (None without a bias), the map's output scaled per channel (and its input by a
    constant) folded into it; two maps in one op."""
    if not 1 <= len(maps) <= 2:
        raise ValueError(f"scale_rows takes one or two maps, got {len(maps)}")
    if not fusable(*[t for m in maps for t in m[:3]]):
        return [_scaled_plain(*m) for m in maps]
    w = maps[0][0]
    flat = [(m[0], _none_empty(m[1], m[0]), m[2], float(m[3])) for m in maps]
    flat += [(w.new_empty(0), w.new_empty(0), w.new_empty(0), 1.0)] * (2 - len(maps))
    out = _sr(*[a for m in flat for a in m])
    return [(out[2 * i], out[2 * i + 1] if m[1] is not None else None) for i, m in enumerate(maps)]


def _gelu_grad(grad_out: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.gelu_backward(grad_out.to(u.dtype), u)


def _folded(weight: torch.Tensor, bias: Optional[torch.Tensor], scale: Optional[torch.Tensor],
            input_scale: float = 1.0):
    """``weight`` and ``bias`` with the per-output-channel ``scale`` multiplied in (both as given when it is None),
    and the weight by ``input_scale``, by one fused op (:func:`scale_rows`)."""
    if scale is None:
        return (weight, bias) if input_scale == 1.0 else (weight * input_scale, bias)
    return scale_rows([(weight, bias, scale, input_scale)])[0]


class _FusedLinear(torch.autograd.Function):
    """``F.linear(h * c, weight * scale[:, None], bias * scale)`` with ``h = GELU(u)`` or ``u`` and a constant ``c``
    (``input_scale``, folded into the weight), keeping for backward
    only ``u``, the parameters and the scaled weight (a weight's size, against a launch to fold it again): not the
    GELU's output (recomputed), not the output (the scale's gradient comes from the weight's:
    ``rowsum(W * grad_W') + b * grad_b'``, in the fused backward of :func:`scale_rows`)."""

    @staticmethod
    def forward(ctx, u, weight, bias, scale, gelu, input_scale, h):
        folded_w, folded_b = _folded(weight, bias, scale, input_scale)
        ctx.save_for_backward(u, weight, bias, scale, folded_w)
        ctx.gelu, ctx.input_scale = gelu, input_scale
        return F.linear(_act(u, gelu, h), folded_w, folded_b)

    @staticmethod
    def backward(ctx, grad):
        u, weight, bias, scale, folded_w = ctx.saved_tensors
        need_u, need_w, need_b, need_s = ctx.needs_input_grad[:4]
        grad_u = grad_w = grad_b = grad_s = h = None
        if need_u:
            grad_h = grad @ folded_w.to(grad.dtype)
            if ctx.gelu and (need_w or need_s):  # the GELU again for the weight's gradient, and its derivative
                h, grad_u = gelu_and_grad(grad_h, u)
            else:
                grad_u = _gelu_grad(grad_h, u) if ctx.gelu else grad_h.to(u.dtype)
        flat = grad.reshape(-1, grad.shape[-1])
        if need_w or need_s:
            if h is None:
                h = F.gelu(u) if ctx.gelu else u
            h = h.to(grad.dtype)
            grad_w = (flat.t() @ h.reshape(-1, h.shape[-1])).to(weight.dtype)  # the scaled weight's gradient
        if bias is not None and (need_w or need_b or need_s):
            grad_b = flat.sum(0).to(bias.dtype)
        if scale is not None and (need_w or need_b or need_s):
            maps = [(weight, bias, scale, ctx.input_scale)]
            (grad_w, grad_b, grad_s), = scale_rows_backward([(grad_w, grad_b)], maps)
        elif ctx.input_scale != 1.0 and grad_w is not None:
            grad_w = grad_w * ctx.input_scale
        return (grad_u, grad_w if need_w else None, grad_b if need_b else None, grad_s if need_s else None, None,
                None, None)


class _SkipLinear(torch.autograd.Function):
    """``(F.linear(x, weight, bias), x)`` as one autograd node: a residual branch's first linear map and its input
    passed on to the skip. Both gradients of ``x`` then reach one backward, which adds the skip's inside the input
    gradient's matrix product (``addmm``, one kernel), where autograd would add the two in a pass of its own. Under
    autocast the map runs in the autocast dtype and keeps its input in it, as autograd through autocast's cast does;
    on CUDA the product then writes the skip's wider dtype directly (``addmm`` with ``out_dtype``)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        dtype = autocast_dtype(x.device.type)
        if dtype is not None:
            with torch.autocast(x.device.type, enabled=False):
                xc, wc = x.to(dtype), weight.to(dtype)
                y = F.linear(xc, wc, None if bias is None else bias.to(dtype))
        else:
            xc, wc = x, weight
            y = F.linear(x, weight, bias)
        ctx.save_for_backward(xc, wc)
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return y, x.view_as(x)

    @staticmethod
    def backward(ctx, grad, grad_skip):
        x, weight = ctx.saved_tensors
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        need_x, need_w, need_b = ctx.needs_input_grad
        if grad is None:
            return grad_skip, None, None
        flat = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_w = grad_b = None
        if need_x:
            w = weight.to(grad.dtype)
            if grad_skip is None:
                grad_x = (flat @ w).view(x.shape).to(x_dtype)
            elif grad_skip.dtype == grad.dtype:
                grad_x = torch.addmm(grad_skip.reshape(-1, w.shape[1]), flat, w).view(x.shape)
            elif grad.is_cuda and not torch.is_grad_enabled():
                grad_x = torch.ops.aten.addmm.dtype(grad_skip.reshape(-1, w.shape[1]), flat, w,
                                                    grad_skip.dtype).view(x.shape)
            else:
                grad_x = grad_skip + (flat @ w).view(x.shape).to(grad_skip.dtype)
        if need_w:
            grad_w = (flat.t() @ x.reshape(-1, x.shape[-1]).to(grad.dtype)).to(w_dtype)
        if need_b:
            grad_b = flat.sum(0).to(b_dtype)
        return grad_x, grad_w, grad_b


def skip_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None):
    """``(F.linear(x, weight, bias), x')``, ``x'`` equal to ``x``: for a residual ``x + f(x)`` whose branch ``f``
    starts with this map, give the skip ``x'``, and backward adds the two gradients of ``x`` in one matrix product
    (:class:`_SkipLinear`). Where autograd records nothing, or under tracing, compiling and transforms, the plain
    map and ``x`` itself, as where the fused ops are off (:func:`lipsformer.layers.fused.fusable`)."""
    if not records_grad(x, weight, bias) or not fusable(x, weight, bias):
        return F.linear(x, weight, bias), x
    return _SkipLinear.apply(x, weight, bias)


def records_grad(*tensors) -> bool:
    """Whether autograd will record the op for a backward pass, outside torch.func and torch.compile; otherwise
    the plain ops run. Under torch.func transforms ``jvp`` would need a custom rule, which torch.compile cannot
    trace. Under torch.compile the compiler's partitioner chooses what backward keeps whichever form it traces
    (a compiled Swin-T step kept the same bytes either way), and the plain ops compile faster. torch.fx tracing
    records the plain ops, and so does torch.jit's tracer (the TorchScript ONNX exporter cannot export a custom
    Function)."""
    if torch.jit.is_tracing() or any(isinstance(t, torch.fx.Proxy) for t in tensors):
        return False
    return (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
            and not torch._C._are_functorch_transforms_active() and not torch.compiler.is_compiling())


def _act(u: torch.Tensor, gelu: bool, h: Optional[torch.Tensor]) -> torch.Tensor:
    """The linear map's input: ``GELU(u)`` (``h`` where the op before computed it) or ``u``."""
    if not gelu:
        return u
    return F.gelu(u) if h is None else h


@register_notrace_function  # reason: chooses its autograd form from the grad mode at run time
def fused_linear(u: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                 scale: Optional[torch.Tensor] = None, gelu: bool = False, input_scale: float = 1.0,
                 h: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``scale * F.linear(input_scale * (GELU(u) if gelu else u), weight, bias)`` (``scale`` per output channel, or
    None; ``input_scale`` a constant, folded into the weight), saving only ``u`` and the parameters for backward.
    ``h``: ``GELU(u)`` where the op before computed it (a value only: ``u`` takes the gradient)."""
    if not records_grad(u, weight, bias, scale):  # the GELU from u, where autograd records it
        return F.linear(_act(u, gelu, None), *_folded(weight, bias, scale, input_scale))
    return _FusedLinear.apply(u, weight, bias, scale, gelu, float(input_scale), h)


@register_notrace_function  # reason: chooses its autograd form from the grad mode at run time
def gelu_linear(u: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                scale: Optional[torch.Tensor] = None, h: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(F.gelu(u), weight, bias)`` (times ``scale``), saving only ``u`` (and the parameters) for backward;
    ``h``: ``GELU(u)`` where the op before computed it."""
    return fused_linear(u, weight, bias, scale, gelu=True, h=h)
