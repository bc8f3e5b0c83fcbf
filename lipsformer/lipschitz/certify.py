"""Certified robustness from the Lipschitz bound, and an l2 PGD attack to check it against.

If a classifier's logits are L-Lipschitz in the l2 norm of its input, each logit difference ``z_i - z_j`` is
``sqrt(2) L``-Lipschitz, so no perturbation of l2 norm below ``margin / (sqrt(2) L)`` can change the prediction,
where ``margin`` is the top logit minus the runner-up (Tsuzuku, Sato & Sugiyama, "Lipschitz-margin training",
NeurIPS 2018, Proposition 1). That radius is the image's **certified radius**.

Radii are in the pixel space users perturb: the model's input image with pixels in [0, 1] (after the resize and
crop of its preprocessing), before the normalisation ``(x - mean) / std``. The normalisation is part of the map,
so ``L = network bound / min(std)``, the network bound taken from :func:`~lipsformer.lipschitz.bounds.lipschitz_report`
(the report users read), never assumed. A model without a finite bound certifies nothing, and says why.

The certificate is for the function actually computed. AttLip blocks are solved only approximately; under
:func:`~lipsformer.layers.attlip.solve_to_tolerance` each window's proximal residual is at most ``tol`` on every
input (or the forward refuses), so by AttLip Proposition 3 (1) each block's output is within ``D_l`` of the exact
1-Lipschitz prox, and the logits within ``D = sum_l D_l * L_after(l)`` of the exact network's
(:attr:`~lipsformer.lipschitz.bounds.LipschitzReport.defect`). For any ``x'`` with ``||x' - x|| <= r``, every logit
difference then moves by at most ``sqrt(2) (L r + 2 D)``, so the certified radius is

    r(x) = max(0, (margin(x) - 2 sqrt(2) D) / (sqrt(2) L)).

**The pairwise rule** (what :func:`predict_certified` returns; GloRo, LiResNet, BRONet and LipShiFT certify so). When
the network ends in a linear layer, ``z = W h(x) + b`` with ``h`` the backbone (bound ``L_b``, solver defect
``D_b``, both from the same report: :meth:`~lipsformer.lipschitz.bounds.LipschitzReport.backbone`, the
normalisation's ``1/std`` in ``L_b``), each difference ``z_c - z_j = (w_c - w_j) . h + b_c - b_j`` moves by at most
``||w_c - w_j|| (L_b r + 2 D_b)`` within ``r``, so

    r(x) = max(0, min_{j != c} (z_c - z_j - 2 ||w_c - w_j|| D_b) / (||w_c - w_j|| L_b))

for the predicted class ``c``. Since ``||w_c - w_j|| <= sqrt(2) ||W||``, ``L = L_b ||W||`` and ``D = D_b ||W||``, it is
never smaller than the global radius above (:func:`certified_radius`, which stays for models without a linear
last layer and is reported beside it as ``certified_radius_global``).

Margins are always taken from a float32 forward with autocast off (:func:`predict_certified`), whatever precision
the rest of evaluation runs in; a model whose weights are not float32 or wider certifies nothing.
"""
import contextlib
import functools
import math
import warnings
from dataclasses import dataclass, field
from typing import Dict, Iterator, Optional, Sequence, Tuple, Union

import torch
from timm.data import resolve_data_config
from torch import nn

from ..data.datasets import eval_data_config
from ..errors import Mistake, UsageError
from ..layers.attlip import AttLip, solve_to_tolerance
from .bounds import LipschitzReport, lipschitz_report
from .registry import NoBoundError

SQRT2 = math.sqrt(2.0)
PIXEL_TOLERANCE = 1.0 / 255  # one 8-bit grey level: float rounding and bfloat16 images pass, 0-255 pixels do not
NORMALISED_ONCE = ", normalised once with the model's mean and std"


class CertifyInputError(Mistake, ValueError):
    """Input the certificate API does not certify: images that are not a floating-point (batch, channels, height,
    width) batch of finite pixels in [0, 1] (after undoing the model's normalisation) with the model's channels, or
    a model whose weights are not finite."""


