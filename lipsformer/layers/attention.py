"""Attention kernels: per-head ``(q, k, v) -> out`` maps, selected by name.

Every kernel takes ``q, k, v`` of shape (B, heads, N, head_dim) and an optional additive
logit ``bias`` broadcastable to (B, heads, N, N) (a relative position bias, a mask), and runs
through :func:`torch.nn.functional.scaled_dot_product_attention` (``fused=True``) or an
explicit softmax (``fused=False``; the reference the fused path is tested against, and a
path ``torch.func`` transforms can differentiate twice).
"""
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .fused import l2_normalize, qk_normalize

ATTENTIONS = ("scsa", "dot", "l2")


def fused_mask(bias: torch.Tensor, align: int) -> torch.Tensor:
    """``bias`` laid out as CUDA's fused SDPA kernels take a mask: last stride 1 (any other sends SDPA to its math
    kernel) and every other stride a multiple of ``align`` elements (the memory-efficient kernel's alignment, which
    eager SDPA pads to but a compiled graph calls the kernel without). A copy with its rows padded to ``align`` and
    narrowed back, where the layout differs; the values are ``bias``'s."""
    n = bias.shape[-1]
    if bias.stride(-1) == 1 and all(s % align == 0 for s, d in zip(bias.stride()[:-1], bias.shape[:-1]) if d > 1):
        return bias
    bias = bias.clone(memory_format=torch.contiguous_format)
    return F.pad(bias, (0, -n % align)).narrow(-1, 0, n) if n % align else bias


def _softmax_attention(q, k, v, scale, bias: Optional[torch.Tensor], fused: bool) -> torch.Tensor:
    """softmax(scale * q k^T + bias) v, fused or explicit. On the CPU a bias that needs a gradient sends SDPA to its
    unfused math path, which adds work to the explicit one (q and k scaled apart, masked-row checks in the softmax):
    there the explicit path runs."""
    if bias is not None:
        bias = bias.to(q.dtype)
        if fused and bias.requires_grad and torch.is_grad_enabled() and q.device.type == "cpu":
            fused = False
    if fused:
        if bias is not None:
            bias = fused_mask(bias, align=1 if q.device.type == "cpu" else 16)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
    logits = (q * scale if scale != 1.0 else q) @ k.transpose(-2, -1)
    if bias is not None:
        logits = logits + bias
    return logits.softmax(-1) @ v


def scsa(q, k, v, tau, bias=None, nu: Optional[float] = None, eps: float = 1e-12, fused: bool = True):
    r"""Scaled cosine similarity attention, LipsFormer eq. 6.

    .. math:: \mathrm{SCSA}(X) = \nu\, \mathrm{softmax}(\tau \hat Q \hat K^\top + B)\, \hat V

    with rows :math:`\hat q_i = q_i / \sqrt{\|q_i\|^2 + \epsilon}` (same for k). ``nu=None``
    keeps ``v`` unnormalised, as the released code does; a float (or tensor) ``nu`` normalises
    ``v`` and scales by ``nu``, as the paper does. ``tau`` may be a float or a 0-d tensor; a float is folded into
    the normalisation of q.
    """
    if isinstance(tau, torch.Tensor):  # learnable: SDPA's scale must be a float
        q, k = l2_normalize(q, eps) * tau.to(q.dtype), l2_normalize(k, eps)
    else:
        q, k = qk_normalize(q, k, eps, float(tau))
    if nu is not None:
        v = l2_normalize(v, eps, nu) if isinstance(nu, float) else l2_normalize(v, eps) * nu
    return _softmax_attention(q, k, v, 1.0, bias, fused)


def dot_attention(q, k, v, bias=None, fused: bool = True):
    r"""Standard scaled dot-product attention, :math:`\mathrm{softmax}(QK^\top/\sqrt{d} + B)V` (not Lipschitz)."""
    return _softmax_attention(q, k, v, q.shape[-1] ** -0.5, bias, fused)


