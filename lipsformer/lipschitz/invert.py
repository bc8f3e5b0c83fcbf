"""Invertible residual blocks (Kim et al. Sec. 4; Behrmann et al., "Invertible residual networks").

``g(x) = x + c f(x)`` is invertible when ``c Lip(f) < 1``: ``g^-1(y)`` is the unique fixed point of
``x <- y - c f(x)`` (Banach), reached from ``x = y`` exponentially fast. :class:`InvertibleResidual` holds ``f`` and
``c``; :func:`invert` certifies ``c Lip(f) < 1`` from the bounds code before iterating and stops once the a-posteriori
Banach estimate ``L / (1 - L) ||x_k - x_{k-1}||`` guarantees the requested tolerance.
:class:`ContractiveL2Attention` is Kim et al.'s L2 multi-head attention divided by its Theorem 3.2 bound, so its
certified constant is 1 and ``InvertibleResidual(ContractiveL2Attention(...), c)`` is invertible for any ``c < 1``.

Norms: a certificate and a tolerance are in one norm, ``"2"`` or ``"inf"``, of one sample's flattened (N, D)
tokens; a batch is inverted sample by sample (the map acts on each sample alone), errors are the largest over it.
"""
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import torch
from torch import nn

from ..layers.attention import KimL2Attention
from .layer_bounds import kim_l2_bound, kim_l2_inf_bound, kim_theorem_3_2
from .registry import Bound, NoBoundError, module_bound, register_bound

NORMS = ("2", "inf")


def _check_norm(norm: str) -> str:
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
    return norm


class ContractiveL2Attention(nn.Module):
    """Kim et al.'s Contractive-L2-MHA (Sec. 4.2): :class:`KimL2Attention` divided by its Theorem 3.2 bound in
    ``norm`` for the tokens it is given (recomputed from the live weights each call, and differentiated through,
    as in Kim et al. Sec. 5.3). Its certified Lipschitz constant in ``norm`` is 1 for any weights and any N.
    """

    def __init__(self, dim: int, heads: int = 1, norm: str = "2", fused: bool = True):
        super().__init__()
        self.norm = _check_norm(norm)
        self.attn = KimL2Attention(dim, heads, fused=fused)

    def bound(self, n: int) -> torch.Tensor:
        """Theorem 3.2's bound of the inner attention on ``n`` tokens, in this layer's norm (a tensor)."""
        a = self.attn
        return kim_theorem_3_2(a.q.weight, a.v.weight, a.proj.weight, a.heads, n, self.norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x) / self.bound(x.shape[-2]).to(x.dtype)

    def extra_repr(self) -> str:
        return f"norm={self.norm!r}"


@register_bound(ContractiveL2Attention)
def contractive_l2_attention_bound(attn: ContractiveL2Attention, hw) -> Bound:
    """l2: Theorem 3.2 of the inner attention (float64) over the normaliser the layer divides by (its own dtype):
    1 up to rounding when the layer's norm is l2 too."""
    n = hw[0] * hw[1]
    with torch.no_grad():
        own = float(attn.bound(n))
    return Bound(kim_l2_bound(attn.attn, n) / own, f"Kim Thm 3.2 (l2) / Thm 3.2 ({attn.norm}), N={n}")


def _inf_bound(f: nn.Module, n: int) -> float:
    """Certified Lip-inf of the branch types invert() knows in that norm (the registry holds l2 bounds)."""
    if type(f) is nn.Linear:  # on every token: the largest row sum of |W|
        return float(f.weight.detach().abs().sum(1).max())
    if type(f) is KimL2Attention:
        return kim_l2_inf_bound(f, n)
    if type(f) is ContractiveL2Attention:
        with torch.no_grad():
            own = float(f.bound(n))
        return kim_l2_inf_bound(f.attn, n) / own
    raise NoBoundError(f"no certified Lipschitz-inf bound for {type(f).__name__}; in l-inf, invert() knows "
                       f"nn.Linear, KimL2Attention and ContractiveL2Attention (norm='2' uses the bounds registry)")


