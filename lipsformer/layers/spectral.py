"""The spectral norm of a weight: one function for the spectral init and the certified bounds."""
import contextlib
import math

import numpy as np
import torch

# Up to this size of the smaller side the certified route is exact (an eigenvalue of the Gram matrix); above it,
# power iteration.
EXACT_MAX_DIM = 4096
# Sides up to this size take the exact route even when no certificate is asked for (it is cheaper there: 0.2 ms
# against 0.5 ms of Lanczos at 64, 7.5 ms against 1.2 ms at 256).
SMALL_DIM = 96


def numpy_blas_one_thread() -> contextlib.AbstractContextManager:
    """A context in which NumPy's BLAS runs on one thread (``threadpoolctl``), for a loop of Lanczos runs between
    torch operations. NumPy's OpenBLAS threads keep spinning after each product and then compete with torch's
    OpenMP threads for the cores: building LipsFormer-Swin-S took 1.61 s with them, 0.80 s without (2 cores)."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # a dependency; without it only slower
        return contextlib.nullcontext()
    return threadpool_limits(1, user_api="blas")


def _generator(device: torch.device) -> torch.Generator:
    return torch.Generator(device).manual_seed(0)


def _lanczos(w: torch.Tensor, rtol: float = 1e-5, check_every: int = 4) -> float:
    """Top eigenvalue of ``w.T @ w`` (n x n, never formed; the products in ``w``'s dtype, the recurrence in
    float64) by Lanczos with full reorthogonalisation, stopped when the top Ritz value changes by less than ``rtol``
    relative between checks (every ``check_every`` steps).

    In NumPy: a step is a dozen small operations, each about ten times cheaper than a torch call, and on CPU the
    steps are bound by that overhead rather than by the products (0.42x of the same loop in torch on Swin-T's
    shapes, with the looser stop). At ``rtol=1e-5`` the result is within about 1e-6 relative of the exact value
    (1e-4 is tested); 1e-6 took 1.3x the steps for digits the spectral init does not need. It runs on the CPU
    whatever ``w``'s device: a weight on a GPU is copied to the host."""
    a = w.detach().cpu().numpy()
    n = a.shape[1]
    basis = np.empty((n, n))  # rows: the orthonormal Lanczos vectors, float64
    diag, off = np.zeros(n), np.zeros(n)
    q = torch.randn(n, dtype=torch.float64, generator=_generator(torch.device("cpu"))).numpy()
    basis[0] = q / np.linalg.norm(q)
    top = 0.0
    for k in range(n):
        z = (a.T @ (a @ basis[k].astype(a.dtype))).astype(np.float64)
        diag[k] = basis[k] @ z
        done = basis[:k + 1]
        for _ in range(2):  # full reorthogonalisation, twice is enough
            z -= done.T @ (done @ z)
        off[k] = np.linalg.norm(z)
        last = k + 1 == n or off[k] <= 1e-13 * np.abs(diag[:k + 1]).max()
        if last or (k + 1) % check_every == 0:
            t = np.diag(diag[:k + 1]) + np.diag(off[:k], 1) + np.diag(off[:k], -1)
            previous, top = top, float(np.linalg.eigvalsh(t)[-1])
            if last or abs(top - previous) <= rtol * top:
                break
        basis[k + 1] = z / off[k]
    return top


def _tall(weight: torch.Tensor):
    """``weight`` viewed as (out, in * kh * kw), transposed when wider than tall: ``(w, tall)`` with ``w`` (m, n), n
    the smaller side, whose Gram matrix ``w^T w`` (n, n) is the smaller one; ``tall`` says no transpose was made."""
    w = weight.flatten(1)
    tall = w.shape[0] >= w.shape[1]
    return (w if tall else w.T), tall


UNIT_ROUNDOFF64 = 2.0 ** -53


@torch.no_grad()
def gram_norm_upper(weight: torch.Tensor) -> float:
    """A certified upper bound on the largest singular value of ``weight`` (as (out, in * kh * kw)), rounding included.

    With ``w`` (m, n), n the smaller side, converted to float64 exactly, and ``G = fl(w^T w)`` formed in float64:
    ``||w^T w - G||_2 <= ||w^T w - G||_F <= gamma_m ||w||_F^2`` (each entry is a length-m dot product,
    ``gamma_m = m u / (1 - m u)``, u = 2^-53), and the computed top eigenvalue of ``G`` is within ``p(n) u ||G||_2``
    of the exact one (backward stability of LAPACK's symmetric eigensolvers; p(n) taken as 4n). So
    ``sigma_max(w)^2 <= lambda_hat (1 + 4 n u) + gamma_m ||w||_F^2``, and the square root of that is returned
    (rounded up). About 1e-13 relative above the exact value at the zoo's sizes: a certificate that never rests on
    the eigensolver being exact."""
    w = _tall(weight.detach())[0].to(torch.float64)
    return _upper_from_top(float(torch.linalg.eigvalsh(w.T @ w)[-1].clamp_min(0)), w)