@dataclass(frozen=True)
class PixelLipschitz:
    """The Lipschitz bound of ``pixels in [0, 1] -> logits``: the network bound times the normalisation's."""

    network: float  # the report's network bound (eq. 19), on normalised inputs
    input_scale: float  # 1 / min(std): the normalisation's Lipschitz constant
    reason: str = ""  # why the bound is infinite ("" when finite)
    defect: float = 0.0  # ||computed - exact logits||_2 per image (the report's defect): 2 sqrt(2) D off each margin
    # the pairwise rule, when the network ends in a linear layer: L_b and D_b of its input (on normalised inputs,
    # as ``network``) and ``gaps[c, j] = ||w_c - w_j||`` (float64, rounded up); None: the global rule only
    backbone: float = math.inf
    backbone_defect: float = 0.0
    gaps: Optional[torch.Tensor] = field(default=None, compare=False, repr=False)

    @property
    def bound(self) -> float:
        return self.network * self.input_scale

    @property
    def finite(self) -> bool:
        return math.isfinite(self.bound)

    @property
    def backbone_bound(self) -> float:
        """``L_b`` in pixel space: the backbone's bound times the normalisation's."""
        return self.backbone * self.input_scale


def head_gaps(weight: torch.Tensor) -> torch.Tensor:
    """``||w_c - w_j||`` for every pair of rows of a (classes, features) weight, in float64, each rounded up by the
    float64 computation's relative error bound, charged as ``(features + 2) eps`` with eps = 2^-52 (about twice what
    the differences, their squares, their sum in any order and the square root can lose). By ``torch.cdist``
    without the Gram-matrix shortcut (whose cancellation has no relative bound): no (classes, classes, features)
    temporary, which at 1000 classes and 768 features would take 6.1 GB and would dominate ``pixel_lipschitz`` of
    the certifiable Swin-T (what every ``predict_certified`` call without a precomputed bound computes)."""
    w = weight.detach().to(torch.float64)
    gaps = torch.cdist(w, w, compute_mode="donot_use_mm_for_euclid_dist")
    return gaps * (1 + (w.shape[1] + 2) * torch.finfo(torch.float64).eps)


def normalization(model: nn.Module) -> Tuple[torch.Tensor, torch.Tensor]:
    """The (mean, std) of ``model``'s preprocessing, as (C, 1, 1) tensors (timm's data config of the model)."""
    cfg = resolve_data_config({}, model=model)
    mean, std = (torch.tensor(cfg[k], dtype=torch.float32).view(-1, 1, 1) for k in ("mean", "std"))
    return mean, std


def pixel_lipschitz(model: nn.Module, report: Optional[LipschitzReport] = None) -> PixelLipschitz:
    """``L`` of the certificate: :func:`lipschitz_report`'s bound times ``1 / min(std)`` of the model's
    preprocessing; a model with a non-finite weight is a :class:`CertifyInputError`."""
    _check_finite(model)
    report = lipschitz_report(model) if report is None else report
    _, std = normalization(model)
    network = report.bound
    reason = ""
    if not math.isfinite(network):
        notes = sorted({r.note for r in report.rows if not math.isfinite(r.lip) and r.note})
        reason = ("the certified bound is infinite: " + "; ".join(notes) if notes
                  else f"the certified bound exceeds the float range (1e{report.log10_bound:.0f})")
    pairwise = {}
    if report.head is not None and math.isfinite(network):
        backbone = report.backbone()
        pairwise = dict(backbone=backbone.bound, backbone_defect=backbone.defect, gaps=head_gaps(report.head))
    return PixelLipschitz(network, 1.0 / float(std.min()), reason, report.defect, **pairwise)


def input_channels(model: nn.Module) -> int:
    """The channels ``model`` takes: its first conv's (timm's ``first_conv``), else its data config's."""
    model = getattr(model, "module", model)  # a DDP-wrapped model
    first = (getattr(model, "pretrained_cfg", None) or {}).get("first_conv")
    try:
        channels = getattr(model.get_submodule(first), "in_channels", None) if isinstance(first, str) else None
    except AttributeError:
        channels = None
    return int(channels or resolve_data_config({}, model=model)["input_size"][0])


