"""The spectral norm of a weight: one function for the spectral init and the certified bounds."""
import contextlib
import functools
import math

import numpy as np
import torch

# Up to this size of the smaller side the certified route is exact (an eigenvalue of the Gram matrix); above it,
# power iteration.
EXACT_MAX_DIM = 4096
# Sides up to this size take the exact route even when no certificate is asked for (it is cheaper than Lanczos
# there; at 256 Lanczos is the cheaper one).
SMALL_DIM = 96


@functools.lru_cache(maxsize=None)
def _blas_controller():
    """threadpoolctl's controller, found once (its library scan is too slow for every call); None without
    threadpoolctl."""
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:  # a dependency; without it only slower
        return None
    return ThreadpoolController()


def numpy_blas_one_thread() -> contextlib.AbstractContextManager:
    """A context in which NumPy's BLAS runs on one thread (``threadpoolctl``), for Lanczos runs between torch
    operations. NumPy's OpenBLAS threads keep spinning after each product and then compete with torch's OpenMP
    threads for the cores, which slows down building a model and the bound keeping of the certifiable models."""
    controller = _blas_controller()
    return contextlib.nullcontext() if controller is None else controller.limit(limits=1, user_api="blas")


def _generator(device: torch.device) -> torch.Generator:
    return torch.Generator(device).manual_seed(0)


def _lanczos(product, n: int, rtol: float = 1e-5, check_every: int = 4, vector: bool = False):
    """Top eigenvalue of a symmetric positive semi-definite n x n operator given by ``product`` (a float64 NumPy
    vector to the operator times it, float64), by Lanczos with full reorthogonalisation from a fixed start (the same
    value on every call), stopped when the top Ritz value changes by less than ``rtol`` relative between checks
    (every ``check_every`` steps). A Ritz value is never above the top eigenvalue. ``vector=True`` returns
    ``(value, its Ritz vector)``, the vector float64 of norm 1 up to rounding.

    In NumPy: a step is a dozen small operations, each about ten times cheaper than a torch call, and on CPU the
    steps are bound by that overhead rather than by the products (faster than the same loop in torch on Swin-T's
    shapes)."""
    basis = np.empty((n, n))  # rows: the orthonormal Lanczos vectors, float64
    diag, off = np.zeros(n), np.zeros(n)
    q = torch.randn(n, dtype=torch.float64, generator=_generator(torch.device("cpu"))).numpy()
    basis[0] = q / np.linalg.norm(q)
    top = 0.0
    for k in range(n):
        z = product(basis[k])
        diag[k] = basis[k] @ z
        done = basis[:k + 1]
        for _ in range(2):  # full reorthogonalisation, twice is enough
            z -= done.T @ (done @ z)
        off[k] = np.linalg.norm(z)
        last = k + 1 == n or off[k] <= 1e-13 * np.abs(diag[:k + 1]).max()
        if last or (k + 1) % check_every == 0:
            t = np.diag(diag[:k + 1]) + np.diag(off[:k], 1) + np.diag(off[:k], -1)
            if vector:
                values, ritz = np.linalg.eigh(t)
            else:
                values = np.linalg.eigvalsh(t)
            previous, top = top, float(values[-1])
            if last or abs(top - previous) <= rtol * top:
                break
        basis[k + 1] = z / off[k]
    return (top, ritz[:, -1] @ basis[:k + 1]) if vector else top


def _gram_lanczos(w: torch.Tensor, rtol: float = 1e-5, vector: bool = False):
    """Top eigenvalue of ``w.T @ w`` (n x n, never formed; the products in ``w``'s dtype, the recurrence in float64)
    by :func:`_lanczos` (``vector=True``: with its Ritz vector). At ``rtol=1e-5`` the result is within about 1e-6
    relative of the exact value (1e-4 is tested); a smaller ``rtol`` takes more steps for digits the spectral init
    does not need. It runs on the CPU whatever ``w``'s device: a weight on a GPU is copied to the host."""
    a = w.detach().cpu().numpy()
    return _lanczos(lambda q: (a.T @ (a @ q.astype(a.dtype))).astype(np.float64), a.shape[1], rtol, vector=vector)


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


