"""Residual shortcuts: LipsFormer's weighted residual (Sec. 4.1.3, Table 1) and a convex combination that is
1-Lipschitz whenever its branch is."""
from typing import List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from timm.layers import DropPath
from torch import nn

from .fused import defer_bias, drop_factor, gelu_residual, residual_add
from .gelu import fused_linear, scale_rows, skip_linear
from .norm import CenterNorm

RESIDUALS = ("add", "convex")


class FoldedMap(NamedTuple):
    """A branch's last linear map with a per-channel output scale (and the constant its input is multiplied by)
    folded into its weight and bias (:func:`fold_out_scales`)."""
    weight: torch.Tensor
    bias: Optional[torch.Tensor]


# a ScaledOutput branch's output scale: per channel, folded into its last map already, or none
OutScale = Union[torch.Tensor, FoldedMap, None]


class ScaledOutput:
    """A residual branch that ends in a linear map and can fold a per-channel output scale into it: its
    ``forward(x, out_scale)`` returns ``out_scale * f(x)`` through :func:`scaled_linear` (``out_scale`` a tensor, or
    a :class:`FoldedMap` of the map :meth:`out_map` names with it folded in; None: ``f(x)``).
    :class:`lipsformer.layers.LipsBlock` gives it a weighted residual's ``alpha``, folded, and ``skip=True``, for which
    it returns ``(out_scale * f(x), x')``: ``x'`` is ``x`` as its first linear map passes it on to the skip
    (:func:`entry_linear`), or ``x`` itself."""

    def out_map(self) -> Tuple[nn.Module, float]:
        """The branch's last linear map and the constant its input is multiplied by."""
        raise NotImplementedError

    def out_dropout(self) -> nn.Module:
        """The dropout on the last linear map's output (``nn.Dropout``)."""
        raise NotImplementedError


def _plain_linear(linear: nn.Module) -> bool:
    """``nn.Linear``'s own forward and no hooks: a map the fused forms may compute from its weight and bias."""
    return type(linear).forward is nn.Linear.forward and not (linear._forward_hooks or linear._forward_pre_hooks)


def fold_out_scales(branches: Sequence[Tuple[ScaledOutput, torch.Tensor]]) -> List[OutScale]:
    """Each branch's output scale given as ``(branch, scale)``: folded into the branch's last linear map, one or two
    maps in one op (:func:`lipsformer.layers.gelu.scale_rows`, one kernel each way for a block's two branches); the
    scale itself for a map with its own forward or with hooks."""
    maps = [(i, *branch.out_map()) for i, (branch, _) in enumerate(branches)]
    maps = [(i, linear, c) for i, linear, c in maps if _plain_linear(linear)]
    out: List[OutScale] = [scale for _, scale in branches]
    if maps:
        folded = scale_rows([(linear.weight, linear.bias, branches[i][1], c) for i, linear, c in maps])
        for (i, _, _), (weight, bias) in zip(maps, folded):
            out[i] = FoldedMap(weight, bias)
    return out


def split_bias(branch: ScaledOutput, scale: OutScale, x: torch.Tensor) -> Tuple[OutScale, Optional[torch.Tensor]]:
    """``scale`` as a folded map without its bias, and the bias, where the fused ops take it for the branch's input
    ``x`` (:func:`~lipsformer.layers.fused.defer_bias`) and the branch's output goes straight into the residual's sum
    (its dropout off): the sum adds the bias (:meth:`WeightedResidual.add_scaled`) and the CenterNorm after it sums
    the bias's gradient with its own, one op less than the map's backward; else ``(scale, None)``."""
    if not isinstance(scale, FoldedMap) or scale.bias is None or not defer_bias(x):
        return scale, None
    drop = branch.out_dropout()
    if drop.training and drop.p > 0:
        return scale, None
    return FoldedMap(scale.weight, None), scale.bias


def map_params(linear: nn.Linear, scale: OutScale) -> Tuple[torch.Tensor, Optional[torch.Tensor],
                                                            Optional[torch.Tensor]]:
    """The weight, bias and per-channel output scale of ``linear`` for ``scale``: a folded map's own, no scale."""
    if isinstance(scale, FoldedMap):
        return scale.weight, scale.bias, None
    return linear.weight, linear.bias, scale


def scaled_linear(h: torch.Tensor, linear: nn.Linear, scale: OutScale, input_scale: float = 1.0) -> torch.Tensor:
    """``scale * linear(input_scale * h)``, ``scale`` per output channel, as one linear map with the scales folded
    into its weight and bias (:func:`lipsformer.layers.gelu.fused_linear`; a :class:`FoldedMap` is that map, both
    scales in it). Backward then keeps only ``h`` (which the linear map keeps anyway) and the parameters: no copy of
    the output for the scale's gradient, which comes from the folded map's own (``rowsum(W * grad_W') + b *
    grad_b'``). A module with its own forward (not ``nn.Linear``'s) or with hooks is called and its output scaled."""
    if isinstance(scale, FoldedMap):
        return fused_linear(h, scale.weight, scale.bias)
    if not _plain_linear(linear):
        out = linear(h if input_scale == 1.0 else h * input_scale)
        return out if scale is None else out * scale
    if scale is None and input_scale == 1.0:
        return linear(h)
    return fused_linear(h, linear.weight, linear.bias, scale, input_scale=input_scale)


