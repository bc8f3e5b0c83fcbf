"""Normalisation layers: CenterNorm (LipsFormer eq. 2) and the ablation alternatives."""
import torch
from torch import nn

from .gelu import records_grad

NORMS = ("center", "layer", "none")


class _CenterNorm(torch.autograd.Function):
    """:class:`CenterNorm`'s forward with a backward in four passes over the activation: autograd's, through the
    mean and the broadcast affine map, takes nine (several times LayerNorm's cost at stage 1 of Swin-T). Keeps the
    centred input, as autograd does. Under ``create_graph`` the input's gradient stays exact to any order (it does not
    read the centred input: an input-gradient penalty is exact, tested), but the weight's gradient is not
    differentiated with respect to the input (the saved centred input carries no graph)."""

    @staticmethod
    def forward(ctx, x, weight, bias, scale):
        xc = x - x.mean(-1, keepdim=True)
        ctx.save_for_backward(xc, weight)
        ctx.scale = scale
        return torch.addcmul(bias, xc, weight * scale)

    @staticmethod
    def backward(ctx, grad):
        xc, weight = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        rows = grad.reshape(-1, grad.shape[-1])
        if ctx.needs_input_grad[0]:
            grad_xc = grad * (weight * ctx.scale)
            grad_x = grad_xc.sub_(grad_xc.mean(-1, keepdim=True))
        if ctx.needs_input_grad[1]:
            grad_w = (rows * xc.reshape(rows.shape)).sum(0) * ctx.scale
        if ctx.needs_input_grad[2]:
            grad_b = rows.sum(0)
        return grad_x, grad_w, grad_b, None


class CenterNorm(nn.Module):
    r"""CenterNorm over the last (channel) dimension, LipsFormer eq. 2.

    .. math:: \mathrm{CN}(x) = \gamma \odot \frac{D}{D-1}\,(x - \tfrac{1}{D}\mathbf{1}\mathbf{1}^\top x) + \beta

    Unlike LayerNorm it does not divide by the standard deviation, so it is Lipschitz with
    constant ``D/(D-1) * max|gamma|`` (``D/(D-1)`` at initialisation, gamma = 1, beta = 0).
    Parameters are named ``weight`` (gamma) and ``bias`` (beta) as in the released code.
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
        if records_grad(x, self.weight, self.bias):
            return _CenterNorm.apply(x, self.weight, self.bias, self.scale)
        x = x - x.mean(-1, keepdim=True)
        return torch.addcmul(self.bias, x, self.weight * self.scale)

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
