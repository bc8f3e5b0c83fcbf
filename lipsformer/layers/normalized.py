"""Spectrally normalised linear maps: the weight divided by its largest singular value (computed once per change
of the weight: verified at evaluation, a Lanczos estimate within about 1e-9 in training; see :class:`_RawWeight`),
with the gradient of that divisor (``u v^T``).

Keeping a layer's norm at 1 by projection (rescaling the weight after each optimizer step, as
:func:`lipsformer.lipschitz.constraints.keep_bound` does) leaves the gradient blind to the constraint: the step
pushes the norm up and the projection takes it back. Dividing inside the graph (as 1-Lipschitz CNNs do) lets the
gradient see the normalisation, so it only moves the weight along directions that keep the map's scale, and the
layer's top singular direction is norm-preserving at every step.

The normalised weight *is* the module's ``weight``: every reader (``forward``, fused paths that read
``module.weight``, the certified bounds in :mod:`lipsformer.lipschitz.bounds`) sees the same matrix. The parameter
(``raw_weight``, saved as ``weight`` so that state dicts keep ``nn.Linear``'s keys) is free; its scale is
irrelevant. Writes to ``weight`` in place would change a temporary: write to ``raw_weight``.
"""
import math
from typing import Dict

import torch
import torch.nn.functional as F
from timm.layers import register_notrace_module
from torch import nn

from .spectral import UNIT_ROUNDOFF64, estimated_top_triple, top_singular_triple

# ``linear=`` choice -> whether its normalised layers train with power iteration (None: plain layers)
LINEARS = {"plain": None, "normalized": False, "normalized_power": True}


def _divisor(w: torch.Tensor, triple) -> torch.Tensor:
    """The largest singular value of ``w`` from its ``(sigma, u, v)`` (:func:`top_singular_triple`, computed outside
    the graph), in ``w``'s dtype, as a divisor that autograd follows: where ``w`` needs a gradient, the value sigma
    with the exact gradient ``d sigma / dW = u v^T`` (the derivative of a simple largest singular value), through one
    bilinear form instead of back through the Gram matrix and its eigendecomposition (the same gradient, at a
    fraction of the cost)."""
    sigma, u, v = triple
    sigma = sigma.to(w.dtype).clamp_min(torch.finfo(w.dtype).tiny)
    if torch.is_grad_enabled() and w.requires_grad:
        t = u.to(w.dtype) @ w.flatten(1) @ v.to(w.dtype)
        sigma = sigma + (t - t.detach())
    return sigma