def l2_attention(q, k, v, bias=None, fused: bool = True):
    r"""L2 self-attention, Kim et al. eq. 8: :math:`P_{ij} \propto \exp(-\|q_i - k_j\|^2 / \sqrt{D/H})`.

    Expanding :math:`-\|q_i - k_j\|^2 = 2 q_i\cdot k_j - \|k_j\|^2 - \|q_i\|^2` and dropping the
    last term (constant along each softmax row) gives a dot-product kernel with scale
    :math:`2/\sqrt{d}` and the additive bias :math:`-\|k_j\|^2/\sqrt{d}`, so it runs fused.
    With tied projections pass ``k = q`` (Kim et al. Thm 3.2 needs :math:`W^Q = W^K`).
    """
    d = q.shape[-1]
    key_bias = (k.pow(2).sum(-1) * (-1.0 / math.sqrt(d))).unsqueeze(-2)  # (B, H, 1, N)
    bias = key_bias if bias is None else key_bias + bias
    return _softmax_attention(q, k, v, 2.0 / math.sqrt(d), bias, fused)


def kim_value_map(wq: torch.Tensor, wv: torch.Tensor, heads: int) -> torch.Tensor:
    r"""Kim et al.'s per-head value map :math:`W^{Q,h\top} W^{V,h} / \sqrt{d}`, (heads, d, d), from query and
    value weights of shape (heads * d, D) (heads stacked by rows, as ``nn.Linear`` keeps them): the values
    :math:`X A_h W^{V,h}` are then ``q_h @ map_h`` with :math:`A_h = W^{Q,h} W^{Q,h\top} / \sqrt d`."""
    wq, wv = wq.reshape(heads, -1, wq.shape[-1]), wv.reshape(heads, -1, wv.shape[-1])
    return wq @ wv.transpose(-1, -2) / math.sqrt(wq.shape[1])