# The verified route of :func:`top_singular_triple`: the top eigenvalue lam of the Gram matrix by Lanczos, then a
# Cholesky factorisation of t I - G at t = lam (1 + VERIFY_MARGIN) proves lam_max(G) < t (plus its rounding), and two
# solves with that factor (inverse iteration) give the top vector. 5 to 17 times cheaper than ``eigh`` at the zoo's
# sides (96 to 768); where the factorisation fails (Lanczos short of the top), ``eigh``. The margin costs the bound
# 5e-9 relative; the rounding of the factorisation is far below it (n u ||G|| ~ 1e-13 relative at 768).
VERIFY_MARGIN = 1e-8
# Demmel's bound for a Cholesky factorisation that runs to completion (Higham, Accuracy and Stability of Numerical
# Algorithms, 2nd ed., Thm 10.3: R^T R = A + dA, |dA| <= gamma_{n+1} |R^T| |R|) is stated for the unblocked orders;
# LAPACK's blocked factorisation with conventional products satisfies it with another modest constant: charged
# this many times over
CHOLESKY_SAFETY = 100.0
# below this smaller side ``eigh`` is the cheaper route (at 96 it is, at 384 the verified route is)
VERIFIED_MIN_DIM = 128


def _verified_top(a: torch.Tensor, gram: torch.Tensor):
    """``(v, upper)`` for ``a`` (m, n) float64, n the smaller side, and ``gram = fl(a^T a)``: the eigenvector ``v``
    of the Gram matrix's top eigenvalue (Lanczos's estimate of it, verified, then inverse iteration) and a certified
    upper bound on ``||a||_2``; ``None`` when the Cholesky test fails.

    If the floating-point Cholesky factorisation of ``A = fl(t I - G)`` (only the diagonal is rounded, by at most
    ``u |A_ii|``) runs to completion, ``R^T R = A + dA`` is positive definite with ``||dA||_2 <= gamma_{n+1}
    ||R||_F^2 <= gamma_{n+1} tr(A) / (1 - gamma_{n+1})`` (Demmel's bound, whose diagonal gives ``||R||_F^2 = tr(A +
    dA) <= tr(A) + gamma_{n+1} ||R||_F^2``). So ``lam_max(G) < t + ||dA|| + u max|A_ii|``, and with the Gram matrix's
    own rounding (:func:`_upper_from_top`'s ``gamma_m ||a||_F^2``) ``||a||_2^2`` is below the sum; the float64 sums
    here are rounded up."""
    n = gram.shape[0]
    g = gram.cpu().numpy()
    with numpy_blas_one_thread():
        lam = _lanczos(lambda q: g @ q, n, rtol=1e-13)
    if not lam > 0:
        return None
    t = lam * (1 + VERIFY_MARGIN)
    shifted = -gram
    shifted.diagonal().add_(t)
    factor, info = torch.linalg.cholesky_ex(shifted)
    if int(info) != 0:
        return None
    u = UNIT_ROUNDOFF64
    gamma = (n + 1) * u / (1 - (n + 1) * u)
    diagonal = shifted.diagonal()
    trace = float(diagonal.sum()) * (1 + 2 * n * u)
    excess = CHOLESKY_SAFETY * gamma / (1 - gamma) * trace + u * float(diagonal.abs().max())
    top = (t + excess) * (1 + 4 * u)  # every eigenvalue of fl(a^T a) is below this
    v = torch.ones(n, 1, dtype=gram.dtype, device=gram.device)
    for _ in range(2):  # inverse iteration at the shift t, just above lam_max: the top direction grows 1 / (t - lam)
        v = torch.cholesky_solve(v, factor)
        v = v / v.norm()
    return v[:, 0], _upper_from_top(top, a)