class _RawWeight:
    """The parameter behind a normalised ``weight`` (stored as ``weight`` in ``_parameters`` and state dicts).

    The divisor (the top singular triple) is computed once per change of the raw weight and reused, in training and
    in eval mode: at inference the weights do not move, and in training the bound keeping after an optimizer step
    (:meth:`certified_norm`) computes what the next forward divides by, and the forwards of an accumulation window
    or a gradient-checkpointing recomputation share it. In eval mode it is the verified triple
    (:func:`top_singular_triple`); in training, where nothing is certified, Lanczos's estimate without the Gram
    matrix (:func:`estimated_top_triple`, within about 1e-9 of the norm, the same bits on every call, 2-4 times
    cheaper at Swin-T's sizes), and :meth:`certified_norm` charges the difference. The cache is keyed on the
    parameter's storage, version counter (bumped by in-place optimizer steps,
    ``load_state_dict``, ``copy_`` under ``no_grad``), dtype, device, shape, strides and a checksum of its values
    (:func:`fingerprint`: writes that bypass the version counter are seen too), holds an alias of that storage, and
    is dropped by ``.to()`` / ``.half()`` (``_apply``) and by every change between train and eval mode;
    :meth:`certified_norm` fills it for the weight as it is now (with the verified triple it computes, where that is
    this mode's divisor). The divisor's gradient is the exact one
    (:func:`_divisor`: ``u v^T``, the top singular vectors), and gradients with respect to the input (attacks) do not
    involve it."""

    _divisor_cache = None  # (storage fingerprint, alias of the raw weight, (sigma, u, v)) of this mode's divisor
    # training with power iteration (``power_iteration=True``, ``linear="normalized_power"``; opt-in: under Adam at
    # lr 5e-3 on the digits configs one iteration per step lagged the moving top direction, layers reached norm 1.9
    # in training after two steps and bound keeping at 1.01 refused the run): the buffer ``weight_u`` is the vector the
    # next iteration starts from (zeros: none yet, the first one is the exact top singular vector); ``_power`` holds
    # (fingerprint, alias, u) of the iterate in use, computed once per change of the raw weight
    power_iteration = False
    _power = None
    _start_valid = False

    def __init__(self, *args, power_iteration: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.power_iteration = power_iteration
        if power_iteration:
            w = self.raw_weight
            self.register_buffer("weight_u", torch.zeros(w.shape[0], dtype=w.dtype, device=w.device),
                                 persistent=False)  # saved by train.py's checkpoints (PowerIterationState)

    @property
    def raw_weight(self) -> nn.Parameter:
        return self._parameters["weight"]

    @property
    def weight(self) -> torch.Tensor:
        w = self._parameters.get("weight")
        if w is None:  # during nn.Module.__init__, before the parameter is registered
            raise AttributeError("weight")
        if self.training and self.power_iteration:
            return w / self._power_divisor(w)
        return w / _divisor(w, self._divisor_triple(w))

    def _power_divisor(self, w: torch.Tensor) -> torch.Tensor:
        """Training: ``||W^T u||`` (= u^T W v with v = W^T u / ||W^T u||, both outside the graph), u advanced by one
        power iteration per change of ``w`` (not per forward: gradient accumulation and recomputation under
        gradient checkpointing see the same divisor); at most the exact norm, equal once u has converged."""
        key = fingerprint(w)
        if self._power is None or self._power[0] != key:
            with torch.no_grad():
                if self._power is not None:  # the iterate in use becomes the start of the next one
                    self.weight_u.copy_(self._power[2])
                    self._start_valid = True
                u = _power_step(w, self.weight_u) if self._start_valid else top_singular_triple(w)[1]
            self.__dict__["_power"] = (key, w.detach(), u)
        u = self._power[2]
        sigma = torch.mv(w.flatten(1).to(torch.float64).T, u).norm()
        return sigma.to(w.dtype).clamp_min(torch.finfo(w.dtype).tiny)

    @torch.no_grad()
    def settle_power_iteration(self) -> None:
        """Write the next iteration's start into ``weight_u`` and drop the iterate in use (recomputed from it, bit
        for bit, at the next use): what a checkpoint saves, and what ``.to()`` moves."""
        if self._power is not None and self._power[0] != fingerprint(self.raw_weight):
            self.weight_u.copy_(self._power[2])  # stale: the next use starts from it
            self._start_valid = True
        self.__dict__["_power"] = None

    def load_power_iteration(self, start: torch.Tensor) -> None:
        """Restore ``weight_u`` as :meth:`settle_power_iteration` left it (zeros: start from the exact vector)."""
        with torch.no_grad():
            self.weight_u.copy_(start)
        self._start_valid = bool(start.any())
        self.__dict__["_power"] = None

    def _divisor_triple(self, w: torch.Tensor, verified=None):
        """``(sigma, u, v)`` of ``w`` that this mode divides by (:func:`top_singular_triple`, or in training
        :func:`estimated_top_triple`), from the cache when ``w`` holds the values it was computed for; given
        ``verified`` (:func:`top_singular_triple`'s triple just computed for ``w``), afresh whatever the cache holds
        (``verified`` itself where that is this mode's divisor)."""
        key = fingerprint(w)
        cached = self._divisor_cache
        if verified is not None or cached is None or cached[0] != key:
            if self.training and not self.power_iteration:
                triple = estimated_top_triple(w, verified)
            else:
                triple = verified if verified is not None else top_singular_triple(w)
            cached = (key, w.detach(), triple)
            self.__dict__["_divisor_cache"] = cached
        return cached[2]

    @torch.no_grad()
    def certified_norm(self) -> float:
        """A certified upper bound on the largest singular value of ``weight`` as this mode's forward computes it,
        ``fl(W / d)`` with ``d`` the divisor it divides by (the verified one, in training Lanczos's estimate, at most
        the norm and within about 1e-9 of it, or the power iterate's, which may lag):
        ``(upper(W) + u ||W||_F) / d``, with ``upper`` :func:`~lipsformer.layers.spectral.gram_norm_upper`'s certified
        bound on the raw weight as it is now (never cached) and u the weight dtype's unit roundoff (each entry is
        rounded once in the division: ``fl(W / d) = W / d + E`` with ``|E_ij| <= u |W_ij| / d``, and
        ``||E||_2 <= ||E||_F``), rounded up: ``1 + u ||W||_F / ||W||_2`` in float32 with the exact divisor, 1e-7 to
        2e-6 above 1 at the zoo's sizes. The divisor goes in the cache (the verified triple computed for ``upper``
        where it is this mode's): the forwards after it divide by what this bound was computed for (and after an
        optimizer step, the bound keeping computes what the next forward divides by)."""
        w = self.raw_weight
        *verified, upper = top_singular_triple(w, upper=True)
        triple = self._divisor_triple(w, tuple(verified))
        d = self._power_divisor(w) if self.training and self.power_iteration else _divisor(w, triple)
        a = w.detach().flatten(1).to(torch.float64)
        f64 = UNIT_ROUNDOFF64
        frob = float(a.pow(2).sum()) * (1 + a.numel() * f64)  # the float64 sum's rounding charged
        num = (upper + torch.finfo(w.dtype).eps / 2 * math.sqrt(frob)) * (1 + 4 * f64)
        return math.nextafter(num / float(d) * (1 + f64), math.inf)

    def forget_divisor(self) -> None:
        """Drop the cached divisor: the next forward computes it again."""
        self.__dict__.pop("_divisor_cache", None)

    def train(self, mode: bool = True):
        if mode != self.training:  # a write the version counter missed is not carried across a change of mode
            self.forget_divisor()
        return super().train(mode)

    def _apply(self, fn, recurse=True):
        self.forget_divisor()  # .to() / .half() / .cuda(): new storage, possibly at a freed address
        if self.power_iteration:
            self.settle_power_iteration()
        return super()._apply(fn, recurse)

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        if self.power_iteration:  # new weights: the first iteration is the exact top singular vector again
            self.load_power_iteration(torch.zeros_like(self.weight_u))

    @torch.no_grad()
    def _copy_from(self, module: nn.Module) -> None:
        self.raw_weight.copy_(module.weight)
        if module.bias is not None:
            self.bias.copy_(module.bias)


def fingerprint(w: torch.Tensor) -> tuple:
    """What identifies ``w``'s values: storage, version counter (bumped by in-place writes under autograd's watch:
    optimizer steps, ``load_state_dict``), dtype, device, shape, strides, and a checksum of the values (their sum
    and norm, one host sync) for the writes the version counter misses: ``.data`` edits, optimizers that write
    through it, FSDP2's all-gathers into storage whose version counter it preserves."""
    try:
        ptr = w.data_ptr()
    except RuntimeError:  # a tensor without storage of its own (a DTensor shard): never equal
        return (object(),)
    with torch.no_grad():
        checksum = tuple(torch.stack([w.sum(), w.norm()]).tolist())
    return (ptr, w._version, w.dtype, w.device, tuple(w.shape), w.stride(), checksum)


@torch.no_grad()
def _power_step(w: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """One power iteration from ``start`` on ``w`` viewed as (out, in * kh * kw), in float64: the new left vector."""
    a = w.detach().flatten(1).to(torch.float64)
    tiny = torch.finfo(torch.float64).tiny
    v = a.T @ start.to(torch.float64)
    v = v / v.norm().clamp_min(tiny)
    u = a @ v
    return u / u.norm().clamp_min(tiny)


# reason (both): the divisor is computed outside the graph, once per change of the weight; traced through, the divided
# weight would be a constant of the graph and the parameter lost to it
@register_notrace_module
class NormalizedLinear(_RawWeight, nn.Linear):
    r"""``nn.Linear`` with weight :math:`W / \sigma_{\max}(W)`: spectral norm exactly 1 (up to float rounding) at
    every forward; its certified bound is the largest singular value of that matrix, computed from the weights.
    ``LipschitzOptions(linear="normalized")`` turns every Linear of a model into one."""

    def reset_parameters(self) -> None:
        nn.init.xavier_normal_(self.raw_weight)  # the scale does not matter: the forward divides it out
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, power_iteration: bool = False) -> "NormalizedLinear":
        """A normalised copy of ``linear`` (same parameters, device and dtype)."""
        w = linear.weight
        out = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device=w.device,
                  dtype=w.dtype, power_iteration=power_iteration)
        out._copy_from(linear)
        return out


