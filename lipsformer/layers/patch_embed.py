"""Patch embedding: a stride-``patch_size`` convolution then a norm, channels-last output."""
from typing import Tuple

import torch
import torch.nn.functional as F
from timm.layers import register_notrace_module, to_2tuple
from torch import nn

from .norm import create_norm


@register_notrace_module  # reason: the input-size check and the padding read the input's shape
class PatchEmbed(nn.Module):
    """Conv(kernel = stride = ``patch_size``) + norm, (B, C, H, W) -> (B, H', W', D).

    An input that is not 4-D or has another number of channels than ``in_chans`` is a ``ValueError`` saying so.
    ``strict_img_size=True`` (default) raises ``ValueError`` naming the built size when an input of another size
    arrives: LipsFormer's windows, stripes and relative position tables are fixed at construction (timm's
    ``strict_img_size``). With ``False`` any size runs: the input is zero-padded at the bottom and right to a
    multiple of the patch size, so the output is (B, ceil(H / p), ceil(W / p), D).
    """

    def __init__(self, img_size=224, patch_size=4, in_chans=3, embed_dim=96, norm="center",
                 strict_img_size: bool = True):
        super().__init__()
        self.patch_size: Tuple[int, int] = to_2tuple(patch_size)
        self.strict_img_size = strict_img_size
        self.set_input_size(img_size)
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=self.patch_size, stride=self.patch_size)
        self.norm = create_norm(norm, embed_dim)

    def set_input_size(self, img_size) -> None:
        """The size inputs must have (``strict_img_size``) and the grid the stages are built for."""
        img_size = to_2tuple(img_size)
        if not all(isinstance(s, int) and s > 0 for s in img_size):
            raise ValueError(f"img_size {img_size} must be positive integers")
        if any(s % p for s, p in zip(img_size, self.patch_size)):
            raise ValueError(f"img_size {img_size} must be divisible by patch_size {self.patch_size}")
        self.img_size: Tuple[int, int] = img_size
        self.grid_size = (img_size[0] // self.patch_size[0], img_size[1] // self.patch_size[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim != 4 or x.shape[1] != self.proj.in_channels:
            raise ValueError(f"input of shape {tuple(x.shape)}: the model takes (B, {self.proj.in_channels}, H, W) "
                             f"images (in_chans={self.proj.in_channels})")
        H, W = x.shape[-2:]
        if self.strict_img_size:
            if (H, W) != self.img_size:
                raise ValueError(
                    f"input size {(H, W)} does not match the size this model was built for, "
                    f"{self.img_size}; build it with img_size={(H, W)} (and a window/split size "
                    f"that divides every stage) to use another size")
        else:
            pad_h, pad_w = -H % self.patch_size[0], -W % self.patch_size[1]
            if pad_h or pad_w:
                x = F.pad(x, (0, pad_w, 0, pad_h))
        # a channels-last input makes oneDNN write the embedding channels-last, so that (B, H, W, C) below is
        # row-major: from an NCHW output it would be a permuted view, and every stage-1 operation would inherit that
        # layout (the MLP's first linear layer would copy its input, the depth-wise convolutions would run NCHW)
        return self.norm(self.proj(x.contiguous(memory_format=torch.channels_last)).permute(0, 2, 3, 1))
