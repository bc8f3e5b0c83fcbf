"""LipsFormer-CSwin: CSwin Transformer with Lipschitz-continuous blocks (Qi et al., LipsFormer).

Architecture exactly as the CSwin-based code in the released repository's history
(IDEA-Research/LipsFormer ``models/cswin.py`` at commit 00acb80): a 4x4 stride-4 conv + CenterNorm
stem; cross-shaped window attention (half the channels and heads attend inside vertical stripes
of width ``split_size``, half inside horizontal ones; one full-attention branch where the stage
is no larger than the split, i.e. the last stage); SCSA with tau 12, fixed; LePE (a 3x3
depth-wise conv of v inside each stripe) added to each head's output; each branch divided by
sqrt(its heads); conv blocks D before the attention; CenterNorm after the MLP residual only;
2x2 stride-2 conv + CenterNorm between stages; no final norm; mean over tokens; linear head.
"""
import math
from typing import Optional, Sequence, Tuple

import torch
from timm.layers import register_notrace_module, to_2tuple
from timm.models import generate_default_cfgs, register_model
from torch import nn

from ..layers import AttentionKernel, LipsBlock, LipschitzOptions, PatchEmbed, create_norm
from ..layers.fused import fusable
from ..layers.options import CERTIFIABLE, MIXER_TYPES, TOKEN_MIXERS, preset
from ..layers.residual import OutScale, ScaledOutput, entry_linear, scaled_linear
from ..layers.shift import ShiftMixer
from ..layers.stripes import lepe_fusable, lepe_map, stripe_merge, stripe_qkv
from ..layers.windows import pad_to_multiple, window_partition, window_reverse
from ._base import (RELEASED_BLOCK_RENAMES, LipsFormerBase, LipsStage, build_with_cfg, certified_cfg,
                    check_arguments, convert_released, drop_path_rates, pretrained_cfg, rename_prefix)

__all__ = ["LipsFormerCSwin"]