def entry_linear(x: torch.Tensor, linear: nn.Module, skip: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """A residual branch's first linear map ``linear(x)``, and ``x`` for the residual's skip: with ``skip``, passed
    on through the map (:func:`lipsformer.layers.gelu.skip_linear`), so that backward adds the skip's gradient inside
    the map's input gradient; else ``x`` itself. A module with its own forward (not ``nn.Linear``'s) or with hooks
    is called."""
    if not skip or not _plain_linear(linear):
        return linear(x), x
    return skip_linear(x, linear.weight, linear.bias)


# a residual's DropPath draw: (the per-sample draw, what it is divided by); see DropPathDraw.drop_mask
Draw = Tuple[Optional[torch.Tensor], float]


class DropPathDraw:
    """A residual whose branch timm's DropPath (``self.drop_path``) drops per sample."""

    def drops(self) -> bool:
        """Whether the residual has a DropPath rate (it draws in training)."""
        return isinstance(self.drop_path, DropPath) and self.drop_path.drop_prob > 0

    def drop_keep(self) -> Optional[float]:
        """The probability of keeping a sample's branch where this residual drops (training with a drop rate),
        else None."""
        if not (self.training and self.drops()):
            return None
        return 1.0 - self.drop_path.drop_prob

    def drop_mask(self, x: torch.Tensor) -> Draw:
        """DropPath's per-sample draw for a batch ``x`` and what it is divided by: ``(bernoulli(keep), keep)``, the
        same random stream as timm's DropPath, in training with a drop rate; ``(None, 1.0)`` otherwise."""
        keep = self.drop_keep()
        if keep is None:
            return None, 1.0
        return x.new_empty(x.shape[0]).bernoulli_(keep), self.divisor(keep)

    def divisor(self, keep: float) -> float:
        """What a kept branch is divided by: ``keep``, or 1 where timm's DropPath does not scale by it."""
        return keep if self.drop_path.scale_by_keep else 1.0


def drop_masks(residuals: Sequence[Optional[DropPathDraw]], x: torch.Tensor, factors: bool = False
               ) -> Tuple[Optional[Draw], ...]:
    """The DropPath draws of several residuals (None: none there) for a batch ``x``, as :meth:`DropPathDraw.drop_mask`
    makes them, in one ``bernoulli_`` where those that drop share a rate (a block's residuals do): one kernel
    instead of one a residual. The rows are the residuals' draws in order, so on the CPU the same random stream as
    one draw each (on CUDA the same distribution, from another split of the generator's stream). ``factors``: each
    draw as its factor (:func:`drawn_factor`), the rows of one draw divided in one op."""
    keeps = [None if r is None else r.drop_keep() for r in residuals]
    rates = {k for k in keeps if k is not None}
    if len(rates) != 1:
        draws = [None if r is None else r.drop_mask(x) for r in residuals]
    else:
        keep = rates.pop()
        rows = x.new_empty(sum(k is not None for k in keeps), x.shape[0]).bernoulli_(keep)
        divisors = [r.divisor(keep) for r, k in zip(residuals, keeps) if k is not None]
        if factors and len(set(divisors)) == 1:  # all the factors in one op
            rows, divisors = rows.div(divisors[0]), [1.0] * len(divisors)
        draws, row = [], 0
        for r, k in zip(residuals, keeps):
            draws.append(None if r is None else (None, 1.0) if k is None else (rows[row], divisors[row]))
            row += k is not None
    return tuple(drawn_factor(d) if factors and d is not None else d for d in draws)


def drawn_factor(draw: Draw) -> Optional[Draw]:
    """A draw as its factor ``mask / keep`` over 1: what a compiled block takes, so that the drop rate is not a
    constant of its graph (blocks of a stage whose rates differ share one)."""
    mask, keep = draw
    return None if mask is None else (mask if keep == 1.0 else mask.div(keep), 1.0)


class WeightedResidual(DropPathDraw, nn.Module):
    r"""``x + DropPath(alpha * f(x))`` with a learnable per-channel ``alpha`` (channels last).

    LipsFormer Table 1: :math:`x_{i+1} = x_i + \mathrm{DropPath}_{p}(\alpha_i f(x_i))`, so that
    :math:`\mathrm{Lip} \le 1 + \max|\alpha|\,\mathrm{Lip}(f)`. The branch output ``f(x)`` is
    computed by the caller and passed in, so the branch module keeps its own parameter names.
    """

    def __init__(self, dim: int, alpha_init: float, drop_path: float = 0.0):
        super().__init__()
        self.alpha = nn.Parameter(torch.full((dim,), float(alpha_init)))
        self.drop_path = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()

    def forward(self, x: torch.Tensor, fx: torch.Tensor, gelu: bool = False, draw: Optional[Draw] = None,
                bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``x + DropPath(alpha * fx)``, or with ``gelu=True`` ``x + DropPath(alpha * GELU(fx + bias))``.

        One pass: DropPath's per-sample draw is folded into ``alpha``; with ``gelu`` one fused op
        (:func:`lipsformer.layers.fused.gelu_residual`), whose backward recomputes the GELU rather than keep it, and
        sums ``bias``'s gradient (the map before's, left out of it) with alpha's.
        ``draw``: the draw :meth:`drop_mask` made beforehand (a compiled block takes its draws as inputs).
        """
        mask, keep = draw if draw is not None else self.drop_mask(x)
        if gelu:
            return gelu_residual(x, fx, self.alpha, mask, keep, bias)
        if bias is not None:
            fx = fx + bias
        factor = drop_factor(mask, keep, x)
        return torch.addcmul(x, fx, self.alpha if factor is None else self.alpha * factor)

    def add_scaled(self, x: torch.Tensor, scaled_fx: torch.Tensor, norm: Optional[nn.Module] = None,
                   draw: Optional[Draw] = None, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``norm(x + DropPath(scaled_fx + bias))`` for a branch output already multiplied by ``alpha`` (a
        :class:`ScaledOutput` branch given ``out_scale=alpha``; ``bias``: its last map's, scaled, where
        :func:`split_bias` took it out of the map): the same sum as :meth:`forward`, with the same DropPath draws; a
        :class:`~lipsformer.layers.norm.CenterNorm` after it in the same fused op."""
        mask, keep = draw if draw is not None else self.drop_mask(x)
        if isinstance(norm, CenterNorm):
            return norm.residual(x, scaled_fx, mask, keep, bias)
        if bias is not None:
            scaled_fx = scaled_fx + bias
        y = x + scaled_fx if mask is None else residual_add(x, scaled_fx, mask, keep)
        return y if norm is None else norm(y)


class ConvexResidual(DropPathDraw, nn.Module):
    r"""``(1 - a) x + a f(x)`` with one learnable scalar ``a`` (``alpha``, kept in [0, 1] by
    :func:`lipsformer.lipschitz.constraints.keep_bound`).

    By the triangle inequality :math:`\mathrm{Lip} \le |1 - a| + |a|\,\mathrm{Lip}(f)`, which is at most 1 for
    :math:`a \in [0, 1]` and :math:`\mathrm{Lip}(f) \le 1`: stacking such residuals never compounds, unlike
    :class:`WeightedResidual`'s :math:`1 + \alpha\,\mathrm{Lip}(f)`. The weight is one scalar on purpose: with
    per-channel weights :math:`a_c` the same argument only gives :math:`\max_c|1 - a_c| + \max_c|a_c|\,\mathrm{Lip}(f)`,
    above 1 as soon as the weights differ. DropPath (per sample, timm's) sets ``a`` to 0 for dropped samples,
    and rescales the kept ones by ``1/(1-p)`` as timm does. ``alpha_range`` (within [0, 1]) is where bound keeping
    keeps ``a``: ``(0, 0)`` with ``alpha_init=0`` switches the branch off for good, a floor keeps it on.
    """

    def __init__(self, dim: int, alpha_init: float, drop_path: float = 0.0,
                 alpha_range: Tuple[float, float] = (0.0, 1.0)):
        super().__init__()
        lo, hi = (float(v) for v in alpha_range)
        if not 0.0 <= lo <= alpha_init <= hi <= 1.0:
            raise ValueError(f"a convex residual needs 0 <= alpha_range[0] <= alpha_init <= alpha_range[1] <= 1, got "
                             f"alpha_init {alpha_init} and alpha_range {tuple(alpha_range)}")
        self.alpha_range = (lo, hi)
        self.alpha = nn.Parameter(torch.full((1,), float(alpha_init)))
        self.drop_path = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()

    def forward(self, x: torch.Tensor, fx: torch.Tensor, draw: Optional[Draw] = None) -> torch.Tensor:
        mask, keep = draw if draw is not None else self.drop_mask(x)
        factor = drop_factor(mask, keep, x)
        scale = self.alpha.to(x.dtype)
        return torch.addcmul(x, fx - x, scale if factor is None else scale * factor)


def create_residual(kind: str, dim: int, alpha_init: float, drop_path: float = 0.0,
                    alpha_range: Tuple[float, float] = (0.0, 1.0)) -> nn.Module:
    """``add``: LipsFormer's ``x + alpha * f(x)`` (per-channel alpha); ``convex``: ``(1 - a) x + a f(x)``, ``a`` kept
    in ``alpha_range``."""
    if kind == "add":
        if tuple(alpha_range) != (0.0, 1.0):
            raise ValueError(f"alpha_range is where bound keeping keeps a convex residual's weight; the residual "
                             f"'add' has none, got {tuple(alpha_range)}")
        return WeightedResidual(dim, alpha_init, drop_path)
    if kind == "convex":
        return ConvexResidual(dim, alpha_init, drop_path, alpha_range)
    raise ValueError(f"residual must be one of {RESIDUALS}, got {kind!r}")
