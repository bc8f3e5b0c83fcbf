"""The Lipschitz choices of a LipsFormer model, in one typed object shared by both families.

Every field is a keyword argument of ``timm.create_model`` for every family
(``timm.create_model("lipsformer_swin_t", attn="attlip", v_norm=True)``); a family only sets its own
defaults (e.g. CSwin's tau 12). Adding an option is one field here, plus its use in the layer it changes.
"""
import dataclasses
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Mapping, Optional, Sequence, Tuple

from torch import nn

from .attention import ATTENTIONS, AttentionKernel
from .attlip import DEFAULT_TOL, FIRST_PASS_STEPS, FORMS, AttLipMixer
from .conv_blocks import ACTS, CONV_BLOCKS, create_act
from .init import INITS
from .norm import NORMS
from .normalized import LINEARS
from .residual import RESIDUALS

STAGE_ACTS = ("none", *ACTS)
# the fields that name a choice, and their choices: checked when the options are made
CHOICES = dict(norm=NORMS, attn=(*ATTENTIONS, "attlip"), init=INITS, conv_blocks=CONV_BLOCKS, residual=RESIDUALS,
               act=ACTS, linear=tuple(LINEARS), stage_act=STAGE_ACTS, attlip_form=tuple(FORMS))


# The certifiable configuration (issue 17), the one home of its choices: every layer 1-Lipschitz by construction
# or kept so, the bound computed from the weights. The ``*_cert`` models are a family's size with these fields
# (a family's own defaults, e.g. CSwin's tau, stay under them); keyword arguments still replace any of them.
CERTIFIABLE = MappingProxyType(dict(
    attn="attlip",          # AttLip Thm 4: 1-Lipschitz for any weights
    attlip_form="orthogonal",  # W = diag(s_h) Q: no Gram product in the solve, which starts from the uniform-
                            # attention prox (Swin-T at 224, random weights: 2 to 5 gradient evaluations a window on
                            # average instead of 12; benchmarks/certified_speed.py)
    attlip_steps=(2, FIRST_PASS_STEPS),  # evaluation takes the certified solve's first pass, as many evaluations as
                            # it may: plain evaluation (train.py's validation, eval.py) gives the certified outputs
    norm="none",            # CenterNorm would add D/(D-1) max|gamma| per norm
    residual="convex",      # (1 - a) x + a f(x), a in [0, 1]: 1-Lipschitz when f is
    act="groupsort",        # 1-Lipschitz, gradient-norm preserving (GELU: 1.1289)
    linear="normalized",    # Linear and non-overlapping convs divided by their spectral norm in every forward
                            # (the gradient sees it); kept by projection instead: 66% clean after 6 epochs, not 92%
    attlip_prox=True,       # the mixer returns prox(x): (1 - a) x + a prox(x), not (1 - 2a) x + a prox(x)
    conv_blocks="A",        # no depth-wise conv blocks (kept by projection; the same accuracy without, faster)
    alpha_init=0.1,         # the skip path keeps (1 - a) of the signal per residual
    stage_act="groupsort",  # a 1-Lipschitz activation after the patch embedding and each downsampling: the path
                            # between the blocks is otherwise linear (CSwin on digits, 10 epochs: 91.4 -> 94.4 clean)
))


