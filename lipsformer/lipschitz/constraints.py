"""Keeping the certified bound under a target while training (LipsFormer Sec. 4.1: "constrain gamma and beta to
a pre-defined range", "constrain alpha to a pre-defined range").

After an optimizer step, :func:`keep_bound` projects the parameters the bound depends on:

1. CenterNorm gammas are clipped to ``[-gamma_max, gamma_max]`` (eq. 2's bound is ``D/(D-1) max|gamma|``);
2. a learnable tau is clipped to ``(0, tau_max]`` (Theorem 1 grows with tau);
3. with ``weight_max``, every Linear weight whose spectral norm exceeds it is scaled back to it (eq. 5's
   spectral normalisation, kept through training rather than only at initialisation);
3b. with ``conv_max``, every Conv2d whose certified operator norm at its input size (found by one forward pass
   of a zero image at the model's input size, then cached) exceeds it is scaled back to it
   (:func:`~lipsformer.lipschitz.layer_bounds.conv_bound`: the operator, padding and stride included, not the kernel);
3c. the weight of every :class:`~lipsformer.layers.ConvexResidual` is clipped to its ``alpha_range`` (within
   [0, 1], where the residual is a convex combination, 1-Lipschitz when its branch is);
4. if the network bound (eq. 19) is still above the target, every residual weight alpha is multiplied by one
   common factor ``s`` in (0, 1), the largest for which the bound meets the target (bisection): eq. 19 is
   increasing in each max|alpha|, so this is the smallest uniform shrink that works.

Without ``weight_max`` the weights are left free: their spectral norms enter the bound through the residual
branches, which the alpha shrink pays for; likewise convolutions without ``conv_max``. Convex residuals are not
shrunk in step 4 (their bound ``|1 - a| + a Lip(f)`` is not increasing in ``a`` when ``Lip(f) < 1``).
"""
import math
import weakref
from typing import Dict, Optional, Tuple

import torch
from torch import nn

from ..errors import Mistake, Stopped
from ..layers import AttentionKernel, CenterNorm, ConvexResidual, NormalizedConv2d, NormalizedLinear
from .bounds import lipschitz_report
from .layer_bounds import conv_bound, matrix_norm
from .registry import NoBoundError

# each convolution's input (H, W) in the model it was measured in (weak: dropped with the model)
_CONV_INPUT_HW: "weakref.WeakKeyDictionary[nn.Conv2d, Tuple[int, int]]" = weakref.WeakKeyDictionary()


class BoundUnreachable(Stopped, ValueError):
    """The target cannot be met by shrinking residual weights (the layers outside residuals exceed it)."""


class NotKeepable(Mistake, ValueError):
    """A model whose bound no projection can keep, whatever its weights: a module with no registered bound, or one
    whose bound is infinite by construction (dot-product attention, LayerNorm, SCSA with unnormalised v)."""


def check_keepable(model: nn.Module, what: str = "lipschitz_target") -> None:
    """Raise :class:`NotKeepable` naming the module when :func:`keep_bound` could never keep ``model``'s bound,
    before anything is trained or written. ``what`` names the setting that asks for it. Every infinite bound of the
    registry is one of construction (the module's kind), not of its weights, so the weights at hand tell."""
    try:
        report = lipschitz_report(model)
    except NoBoundError as e:
        raise NotKeepable(f"{what}: {e}") from None
    unbounded = [r for r in report.rows if not math.isfinite(r.lip)]
    if unbounded:
        first = unbounded[0]
        raise NotKeepable(f"{what}: {first.name} has no finite Lipschitz bound ({first.note or 'by construction'})"
                          f"{f', nor have {len(unbounded) - 1} more layers' if len(unbounded) > 1 else ''}; no "
                          f"projection can keep this model's bound: choose Lipschitz options that bound every layer, "
                          f"or unset {what}")


