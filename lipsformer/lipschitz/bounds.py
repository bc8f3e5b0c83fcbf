"""Certified upper bounds on Lipschitz constants (l2 norms; an image or token map is one flattened vector).

One function per module kind, each citing where its bound comes from. LipsFormer = Qi et al.,
Kim = Kim, Papamakarios & Mnih, "The Lipschitz constant of self-attention".
Bounds compose by products (Lipschitz constants of compositions multiply, LipsFormer Lemma 2).
"""
import math
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..layers import AttentionKernel, AttLipMixer, CenterNorm
from ..layers.block import LipsBlock
from ..layers.conv_blocks import ConvBlocks
from ..layers.patch_embed import PatchEmbed
from ..layers.residual import WeightedResidual

INF = math.inf
# Matrices up to this size in their smaller dimension get an exact SVD; larger ones power iteration.
EXACT_MAX_DIM = 4096


# -- linear maps -------------------------------------------------------------------------------------
def matrix_norm(weight: torch.Tensor, iters: int = 100) -> float:
    """Largest singular value of a 2-D weight (LipsFormer eq. 1: Lip of an affine map).

    Matrices whose smaller side is at most ``EXACT_MAX_DIM`` get an exact SVD (certified); larger ones get
    power iteration, a lower estimate that converges to the norm.
    """
    w = weight.detach().double().flatten(1)
    if min(w.shape) <= EXACT_MAX_DIM:
        return float(torch.linalg.matrix_norm(w, ord=2))
    v = torch.randn(w.shape[1], dtype=w.dtype, generator=torch.Generator().manual_seed(0))
    for _ in range(iters):
        v = w.T @ (w @ v)
        v = v / v.norm().clamp_min(1e-300)
    return float((w @ v).norm())


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
      the norm is exactly the largest singular value of each group's reshaped kernel.
    - stride 1: a zero-padded conv is a crop of a circular conv on the (H+kh-1, W+kw-1) grid, whose norm
      is the largest singular value over the grid's frequencies of the kernel's DFT (per group).
    - anything else falls back to the reshaped-kernel bound times the number of overlapping positions.
    """
    w = conv.weight.detach().double()
    g = conv.groups
    groups = w.view(g, w.shape[0] // g, *w.shape[1:])  # (g, out/g, in/g, kh, kw)
    kh, kw = conv.kernel_size
    if tuple(conv.stride) == (kh, kw) and tuple(conv.padding) == (0, 0):
        return max(float(torch.linalg.matrix_norm(m.flatten(1), ord=2)) for m in groups)
    if tuple(conv.stride) == (1, 1) and tuple(conv.dilation) == (1, 1):
        grid = (input_hw[0] + kh - 1, input_hw[1] + kw - 1)
        spectrum = torch.fft.fft2(groups, s=grid)  # (g, out/g, in/g, n1, n2)
        if spectrum.shape[1] == spectrum.shape[2] == 1:  # depth-wise
            return float(spectrum.abs().max())
        per_freq = spectrum.permute(0, 3, 4, 1, 2)
        return float(torch.linalg.matrix_norm(per_freq, ord=2).max())
    overlap = math.ceil(kh / conv.stride[0]) * math.ceil(kw / conv.stride[1])
    return math.sqrt(overlap) * max(float(torch.linalg.matrix_norm(m.flatten(1), ord=2)) for m in groups)


# -- pointwise maps and norms -------------------------------------------------------------------------
def gelu_bound() -> float:
    r"""GELU's largest slope: :math:`\Phi(x) + x\varphi(x)` peaks at :math:`x = \sqrt 2` (about 1.1289)."""
    x = math.sqrt(2.0)
    return 0.5 * (1 + math.erf(x / math.sqrt(2))) + x * math.exp(-x * x / 2) / math.sqrt(2 * math.pi)


def norm_bound(norm: nn.Module) -> float:
    """CenterNorm: ``D/(D-1) * max|gamma|`` (LipsFormer eq. 2); LayerNorm is not Lipschitz (LipsFormer
    Sec. 4.1.1: its Jacobian grows without bound as the variance goes to 0); Identity: 1."""
    if isinstance(norm, CenterNorm):
        return norm.scale * float(norm.weight.detach().abs().max())
    if isinstance(norm, nn.LayerNorm):
        return INF
    if isinstance(norm, nn.Identity):
        return 1.0
    raise TypeError(f"no Lipschitz bound for norm {type(norm).__name__}")


def residual_bound(residual: WeightedResidual, branch: float) -> float:
    """Weighted residual ``x + alpha * f(x)``: ``1 + max|alpha| * Lip(f)`` (LipsFormer eq. 4)."""
    return 1.0 + float(residual.alpha.detach().abs().max()) * branch


