"""Certified upper bounds on Lipschitz constants (l2 norms; an image or token map is one flattened vector): the
network's report, composed from the bounds of its parts.

LipsFormer = Qi et al., Kim = Kim, Papamakarios & Mnih, "The Lipschitz constant of self-attention".
Bounds compose by products (Lipschitz constants of compositions multiply, LipsFormer Lemma 2).

The pieces: :mod:`lipsformer.lipschitz.registry` (which function bounds each module type, and how to register
one), :mod:`lipsformer.lipschitz.layer_bounds` (the bound of each layer type) and here the blocks' and stages'
rows, :class:`LipschitzReport` and :func:`lipschitz_report`. Each name is imported from its module;
:mod:`lipsformer.lipschitz` gathers the ones users call.
"""
import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
from timm.layers import ClassifierHead
from torch import nn

from ..layers import AttLipMixer
from ..layers.block import LipsBlock
from ..layers.conv_blocks import ConvBlocks
from ..layers.patch_embed import PatchEmbed
from ..models._base import LipsFormerBase, LipsStage
from ..models.lipsformer_cswin import ConvDownsample
from ..models.lipsformer_swin import PatchMerging
from ..models.peer import TorchlipCNN
from .layer_bounds import conv_bound, gelu_bound, matrix_norm
from .registry import (HW, INF, NoBoundError, Row, module_bound, module_rows, register_in, register_rows,
                       residual_row)


# -- blocks and the network ---------------------------------------------------------------------------
@dataclass
class LipschitzReport:
    rows: List[Row] = field(default_factory=list)
    #: when the network ends in a linear layer (``logits = W h + b``, the last row), ``W`` as its forward computes
    #: it, in float64: the pairwise certificate's ``||w_c - w_j||`` (:meth:`backbone` bounds ``h``)
    head: Optional[torch.Tensor] = None

    def backbone(self) -> "LipschitzReport":
        """The report of the map from the input to the last linear layer's input ``h`` (every row but the last):
        its :attr:`bound` and :attr:`defect` are the pairwise certificate's ``L_b`` and ``D_b``."""
        if self.head is None:
            raise ValueError("this network does not end in a linear layer: it has no backbone to bound apart")
        return LipschitzReport(self.rows[:-1])

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
    def defect(self) -> float:
        """A bound on ``||computed logits - exact logits||_2`` per image: each row's defect times the bound of the
        rows after it (AttLip appendix, "Composition of approximate proximal layers", with the Lipschitz constant
        of what follows each block instead of 1). Holds when every AttLip block meets its ``tol`` on every input,
        which :func:`~lipsformer.layers.attlip.solve_to_tolerance` guarantees or refuses."""
        out, after = 0.0, 0.0  # after: log10 of the product of the bounds of the rows after the current one
        for r in reversed(self.rows):
            if r.defect:
                out += r.defect * _power10(after)
            after += math.log10(r.lip)
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


@register_rows(ConvBlocks)
def conv_blocks_rows(convs: ConvBlocks, name: str, hw: HW) -> List[Row]:
    """Configurations B-D: ``x + s1 GELU(pw(GELU(dw1 x)))`` then ``x + s2 GELU(dw2 x)``."""
    rows = []
    if convs.dw1 is None:
        return rows
    g = gelu_bound() if convs.act is None else module_bound(convs.act).lip  # None: the fused GELU path
    branch = g * conv_bound(convs.dw1, hw)
    if convs.pw is not None:
        branch *= g * conv_bound(convs.pw, hw)
    rows.append(residual_row(f"{name}.res1", convs.res1, branch))
    if convs.dw2 is not None:
        rows.append(residual_row(f"{name}.res2", convs.res2, g * conv_bound(convs.dw2, hw)))
    return rows


@register_rows(LipsBlock)
def block_rows(block: LipsBlock, name: str, hw: HW) -> List[Row]:
    """Conv blocks, ``N1(x + alpha1 attn(x))``, ``N2(x + alpha2 mlp(x))``: the mixer and MLP by their types."""
    rows = module_rows(block.convs, f"{name}.convs", hw)
    attn, note = module_bound(block.attn, hw, f"{name}.attn")
    rows.append(residual_row(f"{name}.res_attn", block.res_attn, attn, note))
    if isinstance(block.attn, AttLipMixer):  # the residual scales the mixer's deviation by at most max|alpha|
        rows[-1].defect = rows[-1].alpha * block.attn.solver_defect(hw)
    rows += module_rows(block.norm1, f"{name}.norm1", hw)
    mlp, note = module_bound(block.mlp, hw, f"{name}.mlp")
    rows.append(residual_row(f"{name}.res_mlp", block.res_mlp, mlp, note))
    rows += module_rows(block.norm2, f"{name}.norm2", hw)
    return rows


@register_rows(PatchMerging)
def patch_merging_rows(down: PatchMerging, name: str, hw: HW) -> List[Row]:
    """Swin patch merging: a 2x2 regrouping (a permutation, norm-preserving), then norm and Linear."""
    return module_rows(down.norm, f"{name}.norm", hw) + module_rows(down.reduction, f"{name}.reduction", hw)


@register_rows(ConvDownsample)
def conv_downsample_rows(down: ConvDownsample, name: str, hw: HW) -> List[Row]:
    """CSwin downsampling: a 2x2 stride-2 conv on the ``hw`` input grid, then norm."""
    return module_rows(down.conv, f"{name}.conv", hw) + module_rows(down.norm, f"{name}.norm", hw)


