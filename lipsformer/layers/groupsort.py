"""GroupSort (Anil, Lucas & Grosse, "Sorting out Lipschitz function approximation", ICML 2019).

Sorting each group of ``group_size`` consecutive channels is, on each region where the order does not change,
a permutation of the coordinates: the Jacobian is a permutation matrix almost everywhere, so the activation is
1-Lipschitz in l2 and preserves gradient norms (GELU's largest slope is 1.1289, ReLU loses norm). With
``group_size=2`` it is MaxMin: ``(max(a, b), min(a, b))`` for each channel pair.
"""
import torch
from timm.layers import register_notrace_function
from torch import nn

from .gelu import _records_grad


def _max_min(x: torch.Tensor) -> torch.Tensor:
    a, b = x.unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((torch.maximum(a, b), torch.minimum(a, b)), -1).flatten(-2)


class _MaxMin(torch.autograd.Function):
    """MaxMin whose backward applies the forward's permutation to the gradient, saving one byte per channel pair
    (whether it was swapped). Autograd's own backward of ``maximum`` / ``minimum`` saves both inputs and makes
    five passes for each (equality for ties, halving, masking): 94 against 26 ms for a forward and backward of an
    (8, 3136, 384) float32 tensor on 2 cores, and both outputs are written in place into their channels. At a tie (a == b) the gradient goes through unswapped, the
    permutation's Jacobian, where autograd's splits it in halves between a and b."""

    @staticmethod
    def forward(ctx, x):
        a, b = x.unflatten(-1, (-1, 2)).unbind(-1)
        swapped = a < b
        ctx.save_for_backward(swapped)
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        pairs = out.unflatten(-1, (-1, 2))  # written in place: 20 against 30 ms for stack's copy at that size
        torch.maximum(a, b, out=pairs[..., 0])
        torch.minimum(a, b, out=pairs[..., 1])
        return out

    @staticmethod
    def backward(ctx, grad):
        swapped, = ctx.saved_tensors
        g_max, g_min = grad.unflatten(-1, (-1, 2)).unbind(-1)
        out = torch.empty_like(grad, memory_format=torch.contiguous_format)
        pairs = out.unflatten(-1, (-1, 2))
        torch.where(swapped, g_min, g_max, out=pairs[..., 0])
        torch.where(swapped, g_max, g_min, out=pairs[..., 1])
        return out


@register_notrace_function  # reason: the channel check reads the input's shape
def group_sort(x: torch.Tensor, group_size: int = 2) -> torch.Tensor:
    """Sort each group of ``group_size`` consecutive entries of the last dimension, in descending order."""
    if x.shape[-1] % group_size:
        raise ValueError(f"GroupSort needs channels divisible by group_size {group_size}, got {x.shape[-1]}")
    if group_size == 2:
        return _MaxMin.apply(x) if _records_grad(x) else _max_min(x)
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
