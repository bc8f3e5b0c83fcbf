"""GroupSort (Anil, Lucas & Grosse, "Sorting out Lipschitz function approximation", ICML 2019).

Sorting each group of ``group_size`` consecutive channels is, on each region where the order does not change,
a permutation of the coordinates: the Jacobian is a permutation matrix almost everywhere, so the activation is
1-Lipschitz in l2 and preserves gradient norms (GELU's largest slope is 1.1289, ReLU loses norm). With
``group_size=2`` it is MaxMin: ``(max(a, b), min(a, b))`` for each channel pair.
"""
import torch
from timm.layers import register_notrace_function
from torch.autograd import forward_ad
from torch import nn

from .gelu import records_grad


def _max_min(x: torch.Tensor) -> torch.Tensor:
    a, b = x.unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((torch.maximum(a, b), torch.minimum(a, b)), -1).flatten(-2)


def _swap_pairs(swapped: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``t`` with each channel pair swapped where ``swapped`` (one entry a pair) says, written in place into a new
    tensor; differentiable ops where autograd records (a double backward through :class:`_MaxMin`)."""
    first, second = t.unflatten(-1, (-1, 2)).unbind(-1)
    if torch.is_grad_enabled() and t.requires_grad:
        return torch.stack((torch.where(swapped, second, first), torch.where(swapped, first, second)), -1).flatten(-2)
    out = torch.empty_like(t, memory_format=torch.contiguous_format)
    pairs = out.unflatten(-1, (-1, 2))
    torch.where(swapped, second, first, out=pairs[..., 0])
    torch.where(swapped, first, second, out=pairs[..., 1])
    return out


class _MaxMin(torch.autograd.Function):
    """MaxMin whose backward applies the forward's permutation to the gradient, saving one byte per channel pair
    (whether it was swapped). Autograd's own backward of ``maximum`` / ``minimum`` saves both inputs and makes
    five passes for each (equality for ties, halving, masking), several times the cost of this one's; both outputs
    are written in place into their channels. At a tie (a == b)
    the gradient goes through unswapped, the permutation's Jacobian, where autograd's splits it in halves."""

    @staticmethod
    def forward(ctx, x):
        a, b = x.unflatten(-1, (-1, 2)).unbind(-1)
        swapped = a < b
        ctx.save_for_backward(swapped)
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        pairs = out.unflatten(-1, (-1, 2))  # written in place: cheaper than stack's copy
        torch.maximum(a, b, out=pairs[..., 0])
        torch.minimum(a, b, out=pairs[..., 1])
        return out

    @staticmethod
    def backward(ctx, grad):
        swapped, = ctx.saved_tensors
        if torch._C._functorch.is_legacy_batchedtensor(grad):  # vectorised Jacobians: no views, no out=
            partner = torch.arange(grad.shape[-1], device=grad.device) ^ 1
            return torch.where(swapped.repeat_interleave(2, -1), grad.index_select(-1, partner), grad)
        return _swap_pairs(swapped, grad)


@register_notrace_function  # reason: the channel check reads the input's shape
def group_sort(x: torch.Tensor, group_size: int = 2) -> torch.Tensor:
    """Sort each group of ``group_size`` consecutive entries of the last dimension, in descending order."""
    if x.shape[-1] % group_size:
        raise ValueError(f"GroupSort needs channels divisible by group_size {group_size}, got {x.shape[-1]}")
    if group_size == 2:
        # forward-mode AD (a dual tensor) takes the plain ops, which have their own rule
        recorded = records_grad(x) and forward_ad.unpack_dual(x).tangent is None
        return _MaxMin.apply(x) if recorded else _max_min(x)
    return x.unflatten(-1, (-1, group_size)).sort(-1, descending=True).values.flatten(-2)


class GroupSort(nn.Module):
    """:func:`group_sort` over the last (channel) dimension; channel-last inputs (B, ..., C)."""

    def __init__(self, group_size: int = 2):
        super().__init__()
        if group_size < 2:
            raise ValueError(f"group_size must be at least 2, got {group_size}")
        self.group_size = group_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return group_sort(x, self.group_size)

    def extra_repr(self) -> str:
        return f"group_size={self.group_size}"
