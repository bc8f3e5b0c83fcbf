"""Keeping the certified bound under a target while training (LipsFormer Sec. 4.1: "constrain gamma and beta to
a pre-defined range", "constrain alpha to a pre-defined range").

After an optimizer step, :func:`keep_bound` projects the parameters the bound depends on:

1. CenterNorm gammas are clipped to ``[-gamma_max, gamma_max]`` (eq. 2's bound is ``D/(D-1) max|gamma|``);
2. a learnable tau is clipped to ``(0, tau_max]`` (Theorem 1 grows with tau);
3. with ``weight_max``, every Linear weight whose spectral norm exceeds it is scaled back to it (eq. 5's
   spectral normalisation, kept through training rather than only at initialisation);
4. if the network bound (eq. 19) is still above the target, every residual weight alpha is multiplied by one
   common factor ``s`` in (0, 1), the largest for which the bound meets the target (bisection): eq. 19 is
   increasing in each max|alpha|, so this is the smallest uniform shrink that works.

Without ``weight_max`` the weights are left free: their spectral norms enter the bound through the residual
branches, which the alpha shrink pays for. Convolutions are never rescaled (their operator norm depends on the
input size).
"""
import math
from typing import Optional

import torch
from torch import nn

from ..layers import AttentionKernel, CenterNorm
from .bounds import lipschitz_report, matrix_norm


class BoundUnreachable(ValueError):
    """The target cannot be met by shrinking residual weights (the layers outside residuals exceed it)."""


@torch.no_grad()
def keep_bound(model: nn.Module, target: float, gamma_max: float = 1.0, tau_max: Optional[float] = None,
               weight_max: Optional[float] = None, iters: int = 60) -> dict:
    """Project ``model``'s parameters so that its certified network bound is at most ``target``.

    Returns ``bound`` (after projection), ``bound_before`` (after clipping gamma and tau, before shrinking
    alpha) and ``alpha_scale`` (1.0 when nothing shrank).
    """
    for m in model.modules():
        if isinstance(m, CenterNorm):
            m.weight.clamp_(-gamma_max, gamma_max)
        if isinstance(m, AttentionKernel) and isinstance(m.tau, torch.Tensor) and tau_max is not None:
            m.tau.clamp_(1e-6, tau_max)
        if isinstance(m, nn.Linear) and weight_max is not None:
            norm = matrix_norm(m.weight)
            if norm > weight_max:
                m.weight.mul_(weight_max / norm)
    report = lipschitz_report(model)
    before = report.log10_bound
    if before <= math.log10(target):
        return dict(bound=report.bound, bound_before=report.bound, alpha_scale=1.0)
    fixed = sum(math.log10(r.lip) for r in report.rows if r.branch is None)
    residual = [r for r in report.rows if r.branch is not None]
    if not math.isfinite(before) or fixed > math.log10(target):
        why = ("a layer has no finite bound (" + "; ".join(sorted({r.note for r in residual if r.note})) + ")"
               if not math.isfinite(before) else f"the layers outside residuals alone give 1e{fixed:.1f}")
        raise BoundUnreachable(f"cannot keep the Lipschitz bound under {target:g}: {why}")

    def log10_bound(s: float) -> float:  # eq. 19 with every alpha scaled by s
        return fixed + sum(math.log10(1.0 + s * r.alpha * r.branch) for r in residual)

    aim = math.log10(target) + math.log10(1.0 - 1e-4)  # margin for the alphas' float32 rounding
    lo, hi = 0.0, 1.0
    for _ in range(iters):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if log10_bound(mid) <= aim else (lo, mid)
    for r in residual:
        model.get_submodule(r.name).alpha.mul_(lo)
    return dict(bound=10.0 ** log10_bound(lo), bound_before=report.bound, alpha_scale=lo)