class AttentionKernel(nn.Module):
    """The Lipschitz choice of an attention layer, with its scalars; the layer owns q, k, v.

    Args:
        kind: ``scsa`` (LipsFormer), ``dot`` (standard) or ``l2`` (Kim et al.).
        tau: SCSA temperature (released code: 10 for Swin, 12 for CSwin).
        learn_tau: make ``tau`` a learnable scalar (parameter ``tau``); fixed otherwise.
        v_norm: SCSA only: l2-normalise ``v`` and scale by ``nu`` as in the paper
            (the released code keeps ``v`` unnormalised).
        nu: SCSA output scale when ``v_norm``.
        tied_qk: ``l2`` only: share ``W^Q = W^K`` and take Kim et al.'s Lipschitz form: the layer projects to
            (q, v) and the values become :math:`X A_h W^{V,h}` (see :meth:`kim_values`).
        eps: smoothing of the SCSA normalisation.
        fused: run through ``scaled_dot_product_attention``; ``False`` uses the explicit softmax.
    """

    def __init__(self, kind: str = "scsa", tau: float = 10.0, learn_tau: bool = False, v_norm: bool = False,
                 nu: float = 1.0, tied_qk: bool = False, eps: float = 1e-12, fused: bool = True):
        super().__init__()
        if kind not in ATTENTIONS:
            raise ValueError(f"attn must be one of {ATTENTIONS} or 'attlip' (a mixer of its own), got {kind!r}")
        if (learn_tau or v_norm) and kind != "scsa":
            raise ValueError(f"learn_tau and v_norm apply to attn='scsa' only, got attn={kind!r}")
        if tied_qk and kind != "l2":
            raise ValueError(f"tied_qk applies to attn='l2' only, got attn={kind!r}")
        if kind == "scsa" and tau <= 0:
            raise ValueError(f"tau must be positive, got {tau}")
        self.kind = kind
        self.tau = nn.Parameter(torch.tensor(float(tau))) if learn_tau else float(tau)
        self.nu = float(nu) if v_norm else None
        self.tied_qk = tied_qk
        self.eps = eps
        self.fused = fused

    @property
    def num_proj(self) -> int:
        """How many dim-sized projections the layer computes: (q, v) when tied, else (q, k, v)."""
        return 2 if self.tied_qk else 3

    def split(self, qkv: torch.Tensor):
        """q, k, v of shape (B, heads, N, d) from projections laid out (B, N, P, heads, d) (k is q when tied).

        ``unbind`` over that layout makes backward stack the three gradients straight into the projection's
        (B, N, P * heads * d) layout: indexing would fill a zero tensor of the whole stack per part, and a
        (P, B, heads, N, d) permutation would need one more copy back.
        """
        parts = [t.transpose(1, 2) for t in qkv.unbind(2)]
        return (parts[0], parts[0], parts[1]) if self.tied_qk else tuple(parts)

    @property
    def kim(self) -> bool:
        """Kim et al.'s L2 form (tied weights, A_h factor): Lipschitz by their Theorem 3.2."""
        return self.kind == "l2" and self.tied_qk

    @staticmethod
    def kim_values(q: torch.Tensor, qkv: nn.Linear, heads: int, rows: slice = slice(None)) -> torch.Tensor:
        r"""Kim et al.'s values :math:`X A_h W^{V,h} + b^{V,h}`, with :math:`A_h = W^{Q,h} W^{Q,h\top}/\sqrt{d}`.

        Computed from the tied query ``q`` (B, heads, N, d) of the tied ``qkv`` projection (rows ``[q; v]``):
        :math:`X W^{Q,h} = q_h - b^{Q,h}`, so the values are :math:`(q_h - b^{Q,h}) W^{Q,h\top} W^{V,h} / \sqrt d`
        plus the value bias. ``rows`` selects a channel range of q and v (a CSwin branch).
        """
        dim = qkv.weight.shape[1]
        w = qkv.weight.view(2, dim, dim)[:, rows]
        value_map = kim_value_map(w[0], w[1], heads)
        if qkv.bias is None:
            return q @ value_map
        b = qkv.bias.view(2, dim)[:, rows].reshape(2, heads, 1, -1)
        return (q - b[0]) @ value_map + b[1]

    @property
    def normalizes_apart(self) -> bool:
        """SCSA as released (a fixed temperature, v as it is), fused: its q and k may come normalised from the op
        that gathers them (:func:`lipsformer.layers.stripes.stripe_qkv`), and :meth:`attend_normalized` attends."""
        return self.kind == "scsa" and not isinstance(self.tau, torch.Tensor) and self.nu is None and self.fused

    def attend_normalized(self, q, k, v) -> torch.Tensor:
        """SCSA on q and k already normalised, q times tau (:attr:`normalizes_apart`)."""
        return _softmax_attention(q, k, v, 1.0, None, True)

    def forward(self, q, k, v, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.kind == "scsa":
            return scsa(q, k, v, self.tau, bias, nu=self.nu, eps=self.eps, fused=self.fused)
        if self.kind == "dot":
            return dot_attention(q, k, v, bias, fused=self.fused)
        return l2_attention(q, k, v, bias, fused=self.fused)

    def extra_repr(self) -> str:
        s = f"kind={self.kind!r}"
        if self.kind == "scsa":
            s += f", tau={float(self.tau):g}, v_norm={self.nu is not None}"
        if self.tied_qk:
            s += ", tied_qk=True"
        return s


class KimL2Attention(nn.Module):
    r"""L2 multi-head self-attention in Kim et al.'s Lipschitz form (Sec. 3.2) on token groups (B, N, C).

    .. math:: F(X) = [f^1(X) W^{V,1}, \dots, f^H(X) W^{V,H}]\, W^O,\quad f^h(X) = P^h X A_h,

    with tied :math:`W^{Q,h} = W^{K,h}`, :math:`P^h_{ij} \propto \exp(-\|x_i W^{Q,h} - x_j W^{Q,h}\|^2/\sqrt{D/H})`
    and :math:`A_h = W^{Q,h} W^{Q,h\top} / \sqrt{D/H}`. Since
    :math:`X A_h W^{V,h} = q_h (W^{Q,h\top} W^{V,h})/\sqrt{D/H}`, the value path is a (d_h x d_h) map of q and the
    attention runs through :func:`l2_attention` (fused).
    Theorem 3.2 bounds its Lipschitz constant (:func:`lipsformer.lipschitz.layer_bounds.kim_l2_bound`).
    """

    def __init__(self, dim: int, heads: int = 1, fused: bool = True):
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} must be divisible by heads {heads}")
        self.heads, self.fused = heads, fused
        self.q = nn.Linear(dim, dim, bias=False)  # W^Q = W^K, heads stacked by rows
        self.v = nn.Linear(dim, dim, bias=False)  # W^{V,h} transposed, heads stacked by rows
        self.proj = nn.Linear(dim, dim, bias=False)  # W^O

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        q = self.q(x).view(B, N, self.heads, -1).transpose(1, 2)  # (B, H, N, d)
        out = l2_attention(q, q, q @ kim_value_map(self.q.weight, self.v.weight, self.heads), fused=self.fused)
        return self.proj(out.transpose(1, 2).reshape(B, N, C))