@dataclass(frozen=True)
class LipschitzOptions:
    """The paper's Lipschitz switches (LipsFormer Table 3) and their parameters; defaults are the released Swin's.

    Args:
        norm: ``center`` | ``layer`` | ``none`` (Table 3).
        attn: ``scsa`` | ``dot`` | ``l2`` (Table 3) | ``attlip``.
        tau, learn_tau, v_norm, nu, tied_qk: see :class:`lipsformer.layers.AttentionKernel`
            (``l2`` with ``tied_qk`` is Kim et al.'s Lipschitz form).
        alpha_init: initial residual weights; ``None`` means ``1 / sum(depths)`` (released Swin).
        init: ``spectral`` | ``xavier`` | ``trunc_normal`` (Table 3).
        conv_blocks: ``A`` | ``B`` | ``C`` | ``D`` (Table 3).
        fused_attn: attention through ``scaled_dot_product_attention`` (else explicit softmax).
        attlip_eta, attlip_steps, attlip_tol: ``attn="attlip"``: proximal step, descent steps (training,
            evaluation) and solver tolerance; see :class:`lipsformer.layers.AttLipMixer`.
        attlip_form: ``attn="attlip"``: ``general`` (the paper's, W any matrix: :class:`lipsformer.layers.AttLip`)
            | ``orthogonal`` (``W = diag(s_h) Q``, Q orthogonal: the same block with a scalar Gram product per head,
            :class:`lipsformer.layers.attlip.OrthogonalAttLip`; the certifiable models' default). Their weights
            differ in name (``weight`` / ``rotation`` and ``scale``), so a checkpoint of one form does not load
            into the other.
        residual: ``add`` (LipsFormer's ``x + alpha f(x)``, bound ``1 + max|alpha| Lip(f)``) | ``convex``
            (``(1 - a) x + a f(x)`` with one scalar ``a`` in [0, 1]: 1-Lipschitz when ``f`` is;
            :class:`lipsformer.layers.residual.ConvexResidual`).
        act: ``gelu`` (LipsFormer) | ``groupsort`` (MaxMin, 1-Lipschitz) in the MLPs and conv blocks.
        linear: ``plain`` | ``normalized`` | ``normalized_power``: every Linear, and every non-overlapping
            convolution (patch embedding, downsampling, 1x1), divides its weight by its largest singular value
            (:class:`lipsformer.layers.normalized.NormalizedLinear` / ``NormalizedConv2d``; bound 1, and the
            gradient sees the normalisation, unlike keeping the norm by projection after each step): exact at
            evaluation; in training exact (``normalized``) or by persistent power iteration (``normalized_power``).
        attlip_prox: ``attn="attlip"``: the mixer returns ``prox(x)`` instead of ``prox(x) - x``. Under a convex
            residual ``(1 - a) x + a prox(x)`` moves the tokens toward their proximal point and is the identity at
            ``a = 0``; with ``prox(x) - x`` it is ``(1 - 2a) x + a prox(x)``, which contracts by ``1 - a``
            (both 1-Lipschitz mixers: AttLip Thm 4).
        stage_act: ``none`` (LipsFormer) | ``gelu`` | ``groupsort``: an activation opening every stage, after the
            patch embedding and after each downsampling. Under a convex residual the path between the blocks is
            otherwise linear (patch embedding, downsampling and the ``(1 - a) x`` skips), as a CNN without
            activations would be; ``groupsort`` keeps it 1-Lipschitz.
    """

    norm: str = "center"
    attn: str = "scsa"
    tau: float = 10.0
    learn_tau: bool = False
    v_norm: bool = False
    nu: float = 1.0
    tied_qk: bool = False
    alpha_init: Optional[float] = None
    init: str = "spectral"
    conv_blocks: str = "D"
    fused_attn: bool = True
    attlip_eta: float = 1.0
    attlip_steps: Tuple[int, int] = (2, 20)
    attlip_tol: float = DEFAULT_TOL
    residual: str = "add"
    act: str = "gelu"
    linear: str = "plain"
    attlip_prox: bool = False
    stage_act: str = "none"
    attlip_form: str = "general"

    def __post_init__(self):
        for name, choices in CHOICES.items():
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {getattr(self, name)!r}")

    @classmethod
    def from_kwargs(cls, owner: str, defaults: Mapping, options: Optional["LipschitzOptions"] = None,
                    **kwargs) -> "LipschitzOptions":
        """``options`` (or ``cls(**defaults)``) with ``kwargs`` replaced; an unknown name is a ``TypeError``
        worded as Python words one for ``owner``'s signature."""
        names = {f.name for f in dataclasses.fields(cls)}
        for key in kwargs:
            if key not in names:
                raise TypeError(f"{owner}.__init__() got an unexpected keyword argument {key!r}")
        return dataclasses.replace(options or cls(**defaults), **kwargs)

    def kernel(self) -> AttentionKernel:
        """A fresh attention kernel of this choice (``attn`` other than ``attlip``)."""
        return AttentionKernel(self.attn, tau=self.tau, learn_tau=self.learn_tau, v_norm=self.v_norm, nu=self.nu,
                               tied_qk=self.tied_qk, fused=self.fused_attn)

    def mixer(self, dim: int, heads: int, windows: Sequence[Tuple[int, int]],
              attention: Callable[[AttentionKernel], nn.Module]) -> Callable[[], nn.Module]:
        """A factory of one token mixer per block: ``AttLipMixer`` over ``windows`` for ``attn="attlip"``, else
        the family's ``attention(kernel)`` with a fresh kernel."""
        if self.attn == "attlip":
            return lambda: AttLipMixer(dim, heads, windows, self.attlip_eta, *self.attlip_steps, self.attlip_tol,
                                       delta=not self.attlip_prox, form=self.attlip_form)
        return lambda: attention(self.kernel())

    def stage_activation(self) -> nn.Module:
        """The module ``stage_act`` names (identity for ``none``)."""
        return nn.Identity() if self.stage_act == "none" else create_act(self.stage_act)

    def block_kwargs(self, alpha_init: float) -> dict:
        """The :class:`lipsformer.layers.LipsBlock` arguments these options set (``alpha_init`` resolved)."""
        return dict(norm=self.norm, conv_blocks=self.conv_blocks, alpha_init=alpha_init, act=self.act,
                    residual=self.residual)
