"""The LipsFormer block (LipsFormer Fig. 1, Table 1), shared by the Swin and CSwin families."""
from typing import Tuple

import torch
from timm.layers import Mlp
from torch import nn

from .conv_blocks import ConvBlocks, create_act
from .gelu import gelu_linear
from .norm import CenterNorm, create_norm
from .residual import (OutScale, ScaledOutput, WeightedResidual, create_residual, drop_masks, entry_linear,
                       fold_out_scales, map_params, scaled_linear, split_bias)


class GeluMlp(Mlp, ScaledOutput):
    """timm's Mlp (``fc1``, GELU, ``fc2``), with the GELU fused into ``fc2`` (:func:`gelu_linear`) unless a
    dropout sits between them, so backward keeps the hidden layer once instead of twice; ``out_scale`` is folded
    into ``fc2`` (:class:`~lipsformer.layers.residual.ScaledOutput`)."""

    def forward(self, x: torch.Tensor, out_scale: OutScale = None, skip: bool = False):
        u, x = entry_linear(x, self.fc1, skip)
        if self.training and self.drop1.p > 0:
            out = self.drop2(scaled_linear(self.norm(self.drop1(self.act(u))), self.fc2, out_scale))
        else:
            out = self.drop2(gelu_linear(u, *map_params(self.fc2, out_scale)))
        return (out, x) if skip else out

    def out_map(self) -> Tuple[nn.Module, float]:
        return self.fc2, 1.0

    def out_dropout(self) -> nn.Module:
        return self.drop2


