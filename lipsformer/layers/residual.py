"""Weighted residual shortcut (LipsFormer Sec. 4.1.3, Table 1)."""
import torch
from timm.layers import DropPath
from torch import nn

from .gelu import gelu_residual


class WeightedResidual(nn.Module):
    r"""``x + DropPath(alpha * f(x))`` with a learnable per-channel ``alpha`` (channels last).

    LipsFormer Table 1: :math:`x_{i+1} = x_i + \mathrm{DropPath}_{p}(\alpha_i f(x_i))`, so that
    :math:`\mathrm{Lip} \le 1 + \max|\alpha|\,\mathrm{Lip}(f)`. The branch output ``f(x)`` is
    computed by the caller and passed in, so the branch module keeps its own parameter names.
    """

    def __init__(self, dim: int, alpha_init: float, drop_path: float = 0.0):
        super().__init__()
        self.alpha = nn.Parameter(torch.full((dim,), float(alpha_init)))
        self.drop_path = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()

    def forward(self, x: torch.Tensor, fx: torch.Tensor, gelu: bool = False) -> torch.Tensor:
        """``x + DropPath(alpha * fx)``, or with ``gelu=True`` ``x + DropPath(alpha * GELU(fx))``.

        One ``addcmul`` pass: DropPath's per-sample mask (drawn by timm's DropPath, from the same random
        stream) is folded into ``alpha``, and the GELU's output is recomputed in backward rather than kept.
        """
        scale = self.alpha
        if self.training and isinstance(self.drop_path, DropPath):
            scale = scale * self.drop_path(x.new_ones((x.shape[0],) + (1,) * (x.ndim - 1)))
        return gelu_residual(x, fx, scale) if gelu else torch.addcmul(x, fx, scale)
