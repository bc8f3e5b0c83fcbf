"""Weight initialisation: spectral (LipsFormer Sec. 4.1.4) and the ablation alternatives."""
import torch
from timm.layers import trunc_normal_
from torch import nn

from .norm import CenterNorm
from .normalized import NormalizedConv2d, NormalizedLinear
from .spectral import largest_singular_value, numpy_blas_one_thread

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
    with numpy_blas_one_thread():  # the spectral division's Lanczos runs in NumPy between torch calls
        for m in model.modules():
            if isinstance(m, (nn.Linear, nn.Conv2d)):
                # a normalised layer's ``weight`` is computed from its parameter ``raw_weight``, which init writes
                w = m.raw_weight if isinstance(m, (NormalizedLinear, NormalizedConv2d)) else m.weight
                if mode == "trunc_normal":
                    trunc_normal_(w, std=0.02)
                else:
                    nn.init.xavier_normal_(w)
                    if mode == "spectral" and normalize and w.device.type != "meta":
                        w.div_(largest_singular_value(w, certified=False))
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, (CenterNorm, nn.LayerNorm)):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
