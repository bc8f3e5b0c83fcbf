"""Weight initialisation: spectral (LipsFormer Sec. 4.1.4) and the ablation alternatives."""
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from timm.layers import trunc_normal_
from torch import nn

from .norm import CenterNorm
from .normalized import NormalizedConv2d, NormalizedLinear
from .spectral import largest_singular_value, numpy_blas_one_thread

INITS = ("spectral", "xavier", "trunc_normal")
# threads computing the spectral init's norms beside the drawing thread: at most this many, and at most torch's
# intra-op thread count less one
NORM_WORKERS = 4


@torch.no_grad()
def init_weights(model: nn.Module, mode: str = "spectral", normalize: bool = True) -> None:
    r"""Initialise every Linear / Conv2d / norm of ``model`` in place.

    - ``spectral``: Xavier-normal, then :math:`W \leftarrow W / \sigma_{\max}(W)` so each layer
      starts 1-Lipschitz (LipsFormer eq. 9; conv weights viewed as (out, in * kh * kw));
    - ``xavier``: Xavier-normal only; ``trunc_normal``: truncated normal, std 0.02 (Swin's init).

    Biases start at 0, norm weights at 1 and norm biases at 0 in every mode. ``normalize=False`` leaves out the
    spectral division (the one costly step), for weights that are about to be overwritten by a load.

    The spectral norms of CPU weights are computed on worker threads (``torch.get_num_threads() - 1`` of them, at
    most ``NORM_WORKERS``; none with one thread) while this thread draws the next weights (NumPy and torch release
    the GIL in their kernels); each weight is divided at the end. The random draws keep their order and each norm
    depends on its own weight only, so the result is bit-identical to a serial loop (tested); a weight shared by
    two modules is drawn twice as before and divided once, by the norm of its last draw. On 2 cores building
    LipsFormer-Swin-S to -L takes 1.3x to 1.8x of timm's Swin against 2.1x to 2.3x serially
    (``benchmarks/build_time.py``, README Building).
    """
    if mode not in INITS:
        raise ValueError(f"init must be one of {INITS}, got {mode!r}")
    divide = mode == "spectral" and normalize
    workers = min(NORM_WORKERS, torch.get_num_threads() - 1)
    pool = ThreadPoolExecutor(workers) if divide and workers > 0 else None
    norms = {}  # id(weight) -> (weight, its norm: a float, or a Future of one)
    try:
        # the Lanczos runs use NumPy's BLAS, kept to one thread each (see ``numpy_blas_one_thread``)
        with numpy_blas_one_thread():
            for m in model.modules():
                if isinstance(m, (nn.Linear, nn.Conv2d)):
                    # a normalised layer's ``weight`` is computed from its parameter ``raw_weight``, which init writes
                    w = m.raw_weight if isinstance(m, (NormalizedLinear, NormalizedConv2d)) else m.weight
                    if id(w) in norms:  # shared: no worker may still read it while it is drawn again
                        previous = norms.pop(id(w))[1]
                        if isinstance(previous, Future):
                            previous.result()
                    if mode == "trunc_normal":
                        trunc_normal_(w, std=0.02)
                    else:
                        nn.init.xavier_normal_(w)
                        if divide and w.device.type != "meta":
                            # a CUDA weight is read inline: a worker thread would not wait for the caller's stream
                            norms[id(w)] = (w, pool.submit(largest_singular_value, w, certified=False)
                                            if pool is not None and w.device.type == "cpu"
                                            else largest_singular_value(w, certified=False))
                    if m.bias is not None:
                        nn.init.zeros_(m.bias)
                elif isinstance(m, (CenterNorm, nn.LayerNorm)):
                    nn.init.ones_(m.weight)
                    nn.init.zeros_(m.bias)
            for w, norm in norms.values():
                w.div_(norm.result() if isinstance(norm, Future) else norm)
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)  # after an error, queued norms are not computed for nothing
