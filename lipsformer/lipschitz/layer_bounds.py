"""The certified Lipschitz bound of each layer type (l2 norms; an image or token map is one flattened vector), each
registered for its type (:mod:`lipsformer.lipschitz.registry`) and citing its source: linear maps and convolutions,
pointwise maps, norms, residual forms, MLPs, attention (SCSA, Kim et al.'s L2 attention, AttLip) and pools.
The network's report, which composes them, is :func:`lipsformer.lipschitz.bounds.lipschitz_report`.

LipsFormer = Qi et al., Kim = Kim, Papamakarios & Mnih, "The Lipschitz constant of self-attention".
"""
import math
from typing import List, Tuple

import torch
import torch.nn.functional as F
from timm.layers import Mlp, SelectAdaptivePool2d
from timm.layers.adaptive_avgmax_pool import (AdaptiveAvgMaxPool2d, AdaptiveCatAvgMaxPool2d,
                                              FastAdaptiveAvgMaxPool, FastAdaptiveAvgPool,
                                              FastAdaptiveCatAvgMaxPool, FastAdaptiveMaxPool)
from torch import nn

from ..layers import AttentionKernel, AttLip, AttLipMixer, CenterNorm, ConvexResidual, GroupSort
from ..layers.normalized import NormalizedConv2d, NormalizedLinear
from ..layers.attention import KimL2Attention
from ..layers.attlip import OrthogonalAttLip
from ..layers.block import CPLMlp, GeluMlp
from ..layers.residual import WeightedResidual
from ..layers.shift import ShiftMixer
from ..layers.spectral import gram_norm_upper, largest_singular_value
from ..models.lipsformer_cswin import CrossShapedAttention
from ..models.lipsformer_swin import WindowAttention
from .registry import (HW, INF, Bound, NoBoundError, Row, kernel_bound_fn, module_bound, register_bound,
                       register_kernel_bound, register_residual_bound, register_rows, residual_row)

# -- linear maps -------------------------------------------------------------------------------------
def matrix_norm(weight: torch.Tensor, iters: int = 100) -> float:
    """Largest singular value of a 2-D weight (LipsFormer eq. 1: Lip of an affine map).

    :func:`lipsformer.layers.spectral.largest_singular_value`: exact (certified) when the smaller side is at
    most its ``EXACT_MAX_DIM``; larger ones get power iteration, a lower estimate that converges to the norm.
    """
    return largest_singular_value(weight, iters=iters)


def conv_operator_norm(conv: nn.Conv2d, input_hw: Tuple[int, int], iters: int = 200) -> float:
    """Operator norm of ``conv`` on (C, H, W) inputs, by power iteration on conv / conv-transpose.

    This is the conv as the linear operator it is (padding and stride included), not its reshaped kernel.
    Converges from below; :func:`conv_bound` is the certified upper bound used in reports.
    """
    w = conv.weight.detach().double()
    kw = dict(stride=conv.stride, padding=conv.padding, dilation=conv.dilation, groups=conv.groups)
    x = torch.randn(1, conv.in_channels, *input_hw, dtype=w.dtype, generator=torch.Generator().manual_seed(0))
    out_hw = F.conv2d(x, w, **kw).shape[-2:]
    # the transpose must give back the input size exactly: add what the stride rounded away
    extra = tuple(s - ((o - 1) * st - 2 * p + d * (k - 1) + 1) for s, o, st, p, d, k in
                  zip(input_hw, out_hw, conv.stride, conv.padding, conv.dilation, conv.kernel_size))
    for _ in range(iters):
        x = F.conv_transpose2d(F.conv2d(x, w, **kw), w, output_padding=extra, **kw)
        x = x / x.norm().clamp_min(1e-300)
    return float(F.conv2d(x, w, **kw).norm())


