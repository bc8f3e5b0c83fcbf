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
    the GIL in their kernels). Once the drawing is over this thread computes the norms no worker has started,
    from the end of the queue, and each weight is divided at the end. The random draws keep their order and each
    norm depends on its own weight only, so the result is bit-identical to a serial loop (tested); a weight shared
    by two modules is drawn twice, as a serial loop draws it, and divided once, by the norm of its last draw. What
    building takes against timm's nearest Swin: ``benchmarks/build_time.py``, README Building.
    """
    if mode not in INITS:
        raise ValueError(f"init must be one of {INITS}, got {mode!r}")
    divide = mode == "spectral" and normalize
    workers = min(NORM_WORKERS, torch.get_num_threads() - 1)
    pool = ThreadPoolExecutor(workers) if divide and workers > 0 else None

    def norm_of(w: torch.Tensor) -> Future:
        """``w``'s norm, queued for a worker; a CUDA weight's is computed at once (a worker thread would not wait
        for the caller's stream)."""
        if pool is not None and w.device.type == "cpu":
            return pool.submit(largest_singular_value, w, certified=False)
        done = Future()
        done.set_result(largest_singular_value(w, certified=False))
        return done

    norms = {}  # id(weight) -> (weight, the future of its norm)
    try:
        # the Lanczos runs use NumPy's BLAS, kept to one thread each (see ``numpy_blas_one_thread``)
        with numpy_blas_one_thread():
            for m in model.modules():
                if isinstance(m, (nn.Linear, nn.Conv2d)):
                    # a normalised layer's ``weight`` is computed from its parameter ``raw_weight``, which init writes
                    w = m.raw_weight if isinstance(m, (NormalizedLinear, NormalizedConv2d)) else m.weight
                    if id(w) in norms:  # shared: no worker may still read it while it is drawn again
                        earlier = norms.pop(id(w))[1]
                        earlier.cancel() or earlier.result()
                    if mode == "trunc_normal":
                        trunc_normal_(w, std=0.02)
                    else:
                        nn.init.xavier_normal_(w)
                        if divide and w.device.type != "meta":
                            norms[id(w)] = (w, norm_of(w))
                    if m.bias is not None:
                        nn.init.zeros_(m.bias)
                elif isinstance(m, (CenterNorm, nn.LayerNorm)):
                    nn.init.ones_(m.weight)
                    nn.init.zeros_(m.bias)
            # from the last queued: the workers take the queue from its front, so the two ends meet once; a norm
            # no worker has started is computed here
            for w, norm in reversed(list(norms.values())):
                w.div_(largest_singular_value(w, certified=False) if norm.cancel() else norm.result())
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)  # after an error, queued norms are not computed for nothing
