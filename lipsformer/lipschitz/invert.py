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
from .bounds import kim_theorem_3_2, matrix_norm

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


def _linear_bound(m: nn.Linear, n: int, norm: str) -> float:
    # a Linear on every token: l2 of the flattened tokens -> sigma_max; l-inf -> largest row sum of |W|
    return matrix_norm(m.weight) if norm == "2" else float(m.weight.detach().abs().sum(1).max())


def _kim_bound(m: KimL2Attention, n: int, norm: str) -> float:
    w = [p.weight.detach().double() for p in (m.q, m.v, m.proj)]
    return float(kim_theorem_3_2(*w, m.heads, n, norm))


def _contractive_bound(m: ContractiveL2Attention, n: int, norm: str) -> float:
    # Lip_norm(attn / B) = Lip_norm(attn) / B, with B the layer's own normaliser (in its norm, as it computes it)
    with torch.no_grad():
        own = float(m.bound(n))
    return 1.0 if norm == m.norm else _kim_bound(m.attn, n, norm) / own


# Branch modules with a certified bound Lip_norm(f) on n tokens; exact types (a subclass may change forward).
BRANCH_BOUNDS = {
    nn.Linear: _linear_bound,
    KimL2Attention: _kim_bound,
    ContractiveL2Attention: _contractive_bound,
}


def branch_bound(f: nn.Module, n: int, norm: str = "2") -> float:
    """Certified ``Lip_norm(f)`` of a residual branch on ``n`` tokens; an error for a type with no bound."""
    fn = BRANCH_BOUNDS.get(type(f))
    if fn is None:
        raise TypeError(f"no certified Lipschitz bound for {type(f).__name__}; invertible branches: "
                        f"{', '.join(t.__name__ for t in BRANCH_BOUNDS)}")
    return fn(f, n, _check_norm(norm))


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
