"""GELU fused with the operation that consumes it, keeping only the pre-activation for backward.

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


def _gelu_grad(grad_out: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.gelu_backward(grad_out.to(u.dtype), u)


class _GeluLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, u, weight, bias):
        ctx.save_for_backward(u, weight)
        ctx.has_bias = bias is not None
        return F.linear(F.gelu(u), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        u, weight = ctx.saved_tensors
        grad_u = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_u = _gelu_grad(grad @ weight.to(grad.dtype), u)
        if ctx.needs_input_grad[1]:
            h = F.gelu(u).to(grad.dtype)
            grad_w = (grad.reshape(-1, grad.shape[-1]).t() @ h.reshape(-1, h.shape[-1])).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad.reshape(-1, grad.shape[-1]).sum(0)
        return grad_u, grad_w, grad_b


class _GeluResidual(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, u, scale):
        ctx.save_for_backward(u, scale)
        ctx.x_dtype = x.dtype
        return torch.addcmul(x, F.gelu(u), scale)

    @staticmethod
    def backward(ctx, grad):
        u, scale = ctx.saved_tensors
        grad_x = grad.to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        grad_u = _gelu_grad(grad * scale, u) if ctx.needs_input_grad[1] else None
        grad_scale = None
        if ctx.needs_input_grad[2]:
            grad_scale = (grad * F.gelu(u)).sum_to_size(scale.shape).to(scale.dtype)
        return grad_x, grad_u, grad_scale


def _records_grad(*tensors) -> bool:
    """Whether autograd will record the op for a backward pass, outside torch.func and torch.compile; otherwise
    the plain ops run. Under torch.func transforms ``jvp`` would need a custom rule, which torch.compile cannot
    trace. Under torch.compile the compiler's partitioner chooses what backward keeps whichever form it traces
    (a compiled Swin-T step kept the same bytes either way), and the plain ops compile faster."""
    return (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
            and not torch._C._are_functorch_transforms_active() and not torch.compiler.is_compiling())


@register_notrace_function  # reason: chooses its autograd form from the grad mode at run time
def gelu_linear(u: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(F.gelu(u), weight, bias)``, saving only ``u`` (and the weight) for backward."""
    if not _records_grad(u, weight, bias):
        return F.linear(F.gelu(u), weight, bias)
    return _GeluLinear.apply(u, weight, bias)


@register_notrace_function  # reason: chooses its autograd form from the grad mode at run time
def gelu_residual(x: torch.Tensor, u: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x + F.gelu(u) * scale`` (one ``addcmul``), ``scale`` broadcasting over ``u``, saving only ``u`` (and the
    small ``scale``) for backward."""
    if not _records_grad(x, u, scale):
        return torch.addcmul(x, F.gelu(u), scale)
    return _GeluResidual.apply(x, u, scale)