def check_images(images, model: nn.Module, mean: torch.Tensor, std: torch.Tensor, normalised: bool = True,
                 what: str = "images") -> None:
    """A :class:`CertifyInputError` naming what to change unless ``images`` is a floating-point (B, C, H, W) batch,
    B, H, W >= 1, C the model's input channels, of finite values that are pixels in [0, 1] within
    :data:`PIXEL_TOLERANCE`: after undoing the normalisation ``(x - mean) / std`` where ``normalised``, as they are
    otherwise. uint8 and 0-255 float pixels are named as such; a NaN or Inf pixel is refused, never a NaN radius."""
    if not isinstance(images, torch.Tensor):
        raise CertifyInputError(f"{what} must be a torch.Tensor of shape (batch, channels, height, width), got a "
                                f"{type(images).__name__}")
    if images.dim() != 4:
        hint = ": add the batch dimension (images.unsqueeze(0))" if images.dim() == 3 else ""
        raise CertifyInputError(f"{what} must be 4-D (batch, channels, height, width), got shape "
                                f"{tuple(images.shape)}{hint}")
    if images.numel() == 0:
        raise CertifyInputError(f"{what} are empty (shape {tuple(images.shape)}): give at least one image")
    then = ", then normalise with the model's mean and std" if normalised else ""
    if images.dtype == torch.uint8:
        raise CertifyInputError(f"{what} are uint8, pixels look like 0-255: convert to float and divide by 255{then}")
    if not images.is_floating_point():
        raise CertifyInputError(f"{what} must be floating point (pixels in [0, 1]), got {images.dtype}")
    channels = input_channels(model)
    if images.shape[1] != channels:
        raise CertifyInputError(f"{what} have {images.shape[1]} channels, the model takes {channels} (shape "
                                f"{tuple(images.shape)}): give (batch, {channels}, height, width)")
    if {mean.shape[0], std.shape[0]} - {1, channels}:
        raise CertifyInputError(f"the model's normalisation has {mean.shape[0]} channels (mean "
                                f"{mean.flatten().tolist()}, std {std.flatten().tolist()}) and its input {channels}: "
                                f"set mean and std for {channels} (pretrained_cfg_overlay)")
    x = images.detach().float()
    finite = torch.isfinite(x)
    if not bool(finite.all()):
        first = int((~finite).flatten(1).any(1).nonzero()[0])
        raise CertifyInputError(f"{what} hold {int((~finite).sum())} NaN or Inf value(s), the first in image {first}: "
                                f"nothing is certified for them; drop or repair those images")
    pixels = x * std.to(x) + mean.to(x) if normalised else x
    lo, hi = float(pixels.min()), float(pixels.max())
    if -PIXEL_TOLERANCE <= lo and hi <= 1 + PIXEL_TOLERANCE:
        return
    if any(low >= -PIXEL_TOLERANCE and high > 2 for low, high in ((lo, hi), (float(x.min()), float(x.max())))):
        raise CertifyInputError(f"{what}: pixels look like 0-255 (values up to {max(hi, float(x.max())):.4g}): divide "
                                f"by 255{' before normalising' if normalised else ''}; radii are in [0, 1] pixel space")
    undone = " after undoing the model's normalisation" if normalised else ""
    raise CertifyInputError(f"{what}{undone} span [{lo:.4g}, {hi:.4g}], outside the pixel range [0, 1] (tolerance "
                            f"{PIXEL_TOLERANCE:.4g}): give pixels in [0, 1]"
                            f"{NORMALISED_ONCE if normalised else ''}")


def logit_margin(logits: torch.Tensor) -> torch.Tensor:
    """Top logit minus the runner-up, per row (0 for a tie)."""
    top2 = logits.float().topk(2, dim=-1).values
    return top2[:, 0] - top2[:, 1]


