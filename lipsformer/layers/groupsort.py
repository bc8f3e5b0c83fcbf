"""GroupSort (Anil, Lucas & Grosse, "Sorting out Lipschitz function approximation", ICML 2019).

Sorting each group of ``group_size`` consecutive channels is, on each region where the order does not change,
a permutation of the coordinates: the Jacobian is a permutation matrix almost everywhere, so the activation is
1-Lipschitz in l2 and preserves gradient norms (GELU's largest slope is 1.1289, ReLU loses norm). With
``group_size=2`` it is MaxMin: ``(max(a, b), min(a, b))`` for each channel pair.
"""
import torch
from timm.layers import register_notrace_function
from torch import nn


@register_notrace_function  # reason: the channel check reads the input's shape
def group_sort(x: torch.Tensor, group_size: int = 2) -> torch.Tensor:
    """Sort each group of ``group_size`` consecutive entries of the last dimension, in descending order."""
    if x.shape[-1] % group_size:
        raise ValueError(f"GroupSort needs channels divisible by group_size {group_size}, got {x.shape[-1]}")
    if group_size == 2:
        a, b = x.unflatten(-1, (-1, 2)).unbind(-1)
        return torch.stack((torch.maximum(a, b), torch.minimum(a, b)), -1).flatten(-2)
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