@torch.no_grad()
def conv_input_sizes(model: nn.Module,
                     input_size: Optional[Tuple[int, int, int]] = None) -> Dict[nn.Conv2d, Tuple[int, int]]:
    """The input (H, W) of every Conv2d of ``model``, recorded by hooks during one forward pass of a zero image of
    ``input_size`` (C, H, W; default: a LipsFormer's ``patch_embed`` size) in evaluation mode; cached per conv."""
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    if all(c in _CONV_INPUT_HW for c in convs):
        return {c: _CONV_INPUT_HW[c] for c in convs}
    if input_size is None:
        embed = model.patch_embed
        input_size = (embed.proj.in_channels, *embed.img_size)
    handles = [c.register_forward_pre_hook(lambda m, args: _CONV_INPUT_HW.__setitem__(m, tuple(args[0].shape[-2:])))
               for c in convs]
    was_training = model.training
    param = next(model.parameters())
    try:
        model.eval()
        # eagerly, even in a compiled model: tracing the hooks made dynamo guard on the weak dictionary's keys, and a
        # key collected with its model failed that guard (StopIteration, in CI); nor is a batch-1 graph compiled
        with torch.compiler.set_stance("force_eager"):
            model(torch.zeros(1, *input_size, dtype=param.dtype, device=param.device))
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    names = {c: n for n, c in model.named_modules() if isinstance(c, nn.Conv2d)}
    for c in convs:
        if c not in _CONV_INPUT_HW:
            # a 1x1 conv that the model applies as a matmul over channels: its norm is the same at every size
            if tuple(c.kernel_size) == (1, 1) and tuple(c.padding) == (0, 0) and tuple(c.stride) == (1, 1):
                _CONV_INPUT_HW[c] = (1, 1)
            else:
                raise ValueError(f"convolution {names[c]} was not called in a forward pass, so its input size, "
                                 f"which its operator norm depends on, is unknown")
    return {c: _CONV_INPUT_HW[c] for c in convs}


@torch.no_grad()
def keep_bound(model: nn.Module, target: float, gamma_max: float = 1.0, tau_max: Optional[float] = None,
               weight_max: Optional[float] = None, iters: int = 60, conv_max: Optional[float] = None) -> dict:
    """Project ``model``'s parameters so that its certified network bound is at most ``target``.

    Returns ``bound`` (after projection), ``bound_before`` (after clipping gamma and tau, before shrinking
    alpha) and ``alpha_scale`` (1.0 when nothing shrank).
    """
    if conv_max is not None:
        for conv, hw in conv_input_sizes(model).items():
            if isinstance(conv, NormalizedConv2d):  # normalised in its forward: nothing to project
                continue
            norm = conv_bound(conv, hw)
            if norm > conv_max:
                conv.weight.mul_(conv_max / norm)
    for m in model.modules():
        if isinstance(m, ConvexResidual):
            m.alpha.clamp_(*m.alpha_range)
        if isinstance(m, CenterNorm):
            m.weight.clamp_(-gamma_max, gamma_max)
        if isinstance(m, AttentionKernel) and isinstance(m.tau, torch.Tensor) and tau_max is not None:
            m.tau.clamp_(1e-6, tau_max)
        if isinstance(m, nn.Linear) and not isinstance(m, NormalizedLinear) and weight_max is not None:
            norm = matrix_norm(m.weight)
            if norm > weight_max:
                m.weight.mul_(weight_max / norm)
    report = lipschitz_report(model)
    before = report.log10_bound
    if before <= math.log10(target):
        return dict(bound=report.bound, bound_before=report.bound, alpha_scale=1.0)
    def shrinks(r) -> bool:  # a weighted residual x + alpha f(x), whose alpha step 4 scales
        return r.branch is not None and not isinstance(model.get_submodule(r.name), ConvexResidual)

    fixed = sum(math.log10(r.lip) for r in report.rows if not shrinks(r))
    residual = [r for r in report.rows if shrinks(r)]
    if not math.isfinite(before) or fixed > math.log10(target):
        why = ("a layer has no finite bound (" + "; ".join(sorted({r.note for r in report.rows if r.note})) + ")"
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
