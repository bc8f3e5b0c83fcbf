"""Lipschitz-margin training (Tsuzuku, Sato & Sugiyama, "Lipschitz-Margin Training", NeurIPS 2018).

A classifier with l2 Lipschitz bound L whose logit margin at x exceeds sqrt(2) L eps keeps its prediction under
every perturbation of norm at most eps. Training for that margin: the true-class logit is lowered by
sqrt(2) L eps before the usual loss (for softmax losses the same as raising every other logit by it, their
Algorithm 1), so the loss only stops pushing once the margin is certified at eps.
"""
import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..config import KEEP_BOUND_KEYS, MARGIN_KEYS


class LipschitzMarginLoss(nn.Module):
    """``criterion(logits - sqrt(2) * bound * eps * onehot(target), target)``.

    ``target`` may be class indices or soft targets (mixup / cutmix, label smoothing): then each logit is
    lowered by ``sqrt(2) * bound * eps`` times its target probability. ``bound`` is a fixed target, or the
    current certified bound of the model (set by :func:`follow_bound` whenever the bound is kept); both in the
    pixel space ``eps`` is measured in (the input normalisation's ``1 / std`` included).
    """

    def __init__(self, criterion: Callable, eps: float, bound: float = 1.0):
        super().__init__()
        if eps < 0 or not math.isfinite(eps):
            raise ValueError(f"the margin's eps must be a finite number >= 0, got {eps}")
        self.criterion, self.eps, self.bound = criterion, float(eps), float(bound)

    @property
    def margin(self) -> float:
        return math.sqrt(2.0) * self.bound * self.eps

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        weights = target.to(logits.dtype) if target.is_floating_point() else F.one_hot(target, logits.shape[-1]).to(
            logits.dtype)
        return self.criterion(logits - self.margin * weights, target)

    def extra_repr(self) -> str:
        return f"eps={self.eps:g}, bound={self.bound:g}"


def follow_bound(keep: Callable[[], dict], criterion: LipschitzMarginLoss,
                 input_scale: float = 1.0) -> Callable[[], dict]:
    """``keep`` (a :func:`lipsformer.lipschitz.constraints.keep_bound` call) that also hands the bound it kept to
    the margin loss, so the margin is sqrt(2) L eps with L the model's current certified bound in pixel space:
    the model's bound times ``input_scale``, the input normalisation's ``1 / min(std)``."""

    def kept() -> dict:
        info = keep()
        if not math.isfinite(info["bound"]):
            raise ValueError("the Lipschitz-margin loss needs a finite certified bound; this model has none "
                             "(set margin_bound to a fixed value, or use layers with finite bounds)")
        criterion.bound = info["bound"] * input_scale
        return info

    return kept


def margin_criterion(criterion: Callable, eps: float, bound: Optional[float]) -> Callable:
    """``criterion`` wrapped in :class:`LipschitzMarginLoss` when ``eps > 0`` (``bound=None``: followed, start 1)."""
    if not eps:
        return criterion
    return LipschitzMarginLoss(criterion, eps, 1.0 if bound is None else bound)


def keep_bound_args(cfg) -> dict:
    """:func:`lipsformer.lipschitz.constraints.keep_bound`'s keyword arguments from the config: the keys declared
    with ``keep_bound=`` (:data:`lipsformer.config.KEEP_BOUND_KEYS`)."""
    return {arg: getattr(cfg, key) for key, arg in KEEP_BOUND_KEYS.items()}


def keep_settings(cfg) -> list:
    """The config keys the bound keeping and the margin it sets depend on, by value: bound keeping's, then the
    margin's, each in the fields' order (checkpoints compare this list as written)."""
    return [getattr(cfg, key) for key in (*KEEP_BOUND_KEYS, *MARGIN_KEYS)]


def kept_record(step: int, bound: float, criterion: Callable, cfg) -> dict:
    """What train.py's checkpoints keep of a projection of the bound: its step and bound, the margin loss's L it
    set, and the settings it was kept under (:func:`restore_kept`)."""
    margin = criterion.bound if isinstance(criterion, LipschitzMarginLoss) else None
    return dict(step=step, bound=bound, margin=margin, settings=keep_settings(cfg))


def restore_kept(kept: Optional[dict], criterion: Callable, cfg) -> bool:
    """On resume: the last projection's margin L as the uninterrupted run left it (whatever step it was kept at;
    with ``lipschitz_every_steps`` > 1 not necessarily the checkpoint's), so the run goes on bit for bit instead of
    projecting again; False when the checkpoint records none or other settings."""
    if kept is None or kept["settings"] != keep_settings(cfg):
        return False
    if kept["margin"] is not None and isinstance(criterion, LipschitzMarginLoss):
        criterion.bound = kept["margin"]
    return True
