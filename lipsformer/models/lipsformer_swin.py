"""LipsFormer-Swin: Swin Transformer with Lipschitz-continuous blocks (Qi et al., LipsFormer).

Architecture exactly as the released code (IDEA-Research/LipsFormer ``models/lipsformer_swin.py``)
so the released LipsFormer-Swin-T checkpoint converts and gives the same logits:
no shifted windows (the depth-wise convolutions mix across windows), window 7, a relative
position bias per head, SCSA with tau 10 and unnormalised v, conv blocks D, CenterNorm after
the attention and after the MLP residual, patch merging at the start of stages 2-4, a final
CenterNorm, average pooling and a linear head; spectral initialisation.
"""
import collections
import math
import warnings
from typing import List, Optional, Sequence, Tuple

import torch
from timm.layers import register_notrace_module, resize_rel_pos_bias_table, to_2tuple, trunc_normal_
from timm.models import generate_default_cfgs, register_model
from torch import nn

from ..layers import AttentionKernel, LipsBlock, LipschitzOptions, PatchEmbed, create_norm
from ..layers.options import CERTIFIABLE, MIXER_TYPES, TOKEN_MIXERS, preset
from ..layers.residual import OutScale, ScaledOutput, scaled_linear
from ..layers.windows import pad_to_multiple, window_partition, window_reverse_heads
from ._base import (RELEASED_BLOCK_RENAMES, LipsFormerBase, LipsStage, build_with_cfg, certified_cfg,
                    check_arguments, convert_released, drop_path_rates, pretrained_cfg, rename_prefix)

__all__ = ["LipsFormerSwin"]


def relative_position_index(window: Tuple[int, int]) -> torch.Tensor:
    """(N, N) index into a ((2wh-1)(2ww-1), heads) bias table, as in Swin."""
    wh, ww = window
    coords = torch.stack(torch.meshgrid(torch.arange(wh), torch.arange(ww), indexing="ij")).flatten(1)
    rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0)
    return (rel[..., 0] + wh - 1) * (2 * ww - 1) + (rel[..., 1] + ww - 1)


# What timm's resize_rel_pos_bias_table makes torch warn about on each call (its grid interpolator's list index and
# non-contiguous searchsorted input): timm's code, nothing a user can change, so not shown to one.
_TIMM_RESIZE_WARNINGS = (r"torch\.searchsorted\(\): input value tensor is non-contiguous",
                         r"Using a non-tuple sequence for multidimensional indexing")


def resize_bias_table(table: torch.Tensor, window: Tuple[int, int], shape: Tuple[int, int]) -> torch.Tensor:
    """timm's ``resize_rel_pos_bias_table`` (bicubic), the table timm's Swin resizes to, without torch's warnings
    about timm's interpolator."""
    with warnings.catch_warnings():
        for message in _TIMM_RESIZE_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=UserWarning)
        return resize_rel_pos_bias_table(table, new_window_size=window, new_bias_shape=shape)