def _upper_from_top(top: float, w: torch.Tensor) -> float:
    """:func:`gram_norm_upper`'s bound from ``top``, the computed top eigenvalue of ``fl(w^T w)``, ``w`` (m, n)
    float64 with n the smaller side (by any backward-stable symmetric eigensolver: ``eigvalsh`` or ``eigh``)."""
    m, n = w.shape
    u = UNIT_ROUNDOFF64
    gamma = m * u / (1 - m * u)
    bound = top * (1 + 4 * n * u) + gamma * float(w.pow(2).sum()) * (1 + 2 * u)
    return math.nextafter(math.sqrt(bound) * (1 + u), math.inf)


@torch.no_grad()
def orthogonality_defect(q: torch.Tensor) -> float:
    """A certified upper bound ``delta`` on ``||q^T q - I||_2`` for a square ``q`` (meant to be orthogonal, e.g.
    one rounded to float32), rounding included; then ``||q||_2^2 <= 1 + delta``.

    ``q`` (m, m) is converted to float64 exactly and ``G = fl(q^T q)`` formed there: each entry is a length-m dot
    product, so ``|G - q^T q| <= gamma_m |q|^T |q|`` entrywise (Higham, Accuracy and Stability, Thm 3.5, any
    summation order, with or without FMA) and ``||G - q^T q||_F <= gamma_m ||q||_F^2``, ``gamma_m = m u / (1 - m u)``,
    u = 2^-53. ``E = fl(G - I)`` rounds only the diagonal, by at most ``u |G_ii - 1|``, so
    ``||G - I||_F <= ||E||_F / (1 - u)``; the computed Frobenius norm of E (m^2 squares summed, a square root) is
    within ``gamma_{m^2 + 2}`` relative. And ``||.||_2 <= ||.||_F``. So ``delta = ||E||_F (1 + gamma_{m^2+2}) /
    (1 - u) + gamma_m ||q||_F^2 (1 + gamma_{m^2+2})``, rounded up: one float64 product, no eigensolver. For a
    float32 rounding of an orthogonal matrix at the zoo's sizes (m <= 768) about 1e-6."""
    a = q.detach().to(torch.float64)
    m = a.shape[0]
    if a.shape != (m, m):
        raise ValueError(f"orthogonality_defect takes a square matrix, got {tuple(a.shape)}")
    u = UNIT_ROUNDOFF64
    gamma_m = m * u / (1 - m * u)
    gamma_sum = (m * m + 2) * u / (1 - (m * m + 2) * u)
    e = a.T @ a - torch.eye(m, dtype=a.dtype, device=a.device)
    frob_e, frob_q = float(e.norm()), float(a.pow(2).sum())
    delta = frob_e * (1 + gamma_sum) / (1 - u) + gamma_m * frob_q * (1 + gamma_sum)
    return math.nextafter(delta * (1 + 2 * u), math.inf)


@torch.no_grad()
def top_singular_triple(weight: torch.Tensor, upper: bool = False):
    """``(sigma, u, v)``: the largest singular value of ``weight`` viewed as (out, in * kh * kw) and its left and
    right singular vectors, float64, from ``eigh`` of the smaller Gram matrix (the route of :func:`gram_norm_upper`,
    with its eigenvector); ``u^T W v = sigma``. Outside the graph: the divisor of the normalised layers
    (:mod:`lipsformer.layers.normalized`, which gives it its exact gradient ``u v^T``). ``upper=True`` appends
    :func:`gram_norm_upper`'s certified bound, from the same eigendecomposition."""
    a, tall = _tall(weight.detach().to(torch.float64))
    values, vectors = torch.linalg.eigh(a.T @ a)
    top = values[-1].clamp_min(0)
    sigma = top.sqrt()
    small = vectors[:, -1]
    large = a @ small
    large = large / large.norm().clamp_min(torch.finfo(torch.float64).tiny)
    triple = (sigma, large, small) if tall else (sigma, small, large)
    return (*triple, _upper_from_top(float(top), a)) if upper else triple


@torch.no_grad()
def largest_singular_value(weight: torch.Tensor, certified: bool = True, iters: int = 100) -> float:
    """Largest singular value of ``weight`` viewed as (out, in * kh * kw), in float64.

    ``certified=True`` (the bounds): when the smaller side is at most ``EXACT_MAX_DIM``, :func:`gram_norm_upper`
    (the top eigenvalue of the smaller Gram matrix, ``eigvalsh``, with its rounding charged); larger
    weights get ``iters`` steps of power iteration, a lower estimate that converges to the norm.
    ``certified=False`` (the spectral init): Lanczos on the Gram matrix without forming it (its products in
    float32, stopped at a change below 1e-5 between checks), an estimate within about 1e-6 relative of the exact
    value (tested to 1e-4), cheaper for large weights.
    """
    w = _tall(weight.detach())[0]
    if not certified and w.shape[1] > SMALL_DIM:
        return _lanczos(w.float()) ** 0.5  # float32 products: half the memory traffic, error ~1e-7
    if w.shape[1] <= EXACT_MAX_DIM:
        return gram_norm_upper(w)
    w = w.to(torch.float64)
    v = torch.randn(w.shape[1], dtype=w.dtype, device=w.device, generator=_generator(w.device))
    for _ in range(iters):
        v = w.T @ (w @ v)
        v = v / v.norm().clamp_min(1e-300)
    return float((w @ v).norm())