def conv_bound(conv: nn.Conv2d, input_hw: Tuple[int, int]) -> float:
    """Certified upper bound on the operator norm of a Conv2d (no dilation) on (C, H, W) inputs.

    - stride == kernel, no padding (patch embedding, 2x2 downsampling): the patches do not overlap, so
      the norm is exactly the largest singular value of each group's reshaped kernel (bounded above with its
      rounding by :func:`~lipsformer.layers.spectral.gram_norm_upper`).
    - stride 1: a zero-padded conv is a crop of a circular conv on the (H+kh-1, W+kw-1) grid, whose norm
      is the largest singular value over the grid's frequencies of the kernel's DFT (per group).
    - anything else falls back to the reshaped-kernel bound times the number of overlapping positions.
    """
    w = conv.weight.detach().double()
    g = conv.groups
    groups = w.view(g, w.shape[0] // g, *w.shape[1:])  # (g, out/g, in/g, kh, kw)
    kh, kw = conv.kernel_size
    if tuple(conv.stride) == (kh, kw) and tuple(conv.padding) == (0, 0):
        return max(gram_norm_upper(m) for m in groups)
    if tuple(conv.stride) == (1, 1) and tuple(conv.dilation) == (1, 1):
        grid = (input_hw[0] + kh - 1, input_hw[1] + kw - 1)
        spectrum = torch.fft.fft2(groups, s=grid)  # (g, out/g, in/g, n1, n2)
        if spectrum.shape[1] == spectrum.shape[2] == 1:  # depth-wise
            return float(spectrum.abs().max())
        per_freq = spectrum.permute(0, 3, 4, 1, 2)
        return float(torch.linalg.matrix_norm(per_freq, ord=2).max())
    overlap = math.ceil(kh / conv.stride[0]) * math.ceil(kw / conv.stride[1])
    return math.sqrt(overlap) * max(float(torch.linalg.matrix_norm(m.flatten(1), ord=2)) for m in groups)


# -- linear maps, pointwise maps and norms ------------------------------------------------------------
@register_bound(nn.Linear)
def linear_bound(linear: nn.Linear, hw: HW) -> Bound:
    """A Linear on every token: the largest singular value of its weight (LipsFormer eq. 1)."""
    return Bound(matrix_norm(linear.weight))


@register_bound(nn.Conv2d)
def conv2d_bound(conv: nn.Conv2d, hw: HW) -> Bound:
    """A Conv2d on (C, H, W): :func:`conv_bound`."""
    return Bound(conv_bound(conv, hw))


@register_bound(NormalizedLinear, NormalizedConv2d)
def normalized_bound(layer, hw: HW) -> Bound:
    """A spectrally normalised Linear, or a normalised Conv2d (non-overlapping, one group: its operator norm is its
    reshaped kernel's): a certified upper bound on the largest singular value of the matrix its forward uses (the
    parameter divided by its divisor, that division's rounding included), computed from the weights, not assumed
    1 (:meth:`~lipsformer.layers.normalized._RawWeight.certified_norm`)."""
    return Bound(layer.certified_norm())


@register_rows(nn.Identity, nn.Dropout, nn.Flatten)
def identity_rows(module: nn.Module, name: str, hw: HW) -> List[Row]:
    """Identity (bound 1, no row); dropout is the identity at evaluation; flattening keeps the l2 norm."""
    return []


def gelu_bound() -> float:
    r"""GELU's largest slope: :math:`\Phi(x) + x\varphi(x)` peaks at :math:`x = \sqrt 2` (about 1.1289)."""
    x = math.sqrt(2.0)
    return 0.5 * (1 + math.erf(x / math.sqrt(2))) + x * math.exp(-x * x / 2) / math.sqrt(2 * math.pi)


@register_bound(nn.GELU)
def gelu_module_bound(act: nn.GELU, hw: HW) -> Bound:
    if act.approximate != "none":
        raise NoBoundError(f"no Lipschitz bound is registered for GELU(approximate={act.approximate!r})")
    return Bound(gelu_bound())


@register_bound(nn.ReLU)
def relu_bound(act: nn.ReLU, hw: HW) -> Bound:
    return Bound(1.0)


@register_bound(GroupSort)
def group_sort_bound(act: GroupSort, hw: HW) -> Bound:
    """GroupSort: 1 (Anil, Lucas & Grosse 2019: a permutation of the coordinates wherever the order is fixed)."""
    return Bound(1.0)


@register_bound(CenterNorm)
def center_norm_bound(norm: CenterNorm, hw: HW) -> Bound:
    """CenterNorm: ``D/(D-1) * max|gamma|`` (LipsFormer eq. 2)."""
    return Bound(norm.scale * float(norm.weight.detach().abs().max()))


@register_bound(nn.LayerNorm)
def layer_norm_bound(norm: nn.LayerNorm, hw: HW) -> Bound:
    """LayerNorm is not Lipschitz (LipsFormer Sec. 4.1.1: its Jacobian grows without bound as the variance
    goes to 0)."""
    return Bound(INF, "LayerNorm is not Lipschitz (LipsFormer Sec. 4.1.1)")


def norm_bound(norm: nn.Module) -> float:
    """CenterNorm: ``D/(D-1) * max|gamma|`` (LipsFormer eq. 2); LayerNorm is not Lipschitz (LipsFormer
    Sec. 4.1.1); Identity: 1; any other type raises :class:`NoBoundError`."""
    return module_bound(norm).lip


@register_residual_bound(WeightedResidual)
def weighted_residual_row(residual: WeightedResidual, name: str, branch: float, note: str = "") -> Row:
    """Weighted residual ``x + alpha * f(x)``: ``1 + max|alpha| * Lip(f)`` (LipsFormer eq. 4), with its DropPath."""
    drop = residual.drop_path
    alpha = float(residual.alpha.detach().abs().max())
    return Row(name, 1.0 + alpha * branch, branch, alpha, float(getattr(drop, "drop_prob", 0.0)),
               bool(getattr(drop, "scale_by_keep", True)), note)


@register_residual_bound(ConvexResidual)
def convex_residual_row(residual: ConvexResidual, name: str, branch: float, note: str = "") -> Row:
    """Convex residual ``(1 - a) x + a f(x)``: ``max|1 - a| + max|a| Lip(f)`` (triangle inequality), at most 1 for
    ``a`` in [0, 1] and ``Lip(f) <= 1``. The row has no DropPath rate: eq. 21 is for ``x + alpha f(x)``, and a
    dropped convex branch leaves the identity, whose bound 1 is below the kept one."""
    a = residual.alpha.detach().double()
    alpha = float(a.abs().max())
    return Row(name, float((1.0 - a).abs().max()) + alpha * branch, branch, alpha, 0.0, True,
               note)


def residual_bound(residual: nn.Module, branch: float) -> float:
    """A residual map's bound given its branch's, e.g. ``1 + max|alpha| * Lip(f)`` (LipsFormer eq. 4)."""
    return residual_row("", residual, branch).lip


@register_bound(Mlp)
def timm_mlp_bound(mlp: Mlp, hw: HW) -> Bound:
    """timm's Mlp: fc2 . norm . act . fc1 (dropout is the identity at evaluation)."""
    return Bound(math.prod(module_bound(m, hw).lip for m in (mlp.fc1, mlp.act, mlp.norm, mlp.fc2)))


@register_bound(CPLMlp)
def cpl_mlp_bound(mlp: CPLMlp, hw: HW) -> Bound:
    """:class:`~lipsformer.layers.block.CPLMlp`: ``max(1, 2 ||W||^2 - 1)`` (its Jacobian ``I - 2 W^T D W`` with D in
    [0, 1] has eigenvalues in ``[1 - 2 ||W||^2, 1]``), ``||W||`` the fc's certified norm."""
    c = module_bound(mlp.fc, hw).lip
    return Bound(max(1.0, 2.0 * c * c - 1.0), "convex potential layer (Meunier et al. 2022)")


@register_bound(GeluMlp)
def gelu_mlp_bound(mlp: GeluMlp, hw: HW) -> Bound:
    """:class:`GeluMlp`: fc2 . GELU . fc1, the GELU fused into fc2 whatever ``act`` says (so ``act`` must be GELU)."""
    if type(mlp.act) is not nn.GELU or not isinstance(mlp.norm, nn.Identity):
        raise NoBoundError(f"GeluMlp computes fc2(GELU(fc1(x))); its act {type(mlp.act).__name__} and norm "
                           f"{type(mlp.norm).__name__} must be GELU and Identity to be bounded")
    return Bound(matrix_norm(mlp.fc2.weight) * gelu_bound() * matrix_norm(mlp.fc1.weight))


def mlp_bound(mlp: nn.Module) -> float:
    """An MLP's bound from the registry (timm's Mlp: fc2 . GELU . fc1)."""
    return module_bound(mlp).lip


# -- attention ----------------------------------------------------------------------------------------
def scsa_bound(w_q: torch.Tensor, w_k: torch.Tensor, w_v: torch.Tensor, n: int, tau: float, nu: float,
               eps: float, norm: str = "2") -> float:
    r"""One SCSA head on ``n`` tokens, LipsFormer Theorem 1 (normalised v, scale nu).

    :math:`\mathrm{Lip}_2 \le 2N(N-1)\nu\tau\epsilon^{-1/2}\|W^K\|_2 + 2(N-1)\nu\tau\epsilon^{-1/2}\|W^Q\|_2
    + 2N\nu\epsilon^{-1/2}\|W^{V\top}\|_2`; the :math:`\ell_\infty` form uses
    :math:`N^2\sqrt D`, :math:`N\sqrt D` and :math:`2N` with :math:`\infty`-norms. Weights are (d, D) rows of
    the projection, as ``nn.Linear`` stores them (so :math:`\|W^\top\|_\infty` is the max row sum).
    An additive logit bias (relative positions, masks) leaves the bound unchanged.
    """
    s = eps ** -0.5
    if norm == "2":
        return (2 * n * (n - 1) * nu * tau * s * matrix_norm(w_k) + 2 * (n - 1) * nu * tau * s * matrix_norm(w_q)
                + 2 * n * nu * s * matrix_norm(w_v))
    if norm == "inf":
        d = w_q.shape[1]

        def inf_norm(w):  # ||W||_inf of the (D, d) matrix the paper writes: max row sum of |W^T|
            return float(w.detach().abs().sum(0).max())

        return (n * n * math.sqrt(d) * nu * tau * s * inf_norm(w_k) + n * math.sqrt(d) * nu * tau * s * inf_norm(w_q)
                + 2 * n * nu * s * float(w_v.detach().abs().sum(1).max()))
    raise ValueError(f"norm must be '2' or 'inf', got {norm!r}")


def lambert_phi_inverse(y: float) -> float:
    r"""The inverse of Kim et al.'s :math:`\phi(x) = x e^{x+1}` on x > 0 (Newton's method)."""
    x = math.log1p(y)
    for _ in range(100):
        step = (x * math.exp(x + 1) - y) / ((x + 1) * math.exp(x + 1))
        x -= step
        if abs(step) < 1e-15 * max(1.0, x):
            break
    return x


def kim_heads_bound(w_q: torch.Tensor, w_v: torch.Tensor, n: int) -> float:
    r"""Kim et al. Theorem 3.2, :math:`\ell_2` form, without the final :math:`\|W^O\|_2`, for heads whose
    (d, D) query and value rows are ``w_q[h]``, ``w_v[h]``:
    :math:`\frac{\sqrt N}{\sqrt{D/H}} (4\phi^{-1}(N-1) + 1) \sqrt{\sum_h \|W^{Q,h}\|_2^2 \|W^{V,h}\|_2^2}`."""
    d = w_q.shape[1]
    heads = math.sqrt(sum((matrix_norm(a) * matrix_norm(b)) ** 2 for a, b in zip(w_q, w_v)))
    return math.sqrt(n) / math.sqrt(d) * (4 * lambert_phi_inverse(n - 1) + 1) * heads


def kim_l2_bound(attn: nn.Module, n: int) -> float:
    """Theorem 3.2 for :class:`~lipsformer.layers.attention.KimL2Attention` on ``n`` tokens."""
    d = attn.q.weight.shape[1] // attn.heads
    w_q = attn.q.weight.detach().view(attn.heads, d, -1)
    w_v = attn.v.weight.detach().view(attn.heads, d, -1)
    return kim_heads_bound(w_q, w_v, n) * matrix_norm(attn.proj.weight)


def kim_theorem_3_2(w_q: torch.Tensor, w_v: torch.Tensor, w_o: torch.Tensor, heads: int, n: int,
                    norm: str = "2") -> torch.Tensor:
    r"""Kim et al. Theorem 3.2 for L2-MHA on ``n`` tokens, as a tensor (differentiable in the weights, so a layer
    can divide by it and train through the denominator, as Kim et al. Sec. 5.3 do).

    Weights in ``nn.Linear`` layout: ``w_q``, ``w_v`` (H d, D) with heads stacked by rows (the paper's
    :math:`W^{Q,h}`, :math:`W^{V,h}` are the transposed row blocks) and ``w_o`` (D, D) (the paper's :math:`W^O` is
    its transpose). ``norm="2"``:
    :math:`\frac{\sqrt N}{\sqrt{D/H}}(4\phi^{-1}(N-1) + 1)\sqrt{\sum_h \|W^{Q,h}\|_2^2\|W^{V,h}\|_2^2}\,\|W^O\|_2`;
    ``norm="inf"`` (the norm of the flattened N x D input, max abs entry):
    :math:`(4\phi^{-1}(N-1) + 1/\sqrt{D/H})\,\|W^{O\top}\|_\infty \max_h \|W^{Q,h}\|_\infty\|W^{Q,h\top}\|_\infty
    \max_h \|W^{V,h\top}\|_\infty`, with :math:`\|M\|_\infty` the largest row sum of :math:`|M|`.
    """
    d = w_q.shape[0] // heads
    q, v = w_q.view(heads, d, -1), w_v.view(heads, d, -1)  # row blocks = W^{.,h} transposed, (H, d, D)
    phi = 4 * lambert_phi_inverse(n - 1)
    if norm == "2":
        per_head = torch.linalg.matrix_norm(q, ord=2) * torch.linalg.matrix_norm(v, ord=2)
        return (math.sqrt(n / d) * (phi + 1) * per_head.pow(2).sum().sqrt()
                * torch.linalg.matrix_norm(w_o, ord=2))
    if norm == "inf":
        q_inf = q.abs().sum(1).amax(-1)  # ||W^{Q,h}||_inf: rows of W^{Q,h} are the columns of the block
        q_t_inf = q.abs().sum(2).amax(-1)  # ||W^{Q,h T}||_inf: rows of the block
        v_t_inf = v.abs().sum(2).amax(-1)  # ||W^{V,h T}||_inf
        o_t_inf = w_o.abs().sum(1).amax()  # ||W^{O T}||_inf: rows of the Linear weight
        return (phi + d ** -0.5) * o_t_inf * (q_inf * q_t_inf).amax() * v_t_inf.amax()
    raise ValueError(f"norm must be '2' or 'inf', got {norm!r}")


def kim_l2_inf_bound(attn: nn.Module, n: int) -> float:
    """Theorem 3.2, l-infinity form, for :class:`~lipsformer.layers.attention.KimL2Attention` on ``n`` tokens
    (Kim et al. Fig. 2 measures its asymptotic tightness; ``benchmarks/paper/kim_tightness.py``)."""
    w = [m.weight.detach().double() for m in (attn.q, attn.v, attn.proj)]
    return float(kim_theorem_3_2(*w, attn.heads, n, norm="inf"))


def attlip_bound() -> float:
    """AttLip (AttLip Theorem 4): a proximal step of a convex potential is firmly non-expansive, so 1 for any
    weights, eta and N (up to the solver's tolerance); so is ``I - prox``, the mixer of :class:`AttLipMixer`."""
    return 1.0



@register_kernel_bound("dot")
def dot_kernel_bound(kernel: AttentionKernel, w: torch.Tensor, n: int, position_bias: bool) -> Bound:
    return Bound(INF, "dot-product attention is not Lipschitz (Kim Thm 3.1)")


@register_kernel_bound("l2")
def l2_kernel_bound(kernel: AttentionKernel, w: torch.Tensor, n: int, position_bias: bool) -> Bound:
    """Kim Theorem 3.2 for tied weights with the A_h factor (``tied_qk=True``), proven without a logit bias."""
    if not kernel.kim:
        return Bound(INF, "untied L2 attention is not Lipschitz (Kim Lemma F.1): set tied_qk=True")
    if position_bias:
        return Bound(INF, "a relative position bias is outside Kim Thm 3.2")
    return Bound(kim_heads_bound(w[0], w[-1], n), f"Kim Thm 3.2, N={n}")


@register_kernel_bound("scsa")
def scsa_kernel_bound(kernel: AttentionKernel, w: torch.Tensor, n: int, position_bias: bool) -> Bound:
    """LipsFormer Theorem 1 per head (normalised v); an additive logit bias leaves it unchanged."""
    if kernel.nu is None:
        return Bound(INF, "SCSA with unnormalised v (released default) is outside Theorem 1: set v_norm=True")
    tau = abs(float(kernel.tau))
    per_head = [scsa_bound(w[0, h], w[1, h], w[2, h], n, tau, kernel.nu, kernel.eps) for h in range(w.shape[1])]
    return Bound(math.sqrt(sum(b * b for b in per_head)), f"LipsFormer Thm 1, N={n}")


def attention_heads_bound(kernel: AttentionKernel, qkv_weight: torch.Tensor, heads: int, n: int,
                          position_bias: bool = False) -> Bound:
    """``sqrt(sum_h Lip(head_h)^2)``: the Lipschitz bound of the concatenated heads of one token group.

    Returns the bound and a note, from the kernel kind's entry in :data:`~.registry.KERNEL_BOUNDS` (an unknown kind
    raises :class:`NoBoundError`). Dot-product attention is not Lipschitz (Kim Theorem 3.1); L2 attention is Lipschitz
    with tied weights and the A_h factor (Kim Theorem 3.2; ``tied_qk=True``), a theorem proven without a logit
    bias; SCSA with unnormalised v (the released code) is outside Theorem 1 and grows with the input scale.
    """
    dim = qkv_weight.shape[1]
    bound = kernel_bound_fn(kernel.kind)
    return bound(kernel, qkv_weight.detach().view(kernel.num_proj, heads, -1, dim), n, position_bias)


@register_bound(WindowAttention)
def window_attention_bound(attn: WindowAttention, hw: HW = None) -> Bound:
    """Swin windows: windows are independent, so the bound is that of one window of ``N`` tokens, then proj."""
    n = attn.window[0] * attn.window[1]
    heads, note = attention_heads_bound(attn.kernel, attn.qkv.weight, attn.num_heads, n, position_bias=True)
    return Bound(heads * matrix_norm(attn.proj.weight), note)


@register_bound(CrossShapedAttention)
def cross_shaped_attention_bound(attn: CrossShapedAttention, resolution: HW) -> Bound:
    """CSwin: each branch is ``(heads(q, k, v) + LePE(v)) / sqrt(branch heads)`` on its stripes; the branches
    act on disjoint channels and are concatenated (root of the sum of squares), then projected."""
    nb = len(attn.windows)
    dim = attn.qkv.weight.shape[1]
    w = attn.qkv.weight.detach().view(attn.kernel.num_proj, nb, dim // nb, dim)
    branches, notes = [], set()
    for b, (window, lepe) in enumerate(zip(attn.windows, attn.lepe)):
        sub = w[:, b].reshape(-1, dim)
        heads, note = attention_heads_bound(attn.kernel, sub, attn.branch_heads, window[0] * window[1])
        notes.add(note)
        lepe_lip = conv_bound(lepe, resolution) * matrix_norm(w[-1, b])
        branches.append((heads + lepe_lip) / math.sqrt(attn.branch_heads))
    return Bound(math.sqrt(sum(b * b for b in branches)) * matrix_norm(attn.proj.weight), "; ".join(sorted(notes)))


@register_bound(KimL2Attention)
def kim_l2_attention_bound(attn: KimL2Attention, hw: HW) -> Bound:
    """Kim Theorem 3.2 on the ``H * W`` tokens of one group."""
    n = hw[0] * hw[1]
    return Bound(kim_l2_bound(attn, n), f"Kim Thm 3.2, N={n}")


@register_bound(AttLip, OrthogonalAttLip)
def attlip_module_bound(attn: AttLip, hw: HW) -> Bound:
    """AttLip Theorem 4: prox is firmly non-expansive. The orthogonal form computes ``prox(x Q'^T) Q'`` with Q'
    the float32 rounding of its rotation: at most ``||Q'||^2 <= 1 + delta`` (``rotation_defect``, certified)."""
    delta = attn.rotation_defect()
    if not delta:
        return Bound(attlip_bound(), "AttLip Thm 4: prox is firmly non-expansive")
    return Bound(math.nextafter(attlip_bound() + delta, INF),
                 f"AttLip Thm 4 in rotated coordinates: ||Q'||^2 <= 1 + {delta:.1e}")


def one_token_gains(branch: OrthogonalAttLip) -> Tuple[float, float]:
    """``[lo, hi]`` holding every eigenvalue of an orthogonal AttLip block's exact prox on one-token groups.

    With N = 1 the potential is a quadratic: head h's score is ``S = s_h^2 ||2 a||^2 / sqrt(d_h)`` in the rotated
    coordinates ``a = x Q'^T``, so ``g(a) = sum_h 2 c_h ||a_h||^2`` with ``c_h = s_h^2 / sqrt(d_h)`` and
    ``prox_{eta g}(a)_h = a_h / (1 + 4 eta c_h)``: a diagonal map, so its eigenvalues are the
    ``1 / (1 + 4 eta c_h)``. Computed in float64 from the scales the forward uses, a few roundings of relative
    size 2^-53 each; the interval is widened by 1e-12 relative, far more than they can move it."""
    s = branch.head_scales().detach().to(torch.float64)
    gains = 1.0 / (1.0 + 4.0 * branch.eta * s.pow(2) / math.sqrt(branch.rotation.shape[0] // branch.heads))
    return float(gains.min()) * (1 - 1e-12), min(1.0, float(gains.max()) * (1 + 1e-12))


@register_bound(AttLipMixer)
def attlip_mixer_bound(mixer: AttLipMixer, hw: HW) -> Bound:
    """AttLip Theorem 4: prox, and ``I - prox`` (the mixer with ``delta``), are firmly non-expansive, and the
    reflected resolvent ``2 prox - I`` (``reflect``) non-expansive; the branches act on disjoint channels, so the
    mixer's bound is their largest. With a rotation Q' (the orthogonal form),
    ``x - Q'^T prox(Q' x) = (I - Q'^T Q') x + Q'^T (I - prox)(Q' x)``: at most ``delta + ||Q'||^2 <= 1 + 2 delta``,
    ``2 Q'^T prox(Q' x) - x`` likewise, and ``prox`` alone ``1 + delta``.

    Where the theory gives less: an orthogonal branch whose windows hold one token is the linear map
    :func:`one_token_gains` describes, so ``||.||`` of prox, ``I - prox`` and ``2 prox - I`` in rotated
    coordinates is the largest ``|g|`` over its gains ``g``: ``lam``, ``1 - lam`` and ``|2 lam - 1|``, times
    ``||Q'||^2``, plus ``delta`` where ``x`` itself is added. The other bounds do not depend on the token count
    (prox's is 1 for any N) and a one-token window is the only case this closes; AttLip's general form keeps 1
    (the same map with ``(I + eta sum_h 4 W_h^T W_h / sqrt(d_h))^{-1}``, which needs a certified smallest
    eigenvalue)."""
    what = "2 prox - I is non-expansive" if mixer.reflect else (
        f"{'I - prox' if mixer.delta else 'prox'} is firmly non-expansive")
    k = 2 if mixer.delta or mixer.reflect else 1  # how many times the rotation's rounding enters
    lips, deltas, closed = [], [], False
    for branch, window in zip(mixer.branches, mixer.windows):
        delta = branch.rotation_defect()
        deltas.append(delta)
        if isinstance(branch, OrthogonalAttLip) and window[0] * window[1] == 1:
            lo, hi = one_token_gains(branch)
            gain = max(abs(2 * lo - 1), abs(2 * hi - 1)) if mixer.reflect else 1 - lo if mixer.delta else hi
            lips.append((gain * (1 + delta) + (k - 1) * delta) * (1 + 1e-15))  # (the sum's rounding)
            closed = True
        else:
            lips.append(attlip_bound() + k * delta)
    note = f"AttLip Thm 4: {what}"
    if closed:
        note += "; one token a window: the prox is linear, bounded by its gains"
    if max(deltas):
        note += f"; rotation rounding {max(deltas):.1e} charged"
    lip = max(lips)
    return Bound(lip if lip == attlip_bound() and not closed else math.nextafter(lip, INF), note)


@register_bound(ShiftMixer)
def shift_mixer_bound(mixer: ShiftMixer, hw: HW) -> Bound:
    """``proj(shift(x))``: the zero-fill shift is a partial permutation (norm at most 1), so ``proj``'s bound."""
    lip, note = module_bound(mixer.proj, hw)
    return Bound(lip, "zero-fill shift (a partial permutation), then proj")


# -- pools ---------------------------------------------------------------------------------------------
@register_bound(FastAdaptiveAvgPool)
def avg_pool_bound(pool: nn.Module, hw: HW) -> Bound:
    """Mean over N tokens: ``||mean(X) - mean(Y)|| <= ||X - Y|| / sqrt(N)`` (Cauchy-Schwarz)."""
    return Bound(1.0 / math.sqrt(hw[0] * hw[1]))


@register_bound(FastAdaptiveMaxPool)
def max_pool_bound(pool: nn.Module, hw: HW) -> Bound:
    """Max over tokens, per channel: ``|max a - max b| <= max |a - b|``, so 1."""
    return Bound(1.0)


@register_bound(FastAdaptiveAvgMaxPool, AdaptiveAvgMaxPool2d)
def avgmax_pool_bound(pool: nn.Module, hw: HW) -> Bound:
    """(mean + max) / 2: at most the mean of the two bounds."""
    return Bound(0.5 * (1.0 / math.sqrt(hw[0] * hw[1]) + 1.0))


@register_bound(FastAdaptiveCatAvgMaxPool, AdaptiveCatAvgMaxPool2d)
def catavgmax_pool_bound(pool: nn.Module, hw: HW) -> Bound:
    """[mean, max] concatenated: the root of the sum of the squared bounds."""
    return Bound(math.sqrt(1.0 / (hw[0] * hw[1]) + 1.0))


@register_bound(SelectAdaptivePool2d)
def select_pool_bound(pool: SelectAdaptivePool2d, hw: HW) -> Bound:
    """timm's selectable global pool: the bound of the pool it holds (identity for ``''``)."""
    return Bound(module_bound(pool.pool, hw, "global_pool.pool").lip * module_bound(pool.flatten, hw).lip)
