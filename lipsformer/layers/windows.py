"""Rectangular window partitioning of channel-last feature maps (Swin windows, CSwin stripes)."""
from typing import Tuple

import torch
import torch.nn.functional as F
from timm.layers import register_notrace_function


@register_notrace_function  # reason: the window count comes from the input's shape
def window_partition(x: torch.Tensor, window: Tuple[int, int]) -> torch.Tensor:
    """(B, H, W, *C) -> (B * nH * nW, wh * ww, *C); windows in raster order, tokens row-major inside. The channel
    dims ``C`` are kept as given and need not be contiguous with each other (one stripe branch's q, k and v, a
    slice of the projection). One copy, or a view of ``x`` where its windows already lie in that order (a window
    as wide as the map, rows of ``x`` contiguous)."""
    B, H, W, *C = x.shape
    wh, ww = window
    x = x.view(B, H // wh, wh, W // ww, ww, *C).permute(0, 1, 3, 2, 4, *range(5, 5 + len(C)))
    return x.reshape(-1, wh * ww, *C)


@register_notrace_function  # reason: int arguments may be traced values
def window_reverse(windows: torch.Tensor, window: Tuple[int, int], H: int, W: int) -> torch.Tensor:
    """Inverse of :func:`window_partition`: (B * nH * nW, wh * ww, *C) -> (B, H, W, *C)."""
    wh, ww = window
    C = windows.shape[2:]
    x = windows.view(-1, H // wh, W // ww, wh, ww, *C).permute(0, 1, 3, 2, 4, *range(5, 5 + len(C)))
    return x.reshape(-1, H, W, *C)


@register_notrace_function  # reason: int arguments may be traced values
def window_reverse_heads(out: torch.Tensor, window: Tuple[int, int], H: int, W: int) -> torch.Tensor:
    """Attention output per window and head, (B * nH * nW, heads, wh * ww, d), to (B, H, W, heads * d): heads
    merged and windows put back in one copy. Always a copy (``clone``, then a view): a reshape that is a view for one
    kernel's output layout and a copy for another's would trace differently for the exporters."""
    wh, ww = window
    heads, d = out.shape[1], out.shape[3]
    x = out.view(-1, H // wh, W // ww, heads, wh, ww, d).permute(0, 1, 4, 2, 5, 3, 6)
    return x.clone(memory_format=torch.contiguous_format).view(-1, H, W, heads * d)


@register_notrace_function  # reason: the padding comes from the input's shape
def pad_to_multiple(x: torch.Tensor, multiple: Tuple[int, int]) -> torch.Tensor:
    """Zero-pad (B, H, W, C) at the bottom and right so H and W divide by ``multiple``; ``x`` itself when they do.

    The padding of ``strict_img_size=False`` models, as timm's Swin pads: padded tokens take part as zeros, and
    the caller crops its output back to (H, W).
    """
    H, W = x.shape[1:3]
    pad_h, pad_w = -H % multiple[0], -W % multiple[1]
    if pad_h or pad_w:
        x = F.pad(x, (0, 0, 0, pad_w, 0, pad_h))
    return x
