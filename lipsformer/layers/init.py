"""Weight initialisation: spectral (LipsFormer Sec. 4.1.4) and the ablation alternatives."""
import torch
from timm.layers import trunc_normal_
from torch import nn

from .norm import CenterNorm
from .spectral import largest_singular_values

INITS = ("spectral", "xavier", "trunc_normal")


@torch.no_grad()
def init_weights(model: nn.Module, mode: str = "spectral", normalize: bool = True) -> None:
    r"""Initialise every Linear / Conv2d / norm of ``model`` in place.

    - ``spectral``: Xavier-normal, then :math:`W \leftarrow W / \sigma_{\max}(W)` so each layer
      starts 1-Lipschitz (LipsFormer eq. 9; conv weights viewed as (out, in * kh * kw));
    - ``xavier``: Xavier-normal only; ``trunc_normal``: truncated normal, std 0.02 (Swin's init).

    Biases start at 0, norm weights at 1 and norm biases at 0 in every mode. ``normalize=False`` leaves out the
    spectral division (the one costly step), for weights that are about to be overwritten by a load.
    """
    if mode not in INITS:
        raise ValueError(f"init must be one of {INITS}, got {mode!r}")
    to_normalize = []
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Conv2d)):
            if mode == "trunc_normal":
                trunc_normal_(m.weight, std=0.02)
            else:
                nn.init.xavier_normal_(m.weight)
                if mode == "spectral" and normalize and m.weight.device.type != "meta":
                    to_normalize.append(m.weight)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, (CenterNorm, nn.LayerNorm)):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
    # all norms at once, over the cores (the random draws above are unchanged: the estimate has its own generator)
    for weight, sigma in zip(to_normalize, largest_singular_values(to_normalize)):
        weight.div_(sigma)