@register_notrace_module
class NormalizedConv2d(_RawWeight, nn.Conv2d):
    r"""A non-overlapping ``nn.Conv2d`` (stride equal to the kernel, no padding or dilation; a 1x1 conv, a patch
    embedding, a 2x2 downsampling) whose reshaped kernel (out, in * kh * kw) is divided by its largest singular
    value. Its patches do not overlap, so the operator norm is exactly that matrix's, 1 at every input size;
    overlapping convolutions have size-dependent norms and are refused (keep them with ``lipschitz_conv_max``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if (tuple(self.stride) != tuple(self.kernel_size) or tuple(self.padding) != (0, 0)
                or tuple(self.dilation) != (1, 1) or self.groups != 1):
            raise ValueError(f"NormalizedConv2d needs stride == kernel, no padding, dilation or groups; got "
                             f"kernel {self.kernel_size}, stride {self.stride}, padding {self.padding}, "
                             f"dilation {self.dilation}, groups {self.groups}")

    def reset_parameters(self) -> None:
        nn.init.xavier_normal_(self.raw_weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, self.weight, self.bias, self.stride)

    @classmethod
    def from_conv(cls, conv: nn.Conv2d, power_iteration: bool = False) -> "NormalizedConv2d":
        w = conv.weight
        out = cls(conv.in_channels, conv.out_channels, conv.kernel_size, stride=conv.stride, padding=conv.padding,
                  dilation=conv.dilation, groups=conv.groups, bias=conv.bias is not None, device=w.device,
                  dtype=w.dtype, power_iteration=power_iteration)
        out._copy_from(conv)
        return out


def non_overlapping(conv: nn.Conv2d) -> bool:
    """Whether ``conv``'s patches are disjoint (stride == kernel, no padding, dilation or groups)."""
    return (tuple(conv.stride) == tuple(conv.kernel_size) and tuple(conv.padding) == (0, 0)
            and tuple(conv.dilation) == (1, 1) and conv.groups == 1)


