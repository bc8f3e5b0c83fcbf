"""The convolution blocks that open every LipsFormer block (LipsFormer Fig. 1, Table 3)."""
import torch
import torch.nn.functional as F
from torch import nn

from .gelu import gelu_linear
from .groupsort import GroupSort
from .residual import create_residual

CONV_BLOCKS = ("A", "B", "C", "D")
ACTS = ("gelu", "groupsort")


def create_act(kind: str) -> nn.Module:
    """The blocks' activation by name: ``gelu`` (LipsFormer; largest slope 1.1289) or ``groupsort``
    (MaxMin, 1-Lipschitz; :class:`lipsformer.layers.groupsort.GroupSort`)."""
    if kind == "gelu":
        return nn.GELU()
    if kind == "groupsort":
        return GroupSort(2)
    raise ValueError(f"act must be one of {ACTS}, got {kind!r}")


def _nchw(x: torch.Tensor) -> torch.Tensor:
    """(B, H, W, C) -> (B, C, H, W) view; convolutions run on it in channels-last memory, no copy."""
    return x.permute(0, 3, 1, 2)


def _nhwc(x: torch.Tensor) -> torch.Tensor:
    return x.permute(0, 2, 3, 1)


class ConvBlocks(nn.Module):
    r"""Depth-wise / point-wise convolution blocks with weighted residuals, on (B, H, W, C).

    Configurations of LipsFormer Table 3:

    - ``A``: none (identity);
    - ``B``: :math:`x + \mathrm{DP}(s_1 \odot \mathrm{GELU}(\mathrm{dw}_{7\times7}(x)))`;
    - ``C``: :math:`x + \mathrm{DP}(s_1 \odot \mathrm{GELU}(\mathrm{pw}_{1\times1}(\mathrm{GELU}(\mathrm{dw}_{7\times7}(x)))))`;
    - ``D`` (released default): ``C`` followed by :math:`x + \mathrm{DP}(s_2 \odot \mathrm{GELU}(\mathrm{dw}'_{7\times7}(x)))`.

    ``s1`` and ``s2`` are per-channel weights initialised to ``alpha_init``. The released code
    calls ``dw1``/``dw2`` ``dwconv_layers.0/1``, ``pw`` ``nin`` and ``res1/2.alpha`` ``scale_layers.0/1.scale``.
    ``act`` replaces GELU (``groupsort``) and ``residual="convex"`` the weighted residuals by
    :class:`lipsformer.layers.residual.ConvexResidual`; the defaults run the fused GELU path.
    """

    def __init__(self, dim: int, config: str = "D", alpha_init: float = 0.1, drop_path: float = 0.0,
                 kernel_size: int = 7, act: str = "gelu", residual: str = "add"):
        super().__init__()
        if config not in CONV_BLOCKS:
            raise ValueError(f"conv_blocks must be one of {CONV_BLOCKS}, got {config!r}")
        self.config = config
        self.act = None if act == "gelu" and residual == "add" else create_act(act)  # None: the fused GELU path

        def dw():
            return nn.Conv2d(dim, dim, kernel_size, padding=kernel_size // 2, groups=dim)

        self.dw1 = dw() if config != "A" else None
        self.pw = nn.Conv2d(dim, dim, 1) if config in ("C", "D") else None
        self.res1 = create_residual(residual, dim, alpha_init, drop_path) if config != "A" else None
        self.dw2 = dw() if config == "D" else None
        self.res2 = create_residual(residual, dim, alpha_init, drop_path) if config == "D" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dw1 is None:
            return x
        if self.act is not None:
            return self._forward_act(x)
        y = _nhwc(self.dw1(_nchw(x)))
        if self.pw is not None:  # the 1x1 convolution as the matmul over channels it is, fused with its GELU
            y = gelu_linear(y, self.pw.weight.flatten(1), self.pw.bias)
        x = self.res1(x, y, gelu=True)
        if self.dw2 is not None:
            x = self.res2(x, _nhwc(self.dw2(_nchw(x))), gelu=True)
        return x

    def _forward_act(self, x: torch.Tensor) -> torch.Tensor:
        """The same blocks with ``self.act`` and the residuals' own forward (no fused GELU)."""
        y = self.act(_nhwc(self.dw1(_nchw(x))))
        if self.pw is not None:
            y = self.act(F.linear(y, self.pw.weight.flatten(1), self.pw.bias))
        x = self.res1(x, y)
        if self.dw2 is not None:
            x = self.res2(x, self.act(_nhwc(self.dw2(_nchw(x)))))
        return x

    def extra_repr(self) -> str:
        return f"config={self.config!r}"
