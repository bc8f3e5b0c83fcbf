"""GELU fused with the operation that consumes it, keeping only the pre-activation for backward; linear maps with
a per-output-channel scale folded in, keeping no output for the scale's gradient.

Autograd would keep both the GELU's input (for its derivative) and its output (for the weight gradient of the
next layer, or the gradient of a residual weight). These functions keep the input alone and recompute the GELU
in backward, one elementwise pass, which saves a whole activation per use: the 4C-wide MLP hidden layer, and
three C-wide tensors in every conv block. The forward values are those of ``F.gelu`` followed by the plain op.

Under autocast the forward's matmul runs in the autocast dtype; backward works in the gradient's dtype and
returns gradients in each input's own dtype, as autograd does through autocast's casts.
"""
from typing import Optional

import torch
import torch.nn.functional as F
from timm.layers import register_notrace_function

from .fused import gelu_and_grad, scale_rows, scale_rows_backward


def _gelu_grad(grad_out: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.gelu_backward(grad_out.to(u.dtype), u)


def _folded(weight: torch.Tensor, bias: Optional[torch.Tensor], scale: Optional[torch.Tensor],
            input_scale: float = 1.0):
    """``weight`` and ``bias`` with the per-output-channel ``scale`` multiplied in (both as given when it is None),
    and the weight by ``input_scale``, by one fused op (:func:`lipsformer.layers.fused.scale_rows`)."""
    if scale is None:
        return (weight, bias) if input_scale == 1.0 else (weight * input_scale, bias)
    return scale_rows(weight, bias, scale, input_scale)


class _FusedLinear(torch.autograd.Function):
    """``F.linear(h * c, weight * scale[:, None], bias * scale)`` with ``h = GELU(u)`` or ``u`` and a constant ``c``
    (``input_scale``, folded into the weight), keeping for backward
    only ``u``, the parameters and the scaled weight (a weight's size, against a launch to fold it again): not the
    GELU's output (recomputed), not the output (the scale's gradient comes from the weight's:
    ``rowsum(W * grad_W') + b * grad_b'``, in the fused backward of :func:`lipsformer.layers.fused.scale_rows`)."""

    @staticmethod
    def forward(ctx, u, weight, bias, scale, gelu, input_scale):
        folded_w, folded_b = _folded(weight, bias, scale, input_scale)
        ctx.save_for_backward(u, weight, bias, scale, folded_w)
        ctx.gelu, ctx.input_scale = gelu, input_scale
        return F.linear(F.gelu(u) if gelu else u, folded_w, folded_b)

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
            grad_w, grad_b, grad_s = scale_rows_backward(grad_w, grad_b, weight, bias, scale, ctx.input_scale)
        elif ctx.input_scale != 1.0 and grad_w is not None:
            grad_w = grad_w * ctx.input_scale
        return (grad_u, grad_w if need_w else None, grad_b if need_b else None, grad_s if need_s else None, None,
                None)


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


@register_notrace_function  # reason: chooses its autograd form from the grad mode at run time
def fused_linear(u: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                 scale: Optional[torch.Tensor] = None, gelu: bool = False, input_scale: float = 1.0) -> torch.Tensor:
    """``scale * F.linear(input_scale * (GELU(u) if gelu else u), weight, bias)`` (``scale`` per output channel, or
    None; ``input_scale`` a constant, folded into the weight), saving only ``u`` and the parameters for backward."""
    if not records_grad(u, weight, bias, scale):
        return F.linear(F.gelu(u) if gelu else u, *_folded(weight, bias, scale, input_scale))
    return _FusedLinear.apply(u, weight, bias, scale, gelu, float(input_scale))


@register_notrace_function  # reason: chooses its autograd form from the grad mode at run time
def gelu_linear(u: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(F.gelu(u), weight, bias)`` (times ``scale``), saving only ``u`` (and the parameters) for backward."""
    return fused_linear(u, weight, bias, scale, gelu=True)