def normalize_linear_maps(model: nn.Module, power_iteration: bool = False) -> nn.Module:
    """Replace, in place, every ``nn.Linear`` and every non-overlapping ``nn.Conv2d`` of ``model`` (exact types) by
    its normalised copy (:class:`NormalizedLinear`, :class:`NormalizedConv2d`); overlapping convolutions stay.
    ``power_iteration``: their training divisor (see :class:`_RawWeight`)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, NormalizedLinear.from_linear(child, power_iteration))
            elif type(child) is nn.Conv2d and non_overlapping(child):
                setattr(parent, name, NormalizedConv2d.from_conv(child, power_iteration))
    return model


def power_iteration_layers(model: nn.Module) -> Dict[str, "_RawWeight"]:
    """The normalised layers of ``model`` that train with power iteration, by name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, _RawWeight) and m.power_iteration}


class PowerIterationState:
    """The power-iteration vectors of a model's normalised layers, as a checkpointable object
    (``accelerator.register_for_checkpointing``): the vectors are non-persistent buffers, so weight files and state
    dicts keep ``nn.Linear``'s keys, while a resumed run continues the iteration bit for bit."""

    def __init__(self, model: nn.Module):
        self.layers = power_iteration_layers(model)

    def state_dict(self) -> Dict[str, torch.Tensor]:
        for m in self.layers.values():
            m.settle_power_iteration()
        return {n: m.weight_u.detach().cpu().clone() for n, m in self.layers.items()}

    def load_state_dict(self, state: Dict[str, torch.Tensor]) -> None:
        if set(state) != set(self.layers):
            raise ValueError(f"power-iteration state for {len(state)} layers, the model has {len(self.layers)}")
        for n, m in self.layers.items():
            m.load_power_iteration(state[n].to(m.weight_u.device, m.weight_u.dtype))
