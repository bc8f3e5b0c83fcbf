"""The Lipschitz choices of a LipsFormer model, in one typed object shared by both families.

Every field is a keyword argument of ``timm.create_model`` for every family
(``timm.create_model("lipsformer_swin_t", attn="attlip", v_norm=True)``), or is given as one object
(``lipschitz=LipschitzOptions(attn="attlip", v_norm=True)``). Both routes go through
:meth:`LipschitzOptions.resolve`, the one place a model's choices are decided: the released Swin's values
(:data:`RELEASED`), under the family's own defaults (e.g. CSwin's tau 12), under a registered variant's preset
(:data:`CERTIFIABLE` for the ``*_cert`` models), under the fields the object sets, under the keyword arguments.
An object carries only what its maker chose: a field left out is :data:`UNSET` and takes the family's value.
Adding an option is one field here and its entry in :data:`RELEASED`, plus its use in the layer it changes.
"""
import dataclasses
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping, Optional, Sequence, Tuple

from torch import nn

from .attention import ATTENTIONS, AttentionKernel
from .attlip import FORMS, AttLipMixer
from .attlip_solver import DEFAULT_TOL, FIRST_PASS_STEPS
from .block import MLPS
from .conv_blocks import ACTS, CONV_BLOCKS, create_act
from .init import INITS
from .norm import NORMS
from .normalized import LINEARS
from .residual import RESIDUALS
from .shift import ShiftMixer


class _Unset:
    """The value of a :class:`LipschitzOptions` field its maker did not set (the family decides it)."""

    _instance = None

    def __new__(cls):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "UNSET"

    def __reduce__(self):
        return _Unset, ()


UNSET: Any = _Unset()

STAGE_ACTS = ("none", *ACTS)
# the ``attn`` choices that replace the family's attention by a mixer of their own (``LipschitzOptions.token_mixer``)
TOKEN_MIXERS = ("attlip", "shift")
MIXER_TYPES = (AttLipMixer, ShiftMixer)  # their modules, which keep their own windows (``set_windows``)
# the fields that name a choice, and their choices: checked when the options are made
CHOICES = dict(norm=NORMS, attn=(*ATTENTIONS, *TOKEN_MIXERS), init=INITS, conv_blocks=CONV_BLOCKS, residual=RESIDUALS,
               act=ACTS, linear=tuple(LINEARS), stage_act=STAGE_ACTS, mlp=MLPS, attlip_form=tuple(FORMS))


# The certifiable configuration, the one home of its choices: every layer 1-Lipschitz by construction
# or kept so, the bound computed from the weights. The ``*_cert`` models are a family's size with these fields
# (a family's own defaults, e.g. CSwin's tau, stay under them); the caller's ``lipschitz`` object and keyword
# arguments replace any of them (:func:`preset`).
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
                            # (the gradient sees it; kept by projection instead, training reaches less accuracy)
    attlip_prox=True,       # the mixer returns prox(x): (1 - a) x + a prox(x), not (1 - 2a) x + a prox(x)
    conv_blocks="A",        # no depth-wise conv blocks (kept by projection; the same accuracy without, faster)
    alpha_init=0.1,         # the skip path keeps (1 - a) of the signal per residual
    stage_act="groupsort",  # a 1-Lipschitz activation after the patch embedding and each downsampling: the path
                            # between the blocks is otherwise linear (CSwin on digits, 10 epochs: 91.4 -> 94.4 clean)
))