@register_notrace_module  # reason: window partitioning and padding read the input's shape
class WindowAttention(nn.Module, ScaledOutput):
    """Multi-head attention inside non-overlapping windows of (B, H, W, C), with relative position bias."""

    def __init__(self, dim: int, num_heads: int, window: Tuple[int, int], kernel: AttentionKernel,
                 qkv_bias: bool = True, proj_drop: float = 0.0):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim {dim} must be divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.window = window
        self.qkv = nn.Linear(dim, dim * kernel.num_proj, bias=qkv_bias)
        self.kernel = kernel
        self.relative_position_bias_table = nn.Parameter(
            torch.zeros((2 * window[0] - 1) * (2 * window[1] - 1), num_heads))
        trunc_normal_(self.relative_position_bias_table, std=0.02)
        self.register_buffer("relative_position_index", relative_position_index(window), persistent=False)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def set_window(self, window: Tuple[int, int]) -> None:
        """Attend in windows of another size: the bias table is resized as timm's Swin resizes it (bicubic,
        ``resize_rel_pos_bias_table``) into a new parameter, and the index buffer is rebuilt."""
        window = tuple(window)
        if window == self.window:
            return
        table = self.relative_position_bias_table
        with torch.no_grad():
            entries = (2 * window[0] - 1) * (2 * window[1] - 1)
            resized = resize_bias_table(table.detach(), window, (entries, self.num_heads))
        self.relative_position_bias_table = nn.Parameter(resized.to(table.dtype), requires_grad=table.requires_grad)
        self.register_buffer("relative_position_index", relative_position_index(window).to(table.device),
                             persistent=False)
        self.window = window

    def position_bias(self) -> torch.Tensor:
        """(1, heads, N, N): four dimensions, which CPU's fused SDPA kernel needs (it refuses a 3-d mask)."""
        n = self.window[0] * self.window[1]
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)]
        return bias.view(n, n, self.num_heads).permute(2, 0, 1).unsqueeze(0)

    def out_map(self) -> Tuple[nn.Module, float]:
        return self.proj, 1.0

    def out_dropout(self) -> nn.Module:
        return self.proj_drop

    def forward(self, x: torch.Tensor, out_scale: OutScale = None, skip: bool = False):
        """(B, H, W, C) -> (B, H, W, C); a size the window does not divide (``strict_img_size=False``) is padded
        with zeros and cropped back. ``out_scale`` is folded into the projection (:class:`ScaledOutput`), which runs
        on the tokens put back in place (a linear map per token: the same values as in window order). ``skip``:
        also ``x`` itself (the projection reads windows, a copy of ``x``, not ``x``)."""
        if skip:
            return self(x, out_scale), x
        B, H, W, C = x.shape
        x = pad_to_multiple(x, self.window)
        Hp, Wp = x.shape[1:3]
        windows = window_partition(x, self.window)
        Bw, N, _ = windows.shape
        q, k, v = self.kernel.split(self.qkv(windows).view(Bw, N, self.kernel.num_proj, self.num_heads, -1))
        if self.kernel.kim:
            v = self.kernel.kim_values(q, self.qkv, self.num_heads)
        out = window_reverse_heads(self.kernel(q, k, v, self.position_bias()), self.window, Hp, Wp)
        if (Hp, Wp) != (H, W):
            out = out[:, :H, :W]
        return self.proj_drop(scaled_linear(out, self.proj, out_scale))

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, window={self.window}"