def certified_radius(logits: torch.Tensor, lipschitz: Union[float, PixelLipschitz]) -> torch.Tensor:
    """Per image, ``max(0, (margin - 2 sqrt(2) D) / (sqrt(2) L))``: no l2 perturbation of smaller norm changes
    the prediction of the computed network (Tsuzuku et al. 2018, with the solver defect ``D`` of the module
    docstring; ``D = 0`` for a float ``L``). 0 everywhere when ``L`` is infinite."""
    L = lipschitz.bound if isinstance(lipschitz, PixelLipschitz) else float(lipschitz)
    defect = lipschitz.defect if isinstance(lipschitz, PixelLipschitz) else 0.0
    margin = logit_margin(logits).double()
    if not math.isfinite(L):
        return torch.zeros_like(margin)
    return ((margin - 2 * SQRT2 * defect) / (SQRT2 * L)).clamp_min(0.0)


def pairwise_radius(logits: torch.Tensor, lipschitz: PixelLipschitz) -> torch.Tensor:
    """Per image, the pairwise rule's radius (module docstring) for the predicted class ``c``:
    ``max(0, min_{j != c} (z_c - z_j - 2 g_cj D_b) / (g_cj L_b))``, ``g_cj = ||w_c - w_j||``. A class whose row equals
    ``c``'s never overtakes it unless it ties now (its logit difference is constant). Without a linear last layer
    (``lipschitz.gaps`` None) it is :func:`certified_radius`."""
    if lipschitz.gaps is None or not math.isfinite(lipschitz.backbone_bound):
        return certified_radius(logits, lipschitz)
    z = logits.detach().double()
    c = z.argmax(-1)
    gaps = lipschitz.gaps.to(z.device)[c]  # (B, classes)
    diff = z.gather(1, c[:, None]) - z
    radius = torch.where(gaps > 0, (diff - 2 * gaps * lipschitz.backbone_defect) / (gaps * lipschitz.backbone_bound),
                         torch.where(diff > 0, math.inf, 0.0))
    radius.scatter_(1, c[:, None], math.inf)  # j != c
    return radius.amin(1).clamp_min(0.0)


