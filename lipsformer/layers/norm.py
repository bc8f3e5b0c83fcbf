"""Normalisation layers: CenterNorm (LipsFormer eq. 2) and the ablation alternatives."""
from typing import Optional

import torch
from torch import nn

from .fused import residual_center_norm

NORMS = ("center", "layer", "none")


class CenterNorm(nn.Module):
    r"""CenterNorm over the last (channel) dimension, LipsFormer eq. 2.

    .. math:: \mathrm{CN}(x) = \gamma \odot \frac{D}{D-1}\,(x - \tfrac{1}{D}\mathbf{1}\mathbf{1}^\top x) + \beta

    Unlike LayerNorm it does not divide by the standard deviation, so it is Lipschitz with
    constant ``D/(D-1) * max|gamma|`` (``D/(D-1)`` at initialisation, gamma = 1, beta = 0).
    Parameters are named ``weight`` (gamma) and ``bias`` (beta) as in the released code. One fused op forward and
    one backward (:mod:`lipsformer.layers.fused`), keeping the centred input for backward, as autograd does.
    """

    def __init__(self, dim: int):
        super().__init__()
        if dim < 2:
            raise ValueError(f"CenterNorm needs at least 2 channels, got dim={dim}")
        self.dim = dim
        self.scale = dim / (dim - 1.0)
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return residual_center_norm(x, None, None, 1.0, self.weight, self.bias, self.scale)

    def residual(self, x: torch.Tensor, h: torch.Tensor, mask: Optional[torch.Tensor] = None,
                 keep: float = 1.0, h_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``CN(x + m * (h + h_bias))``, ``m = mask / keep`` per sample (a weighted residual's DropPath; ``h_bias``
        per channel, or None), as one fused op (:func:`lipsformer.layers.fused.residual_center_norm`)."""
        return residual_center_norm(x, h, mask, keep, self.weight, self.bias, self.scale, h_bias)

    def extra_repr(self) -> str:
        return f"{self.dim}"


def create_norm(kind: str, dim: int) -> nn.Module:
    """Channel-last norm by name: ``center`` (LipsFormer), ``layer`` (LayerNorm, eps 1e-6) or ``none``."""
    if kind == "center":
        return CenterNorm(dim)
    if kind == "layer":
        return nn.LayerNorm(dim, eps=1e-6)
    if kind == "none":
        return nn.Identity()
    raise ValueError(f"norm must be one of {NORMS}, got {kind!r}")