@register_notrace_module  # reason: padding and the 2x2 regrouping read the input's shape
class PatchMerging(nn.Module):
    """Concatenate each 2x2 neighbourhood, norm(4C), Linear(4C, 2C, no bias): (B, H, W, C) -> (B, H/2, W/2, 2C).

    An odd H or W is zero-padded first (``strict_img_size=False``)."""

    def __init__(self, dim: int, norm: str = "center"):
        super().__init__()
        self.norm = create_norm(norm, 4 * dim)
        self.reduction = nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = pad_to_multiple(x, (2, 2))  # an odd size (strict_img_size=False) gives ceil(H / 2), as timm's Swin
        B, H, W, C = x.shape
        # channel order (h0 w0, h1 w0, h0 w1, h1 w1), as the released code's torch.cat([x0, x1, x2, x3])
        x = x.reshape(B, H // 2, 2, W // 2, 2, C).permute(0, 1, 3, 4, 2, 5).flatten(3)
        return self.reduction(self.norm(x))


def stage_window(i: int, res: Tuple[int, int], window_size: int) -> Tuple[int, int]:
    """Stage ``i``'s window: ``window_size``, or the whole stage when it is no larger (released rule)."""
    if not isinstance(window_size, int) or window_size < 1:
        raise ValueError(f"window_size {window_size!r} must be a positive integer")
    window = to_2tuple(min(res)) if min(res) <= window_size else to_2tuple(window_size)
    if res[0] % window[0] or res[1] % window[1]:
        raise ValueError(f"stage {i} resolution {res} is not divisible by window size {window[0]}; "
                         f"choose window_size and img_size so that every stage divides")
    return window


class LipsFormerSwin(LipsFormerBase):
    """LipsFormer-Swin. Defaults reproduce the released LipsFormer-Swin-T.

    Args:
        img_size, patch_size, in_chans, num_classes, global_pool, embed_dim, depths, num_heads,
        window_size, mlp_ratio, qkv_bias: as in timm's Swin. A stage smaller than the window
            attends over the whole stage (released rule); every stage must divide by its window.
        drop_rate: classifier dropout; proj_drop_rate: dropout after MLP and attention projections.
        drop_path_rate: stochastic depth, linear over blocks, the same inside a block.
        num_classes: 0 builds no classifier (the pooled features come out, as timm's models); 1 a single logit.
        Every argument is checked before anything is built (:func:`lipsformer.models._base.check_arguments`): a
            value the model cannot use is a ``ValueError`` naming the argument.
        strict_img_size: inputs must have ``img_size`` (default). ``False``: any size runs, padded with zeros
            where a patch, window or 2x2 merge does not divide and cropped back, so stage ``i`` maps are
            ceil(H / (patch * 2^i)) high (for detection / segmentation backbones), as timm's Swin.
        dynamic_img_size: timm's Swin's name for ``strict_img_size=False`` (as there: True accepts any input
            size, whatever ``strict_img_size`` says).
        lipschitz: the Lipschitz choices as one :class:`lipsformer.layers.LipschitzOptions`; its fields
            (``norm``, ``attn``, ``tau``, ``learn_tau``, ``v_norm``, ``nu``, ``tied_qk``, ``alpha_init``, ``init``,
            ``conv_blocks``, ``fused_attn``, ``attlip_eta``, ``attlip_steps``, ``attlip_tol``, ``residual``, ``act``,
            ``linear``, ``attlip_prox``, ``stage_act``, ``alpha_range``, ``attlip_reflect``, ``mlp``, ``attlip_form``)
            are also keyword arguments, replacing the object's; a field neither sets is the family's default
            (:meth:`LipschitzOptions.resolve`). Defaults: the released Swin (tau 10, alpha 1 / sum(depths)).
    """

    lipschitz_defaults = {}  # the released Swin's values are the base of every family (options.RELEASED)

    def __init__(
            self,
            img_size=224,
            patch_size: int = 4,
            in_chans: int = 3,
            num_classes: int = 1000,
            global_pool: str = "avg",
            embed_dim: int = 96,
            depths: Sequence[int] = (2, 2, 6, 2),
            num_heads: Sequence[int] = (3, 6, 12, 24),
            window_size: int = 7,
            mlp_ratio: float = 4.0,
            qkv_bias: bool = True,
            drop_rate: float = 0.0,
            proj_drop_rate: float = 0.0,
            drop_path_rate: float = 0.1,
            strict_img_size: bool = True,
            dynamic_img_size: bool = False,
            lipschitz: Optional[LipschitzOptions] = None,
            **lipschitz_kwargs,
    ):
        super().__init__()
        check_arguments(depths, num_heads, in_chans=in_chans, num_classes=num_classes, embed_dim=embed_dim,
                        patch_size=patch_size, mlp_ratio=mlp_ratio, drop_rate=drop_rate, proj_drop_rate=proj_drop_rate,
                        drop_path_rate=drop_path_rate)
        lips = LipschitzOptions.resolve(type(self).__name__, self.lipschitz_defaults, lipschitz, **lipschitz_kwargs)
        self.window_size = window_size
        strict_img_size = strict_img_size and not dynamic_img_size  # timm's Swin: dynamic_img_size wins
        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim, lips.norm, strict_img_size)

        dpr = drop_path_rates(drop_path_rate, sum(depths))
        block_kwargs = dict(mlp_ratio=mlp_ratio, drop=proj_drop_rate, attn_norm=True, **lips.block_kwargs(sum(depths)))
        stages = []
        for i, (depth, res) in enumerate(zip(depths, self._stage_resolutions(len(depths)))):
            dim = embed_dim * 2 ** i
            downsample = PatchMerging(dim // 2, lips.norm) if i > 0 else nn.Identity()
            window = stage_window(i, res, window_size)
            blocks = []
            for j in range(depth):
                if lips.attn in TOKEN_MIXERS:
                    attn = lips.token_mixer(dim, num_heads[i], [window])
                else:
                    attn = WindowAttention(dim, num_heads[i], window, lips.kernel(), qkv_bias=qkv_bias,
                                           proj_drop=proj_drop_rate)
                blocks.append(LipsBlock(dim, attn, drop_path=dpr[sum(depths[:i]) + j], **block_kwargs))
            stages.append(LipsStage(downsample, blocks, lips.stage_activation()))
        self._set_stages(stages, embed_dim, lips)
        self.norm = create_norm(lips.norm, self.num_features)
        self._build_head(num_classes, global_pool, drop_rate)
        self._init_weights(lips.init)

    @torch.jit.ignore
    def set_input_size(self, img_size=None, window_size: Optional[int] = None) -> None:
        """Take inputs of another size and/or attend in windows of another size, as timm's
        ``SwinTransformer.set_input_size``: each relative position bias table is resized (bicubic, timm's
        ``resize_rel_pos_bias_table``, as :func:`checkpoint_filter_fn` resizes a loaded one) into a new parameter,
        index buffers are rebuilt, every other weight carries over. Create the optimizer afterwards."""
        window_size = self.window_size if window_size is None else window_size
        built = self.patch_embed.img_size
        self.patch_embed.set_input_size(built if img_size is None else img_size)
        try:
            windows = [stage_window(i, res, window_size) for i, res in enumerate(self._stage_resolutions())]
        except ValueError:
            self.patch_embed.set_input_size(built)
            raise
        for stage, window in zip(self.stages, windows):
            for block in stage.blocks:
                if isinstance(block.attn, MIXER_TYPES):
                    block.attn.set_windows([window])
                else:
                    block.attn.set_window(window)
        self.window_size = window_size

    @torch.jit.ignore
    def load_pretrained(self, path: str) -> None:
        """timm's ``custom_load`` hook: weights of either layout, converted by :func:`checkpoint_filter_fn`."""
        self.load_pretrained_file(path, checkpoint_filter_fn)


# -- released checkpoint layout <-> ours --------------------------------------------------------
def _released_to_ours(key: str) -> Optional[str]:
    parts = key.split(".")
    if parts[0] == "layers" and parts[2] == "blocks":
        if parts[4] == "attn" and parts[5] == "relative_position_index" or parts[4] == "attn_mask":
            return None  # buffers we rebuild
        suffix = rename_prefix(".".join(parts[4:]), RELEASED_BLOCK_RENAMES)
        return f"stages.{parts[1]}.blocks.{parts[3]}.{suffix}"
    if parts[0] == "layers" and parts[2] == "downsample":
        return f"stages.{int(parts[1]) + 1}.downsample." + ".".join(parts[3:])
    if parts[0] == "head":
        return "head.fc." + ".".join(parts[1:])
    return key


def _resize_bias_tables(state_dict: dict, model: LipsFormerSwin) -> Tuple[dict, List[str]]:
    """Each relative position bias table of a square window whose shape differs from the model's, resized to the
    model's window as timm's Swin ``checkpoint_filter_fn`` does (bicubic, ``resize_rel_pos_bias_table``), with one
    line per pair of window sizes. A table of another shape is left for the fit check to name."""
    out, resized = dict(state_dict), collections.Counter()
    for key, value in state_dict.items():
        if not key.endswith(".relative_position_bias_table"):
            continue
        try:
            attn = model.get_submodule(key.rsplit(".", 1)[0])
        except AttributeError:
            continue  # not in this model: the fit check names it
        shape = attn.relative_position_bias_table.shape if isinstance(attn, WindowAttention) else None
        if shape is None or value.shape == shape or value.dim() != 2 or value.shape[1] != shape[1]:
            continue
        side = math.isqrt(value.shape[0])  # a square window w's table has (2w - 1)^2 rows
        if side * side != value.shape[0] or side % 2 == 0:
            continue
        out[key] = resize_bias_table(value.float(), attn.window, shape)
        resized[((side + 1) // 2, tuple(attn.window))] += 1
    return out, [f"{n} relative position bias table{'s' * (n > 1)} (window {w}x{w} -> {a}x{b}, bicubic)"
                 for (w, (a, b)), n in resized.items()]


def checkpoint_filter_fn(state_dict: dict, model: LipsFormerSwin) -> dict:
    """Convert a released-layout LipsFormer-Swin state dict (raw or under ``"model"``) to ours.

    A state dict already in our layout passes through unchanged. Relative position bias tables for another
    window size (another ``img_size`` or ``window_size``) are resized to the model's (bicubic, as timm).
    """
    return convert_released(state_dict, model, "layers.", _released_to_ours, adapt=_resize_bias_tables)



def released_state_dict(model: LipsFormerSwin) -> dict:
    """Our state dict in the released code's layout (the inverse of :func:`checkpoint_filter_fn`)."""
    out = {}
    for key, value in model.state_dict().items():
        parts = key.split(".")
        if parts[0] == "stages" and parts[2] == "blocks":
            if parts[-1] == "tau":
                continue
            suffix = rename_prefix(".".join(parts[4:]), RELEASED_BLOCK_RENAMES, inverse=True)
            out[f"layers.{parts[1]}.blocks.{parts[3]}.{suffix}"] = value
        elif parts[0] == "stages" and parts[2] == "downsample":
            out[f"layers.{int(parts[1]) - 1}.downsample." + ".".join(parts[3:])] = value
        elif parts[0] == "head":
            out["head." + ".".join(parts[2:])] = value
        else:
            out[key] = value
    for name, module in model.named_modules():
        if isinstance(module, WindowAttention):
            s, i, _, j = name.split(".")[:4]
            out[f"layers.{i}.blocks.{j}.attn.relative_position_index"] = module.relative_position_index.clone()
    return out


def _create_lipsformer_swin(variant: str, pretrained: bool = False, **kwargs) -> LipsFormerSwin:
    return build_with_cfg(LipsFormerSwin, variant, pretrained, checkpoint_filter_fn, **kwargs)


default_cfgs = generate_default_cfgs({
    # The one published LipsFormer weight: 82.7% top-1 on ImageNet-1k (released README).
    "lipsformer_swin_t.official_in1k": pretrained_cfg(
        url="https://github.com/cyh1112/LipsFormer/releases/download/checkpoint/lipsformer-swin-tiny.pth",
        license="mit"),
    # No weights were released for these: the configs carry preprocessing only.
    "lipsformer_swin_s": pretrained_cfg(),
    "lipsformer_swin_b": pretrained_cfg(),
    "lipsformer_swin_l": pretrained_cfg(),
    "lipsformer_swin_lpp.in22k": pretrained_cfg(num_classes=21841),
    # Certifiable (no weights): mean 0.5, std 1, so the network's bound is the pixel-space bound (certified_cfg).
    "lipsformer_swin_t_cert": certified_cfg(),
})

SWIN_T = dict(embed_dim=96, depths=(2, 2, 6, 2), num_heads=(3, 6, 12, 24))


@register_model
def lipsformer_swin_t(pretrained: bool = False, **kwargs) -> LipsFormerSwin:
    """LipsFormer-Swin-T: 31M params, 5.0 GFLOPs, 82.7% top-1 (paper Table 2)."""
    return _create_lipsformer_swin("lipsformer_swin_t", pretrained, **dict(SWIN_T, **kwargs))


@register_model
def lipsformer_swin_s(pretrained: bool = False, **kwargs) -> LipsFormerSwin:
    """LipsFormer-Swin-S: 54M params, 9.7 GFLOPs, 83.5% top-1."""
    args = dict(embed_dim=96, depths=(2, 2, 18, 2), num_heads=(3, 6, 12, 24))
    return _create_lipsformer_swin("lipsformer_swin_s", pretrained, **dict(args, **kwargs))


@register_model
def lipsformer_swin_b(pretrained: bool = False, **kwargs) -> LipsFormerSwin:
    """LipsFormer-Swin-B: 96M params, 17.0 GFLOPs, 84.0% top-1."""
    args = dict(embed_dim=128, depths=(2, 2, 18, 2), num_heads=(4, 8, 16, 32))
    return _create_lipsformer_swin("lipsformer_swin_b", pretrained, **dict(args, **kwargs))


@register_model
def lipsformer_swin_l(pretrained: bool = False, **kwargs) -> LipsFormerSwin:
    """LipsFormer-Swin-L: 214M params, 37.7 GFLOPs, 83.5% top-1."""
    args = dict(embed_dim=192, depths=(2, 2, 18, 2), num_heads=(6, 12, 24, 48))
    return _create_lipsformer_swin("lipsformer_swin_l", pretrained, **dict(args, **kwargs))


@register_model
def lipsformer_swin_lpp(pretrained: bool = False, **kwargs) -> LipsFormerSwin:
    """LipsFormer-Swin-L++ with the ImageNet-22k head (21841 classes): 526M params."""
    args = dict(embed_dim=288, depths=(2, 2, 18, 2), num_heads=(6, 12, 24, 48))
    return _create_lipsformer_swin("lipsformer_swin_lpp", pretrained, **dict(args, **kwargs))


@register_model
def lipsformer_swin_t_cert(pretrained: bool = False, **kwargs) -> LipsFormerSwin:
    """Certifiable LipsFormer-Swin-T: Swin-T's widths and depths with every layer 1-Lipschitz
    (:data:`lipsformer.layers.options.CERTIFIABLE`: AttLip, convex residuals, GroupSort, spectrally normalised
    linear maps, no norms), so ``lipschitz_report`` bounds it by 1 and ``predict_certified`` gives radii in pixel
    space. Preprocessing mean 0.5, std 1 (``certified_cfg``: no 1/std factor in the bound). No weights;
    recipe: configs/lipsformer_swin_t_cert.yaml."""
    kwargs = preset(CERTIFIABLE, dict(SWIN_T, **kwargs))  # the caller's lipschitz object and keywords over it
    return _create_lipsformer_swin("lipsformer_swin_t_cert", pretrained, **kwargs)