@contextlib.contextmanager
def evaluation_mode(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` in eval mode inside; afterwards every module is back in the mode it was in (a model in train mode
    with frozen parts in eval mode, as training keeps them, comes back so)."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for m, mode in modes:  # parents first: a child's own mode is set after its parent's
            if m.training != mode:
                m.train(mode)


def _in_evaluation_mode(fn):
    """``fn(model, ...)`` run under :func:`evaluation_mode` of its ``model``."""
    @functools.wraps(fn)
    def wrapper(model, *args, **kwargs):
        with evaluation_mode(model):
            return fn(model, *args, **kwargs)
    return wrapper


def predict_certified(model: nn.Module, images: torch.Tensor, lipschitz: Optional[PixelLipschitz] = None,
                      max_steps: int = 1000) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Predictions and certified radii of a batch of normalised ``images``: ``(logits, pred, radius)``.
    ``images`` must be pixels in [0, 1] normalised with the model's mean and std (:func:`check_images`).

    The one call behind ``eval.py --certify-eps``. The forward runs in eval mode (the model is given back in the
    mode it came in), in float32 with autocast off (an Accelerate-prepared model's mixed-precision wrapper is
    bypassed), with every AttLip solved to its tolerance (:func:`~lipsformer.layers.attlip.solve_to_tolerance`,
    raising past ``max_steps``), so the radius is sound for the logits returned: the pairwise rule's
    (:func:`pairwise_radius`; ``certified_radius(logits, L)`` is the global rule's). ``lipschitz`` defaults to
    :func:`pixel_lipschitz` of ``model``. Where the bound is infinite nothing is certified (every radius 0) and a
    ``UserWarning`` says why (e.g. an attention without a finite bound).
    """
    bare = getattr(model, "module", model)
    with evaluation_mode(bare):
        _check_classes(bare)
        _check_float32(bare)
        check_images(images, bare, *normalization(bare))
        L = pixel_lipschitz(bare) if lipschitz is None else lipschitz  # the eval-mode map's bound, its divisors
        out = _certified_forward(bare, images, L, max_steps)           # the ones the forward divides by
    if not L.finite:
        warnings.warn(f"predict_certified: nothing is certified (every radius is 0): {L.reason}", stacklevel=2)
    return out


def _check_float32(bare: nn.Module) -> None:
    """Weights a certificate can be computed for: float32 or wider, and finite (a NaN weight is a NaN radius)."""
    dtypes = {p.dtype for p in bare.parameters() if p.is_floating_point()}
    if any(torch.finfo(d).bits < 32 for d in dtypes):
        raise NoBoundError(f"certificates need float32 margins; the model's weights are {sorted(map(str, dtypes))}: "
                           f"load it in float32 (autocast for the rest of evaluation is fine)")
    _check_finite(bare)


def _check_classes(bare: nn.Module) -> None:
    """A CertifyInputError unless ``bare`` scores at least two classes: a radius is a margin between two logits
    (one logit has no runner-up, ``num_classes=0`` gives pooled features, not logits)."""
    classes = getattr(bare, "num_classes", None)
    if classes is not None and classes < 2:
        what = "pooled features, not logits" if classes == 0 else "one logit, with no runner-up to keep a margin from"
        raise CertifyInputError(f"the model has num_classes={classes}: it outputs {what}; a certified radius needs a "
                                f"classifier of at least 2 classes")


def _check_finite(model: nn.Module) -> None:
    """A CertifyInputError naming the first parameter of ``model`` with a NaN or Inf (whose bound and radii would be
    NaN)."""
    for name, p in model.named_parameters():
        bad = int(p.numel() - torch.isfinite(p.detach()).sum()) if p.is_floating_point() else 0
        if bad:
            raise CertifyInputError(f"the model's {name} holds {bad} non-finite value(s) (NaN or Inf): no bound holds "
                                    f"for it; load finite weights")


def _certified_forward(bare: nn.Module, images: torch.Tensor, L: PixelLipschitz,
                       max_steps: int = 1000) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`predict_certified`'s ``(logits, pred, radius)`` of ``bare`` in eval mode, under the bound ``L``."""
    forward = getattr(bare, "_original_forward", bare.forward)  # Accelerate keeps the forward before autocast
    dtype = torch.float64 if any(p.dtype == torch.float64 for p in bare.parameters()) else torch.float32
    with torch.no_grad(), torch.autocast(images.device.type, enabled=False), solve_to_tolerance(bare, max_steps):
        logits = forward(images.to(dtype)).to(dtype)
    return logits, logits.argmax(-1), pairwise_radius(logits, L)


def certified_accuracy(radius: torch.Tensor, correct: torch.Tensor, eps: Sequence[float]) -> Dict[float, float]:
    """% of images predicted correctly whose certified radius exceeds each ``eps`` (non-increasing in eps)."""
    n = max(int(correct.numel()), 1)
    return {float(e): 100.0 * float((correct.bool() & (radius > e)).sum()) / n for e in eps}


@_in_evaluation_mode
def pgd_l2(model: nn.Module, pixels: torch.Tensor, labels: torch.Tensor, eps: Union[float, torch.Tensor],
           mean: torch.Tensor, std: torch.Tensor, steps: int = 20, restarts: int = 3, step_size: Optional[float] = None,
           seed: int = 0) -> torch.Tensor:
    """l2 PGD (Madry et al. 2018) on pixels in [0, 1]: per image, whether some perturbation of norm <= ``eps``
    (a float or one per image) was found that makes the prediction differ from ``labels``. ``pixels`` are checked
    as :func:`check_images` checks images, without the normalisation.

    Each restart starts at a random point of the ball and ascends the margin loss ``max_{j != y} z_j - z_y``
    (Carlini & Wagner) with normalised gradient steps of ``step_size`` (default ``2.5 eps / steps``), projected
    back onto the ball and the [0, 1] box; an image counts as fooled as soon as any iterate changes its prediction.
    """
    check_images(pixels, model, mean, std, normalised=False, what="pixels")
    b = pixels.shape[0]
    eps_t = torch.as_tensor(eps, dtype=pixels.dtype, device=pixels.device).expand(b).reshape(b, 1, 1, 1)
    alpha = eps_t * 2.5 / steps if step_size is None else torch.full_like(eps_t, step_size)
    mean, std = mean.to(pixels), std.to(pixels)
    gen = torch.Generator(device=pixels.device).manual_seed(seed)
    fooled = torch.zeros(b, dtype=torch.bool, device=pixels.device)

    def project(delta):
        norm = delta.flatten(1).norm(dim=1).view(b, 1, 1, 1)
        delta = delta * torch.clamp(eps_t / norm.clamp_min(1e-12), max=1.0)
        return (pixels + delta).clamp(0, 1) - pixels

    for _ in range(restarts):
        direction = torch.randn(pixels.shape, generator=gen, device=pixels.device, dtype=pixels.dtype)
        direction = direction / direction.flatten(1).norm(dim=1).view(b, 1, 1, 1)
        radius = torch.rand(b, generator=gen, device=pixels.device, dtype=pixels.dtype).view(b, 1, 1, 1)
        delta = project(direction * radius * eps_t)
        for step in range(steps + 1):
            delta.requires_grad_(True)
            logits = model((pixels + delta - mean) / std)
            fooled |= logits.argmax(-1) != labels
            if step == steps or bool(fooled.all()):
                break
            true = logits.gather(1, labels[:, None]).squeeze(1)
            other = logits.scatter(1, labels[:, None], -math.inf).amax(1)
            (grad,) = torch.autograd.grad((other - true).sum(), delta)
            with torch.no_grad():
                g = grad / grad.flatten(1).norm(dim=1).clamp_min(1e-12).view(b, 1, 1, 1)
                delta = project(delta.detach() + alpha * g)
        if bool(fooled.all()):
            break
    return fooled.detach()


@_in_evaluation_mode
def certify_dataset(model: nn.Module, loader, accelerator, label_sets: Sequence[Sequence[int]],
                    certify_eps: Sequence[float] = (), attack_eps: Sequence[float] = (), attack_steps: int = 20,
                    attack_restarts: int = 3, report: Optional[LipschitzReport] = None) -> dict:
    """Certified and PGD-attacked accuracy (%) of an ``(images, index)`` loader of normalised images whose
    allowed labels are ``label_sets[index]`` (images with no label are left out, as in scoring).

    An image counts as certified at ``eps`` when its top-1 is allowed and its certified radius exceeds ``eps``; as
    attacked-correct when its top-1 is allowed and the attack at ``eps`` did not change it. So for a sound bound,
    certified <= attacked <= clean at every eps. Returns ``lipschitz`` (pixel-space L), ``reason`` (why nothing
    certifies, or ""), ``certified`` (the pairwise rule, :func:`pairwise_radius`), ``certified_global`` (the global
    rule, :func:`certified_radius`) and ``attacked`` ({eps: %}), ``rule`` (``pairwise``, or ``global`` when the
    network does not end in a linear layer) with ``backbone_lipschitz`` (its ``L_b`` in pixel space), ``count``,
    ``radius`` and ``radius_global`` (per image, by index) and ``solver_steps`` (per AttLip block, the most gradient
    evaluations its certified solve took on any window).
    """
    bare = accelerator.unwrap_model(model)
    _check_float32(bare)
    L = pixel_lipschitz(bare, report)  # in eval mode (the decorator): the bound of the map certified below
    built = tuple(eval_data_config(bare)["input_size"][1:])
    mean, std = normalization(bare)
    mean, std = mean.to(accelerator.device), std.to(accelerator.device)
    solved = [(name, m) for name, m in bare.named_modules() if isinstance(m, AttLip)]
    steps: Dict[str, int] = {}  # per AttLip block, the most gradient evaluations any window of any batch took
    keys, radii, globals_, corrects, robusts, valid = [], [], [], [], [], []
    for batch in loader:  # (images, index) or collate_skip_failed's (images, index, failed): stand-ins come last
        images, index = batch[0], batch[1]
        if images is None:
            continue
        check_images(images, bare, mean, std)
        images = images.float()
        if tuple(images.shape[-2:]) != built:  # strict_img_size=False runs other sizes; the bound is not theirs
            raise NoBoundError(f"the certified bound is for {built[0]}x{built[1]} inputs, the model was given "
                               f"{images.shape[-2]}x{images.shape[-1]}: build it at that size (img_size, "
                               f"eval.py --img-size) to certify there")
        stand_ins = len(batch[2]) if len(batch) > 2 else 0
        read = torch.arange(len(images), device=images.device) < len(images) - stand_ins
        logits, pred, radius = _certified_forward(bare, images, L)  # the result's reason says why, not a warning
        radius_global = certified_radius(logits, L)
        for name, m in solved:
            steps[name] = max(steps.get(name, 0), m.last_solve.steps)
        correct = torch.tensor([int(p) in set(label_sets[int(i)]) for p, i in zip(pred.tolist(), index.tolist())],
                               device=images.device)
        robust = torch.zeros(len(pred), len(attack_eps), dtype=torch.bool, device=images.device)
        pixels = (images * std + mean).clamp(0, 1)
        for k, e in enumerate(attack_eps):
            if bool(correct.any()):
                fooled = pgd_l2(model, pixels[correct], pred[correct], e, mean, std, attack_steps, attack_restarts)
                robust[correct.nonzero().squeeze(1), k] = ~fooled
        index, radius, radius_global, correct, robust, read = accelerator.gather_for_metrics(
            (index.to(images.device), radius.to(images.device), radius_global.to(images.device), correct, robust, read))
        keys.append(index.cpu())
        radii.append(radius.cpu())
        globals_.append(radius_global.cpu())
        corrects.append(correct.cpu())
        robusts.append(robust.cpu())
        valid.append(read.cpu())
    if not keys:
        raise ValueError("certify_dataset: the loader gave no readable image")
    read = torch.cat(valid)
    index, radius, radius_global, correct, robust = (torch.cat(t)[read] for t in (keys, radii, globals_, corrects,
                                                                                  robusts))
    scored = torch.tensor([bool(label_sets[int(i)]) for i in index], dtype=torch.bool)
    count = max(int(scored.sum()), 1)
    by_index = torch.zeros(len(label_sets), dtype=torch.double)  # unreadable images keep 0: nothing certified
    by_index[index] = radius
    global_by_index = torch.zeros(len(label_sets), dtype=torch.double)
    global_by_index[index] = radius_global
    return dict(lipschitz=L.bound, network_bound=L.network, input_scale=L.input_scale, reason=L.reason,
                defect=L.defect, margins="float32",
                certified=certified_accuracy(radius[scored], correct[scored], certify_eps),
                certified_global=certified_accuracy(radius_global[scored], correct[scored], certify_eps),
                rule="pairwise" if L.gaps is not None else "global",
                backbone_lipschitz=L.backbone_bound if L.gaps is not None else None,
                attacked={float(e): 100.0 * float(robust[scored, k].sum()) / count for k, e in enumerate(attack_eps)},
                count=int(scored.sum()), radius=by_index, radius_global=global_by_index, solver_steps=steps)


def parse_eps(values: Sequence[str], flag: str) -> Tuple[float, ...]:
    """Radii given on a command line: non-negative finite numbers, else a UsageError naming the flag and value."""
    out = []
    for v in values:
        try:
            e = float(v)
        except ValueError:
            raise UsageError(f"{flag} takes non-negative numbers (l2 radii in [0, 1] pixel space), got {v!r}") from None
        if not math.isfinite(e) or e < 0:
            raise UsageError(f"{flag} takes non-negative numbers (l2 radii in [0, 1] pixel space), got {v!r}")
        out.append(e)
    return tuple(out)