@register_rows(PatchEmbed)
def patch_embed_rows(embed: PatchEmbed, name: str, hw: HW) -> List[Row]:
    """The stride-``patch`` conv on the image, then the norm on the token grid."""
    return module_rows(embed.proj, f"{name}.proj", embed.img_size) + module_rows(embed.norm, f"{name}.norm", hw)


@register_rows(ClassifierHead)
def classifier_head_rows(head: ClassifierHead, name: str, hw: HW) -> List[Row]:
    """timm's head: global pool, dropout (identity at evaluation), fc, flatten."""
    return [row for part in ("global_pool", "drop", "fc", "flatten")
            for row in module_rows(getattr(head, part), f"{name}.{part}", hw)]


#: network type -> ``fn(model) -> LipschitzReport``: networks other than LipsFormers that bound themselves (e.g. the
#: 1-Lipschitz CNN baselines), with :attr:`LipschitzReport.head` set when they end in a linear layer.
NETWORKS: Dict[type, Callable[[nn.Module], "LipschitzReport"]] = {}


def register_network(*types: type):
    """Decorator: ``fn(model) -> LipschitzReport`` bounds whole networks of ``types`` (not LipsFormers)."""
    return lambda fn: register_in(NETWORKS, types, fn)


def linear_head(rows: List[Row], layer: nn.Module, name: str) -> Optional[torch.Tensor]:
    """``layer``'s weight as its forward computes it (float64, detached) when ``layer`` is a Linear whose row,
    named ``name``, is the last of ``rows``, so that the logits are ``W h + b``; else None."""
    if isinstance(layer, nn.Linear) and rows and rows[-1].name == name:
        return layer.weight.detach().to(torch.float64)
    return None


@register_network(TorchlipCNN)
def torchlip_cnn_report(model: TorchlipCNN):
    """The certified report of a :class:`TorchlipCNN`: one row per layer of its Sequential, the last Linear its head."""
    from deel import torchlip

    rows: List[Row] = []
    hw = (model.img_size, model.img_size)
    with torch.no_grad():
        for i, layer in enumerate(model.net):
            name = f"net.{i}"
            if isinstance(layer, torchlip.SpectralConv2d) and tuple(layer.stride) == (1, 1) \
                    and layer.padding_mode == "zeros":
                rows.append(Row(name, conv_bound(layer, hw)))
            elif isinstance(layer, torchlip.ScaledL2NormPool2d):  # l2 norms of disjoint windows, times a coefficient
                rows.append(Row(name, abs(float(layer._coefficient_lip))))
                k = layer.kernel_size if isinstance(layer.kernel_size, int) else layer.kernel_size[0]
                hw = (hw[0] // k, hw[1] // k)
            elif isinstance(layer, torchlip.SpectralLinear):
                rows.append(Row(name, matrix_norm(layer.weight)))
            elif not isinstance(layer, (torchlip.GroupSort2, nn.Flatten)):  # those two: 1, no row
                raise NoBoundError(f"torchlip_cnn: no bound for layer {name} ({type(layer).__qualname__})")
    if not math.isfinite(sum(math.log10(r.lip) for r in rows)):
        raise NoBoundError("torchlip_cnn: a layer's bound is not finite")
    return LipschitzReport(rows, linear_head(rows, model.net[-1], f"net.{len(model.net) - 1}"))


@torch.no_grad()
def lipschitz_report(model: nn.Module, input_size: Optional[Tuple[int, int, int]] = None) -> LipschitzReport:
    """Every layer's certified bound and the network bound (eq. 19; eq. 21 with DropPath) of a LipsFormer
    at its input size (C, H, W), which is fixed when the model is built: ``input_size`` only checks it.
    Inputs and outputs are measured in the l2 norm of the whole tensor. Every module is bounded by its type
    (:data:`~.registry.BOUNDS`); a module of a type with no registered bound raises :class:`NoBoundError` naming it.
    A network of a type in :data:`NETWORKS` gives its own report. The report's :attr:`~LipschitzReport.head` is
    the classifier's weight when the network ends in it (``head.fc``, a Linear, with nothing after it)."""
    if type(model) in NETWORKS:
        return NETWORKS[type(model)](model)
    if not isinstance(model, LipsFormerBase):
        cls = type(model)
        raise NoBoundError(f"lipschitz_report bounds LipsFormer models; got {cls.__module__}.{cls.__qualname__}")
    embed: PatchEmbed = model.patch_embed
    built = (embed.proj.in_channels, *embed.img_size)
    if input_size is not None and tuple(input_size) != built:
        raise ValueError(f"input_size {tuple(input_size)} differs from the size the model was built for, {built}; "
                         f"build it with img_size={tuple(input_size[1:])} to bound it at that size")
    hw = embed.grid_size
    rows = module_rows(embed, "patch_embed", hw)
    for i, (stage, info) in enumerate(zip(model.stages, model.feature_info)):
        if type(stage) is not LipsStage:
            raise NoBoundError(f"stages.{i} is a {type(stage).__qualname__}, "
                               f"not a LipsStage (downsample, act, blocks)")
        out_hw = (embed.img_size[0] // info["reduction"], embed.img_size[1] // info["reduction"])
        rows += module_rows(stage.downsample, f"stages.{i}.downsample", hw)
        hw = out_hw
        rows += module_rows(stage.act, f"stages.{i}.act", hw)
        for j, block in enumerate(stage.blocks):
            rows += module_rows(block, f"stages.{i}.blocks.{j}", hw)
    rows += module_rows(model.norm, "norm", hw)
    rows += module_rows(model.head, "head", hw)
    return LipschitzReport(rows, linear_head(rows, getattr(model.head, "fc", None), "head.fc"))
