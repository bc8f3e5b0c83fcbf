"""An attention-free token mixer: spatial shifts, then a linear map (``attn="shift"``)."""
from typing import Sequence, Tuple

import torch
from torch import nn


def shift_tokens(x: torch.Tensor, shift: int = 1) -> torch.Tensor:
    """(B, H, W, C) with the channels in four groups of ``C // 4``, each moved ``shift`` tokens down, up, right and
    left, the tokens moved in zeros and those moved out dropped (ShiftViT's shift, Wang et al. 2022; LipShiFT's
    mixer); the last ``C % 4`` channels stay. Every entry of ``x`` lands in at most one place of the output and
    every other place is 0: a partial permutation, so ``||shift(x) - shift(y)|| <= ||x - y||``."""
    g = x.shape[-1] // 4
    out = torch.zeros_like(x)
    out[:, shift:, :, :g] = x[:, :-shift, :, :g]
    out[:, :-shift, :, g:2 * g] = x[:, shift:, :, g:2 * g]
    out[:, :, shift:, 2 * g:3 * g] = x[:, :, :-shift, 2 * g:3 * g]
    out[:, :, :-shift, 3 * g:4 * g] = x[:, :, shift:, 3 * g:4 * g]
    out[..., 4 * g:] = x[..., 4 * g:]
    return out


class ShiftMixer(nn.Module):
    """The attention-free mixer of the same parameters as an attention's output map: :func:`shift_tokens`, then
    ``proj`` (a Linear, normalised under ``linear="normalized"``). Its bound is ``proj``'s (the shift's is 1). It has
    no windows: any input size, and ``set_windows`` (the families' resize hook of a mixer) changes nothing."""

    def __init__(self, dim: int, shift: int = 1):
        super().__init__()
        if shift < 1:
            raise ValueError(f"shift must be at least 1 token, got {shift}")
        self.shift = shift
        self.proj = nn.Linear(dim, dim)

    def set_windows(self, windows: Sequence[Tuple[int, int]]) -> None:
        """A shift has no windows (see the class)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(shift_tokens(x, self.shift))

    def extra_repr(self) -> str:
        return f"shift={self.shift}"