def mlp_bound(mlp: nn.Module) -> float:
    """timm's Mlp: fc2 . GELU . fc1 (dropout is the identity at evaluation)."""
    return matrix_norm(mlp.fc2.weight) * gelu_bound() * matrix_norm(mlp.fc1.weight)


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
    (Kim et al. Fig. 2 measures its asymptotic tightness; ``benchmarks/kim_tightness.py``)."""
    w = [m.weight.detach().double() for m in (attn.q, attn.v, attn.proj)]
    return float(kim_theorem_3_2(*w, attn.heads, n, norm="inf"))


def attlip_bound() -> float:
    """AttLip (AttLip Theorem 4): a proximal step of a convex potential is firmly non-expansive, so 1 for any
    weights, eta and N (up to the solver's tolerance); so is ``I - prox``, the mixer of :class:`AttLipMixer`."""
    return 1.0


def attention_heads_bound(kernel: AttentionKernel, qkv_weight: torch.Tensor, heads: int, n: int,
                          position_bias: bool = False) -> Tuple[float, str]:
    """``sqrt(sum_h Lip(head_h)^2)``: the Lipschitz bound of the concatenated heads of one token group.

    Returns the bound and a note. Dot-product attention is not Lipschitz (Kim Theorem 3.1); L2 attention is
    Lipschitz with tied weights and the A_h factor (Kim Theorem 3.2; ``tied_qk=True``), a theorem proven without a
    logit bias; SCSA with unnormalised v (the released code) is outside Theorem 1 and grows with the input scale.
    """
    dim = qkv_weight.shape[1]
    w = qkv_weight.detach().view(kernel.num_proj, heads, -1, dim)
    if kernel.kind == "dot":
        return INF, "dot-product attention is not Lipschitz (Kim Thm 3.1)"
    if kernel.kind == "l2":
        if not kernel.kim:
            return INF, "untied L2 attention is not Lipschitz (Kim Lemma F.1): set tied_qk=True"
        if position_bias:
            return INF, "a relative position bias is outside Kim Thm 3.2"
        return kim_heads_bound(w[0], w[-1], n), f"Kim Thm 3.2, N={n}"
    if kernel.nu is None:
        return INF, "SCSA with unnormalised v (released default) is outside Theorem 1: set v_norm=True"
    tau = abs(float(kernel.tau))
    per_head = [scsa_bound(w[0, h], w[1, h], w[2, h], n, tau, kernel.nu, kernel.eps) for h in range(heads)]
    return math.sqrt(sum(b * b for b in per_head)), f"LipsFormer Thm 1, N={n}"


def window_attention_bound(attn: nn.Module) -> Tuple[float, str]:
    """Swin windows: windows are independent, so the bound is that of one window of ``N`` tokens, then proj."""
    n = attn.window[0] * attn.window[1]
    heads, note = attention_heads_bound(attn.kernel, attn.qkv.weight, attn.num_heads, n, position_bias=True)
    return heads * matrix_norm(attn.proj.weight), note


def cross_shaped_attention_bound(attn: nn.Module, resolution: Tuple[int, int]) -> Tuple[float, str]:
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
    return math.sqrt(sum(b * b for b in branches)) * matrix_norm(attn.proj.weight), "; ".join(sorted(notes))


# -- blocks and the network ---------------------------------------------------------------------------
@dataclass
class Row:
    """One residual branch (or a non-residual layer) of the network."""

    name: str
    lip: float  # the layer's bound; for a residual, 1 + max|alpha| Lip(f)
    branch: Optional[float] = None  # Lip(f) of a residual branch
    alpha: Optional[float] = None  # max|alpha|
    drop_path: float = 0.0
    scale_by_keep: bool = True
    note: str = ""


@dataclass
class LipschitzReport:
    rows: List[Row] = field(default_factory=list)

    @property
    def log10_bound(self) -> float:
        """LipsFormer eq. 19 in log10: the product of every layer's bound (evaluation, DropPath off); infinite
        only when some layer has no finite bound (logs keep deep models from overflowing a float)."""
        return sum(math.log10(r.lip) for r in self.rows)

    @property
    def log10_train_expected_bound(self) -> float:
        """LipsFormer eq. 21 in log10: the expected bound with DropPath on, each branch kept with probability 1-p.

        timm's DropPath divides a kept branch by 1-p (``scale_by_keep``), which cancels the expected
        reduction: then this equals :attr:`log10_bound`. The paper's eq. 21 assumes no rescaling.
        """
        out = 0.0
        for r in self.rows:
            if r.branch is None or not r.drop_path:
                out += math.log10(r.lip)
                continue
            keep = 1.0 - r.drop_path
            kept = r.alpha * r.branch / (keep if r.scale_by_keep else 1.0)
            out += math.log10(keep * (1.0 + kept) + r.drop_path)
        return out

    @property
    def bound(self) -> float:
        """The network bound (eq. 19); ``inf`` also when it exceeds the float range (see :attr:`log10_bound`)."""
        return _power10(self.log10_bound)

    @property
    def train_expected_bound(self) -> float:
        return _power10(self.log10_train_expected_bound)

    def stages(self) -> List[Tuple[str, float]]:
        """log10 of the product of the bounds per top-level part (patch_embed, stages.i, norm, head)."""
        out = {}
        for r in self.rows:
            key = ".".join(r.name.split(".")[:2]) if r.name.startswith("stages.") else r.name.split(".")[0]
            out[key] = out.get(key, 0.0) + math.log10(r.lip)
        return list(out.items())

    def dominant(self) -> Row:
        return max((r for r in self.rows if r.branch is not None), key=lambda r: r.lip)


def _power10(x: float) -> float:
    return 10.0 ** x if x < 308 else INF


def _residual_row(name: str, residual: WeightedResidual, branch: float, note: str = "") -> Row:
    drop = residual.drop_path
    return Row(name, residual_bound(residual, branch), branch, float(residual.alpha.detach().abs().max()),
               float(getattr(drop, "drop_prob", 0.0)), bool(getattr(drop, "scale_by_keep", True)), note)


def conv_blocks_rows(name: str, convs: ConvBlocks, hw: Tuple[int, int]) -> List[Row]:
    """Configurations B-D: ``x + s1 GELU(pw(GELU(dw1 x)))`` then ``x + s2 GELU(dw2 x)``."""
    rows = []
    if convs.dw1 is None:
        return rows
    g = gelu_bound()
    branch = g * conv_bound(convs.dw1, hw)
    if convs.pw is not None:
        branch *= g * conv_bound(convs.pw, hw)
    rows.append(_residual_row(f"{name}.res1", convs.res1, branch))
    if convs.dw2 is not None:
        rows.append(_residual_row(f"{name}.res2", convs.res2, g * conv_bound(convs.dw2, hw)))
    return rows


def block_rows(name: str, block: LipsBlock, hw: Tuple[int, int]) -> List[Row]:
    rows = conv_blocks_rows(f"{name}.convs", block.convs, hw)
    if isinstance(block.attn, AttLipMixer):
        attn, note = attlip_bound(), "AttLip Thm 4: I - prox is firmly non-expansive"
    elif hasattr(block.attn, "window"):
        attn, note = window_attention_bound(block.attn)
    else:
        attn, note = cross_shaped_attention_bound(block.attn, hw)
    rows.append(_residual_row(f"{name}.res_attn", block.res_attn, attn, note))
    rows.append(Row(f"{name}.norm1", norm_bound(block.norm1)))
    rows.append(_residual_row(f"{name}.res_mlp", block.res_mlp, mlp_bound(block.mlp)))
    rows.append(Row(f"{name}.norm2", norm_bound(block.norm2)))
    return rows


def downsample_rows(name: str, down: nn.Module, hw: Tuple[int, int]) -> List[Row]:
    """Swin patch merging (a 2x2 regrouping: norm-preserving, then norm and Linear) or CSwin conv + norm."""
    if isinstance(down, nn.Identity):
        return []
    if hasattr(down, "reduction"):
        return [Row(f"{name}.norm", norm_bound(down.norm)), Row(f"{name}.reduction", matrix_norm(down.reduction.weight))]
    return [Row(f"{name}.conv", conv_bound(down.conv, hw)), Row(f"{name}.norm", norm_bound(down.norm))]


@torch.no_grad()
def lipschitz_report(model: nn.Module, input_size: Optional[Tuple[int, int, int]] = None) -> LipschitzReport:
    """Every layer's certified bound and the network bound (eq. 19; eq. 21 with DropPath) of a LipsFormer
    at its input size (C, H, W), which is fixed when the model is built: ``input_size`` only checks it.
    Inputs and outputs are measured in the l2 norm of the whole tensor."""
    embed: PatchEmbed = model.patch_embed
    built = (embed.proj.in_channels, *embed.img_size)
    if input_size is not None and tuple(input_size) != built:
        raise ValueError(f"input_size {tuple(input_size)} differs from the size the model was built for, {built}; "
                         f"build it with img_size={tuple(input_size[1:])} to bound it at that size")
    rows = [Row("patch_embed.proj", conv_bound(embed.proj, embed.img_size)),
            Row("patch_embed.norm", norm_bound(embed.norm))]
    hw = embed.grid_size
    for i, stage in enumerate(model.stages):
        rows += downsample_rows(f"stages.{i}.downsample", stage.downsample, hw)
        if not isinstance(stage.downsample, nn.Identity):
            hw = (hw[0] // 2, hw[1] // 2)
        for j, block in enumerate(stage.blocks):
            rows += block_rows(f"stages.{i}.blocks.{j}", block, hw)
    rows.append(Row("norm", norm_bound(model.norm)))
    head = model.head
    if getattr(head, "global_pool", None) is not None and not isinstance(head.global_pool, nn.Identity):
        # mean over N tokens: ||mean(X) - mean(Y)|| <= ||X - Y|| / sqrt(N) (Cauchy-Schwarz)
        rows.append(Row("head.global_pool", 1.0 / math.sqrt(hw[0] * hw[1])))
    if isinstance(head.fc, nn.Linear):
        rows.append(Row("head.fc", matrix_norm(head.fc.weight)))
    return LipschitzReport(rows)
