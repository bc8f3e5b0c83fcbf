"""Patch embedding: a stride-``patch_size`` convolution then a norm, channels-last output."""
from typing import Tuple

import torch
from timm.layers import to_2tuple
from torch import nn

from .norm import create_norm


class PatchEmbed(nn.Module):
    """Conv(kernel = stride = ``patch_size``) + norm, (B, C, H, W) -> (B, H', W', D).

    Raises ``ValueError`` naming the built size when an input of another size arrives:
    LipsFormer's windows, stripes and relative position tables are fixed at construction.
    """

    def __init__(self, img_size=224, patch_size=4, in_chans=3, embed_dim=96, norm="center"):
        super().__init__()
        self.img_size: Tuple[int, int] = to_2tuple(img_size)
        self.patch_size: Tuple[int, int] = to_2tuple(patch_size)
        if any(s % p for s, p in zip(self.img_size, self.patch_size)):
            raise ValueError(f"img_size {self.img_size} must be divisible by patch_size {self.patch_size}")
        self.grid_size = (self.img_size[0] // self.patch_size[0], self.img_size[1] // self.patch_size[1])
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=self.patch_size, stride=self.patch_size)
        self.norm = create_norm(norm, embed_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if tuple(x.shape[-2:]) != self.img_size:
            raise ValueError(
                f"input size {tuple(x.shape[-2:])} does not match the size this model was built for, "
                f"{self.img_size}; build it with img_size={tuple(x.shape[-2:])} (and a window/split size "
                f"that divides every stage) to use another size")
        return self.norm(self.proj(x).permute(0, 2, 3, 1))
