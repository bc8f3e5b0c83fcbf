"""Weight initialisation: spectral (LipsFormer Sec. 4.1.4) and the ablation alternatives."""
from concurrent.futures import ThreadPoolExecutor

import torch
from timm.layers import trunc_normal_
from torch import nn

from .norm import CenterNorm
from .normalized import NormalizedConv2d, NormalizedLinear
from .spectral import largest_singular_value, numpy_blas_one_thread

INITS = ("spectral", "xavier", "trunc_normal")
# threads computing the spectral init's norms, at most this many and at most torch's intra-op thread count
NORM_WORKERS = 4


@torch.no_grad()
def init_weights(model: nn.Module, mode: str = "spectral", normalize: bool = True) -> None:
    r"""Initialise every Linear / Conv2d / norm of ``model`` in place.

    - ``spectral``: Xavier-normal, then :math:`W \leftarrow W / \sigma_{\max}(W)` so each layer
      starts 1-Lipschitz (LipsFormer eq. 9; conv weights viewed as (out, in * kh * kw));
    - ``xavier``: Xavier-normal only; ``trunc_normal``: truncated normal, std 0.02 (Swin's init).

    Biases start at 0, norm weights at 1 and norm biases at 0 in every mode. ``normalize=False`` leaves out the
    spectral division (the one costly step), for weights that are about to be overwritten by a load.

    The spectral norms are computed on worker threads while this thread draws the next weights (NumPy and torch
    release the GIL in their kernels); each weight is divided once its norm is known. The random draws keep their
    order and each norm depends on its weight only, so the result is bit-identical to a serial loop (tested). On 2
    cores building LipsFormer-Swin-S to -L takes 1.4x to 1.5x of timm's Swin against 2.1x to 2.3x serially
    (``benchmarks/build_time.py``, README Building).
    """
    if mode not in INITS:
        raise ValueError(f"init must be one of {INITS}, got {mode!r}")
    divide = mode == "spectral" and normalize
    pending = []
    # the Lanczos runs use NumPy's BLAS, kept to one thread each (see ``numpy_blas_one_thread``)
    with numpy_blas_one_thread(), ThreadPoolExecutor(max(1, min(NORM_WORKERS, torch.get_num_threads()))) as pool:
        for m in model.modules():
            if isinstance(m, (nn.Linear, nn.Conv2d)):
                # a normalised layer's ``weight`` is computed from its parameter ``raw_weight``, which init writes
                w = m.raw_weight if isinstance(m, (NormalizedLinear, NormalizedConv2d)) else m.weight
                if mode == "trunc_normal":
                    trunc_normal_(w, std=0.02)
                else:
                    nn.init.xavier_normal_(w)
                    if divide and w.device.type != "meta":
                        pending.append((w, pool.submit(largest_singular_value, w, certified=False)))
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, (CenterNorm, nn.LayerNorm)):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        for w, norm in pending:
            w.div_(norm.result())