class CPLMlp(nn.Module):
    r"""A convex potential layer (Meunier, Delattre, Araujo & Allauzen, "A dynamical system perspective for
    Lipschitz neural networks", ICML 2022) as the MLP branch: :math:`x - 2 W^\top \mathrm{ReLU}(W x + b)`, one
    ``fc`` of ``hidden`` units whose weight is used twice. Its Jacobian :math:`I - 2 W^\top D W` (D diagonal in
    [0, 1]) has eigenvalues in :math:`[1 - 2\|W\|^2, 1]`, so the layer is 1-Lipschitz when :math:`\|W\| \le 1`
    (``linear="normalized"`` divides ``W`` by its norm) and in general :math:`\max(1, 2\|W\|^2 - 1)`-Lipschitz. Unlike a
    convex combination with a contracting branch it is an isometry on the directions ``W`` ignores, and a
    reflection where ``W`` has orthonormal rows."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc = nn.Linear(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.fc.weight
        return x - 2 * torch.relu(self.fc(x)) @ w


MLPS = ("mlp", "cpl")


class LipsBlock(nn.Module):
    r"""Conv blocks, then weighted-residual attention and MLP, on (B, H, W, C).

    .. math::
        x &\leftarrow \mathrm{ConvBlocks}(x) \\
        x &\leftarrow N_1(x + \mathrm{DP}(\alpha_1 \odot \mathrm{Attn}(x))) \\
        x &\leftarrow N_2(x + \mathrm{DP}(\alpha_2 \odot \mathrm{MLP}(x)))

    ``attn`` is the family's token mixer (Swin windows or CSwin stripes). ``attn_norm=False``
    drops :math:`N_1`, as the released CSwin code does (CenterNorm only after the MLP).
    ``act`` (``gelu`` | ``groupsort``) is the MLP's and conv blocks' activation; ``residual`` (``add`` | ``convex``)
    chooses :class:`~lipsformer.layers.residual.WeightedResidual` or
    :class:`~lipsformer.layers.residual.ConvexResidual` for every residual of the block (a convex one keeps its
    weight in ``alpha_range``); ``mlp`` is ``mlp`` (fc1, act, fc2) or ``cpl`` (:class:`CPLMlp`).
    """

    def __init__(self, dim: int, attn: nn.Module, mlp_ratio: float = 4.0, norm: str = "center",
                 conv_blocks: str = "D", alpha_init: float = 0.1, drop_path: float = 0.0, drop: float = 0.0,
                 attn_norm: bool = True, act: str = "gelu", residual: str = "add",
                 alpha_range: Tuple[float, float] = (0.0, 1.0), mlp: str = "mlp"):
        super().__init__()
        self.dim = dim
        self.convs = ConvBlocks(dim, conv_blocks, alpha_init, drop_path, act=act, residual=residual,
                                alpha_range=alpha_range)
        self.attn = attn
        self.res_attn = create_residual(residual, dim, alpha_init, drop_path, alpha_range)
        self.norm1 = create_norm(norm, dim) if attn_norm else nn.Identity()
        if mlp == "cpl":
            self.mlp = CPLMlp(dim, int(dim * mlp_ratio))
        elif act == "gelu":
            self.mlp = GeluMlp(dim, int(dim * mlp_ratio), act_layer=nn.GELU, drop=drop)
        else:
            self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=lambda: create_act(act), drop=drop)
        self.res_mlp = create_residual(residual, dim, alpha_init, drop_path, alpha_range)
        self.norm2 = create_norm(norm, dim)

    # set by lipsformer.engine.speed.compile_model: torch.compile(LipsBlock.body), and whether a training step gives
    # it factors of one where this block does not drop (a stage's first block), so that it shares the graph of the
    # stage's blocks that do
    compiled_body = None
    compiled_unit_draws = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.compiled_body is None:
            return self.body(x, self.drop_draws(x))
        return self.compiled_body(self, x, self.drop_draws(x, factors=True))

    def drop_draws(self, x: torch.Tensor, factors: bool = False) -> tuple:
        """The DropPath draws of the block's four residuals for a batch ``x``, in one kernel
        (:func:`~lipsformer.layers.residual.drop_masks`); ``factors`` for a compiled :meth:`body`, which takes them
        as factors (:func:`~lipsformer.layers.residual.drawn_factor`), so that its graph has them as inputs and the
        blocks of a stage, whose drop rates differ, share one graph (with :attr:`compiled_unit_draws`, factors of
        one in a training step where the block does not drop)."""
        residuals = self._residuals()
        draws = drop_masks(residuals, x, factors)
        if factors and self.compiled_unit_draws and self.training and all(d is None for d in draws):
            ones = x.new_ones(len(draws), x.shape[0])
            draws = tuple(None if r is None else (ones[i], 1.0) for i, r in enumerate(residuals))
        return draws

    def drops(self) -> bool:
        """Whether any of the block's residuals has a DropPath rate (it draws in a training step)."""
        return any(r is not None and r.drops() for r in self._residuals())

    def _residuals(self) -> tuple:
        """The block's four residuals in the order of its draws (None where the conv blocks have none)."""
        return self.convs.res1, self.convs.res2, self.res_attn, self.res_mlp

    def body(self, x: torch.Tensor, draws: tuple) -> torch.Tensor:
        """The block, given its residuals' DropPath draws (None: each residual draws its own)."""
        x = self.convs(x, draws[:2])
        attn_scale, mlp_scale = self._out_scales()
        x = self._residual(self.res_attn, self.attn, self.norm1, x, draws[2], attn_scale)
        return self._residual(self.res_mlp, self.mlp, self.norm2, x, draws[3], mlp_scale)

    def _out_scales(self) -> list:
        """For the attention and the MLP: a weighted residual's ``alpha`` folded into its branch's last linear map
        where the branch takes it (:class:`~lipsformer.layers.residual.ScaledOutput`), both maps in one op
        (:func:`~lipsformer.layers.residual.fold_out_scales`); None elsewhere."""
        pairs = [(res, branch) if isinstance(res, WeightedResidual) and isinstance(branch, ScaledOutput) else None
                 for res, branch in ((self.res_attn, self.attn), (self.res_mlp, self.mlp))]
        folded = iter(fold_out_scales([(branch, res.alpha) for res, branch in filter(None, pairs)]))
        return [None if pair is None else next(folded) for pair in pairs]

    @staticmethod
    def _residual(res: nn.Module, branch: nn.Module, norm: nn.Module, x: torch.Tensor, draw=None,
                  out_scale: OutScale = None) -> torch.Tensor:
        """``norm(res(x, branch(x)))``; with ``out_scale`` (a weighted residual's ``alpha`` for a
        :class:`~lipsformer.layers.residual.ScaledOutput` branch, folded into its last linear map) the branch scales
        its own output, so that backward keeps no copy of it for alpha's gradient (two C-wide activations per
        block), and the sum and a CenterNorm after it are one fused op; the skip takes ``x`` as the branch's first
        linear map passes it on, so that the two gradients of ``x`` meet inside that map's backward
        (:func:`entry_linear`); before a CenterNorm the last map's bias is added in that op
        (:func:`~lipsformer.layers.residual.split_bias`)."""
        if out_scale is not None:
            bias = None
            if isinstance(norm, CenterNorm):
                out_scale, bias = split_bias(branch, out_scale, x)
            out, x = branch(x, out_scale=out_scale, skip=True)
            return res.add_scaled(x, out, None if isinstance(norm, nn.Identity) else norm, draw, bias)
        return norm(res(x, branch(x), draw=draw))