@torch.no_grad()
def top_singular_triple(weight: torch.Tensor, upper: bool = False):
    """``(sigma, u, v)``: the largest singular value of ``weight`` viewed as (out, in * kh * kw) and its left and
    right singular vectors, float64, from the smaller Gram matrix: Lanczos for its top eigenvalue, verified by a
    Cholesky factorisation just above it, the vector by inverse iteration with that factor
    (:func:`_verified_top`), or ``eigh`` where the verification fails or the smaller side is below
    :data:`VERIFIED_MIN_DIM`; ``sigma = ||W v||`` and ``u = W v / sigma``,
    so ``u^T W v = sigma``. The same bits on every call for the same weight (fixed starts), so a resumed run divides
    by what the uninterrupted one did. Outside the graph: the divisor of the normalised layers at evaluation
    (:mod:`lipsformer.layers.normalized`, which gives it its exact gradient ``u v^T``). ``upper=True`` appends a
    certified upper bound on the norm (the verification's, or :func:`gram_norm_upper`'s from ``eigh``)."""
    a, tall = _tall(weight.detach().to(torch.float64))
    gram = a.T @ a
    verified = _verified_top(a, gram) if gram.shape[0] >= VERIFIED_MIN_DIM else None
    if verified is None:
        values, vectors = torch.linalg.eigh(gram)
        top = float(values[-1].clamp_min(0))
        small, bound = vectors[:, -1], _upper_from_top(top, a)
    else:
        small, bound = verified
    triple = _triple(a, small, tall)
    return (*triple, bound) if upper else triple


def _triple(a: torch.Tensor, small: torch.Tensor, tall: bool):
    """``(sigma, u, v)`` of ``weight`` from ``a`` (its float64 tall view, :func:`_tall`) and ``small``, a unit vector
    on ``a``'s smaller side: ``sigma = ||a small||`` and the other vector ``a small / sigma``."""
    large = a @ small
    sigma = large.norm()
    large = large / sigma.clamp_min(torch.finfo(torch.float64).tiny)
    return (sigma, large, small) if tall else (sigma, small, large)


# Where the training divisor's Lanczos stops (the top Ritz value changing by less than this between checks): close
# to the verified route's sigma, far below float32's own rounding of the divided weight; a smaller value buys digits
# no float32 weight keeps, a larger one reaches that rounding
TRAINING_RTOL = 1e-8


@torch.no_grad()
def estimated_top_triple(weight: torch.Tensor, verified=None):
    """``(sigma, u, v)`` as :func:`top_singular_triple` gives them, without forming the Gram matrix or verifying
    anything: Lanczos (:func:`_lanczos`, fixed start, stopped at :data:`TRAINING_RTOL`) on ``w^T w`` applied as two
    products with ``w`` in float32 (the recurrence in float64), its Ritz vector ``v``, ``sigma = ||W v||`` in
    float64: at most the norm (the image of a unit vector), within about 1e-9 of it. The normalised layers'
    divisor in training, where nothing is certified: their certified norm charges the gap
    (:meth:`lipsformer.layers.normalized._RawWeight.certified_norm`). No Gram product (m n^2 float64 multiply-adds)
    and no factorisation, hence a fraction of the verified route's cost. The same bits on every call for the same
    weight. Smaller sides up to :data:`SMALL_DIM` take :func:`top_singular_triple`'s exact route, cheaper there
    (``verified``: its triple for ``weight`` where already computed, returned as it is). Runs on the CPU whatever
    ``weight``'s device: a weight on a GPU is copied to the host."""
    a, tall = _tall(weight.detach())
    if a.shape[1] <= SMALL_DIM:
        return top_singular_triple(weight) if verified is None else verified
    with numpy_blas_one_thread():
        _, small = _gram_lanczos(a if a.dtype == torch.float64 else a.float(), TRAINING_RTOL, vector=True)
    small = torch.from_numpy(small).to(a.device)
    return _triple(a.to(torch.float64), small / small.norm(), tall)


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
        return _gram_lanczos(w.float()) ** 0.5  # float32 products: half the memory traffic, error ~1e-7
    if w.shape[1] <= EXACT_MAX_DIM:
        return gram_norm_upper(w)
    w = w.to(torch.float64)
    v = torch.randn(w.shape[1], dtype=w.dtype, device=w.device, generator=_generator(w.device))
    for _ in range(iters):
        v = w.T @ (w @ v)
        v = v / v.norm().clamp_min(1e-300)
    return float((w @ v).norm())