@register_notrace_module  # reason: stripes and padding read the input's shape
class CrossShapedAttention(nn.Module, ScaledOutput):
    """CSwin attention on (B, H, W, C) with locally-enhanced positional encoding (LePE).

    With two branches, channels ``[:C/2]`` (the first half of the heads) attend inside vertical
    stripes ``(H, split)`` and channels ``[C/2:]`` inside horizontal stripes ``(split, W)``; with
    one branch (``full=True``) all heads attend over the whole map. Each branch's output is
    ``(attention(q, k, v) + LePE(v)) / sqrt(branch heads)``; the branches are concatenated and
    projected.
    """

    def __init__(self, dim: int, num_heads: int, resolution: Tuple[int, int], split_size: int,
                 kernel: AttentionKernel, full: bool = False, qkv_bias: bool = True, proj_drop: float = 0.0):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim {dim} must be divisible by num_heads {num_heads}")
        self.split_size, self.full = split_size, full
        self.set_resolution(resolution)
        if num_heads % len(self.windows):
            raise ValueError(f"num_heads {num_heads} must be even for two stripe branches")
        self.branch_heads = num_heads // len(self.windows)
        branch_dim = dim // len(self.windows)
        self.qkv = nn.Linear(dim, dim * kernel.num_proj, bias=qkv_bias)
        self.kernel = kernel
        self.lepe = nn.ModuleList(
            nn.Conv2d(branch_dim, branch_dim, 3, padding=1, groups=branch_dim) for _ in self.windows)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def set_resolution(self, resolution: Tuple[int, int]) -> None:
        """The stripes (or the whole map) for a stage of ``resolution``; the weights do not depend on it."""
        H, W = resolution
        self.windows = [(H, W)] if self.full else [(H, self.split_size), (self.split_size, W)]

    def out_map(self) -> Tuple[nn.Module, float]:
        """The projection; each branch divided by sqrt(its heads), folded into its weight."""
        return self.proj, 1.0 / math.sqrt(self.branch_heads)

    def out_dropout(self) -> nn.Module:
        return self.proj_drop

    def forward(self, x: torch.Tensor, out_scale: OutScale = None, skip: bool = False):
        """(B, H, W, C) -> (B, H, W, C). The stripes span the input's own H and W; a size the split does not
        divide (``strict_img_size=False``) is padded with zeros and cropped back. ``out_scale`` is folded into the
        projection (:class:`ScaledOutput`); ``skip``: also ``x`` as the qkv projection passes it on
        (:func:`entry_linear`; ``x`` itself where it is padded)."""
        B, H, W, C = x.shape
        padded = x if self.full else pad_to_multiple(x, (self.split_size, self.split_size))
        Hp, Wp = padded.shape[1:3]
        windows = [(Hp, Wp)] if self.full else [(Hp, self.split_size), (self.split_size, Wp)]
        P, nb = self.kernel.num_proj, len(windows)
        qkv, passed = entry_linear(padded, self.qkv, skip and padded is x)
        x_skip = passed if padded is x else x
        if self.kernel.normalizes_apart and fusable(qkv) and all(lepe_fusable(c) for c in self.lepe):
            x = self._fused_stripes(qkv, windows)
        else:
            x = self._stripes(qkv.view(B, Hp, Wp, P, nb, C // nb), windows)
        if (Hp, Wp) != (H, W):
            x = x[:, :H, :W]
        proj, input_scale = self.out_map()
        out = self.proj_drop(scaled_linear(x, proj, out_scale, input_scale))
        return (out, x_skip) if skip else out

    def _fused_stripes(self, qkv: torch.Tensor, windows: list) -> torch.Tensor:
        """The branches with SCSA as released, through the gather and merge ops (:func:`stripe_qkv`,
        :func:`stripe_merge`): the stripes' copies in and out, q and k's normalisation, each LePE and its sum with
        the attention, one pass each way on a GPU."""
        parts = stripe_qkv(qkv, list(self.lepe), windows, self.branch_heads, self.kernel.tau, self.kernel.eps)
        outs, lepes = [], []
        for (q, k, v, lepe), window in zip(parts, windows):
            outs.append(self.kernel.attend_normalized(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)))
            lepes.append(lepe_map(lepe, window))
        return stripe_merge(outs, lepes, windows, qkv.shape[1], qkv.shape[2])

    def _stripes(self, qkv: torch.Tensor, windows: list) -> torch.Tensor:
        """The branches in aten ops, for any attention kernel: (B, H, W, P, branches, C_b) -> (B, H, W, C)."""
        B, Hp, Wp, P, nb, _ = qkv.shape
        C = nb * qkv.shape[-1]
        outs = []
        for b, (part, window, lepe) in enumerate(zip(qkv.unbind(4), windows, self.lepe)):
            # (Bw, N, P, Cb), a copy: a stripe that spans the map is otherwise a view of the whole projection,
            # which the attention's saved q, k, v would keep alive (both branches' channels)
            stripes = window_partition(part, window).contiguous()
            Bw, N = stripes.shape[:2]
            q, k, v = self.kernel.split(stripes.view(Bw, N, P, self.branch_heads, -1))
            v_map = v.transpose(1, 2).reshape(Bw, window[0], window[1], -1).permute(0, 3, 1, 2)  # LePE's input
            if self.kernel.kim:
                v = self.kernel.kim_values(q, self.qkv, self.branch_heads, slice(b * (C // nb), (b + 1) * (C // nb)))
            out = self.kernel(q, k, v).transpose(1, 2).reshape(Bw, N, -1)
            out = out + lepe(v_map).flatten(2).transpose(1, 2)
            outs.append(window_reverse(out, window, Hp, Wp))
        return outs[0] if nb == 1 else torch.cat(outs, dim=-1)

    def extra_repr(self) -> str:
        return f"windows={self.windows}, branch_heads={self.branch_heads}"


class ConvDownsample(nn.Module):
    """2x2 stride-2 conv then norm: (B, H, W, C) -> (B, H/2, W/2, C_out); an odd H or W is zero-padded first
    (``strict_img_size=False``), giving ceil(H / 2)."""

    def __init__(self, dim: int, out_dim: int, norm: str = "center"):
        super().__init__()
        self.conv = nn.Conv2d(dim, out_dim, kernel_size=2, stride=2)
        self.norm = create_norm(norm, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.conv(pad_to_multiple(x, (2, 2)).permute(0, 3, 1, 2)).permute(0, 2, 3, 1))


def stage_stripes(i: int, res: Tuple[int, int], split: int, last: bool) -> Tuple[bool, list]:
    """Stage ``i``'s attention: ``(full, windows)``, full attention in the last stage and where the stage equals
    its split size (released rule), else vertical and horizontal stripes, which the split must divide."""
    if not isinstance(split, int) or split < 1:
        raise ValueError(f"split size {split!r} of stage {i} must be a positive integer")
    full = last or res == to_2tuple(split)
    if not full and (res[0] % split or res[1] % split):
        g = math.gcd(*res)
        fits = [d for d in range(1, g + 1) if g % d == 0]
        raise ValueError(f"stage {i} resolution {res} is not divisible by split size {split}; split sizes that "
                         f"divide it: {', '.join(map(str, fits))} (choose split_size and img_size so that every "
                         f"stage divides)")
    return full, [res] if full else [(res[0], split), (split, res[1])]


class LipsFormerCSwin(LipsFormerBase):
    """LipsFormer-CSwin. Defaults reproduce the released CSwin-based code.

    Args:
        img_size, patch_size, in_chans, num_classes, global_pool, embed_dim, depths, num_heads,
        mlp_ratio, qkv_bias, drop_rate, proj_drop_rate, drop_path_rate: as in
            :class:`lipsformer.models.LipsFormerSwin`.
        split_size: stripe width per stage; a stage whose size equals its split size, and the
            last stage, use full attention (released rule); every other stage must divide by it.
        strict_img_size: inputs must have ``img_size`` (default). ``False``: any size runs; stripes span the
            input's own height and width, padded with zeros where the split, patch or 2x2 downsampling does not
            divide and cropped back, so stage ``i`` maps are ceil(H / (patch * 2^i)) high.
        dynamic_img_size: timm's Swin's name for ``strict_img_size=False`` (as there: True accepts any input
            size, whatever ``strict_img_size`` says).
        lipschitz, and its fields as keyword arguments: the Lipschitz choices, as for the Swin family
            (:class:`lipsformer.layers.LipschitzOptions`); with ``attn="attlip"`` each stripe branch is an AttLip
            block on its half of the channels. Defaults, for every field neither the object nor a keyword sets:
            the released CSwin code's, tau 12 and ``alpha_init``
            0.2 (its ``ScaleLayer`` default; the ``alpha=dict(init_t=0.05)`` it is given is never used);
            ``alpha_init=None`` means ``1 / sum(depths)`` as for Swin.
    """

    lipschitz_defaults = dict(tau=12.0, alpha_init=0.2)

    def __init__(
            self,
            img_size=224,
            patch_size: int = 4,
            in_chans: int = 3,
            num_classes: int = 1000,
            global_pool: str = "avg",
            embed_dim: int = 64,
            depths: Sequence[int] = (1, 2, 21, 1),
            split_size: Sequence[int] = (1, 2, 7, 7),
            num_heads: Sequence[int] = (2, 4, 8, 16),
            mlp_ratio: float = 4.0,
            qkv_bias: bool = True,
            drop_rate: float = 0.0,
            proj_drop_rate: float = 0.0,
            drop_path_rate: float = 0.2,
            strict_img_size: bool = True,
            dynamic_img_size: bool = False,
            lipschitz: Optional[LipschitzOptions] = None,
            **lipschitz_kwargs,
    ):
        super().__init__()
        check_arguments(depths, num_heads, stage_lists=dict(split_size=split_size), in_chans=in_chans,
                        num_classes=num_classes, embed_dim=embed_dim, patch_size=patch_size, mlp_ratio=mlp_ratio,
                        drop_rate=drop_rate, proj_drop_rate=proj_drop_rate, drop_path_rate=drop_path_rate)
        lips = LipschitzOptions.resolve(type(self).__name__, self.lipschitz_defaults, lipschitz, **lipschitz_kwargs)
        self.split_size = tuple(split_size)
        strict_img_size = strict_img_size and not dynamic_img_size  # timm's Swin: dynamic_img_size wins
        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim, lips.norm, strict_img_size)

        dpr = drop_path_rates(drop_path_rate, sum(depths))
        block_kwargs = dict(mlp_ratio=mlp_ratio, drop=proj_drop_rate, attn_norm=False, **lips.block_kwargs(sum(depths)))
        stages = []
        for i, (depth, res) in enumerate(zip(depths, self._stage_resolutions(len(depths)))):
            dim = embed_dim * 2 ** i
            downsample = ConvDownsample(dim // 2, dim, lips.norm) if i > 0 else nn.Identity()
            full, windows = stage_stripes(i, res, split_size[i], i == len(depths) - 1)
            blocks = []
            for j in range(depth):
                if lips.attn in TOKEN_MIXERS:
                    attn = lips.token_mixer(dim, num_heads[i], windows)
                else:
                    attn = CrossShapedAttention(dim, num_heads[i], res, split_size[i], lips.kernel(), full=full,
                                                qkv_bias=qkv_bias, proj_drop=proj_drop_rate)
                blocks.append(LipsBlock(dim, attn, drop_path=dpr[sum(depths[:i]) + j], **block_kwargs))
            stages.append(LipsStage(downsample, blocks, lips.stage_activation()))
        self._set_stages(stages, embed_dim, lips)
        self.norm = nn.Identity()  # the released CSwin code has no final norm
        self._build_head(num_classes, global_pool, drop_rate)
        self._init_weights(lips.init)

    @torch.jit.ignore
    def set_input_size(self, img_size=None, split_size: Optional[Sequence[int]] = None) -> None:
        """Take inputs of another size and/or use other stripe widths. CSwin has no position table (LePE is a
        convolution), so every weight carries over; a stage may not change between stripes and full attention
        (its LePE convolutions differ in number)."""
        split_size = self.split_size if split_size is None else tuple(split_size)
        if len(split_size) != len(self.stages):
            raise ValueError(f"split_size {split_size} must have one size per stage ({len(self.stages)})")
        built = self.patch_embed.img_size
        self.patch_embed.set_input_size(built if img_size is None else img_size)
        try:
            plan = [stage_stripes(i, res, split, i == len(self.stages) - 1)
                    for i, (res, split) in enumerate(zip(self._stage_resolutions(), split_size))]
            for i, (stage, (full, _)) in enumerate(zip(self.stages, plan)):
                if isinstance(stage.blocks[0].attn, ShiftMixer):  # no windows, no weights that depend on them
                    continue
                now = len(stage.blocks[0].attn.windows) == 1
                if full != now:
                    raise ValueError(f"stage {i} would change from {'full attention' if now else 'stripes'} to "
                                     f"{'full attention' if full else 'stripes'}; its weights cannot carry over: "
                                     f"choose an img_size and split_size that keep it")
        except ValueError:
            self.patch_embed.set_input_size(built)
            raise
        for stage, res, split, (_, windows) in zip(self.stages, self._stage_resolutions(), split_size, plan):
            for block in stage.blocks:
                if isinstance(block.attn, MIXER_TYPES):
                    block.attn.set_windows(windows)
                else:
                    block.attn.split_size = split
                    block.attn.set_resolution(res)
        self.split_size = split_size

    @torch.jit.ignore
    def load_pretrained(self, path: str) -> None:
        """timm's ``custom_load`` hook: weights of either layout, converted by :func:`checkpoint_filter_fn`."""
        self.load_pretrained_file(path, checkpoint_filter_fn)


# -- released checkpoint layout <-> ours --------------------------------------------------------
# (released, ours) prefixes at block level, after the shared conv/residual renames.
_CSWIN_BLOCK_RENAMES = RELEASED_BLOCK_RENAMES + (
    ("qkv.", "attn.qkv."),
    ("proj.", "attn.proj."),
    ("attns.0.get_v.", "attn.lepe.0."),
    ("attns.1.get_v.", "attn.lepe.1."),
)
_CSWIN_TOP_RENAMES = (
    ("stage1_conv_embed.0.", "patch_embed.proj."),
    ("stage1_conv_embed.2.", "patch_embed.norm."),
    ("head.", "head.fc."),
)


def _released_to_ours(key: str) -> Optional[str]:
    parts = key.split(".")
    if parts[0].startswith("stage") and parts[0][5:].isdigit():
        if parts[2] == "norm1":
            return None  # built but never used by the released block
        suffix = rename_prefix(".".join(parts[2:]), _CSWIN_BLOCK_RENAMES)
        return f"stages.{int(parts[0][5:]) - 1}.blocks.{parts[1]}.{suffix}"
    if parts[0].startswith("merge"):
        return f"stages.{int(parts[0][5:])}.downsample." + ".".join(parts[1:])
    return rename_prefix(key, _CSWIN_TOP_RENAMES)


def checkpoint_filter_fn(state_dict: dict, model: LipsFormerCSwin) -> dict:
    """Convert a released-layout LipsFormer-CSwin state dict (raw or under ``"model"``) to ours.

    Unused released keys (``stageN.i.norm1.*``, ``nin`` without conv blocks) are dropped; a state
    dict already in our layout passes through unchanged.
    """
    return convert_released(state_dict, model, "stage1", _released_to_ours)



def released_state_dict(model: LipsFormerCSwin) -> dict:
    """Our state dict in the released code's layout (the inverse of :func:`checkpoint_filter_fn`).

    The released block also holds an unused ``norm1``; it is written at its initial value.
    """
    out = {}
    for key, value in model.state_dict().items():
        parts = key.split(".")
        if parts[0] == "stages" and parts[2] == "blocks":
            if parts[-1] == "tau":
                continue
            suffix = rename_prefix(".".join(parts[4:]), _CSWIN_BLOCK_RENAMES, inverse=True)
            out[f"stage{int(parts[1]) + 1}.{parts[3]}.{suffix}"] = value
            if suffix == "norm2.weight":
                out[f"stage{int(parts[1]) + 1}.{parts[3]}.norm1.weight"] = torch.ones_like(value)
                out[f"stage{int(parts[1]) + 1}.{parts[3]}.norm1.bias"] = torch.zeros_like(value)
        elif parts[0] == "stages" and parts[2] == "downsample":
            out[f"merge{parts[1]}." + ".".join(parts[3:])] = value
        else:
            out[rename_prefix(key, _CSWIN_TOP_RENAMES, inverse=True)] = value
    return out


def _create_lipsformer_cswin(variant: str, pretrained: bool = False, **kwargs) -> LipsFormerCSwin:
    return build_with_cfg(LipsFormerCSwin, variant, pretrained, checkpoint_filter_fn, **kwargs)


# No LipsFormer-CSwin weights have been released: the URLs are empty on purpose, and
# `pretrained=True` works only with `pretrained_cfg_overlay=dict(file=...)`.
default_cfgs = generate_default_cfgs({
    "lipsformer_cswin_t": pretrained_cfg(),
    "lipsformer_cswin_s": pretrained_cfg(),
    "lipsformer_cswin_b": pretrained_cfg(),
    # Certifiable (no weights): mean 0.5, std 1, so the network's bound is the pixel-space bound (certified_cfg).
    "lipsformer_cswin_t_cert": certified_cfg(),
})

CSWIN_T = dict(embed_dim=64, depths=(1, 2, 21, 1), num_heads=(2, 4, 8, 16), split_size=(1, 2, 7, 7))


@register_model
def lipsformer_cswin_t(pretrained: bool = False, **kwargs) -> LipsFormerCSwin:
    """LipsFormer-CSwin-T: 24M params, 4.7 GFLOPs, 83.5% top-1 (paper Table 2)."""
    return _create_lipsformer_cswin("lipsformer_cswin_t", pretrained, **dict(CSWIN_T, **kwargs))


@register_model
def lipsformer_cswin_s(pretrained: bool = False, **kwargs) -> LipsFormerCSwin:
    """LipsFormer-CSwin-S: 38M params, 7.6 GFLOPs, 83.8% top-1."""
    args = dict(embed_dim=64, depths=(2, 4, 32, 2), num_heads=(2, 4, 8, 16), split_size=(1, 2, 7, 7))
    return _create_lipsformer_cswin("lipsformer_cswin_s", pretrained, **dict(args, **kwargs))


@register_model
def lipsformer_cswin_b(pretrained: bool = False, **kwargs) -> LipsFormerCSwin:
    """LipsFormer-CSwin-B: 83M params, 16.3 GFLOPs, 84.6% top-1."""
    args = dict(embed_dim=96, depths=(2, 4, 32, 2), num_heads=(4, 8, 16, 32), split_size=(1, 2, 7, 7))
    return _create_lipsformer_cswin("lipsformer_cswin_b", pretrained, **dict(args, **kwargs))


@register_model
def lipsformer_cswin_t_cert(pretrained: bool = False, **kwargs) -> LipsFormerCSwin:
    """Certifiable LipsFormer-CSwin-T: CSwin-T's widths, depths and stripes with every layer 1-Lipschitz
    (:data:`lipsformer.layers.options.CERTIFIABLE`; AttLip runs in each stripe branch), so ``lipschitz_report``
    bounds it by 1 and ``predict_certified`` gives radii in pixel space. Preprocessing mean 0.5, std 1
    (``certified_cfg``: no 1/std factor in the bound). No weights; recipe: configs/lipsformer_cswin_t_cert.yaml."""
    kwargs = preset(CERTIFIABLE, dict(CSWIN_T, **kwargs))  # the caller's lipschitz object and keywords over it
    return _create_lipsformer_cswin("lipsformer_cswin_t_cert", pretrained, **kwargs)