def branch_bound(f: nn.Module, n: int, norm: str = "2") -> float:
    """Certified ``Lip_norm(f)`` of a residual branch on ``n`` tokens: l2 from the bounds registry
    (:func:`~lipsformer.lipschitz.registry.module_bound`), l-inf from Theorem 3.2's other form; an unknown type raises
    :class:`~lipsformer.lipschitz.registry.NoBoundError`."""
    if _check_norm(norm) == "2":
        return module_bound(f, (1, n)).lip
    return _inf_bound(f, n)


class InvertibleResidual(nn.Module):
    """``g(x) = x + c f(x)`` on tokens (B, N, D): invertible by :func:`invert` when ``c Lip(f) < 1`` in ``norm``."""

    def __init__(self, f: nn.Module, c: float = 0.9, norm: str = "2"):
        super().__init__()
        if not c > 0:
            raise ValueError(f"c must be positive, got {c}")
        self.f, self.c, self.norm = f, float(c), _check_norm(norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.c * self.f(x)

    def lipschitz_branch(self, n: int) -> float:
        """Certified ``Lip(c f)`` on ``n`` tokens in this block's norm."""
        return self.c * branch_bound(self.f, n, self.norm)

    def extra_repr(self) -> str:
        return f"c={self.c:g}, norm={self.norm!r}"


@dataclass
class Inverse:
    """What :func:`fixed_point_inverse` returns: the estimate ``x``, the iterations run, whether the stopping
    rule was met, and the largest per-sample step ``||x_k - x_{k-1}||`` of every iteration."""

    x: torch.Tensor
    iterations: int
    converged: bool
    steps: List[float] = field(default_factory=list)


def sample_norm(t: torch.Tensor, norm: str) -> torch.Tensor:
    """The norm of each sample (leading index) of ``t``, flattened."""
    flat = t.flatten(1)
    return flat.norm(dim=1) if norm == "2" else flat.abs().amax(dim=1)


@torch.no_grad()
def fixed_point_inverse(branch: Callable, y: torch.Tensor, tol: float = 1e-6, max_iter: int = 100,
                        norm: str = "inf", lipschitz: Optional[float] = None,
                        callback: Optional[Callable[[int, torch.Tensor], None]] = None) -> Inverse:
    """Iterate ``x <- y - branch(x)`` from ``x = y``, with no certificate (benchmarks use it on dot-product
    attention too). Stops when the largest per-sample step, times ``L / (1 - L)`` when a constant ``L < 1`` is
    given (then the error is at most ``tol``, Banach), is at most ``tol``, or after ``max_iter`` iterations.
    ``callback(k, x_k)`` sees every iterate."""
    factor = 1.0 if lipschitz is None else lipschitz / (1.0 - lipschitz)
    x, steps = y, []
    for k in range(1, max_iter + 1):
        new = y - branch(x)
        step = float(sample_norm(new - x, norm).max())
        x = new
        steps.append(step)
        if callback is not None:
            callback(k, x)
        if not torch.isfinite(x).all():
            return Inverse(x, k, False, steps)
        if factor * step <= tol:
            return Inverse(x, k, True, steps)
    return Inverse(x, max_iter, False, steps)


def invert(module: InvertibleResidual, y: torch.Tensor, tol: float = 1e-6, max_iter: int = 100) -> Inverse:
    """``g^-1(y)`` for ``g = module`` on tokens ``y`` (B, N, D) by fixed-point iteration, to within ``tol`` in the
    block's norm per sample (certified: the Banach bound on the remaining error is below ``tol`` when
    ``converged``). Refuses (ValueError) when the certified ``c Lip(f)`` is not below 1."""
    if not isinstance(module, InvertibleResidual):
        raise TypeError(f"invert takes an InvertibleResidual, got {type(module).__name__}")
    if y.ndim != 3:
        raise ValueError(f"y must be tokens (B, N, D), got shape {tuple(y.shape)}")
    lip = module.lipschitz_branch(y.shape[1])
    if not lip < 1.0:
        raise ValueError(f"cannot invert: the certified Lip(c f) = {lip:.4g} is not below 1 "
                         f"({type(module.f).__name__}, c={module.c:g}, N={y.shape[1]}, norm {module.norm}); "
                         f"lower c or use a contractive branch (ContractiveL2Attention)")
    return fixed_point_inverse(lambda x: module.c * module.f(x), y, tol, max_iter, module.norm, lip)
