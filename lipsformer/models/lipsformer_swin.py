"""LipsFormer-Swin: Swin Transformer with Lipschitz-continuous blocks (Qi et al., LipsFormer).

Architecture exactly as the released code (IDEA-Research/LipsFormer ``models/lipsformer_swin.py``)
so the released LipsFormer-Swin-T checkpoint converts and gives the same logits:
no shifted windows (the depth-wise convolutions mix across windows), window 7, a relative
position bias per head, SCSA with tau 10 and unnormalised v, conv blocks D, CenterNorm after
the attention and after the MLP residual, patch merging at the start of stages 2-4, a final
CenterNorm, average pooling and a linear head; spectral initialisation.
"""
from typing import Optional, Sequence, Tuple

import torch
from timm.layers import to_2tuple, trunc_normal_
from timm.models import generate_default_cfgs, register_model
from torch import nn

from ..layers import AttentionKernel, LipschitzOptions, PatchEmbed, create_norm, init_weights
from ..layers.windows import window_partition, window_reverse
from ._base import (RELEASED_BLOCK_RENAMES, LipsFormerBase, convert_released, create_model, pretrained_cfg,
                    rename_prefix)

__all__ = ["LipsFormerSwin"]


def relative_position_index(window: Tuple[int, int]) -> torch.Tensor:
    """(N, N) index into a ((2wh-1)(2ww-1), heads) bias table, as in Swin."""
    wh, ww = window
    coords = torch.stack(torch.meshgrid(torch.arange(wh), torch.arange(ww), indexing="ij")).flatten(1)
    rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0)
    return (rel[..., 0] + wh - 1) * (2 * ww - 1) + (rel[..., 1] + ww - 1)


class WindowAttention(nn.Module):
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

    def position_bias(self) -> torch.Tensor:
        """(1, heads, N, N): four dimensions, which CPU's fused SDPA kernel needs (it refuses a 3-d mask)."""
        n = self.window[0] * self.window[1]
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)]
        return bias.view(n, n, self.num_heads).permute(2, 0, 1).unsqueeze(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, H, W, C = x.shape
        windows = window_partition(x, self.window)
        Bw, N, _ = windows.shape
        q, k, v = self.kernel.split(self.qkv(windows).view(Bw, N, self.kernel.num_proj, self.num_heads, -1))
        if self.kernel.kim:
            v = self.kernel.kim_values(q, self.qkv, self.num_heads)
        out = self.kernel(q, k, v, self.position_bias()).transpose(1, 2)
        # an explicit copy, not reshape: the fused CPU kernel's output makes reshape trace as a view, which the
        # torch.export-based ONNX exporter then replays on an unfused, differently laid out output and fails
        out = out.clone(memory_format=torch.contiguous_format).view(Bw, N, C)
        out = self.proj_drop(self.proj(out))
        return window_reverse(out, self.window, H, W)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, window={self.window}"


class PatchMerging(nn.Module):
    """Concatenate each 2x2 neighbourhood, norm(4C), Linear(4C, 2C, no bias): (B, H, W, C) -> (B, H/2, W/2, 2C)."""

    def __init__(self, dim: int, norm: str = "center"):
        super().__init__()
        self.norm = create_norm(norm, 4 * dim)
        self.reduction = nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, H, W, C = x.shape
        # channel order (h0 w0, h1 w0, h0 w1, h1 w1), as the released code's torch.cat([x0, x1, x2, x3])
        x = x.reshape(B, H // 2, 2, W // 2, 2, C).permute(0, 1, 3, 4, 2, 5).flatten(3)
        return self.reduction(self.norm(x))


class LipsFormerSwin(LipsFormerBase):
    """LipsFormer-Swin. Defaults reproduce the released LipsFormer-Swin-T.

    Args:
        img_size, patch_size, in_chans, num_classes, global_pool, embed_dim, depths, num_heads,
        window_size, mlp_ratio, qkv_bias: as in timm's Swin. A stage smaller than the window
            attends over the whole stage (released rule); every stage must divide by its window.
        drop_rate: classifier dropout; proj_drop_rate: dropout after MLP and attention projections.
        drop_path_rate: stochastic depth, linear over blocks, the same inside a block.
        lipschitz: the Lipschitz choices as one :class:`lipsformer.layers.LipschitzOptions`; its fields
            (``norm``, ``attn``, ``tau``, ``learn_tau``, ``v_norm``, ``nu``, ``tied_qk``, ``alpha_init``, ``init``,
            ``conv_blocks``, ``fused_attn``, ``attlip_eta``, ``attlip_steps``, ``attlip_tol``) are also keyword
            arguments, replacing the object's. Defaults: the released Swin (tau 10, alpha 1 / sum(depths)).
    """

    lipschitz_defaults = {}  # the released Swin's values are LipschitzOptions' own defaults

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
            lipschitz: Optional[LipschitzOptions] = None,
            **lipschitz_kwargs,
    ):
        super().__init__()
        lips = LipschitzOptions.from_kwargs(type(self).__name__, self.lipschitz_defaults, lipschitz,
                                            **lipschitz_kwargs)
        if len(depths) != len(num_heads):
            raise ValueError(f"depths {tuple(depths)} and num_heads {tuple(num_heads)} must have the same length")
        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim, lips.norm)

        def stage_mixer(i, dim, res):
            window = to_2tuple(min(res)) if min(res) <= window_size else to_2tuple(window_size)
            if res[0] % window[0] or res[1] % window[1]:
                raise ValueError(f"stage {i} resolution {res} is not divisible by window size {window[0]}; "
                                 f"choose window_size and img_size so that every stage divides")
            return lips.mixer(dim, num_heads[i], [window], lambda kernel: WindowAttention(
                dim, num_heads[i], window, kernel, qkv_bias=qkv_bias, proj_drop=proj_drop_rate))

        self._build_stages(embed_dim, depths, lambda dim: PatchMerging(dim, lips.norm), stage_mixer, drop_path_rate,
                           lips, mlp_ratio=mlp_ratio, drop=proj_drop_rate, attn_norm=True)
        self.norm = create_norm(lips.norm, self.num_features)
        self._build_head(num_classes, global_pool, drop_rate)
        init_weights(self, lips.init)

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


def checkpoint_filter_fn(state_dict: dict, model: LipsFormerSwin) -> dict:
    """Convert a released-layout LipsFormer-Swin state dict (raw or under ``"model"``) to ours.

    A state dict already in our layout passes through unchanged.
    """
    return convert_released(state_dict, model, "layers.", _released_to_ours)



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
    return create_model(LipsFormerSwin, variant, pretrained, checkpoint_filter_fn, **kwargs)


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
})


@register_model
def lipsformer_swin_t(pretrained: bool = False, **kwargs) -> LipsFormerSwin:
    """LipsFormer-Swin-T: 31M params, 5.0 GFLOPs, 82.7% top-1 (paper Table 2)."""
    args = dict(embed_dim=96, depths=(2, 2, 6, 2), num_heads=(3, 6, 12, 24))
    return _create_lipsformer_swin("lipsformer_swin_t", pretrained, **dict(args, **kwargs))


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