@dataclass(frozen=True)
class LipschitzOptions:
    """The paper's Lipschitz switches (LipsFormer Table 3) and their parameters, as chosen by their maker.

    A field not given is :data:`UNSET`: the model's family decides it (:meth:`resolve`), so
    ``LipschitzOptions(attn="l2", tied_qk=True)`` builds CSwin with CSwin's tau 12 and Swin with Swin's tau 10,
    as the same two keyword arguments do. A built model keeps its resolved choices, every field set, as
    ``model.lipschitz``. ``a | b``: ``a`` with the fields ``b`` sets replaced.

    Args (the released Swin's value, :data:`RELEASED`, in brackets):
        norm: ``center`` | ``layer`` | ``none`` (Table 3) [center].
        attn: ``scsa`` | ``dot`` | ``l2`` (Table 3) | ``attlip`` | ``shift`` (no attention: the attention-free
            mixer of the same parameters, :class:`lipsformer.layers.shift.ShiftMixer`) [scsa].
        tau, learn_tau, v_norm, nu, tied_qk: see :class:`lipsformer.layers.AttentionKernel`
            (``l2`` with ``tied_qk`` is Kim et al.'s Lipschitz form) [10, False, False, 1, False].
        alpha_init: initial residual weights; ``None`` means ``1 / sum(depths)`` (released Swin) [None].
        init: ``spectral`` | ``xavier`` | ``trunc_normal`` (Table 3) [spectral].
        conv_blocks: ``A`` | ``B`` | ``C`` | ``D`` (Table 3) [D].
        fused_attn: attention through ``scaled_dot_product_attention`` (else explicit softmax) [True].
        attlip_eta, attlip_steps, attlip_tol: ``attn="attlip"``: proximal step, descent steps (training,
            evaluation) and solver tolerance; see :class:`lipsformer.layers.AttLipMixer` [1, (2, 20), DEFAULT_TOL].
        attlip_form: ``attn="attlip"``: ``general`` (the paper's, W any matrix: :class:`lipsformer.layers.AttLip`)
            | ``orthogonal`` (``W = diag(s_h) Q``, Q orthogonal: the same block with a scalar Gram product per head,
            :class:`lipsformer.layers.attlip.OrthogonalAttLip`; the certifiable models' default). Their weights
            differ in name (``weight`` / ``rotation`` and ``scale``), so a checkpoint of one form does not load
            into the other [general].
        residual: ``add`` (LipsFormer's ``x + alpha f(x)``, bound ``1 + max|alpha| Lip(f)``) | ``convex``
            (``(1 - a) x + a f(x)`` with one scalar ``a`` in [0, 1]: 1-Lipschitz when ``f`` is;
            :class:`lipsformer.layers.residual.ConvexResidual`) [add].
        act: ``gelu`` (LipsFormer) | ``groupsort`` (MaxMin, 1-Lipschitz) in the MLPs and conv blocks [gelu].
        linear: ``plain`` | ``normalized`` | ``normalized_power``: every Linear, and every non-overlapping
            convolution (patch embedding, downsampling, 1x1), divides its weight by its largest singular value
            (:class:`lipsformer.layers.normalized.NormalizedLinear` / ``NormalizedConv2d``; bound 1, and the
            gradient sees the normalisation, unlike keeping the norm by projection after each step): exact at
            evaluation; in training exact (``normalized``) or by persistent power iteration (``normalized_power``)
            [plain].
        attlip_prox: ``attn="attlip"``: the mixer returns ``prox(x)`` instead of ``prox(x) - x``. Under a convex
            residual ``(1 - a) x + a prox(x)`` moves the tokens toward their proximal point and is the identity at
            ``a = 0``; with ``prox(x) - x`` it is ``(1 - 2a) x + a prox(x)``, which contracts by ``1 - a``
            (both 1-Lipschitz mixers: AttLip Thm 4) [False].
        stage_act: ``none`` (LipsFormer) | ``gelu`` | ``groupsort``: an activation opening every stage, after the
            patch embedding and after each downsampling. Under a convex residual the path between the blocks is
            otherwise linear (patch embedding, downsampling and the ``(1 - a) x`` skips), as a CNN without
            activations would be; ``groupsort`` keeps it 1-Lipschitz [none].
        alpha_range: ``residual="convex"``: where bound keeping keeps every residual weight ``a`` (attention, MLP,
            conv blocks; within [0, 1]); ``(0, 0)`` with ``alpha_init=0`` switches the branches off (the ablation), a
            floor keeps them on [(0, 1)].
        attlip_reflect: ``attn="attlip"``: the mixer returns the reflected resolvent ``2 prox(x) - x``
            (non-expansive), so ``(1 - a) x + a (2 prox(x) - x)`` is 1-Lipschitz and an isometry where ``prox`` is a
            projection [False].
        mlp: ``mlp`` (fc1, act, fc2) | ``cpl`` (a convex potential layer ``x - 2 W^T ReLU(W x + b)``,
            :class:`lipsformer.layers.block.CPLMlp`: 1-Lipschitz for ``||W|| <= 1``) [mlp].
    """

    norm: str = UNSET
    attn: str = UNSET
    tau: float = UNSET
    learn_tau: bool = UNSET
    v_norm: bool = UNSET
    nu: float = UNSET
    tied_qk: bool = UNSET
    alpha_init: Optional[float] = UNSET
    init: str = UNSET
    conv_blocks: str = UNSET
    fused_attn: bool = UNSET
    attlip_eta: float = UNSET
    attlip_steps: Tuple[int, int] = UNSET
    attlip_tol: float = UNSET
    residual: str = UNSET
    act: str = UNSET
    linear: str = UNSET
    attlip_prox: bool = UNSET
    stage_act: str = UNSET
    alpha_range: Tuple[float, float] = UNSET
    attlip_reflect: bool = UNSET
    mlp: str = UNSET
    attlip_form: str = UNSET

    def __post_init__(self):
        for name, choices in CHOICES.items():
            value = getattr(self, name)
            if value is not UNSET and value not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {value!r}")

    def __repr__(self) -> str:  # what its maker chose, as they would write it
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.chosen().items())})"

    def chosen(self) -> dict:
        """The fields this object sets (every field, for a model's resolved ``model.lipschitz``)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not UNSET}

    def __or__(self, other: Optional["LipschitzOptions"]) -> "LipschitzOptions":
        if other is None:
            return self
        if not isinstance(other, LipschitzOptions):
            raise TypeError(f"lipschitz must be a LipschitzOptions, got {type(other).__name__}")
        return dataclasses.replace(self, **other.chosen())

    @classmethod
    def resolve(cls, owner: str, family_defaults: Mapping, options: Optional["LipschitzOptions"] = None,
                **kwargs) -> "LipschitzOptions":
        """A model's Lipschitz choices, every field set: :data:`RELEASED`, then ``family_defaults``, then the
        fields ``options`` sets (a variant's preset already under them, see :func:`preset`), then ``kwargs``,
        each replacing the one before. An unknown keyword is a ``TypeError`` worded as Python words one for
        ``owner``'s signature; ``options`` of another type is one too."""
        names = {f.name for f in dataclasses.fields(cls)}
        for key in kwargs:
            if key not in names:
                raise TypeError(f"{owner}.__init__() got an unexpected keyword argument {key!r}")
        return cls(**RELEASED) | cls(**family_defaults) | options | cls(**kwargs)

    def kernel(self) -> AttentionKernel:
        """A fresh attention kernel of this choice (``attn`` other than ``attlip``)."""
        return AttentionKernel(self.attn, tau=self.tau, learn_tau=self.learn_tau, v_norm=self.v_norm, nu=self.nu,
                               tied_qk=self.tied_qk, fused=self.fused_attn)

    def token_mixer(self, dim: int, heads: int, windows: Sequence[Tuple[int, int]]) -> nn.Module:
        """The token mixer of ``attn`` in :data:`TOKEN_MIXERS` (both families'): AttLip over ``windows`` with these
        options, or the shift mixer (which has no windows)."""
        if self.attn == "shift":
            return ShiftMixer(dim)
        return AttLipMixer(dim, heads, windows, self.attlip_eta, *self.attlip_steps, self.attlip_tol,
                           delta=not self.attlip_prox, reflect=self.attlip_reflect, form=self.attlip_form)

    def stage_activation(self) -> nn.Module:
        """The module ``stage_act`` names (identity for ``none``)."""
        return nn.Identity() if self.stage_act == "none" else create_act(self.stage_act)

    def block_kwargs(self, num_blocks: int) -> dict:
        """The :class:`lipsformer.layers.LipsBlock` arguments these options set in a model of ``num_blocks`` blocks
        (``alpha_init=None``: ``1 / num_blocks``, the released Swin's)."""
        alpha_init = 1.0 / num_blocks if self.alpha_init is None else self.alpha_init
        return dict(norm=self.norm, conv_blocks=self.conv_blocks, alpha_init=alpha_init, act=self.act,
                    residual=self.residual, alpha_range=tuple(self.alpha_range), mlp=self.mlp)


# The released LipsFormer-Swin's choices: what a field no family, preset, object or keyword sets takes.
RELEASED = MappingProxyType(dict(
    norm="center", attn="scsa", tau=10.0, learn_tau=False, v_norm=False, nu=1.0, tied_qk=False, alpha_init=None,
    init="spectral", conv_blocks="D", fused_attn=True, attlip_eta=1.0, attlip_steps=(2, 20), attlip_tol=DEFAULT_TOL,
    residual="add", act="gelu", linear="plain", attlip_prox=False, stage_act="none",
    alpha_range=(0.0, 1.0), attlip_reflect=False, mlp="mlp", attlip_form="general"))
assert set(RELEASED) == {f.name for f in dataclasses.fields(LipschitzOptions)}, "every option needs its default"


def preset(values: Mapping, kwargs: dict) -> dict:
    """A registered variant's ``kwargs`` with its preset Lipschitz choices (e.g. :data:`CERTIFIABLE`) under the
    caller's: the caller's ``lipschitz`` object and keyword arguments replace any preset field, as they replace
    the family's defaults."""
    return dict(kwargs, lipschitz=LipschitzOptions(**values) | kwargs.get("lipschitz"))
