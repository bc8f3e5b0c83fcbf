"""The AttLip solvers and their tolerance machinery (see :mod:`lipsformer.layers.attlip`): Armijo descent for
training (:func:`attlip_prox`), Barzilai-Borwein steps for evaluation (:func:`attlip_solve`), and the certified
solve (:func:`attlip_prox_certified`), whose every window's residual is checked in float64 or in float32 with a
proven rounding bound (:func:`prox_residual64`, :func:`prox_residual32`), with the multiply-adds each takes.
"""
import math
from typing import Callable, NamedTuple, Optional, Tuple

import torch
from torch.autograd import forward_ad

from ..errors import Mistake
from .attlip_potential import DiagonalWeight, Weight, as_weight, grad_coefficients, projected_potential


# The AttLip solver tolerance by default (``attlip_tol``): each window's residual ||grad phi_x(y)||, so each block's
# output is within eta * tol per window of the exact prox in certified inference. Float32 outputs cannot carry much
# less than about 1e-6 at Swin-T's window sizes (their rounding alone is charged); 1e-4 costs the certifiable
# Swin-T at 224 about 8e-4 of l2 radius (benchmarks/certified_speed.py prints the figure), a few fewer solver steps
# than 1e-5.
DEFAULT_TOL = 1e-4


class SolverToleranceError(Mistake, RuntimeError):
    """AttLip's proximal solve did not reach its tolerance within the hard cap of :func:`solve_to_tolerance`:
    a certificate resting on that tolerance would be unsound, so none is given."""


def prox_residual64(y: torch.Tensor, x: torch.Tensor, weight: Weight, heads: int, eta: float) -> torch.Tensor:
    """||grad phi_x(y)||_2 per leading index (one token group), evaluated in float64 at the float32 iterate ``y``:
    the residual g_K of AttLip Proposition 3, with the float32 rounding of its evaluation left out."""
    w64 = as_weight(weight).cast(torch.float64)

    def residual(y_part, x_part, groups):
        y64, x64, w = y_part.double(), x_part.double(), w64.regroup(groups)
        g = w.back(grad_coefficients(w.project(y64), heads)) + (y64 - x64) / eta
        return g.pow(2).sum((-1, -2)).sqrt()

    lead = y.shape[:-2]
    flat = (y.detach().reshape(-1, *y.shape[-2:]), x.detach().reshape(-1, *x.shape[-2:]), w64.groups)
    return _in_chunks(residual, *flat).reshape(lead)


# the relative error of the float32 exp the bounded residual calls (torch.exp), for t <= 0 with a normal result:
# 2^-18, 64 ulp. PyTorch's CPU kernels take SLEEF's expf (1.0 ulp) or MKL's VML, CUDA's expf has 2 ulp (CUDA C
# Programming Guide); tests/test_certified_solver.py measures the platform's against float64 on a dense grid
EXP_REL_ERROR32 = 2.0 ** -18


def prox_residual32(y: torch.Tensor, x: torch.Tensor, weight: DiagonalWeight, eta: float
                    ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(r, e)`` per group: ``r = ||g||`` for the residual ``g`` of the proximal problem at the float32 point ``y``
    evaluated in float32 (one evaluation, ``2 N^2 d``), and ``e`` a proven bound on the rounding of that evaluation,
    so that the exact residual at ``y`` (AttLip Proposition 3's ``g_K``) is at most ``r + e``: where that is at most
    the tolerance, no float64 evaluation is needed (:func:`attlip_prox_certified`).

    The operations are written out here so that the bound follows them. With ``u = 2^-24``,
    ``gamma_k = k u / (1 - k u)`` and the standard model of float arithmetic (each +, -, *, /, sqrt correctly
    rounded; a length-k dot product, in any order, with or without FMA, within ``gamma_k`` of the sum of the
    products' absolute values: Higham, Accuracy and Stability of Numerical Algorithms, Thm 3.5), for a group
    (N tokens of d channels, scale s, ``c = s^2 / sqrt(d)``):

    1. ``v = s y``, ``w = v d^(-1/4)`` (within ``gamma_3`` of the exact, entrywise), ``q_j = |w_j|^2``; the logits
       ``L_ij = 2 w_i.w_j + q_j`` (one product) are within ``k_L (2 n_i n_j + n_j^2)`` of the exact logits,
       ``n_j^2 = q_j``, ``k_L = gamma_{2d+16}``; so within ``e_L = 3 k_L max_j q_j`` (all i, j).
    2. Softmax by subtracting the row maximum ``m_i`` (exact), ``exp`` (relative error at most
       ``mu = EXP_REL_ERROR32``), the row sum and a division: ``|log alpha_hat_ij - log alpha_ij| <=
       2 e_L + 2 u T + 2 mu + gamma_{N+1} =: rho'`` with ``T`` the largest row range ``max_j L_ij - min_j L_ij``
       (the subtraction's rounding), hence ``|alpha_hat - alpha| <= rho alpha_hat``, ``rho = (e^rho' - 1) e^rho'``
       (an underflow of ``exp`` to a subnormal adds at most ``2^-126`` absolute to a weight, charged too).
    3. The column sums ``col``, ``1 + col``, ``a + a^T`` and the mix ``(1 + col) v + (a + a^T) v`` (one product
       of length N + 1): the column sums are within ``(rho + gamma_{N+1}) (1 + gamma_N) (1 + col)``, ``a + a^T``
       within ``(rho + gamma_2) (a + a^T)`` and ``v`` within ``u |v|``, so the mix is within ``beta [(1 + col) |v|
       + (a + a^T) |v|]``, ``beta = (rho + gamma_{N+1}) (1 + gamma_N) + gamma_{N+5}`` (the product's own rounding
       included), whose Frobenius norm is at most ``beta (1 + max col + max_k rowsum_k(a + a^T)) (1 + gamma_N)
       ||v||_F`` (``||a + a^T||_2`` is at most its largest row sum: it is symmetric).
    4. Times ``s / sqrt(d)`` (``gamma_3``), plus ``(y - x) / eta`` (``gamma_2`` relative) and the final sum
       (``u |g|``).

    ``r`` and the norms in ``e`` are taken in float64 from the float32 values (their rounding, ~1e-13 relative,
    is charged with a factor 1 + 1e-12). ``y`` and ``x`` are float32 (G, N, d). Measured at 224 (random weights,
    Swin-T-cert): ``e`` 1e-6 to 4e-5 against per-head tolerances 2e-5 to 6e-5; the actual difference from the
    float64 residual, 1e-8."""
    if y.dtype != torch.float32:
        raise ValueError(f"prox_residual32 bounds float32 rounding; got {y.dtype}")
    u = 2.0 ** -24
    tiny = 2.0 ** -126

    def gamma(k):
        return k * u / (1 - k * u)

    def part(y, x, s):
        n, d = y.shape[-2:]
        v = y * s
        w = v * d ** -0.25
        q = w.pow(2).sum(-1)
        logits = torch.baddbmm(q.unsqueeze(-2), w, w.transpose(-1, -2), alpha=2.0)
        top = logits.amax(-1, keepdim=True)
        e = torch.exp(logits - top)
        a = e / e.sum(-1, keepdim=True)
        col = a.sum(-2)
        sym = a + a.transpose(-1, -2)
        mix = torch.baddbmm(v * (1 + col).unsqueeze(-1), sym, v)
        grad_f = mix * (s * d ** -0.5)
        diff = (y - x) / eta
        g = grad_f + diff

        def norm(t):
            return t.double().flatten(1).norm(dim=1)

        e_l = 3 * gamma(2 * d + 16) * q.double().amax(-1)
        span = (top.squeeze(-1) - logits.amin(-1)).double().amax(-1)
        rho_p = 2 * e_l + 2 * u * span + 2 * EXP_REL_ERROR32 + gamma(n + 1)
        rho = torch.expm1(rho_p) * torch.exp(rho_p)
        beta = (rho + gamma(n + 1)) * (1 + gamma(n)) + gamma(n + 5)
        spread = (1 + col.double().amax(-1) + sym.double().sum(-1).amax(-1)) * (1 + gamma(n))
        v_f = norm(v)
        s64 = s.double().flatten() * d ** -0.5
        bound = (s64 * (1 + gamma(3)) * (beta * spread * v_f + n * n * tiny * 4 * v_f.clamp_min(1))
                 + gamma(3) * s64 * norm(mix) + gamma(2) * norm(diff) + u * norm(g))
        return norm(g), bound * (1 + 1e-12)

    lead = y.shape[:-2]
    flat = (t.detach().reshape(-1, *t.shape[-2:]) for t in (y, x))
    r, e = _in_chunks(part, *flat, weight.scale.detach())
    return r.reshape(lead), e.reshape(lead)


def attlip_prox(x: torch.Tensor, weight: Weight, heads: int, eta: float = 1.0, steps: int = 20,
                tol: float = DEFAULT_TOL, beta: float = 0.5, c: float = 1e-4, max_backtracks: int = 20,
                step_init: Optional[float] = None, callback: Optional[Callable] = None) -> torch.Tensor:
    """prox_{eta f}(x) by gradient descent with Armijo backtracking (Algorithms 1 and 2), per leading index (a group
    of tokens): at most ``steps`` steps, each group stopping once its residual is at most ``tol`` (training, and the
    gradients of evaluation's solves).

    The step sizes are chosen without gradient tracking, so the output stays differentiable through the
    (unrolled) descent steps, as in training with a few steps. The groups are independent and are solved in
    cache-sized chunks (:data:`CHUNK_ELEMENTS`), forward and backward. ``callback(k, y_k, g_k)``, if given, sees
    each iterate and the subproblem's gradient there, all groups at once (k = 0 is the start; AttLip Fig. 1 plots
    ``||g_k||``). ``weight`` is W (a tensor or :class:`DenseWeight`: the descent starts at ``x``, trial steps from
    ``step_init``, default 1) or a :class:`DiagonalWeight` (it starts where the weight says, from the step it
    says, unless ``step_init`` is given). Evaluation uses :func:`attlip_solve`, certified inference
    :func:`attlip_prox_certified`.
    """
    w = as_weight(weight)

    def descend(part, groups, callback=None):
        ws = w.regroup(groups)
        first = ws.first_step(heads, eta)
        init = step_init if step_init is not None else first if first is not None else 1.0
        return _descend(part, ws, heads, eta, steps, tol, beta, c, max_backtracks, init, callback)

    if callback is not None or x.dim() < 3:
        return descend(x, w.groups, callback)
    return _in_chunks(descend, x.reshape(-1, *x.shape[-2:]), w.groups).reshape(x.shape)


# gradient evaluations of the certified solve's first pass in the input's dtype; a window that has not met its
# tolerance by then (float32 rounding can floor its residual) continues in float64
FIRST_PASS_STEPS = 100
# a window whose residual has not reached a new low for this many evaluations, and whose lowest residual is within
# STALL_FLOOR times its dtype's rounding floor, is stalled there. The floor is estimated as eps ||x|| max(1,
# ||W W^T||_F) per window (measured floors in float32: 0.3 to 3 times that, on random and on trained weights).
# BB steps are not monotone: on the trained certifiable digits models a window's residual rose for more than 8
# evaluations at 56 and at 1.5e-3, far above any floor, and a stall test without the floor's gate stopped it there
STALLED_AFTER = 8
STALL_FLOOR = 100.0
# derivatives through an evaluation solve (attacks, Jacobian estimates) are those of at most this many unrolled
# Armijo steps, whatever the solve's cap: the certifiable presets cap the solve at FIRST_PASS_STEPS, and unrolling
# that many makes the PGD attacks and difference quotients of benchmarks/paper/certified.py several times slower
GRAD_STEPS = 20
# a Barzilai-Borwein step that takes a window's residual above this multiple of its lowest so far is undone and
# retried at a quarter of its length (BB's rises on these windows stay under 4x; a first step of eta / 2 on 1024
# tokens took the residual from 520 to 8.9e3 and on to 3.6e5, from which BB took 30 evaluations to come back)
OVERSHOOT = 10.0


# Armijo's test compares two computed values of the proximal objective phi; once the decrease it asks for is below
# their rounding (near the prox, in float32), the test fails on noise alone and halves the step until
# max_backtracks: on the certifiable Swin-T at 224 (random weights, batch 8) the second and third training steps
# took 10 trials each, every one over all windows, and shrank some windows' steps to 1e-5. So a trial passes when
# it is within this many times ``N eps phi`` (N tokens: a first-order bound on the rounding of phi's token sum)
# of the decrease asked for: an increase that small is the rounding's, and the step is at most the first one.
ARMIJO_SLACK = 1.0


class SolveStats(NamedTuple):
    """What one certified solve took: gradient evaluations of the slowest window, their mean over windows, the
    largest verified residual (float64, rounding to the output dtype included), the tolerance it met, how many
    windows had to finish in float64, and the multiply-adds of the solve and of its float64 check
    (:func:`solve_multiply_adds`, counted as fvcore counts a matmul; :class:`OrthogonalAttLip` adds its two
    rotations to the solve's)."""

    steps: int
    mean_steps: float
    residual: float
    tol: float
    float64_windows: int = 0
    multiply_adds: int = 0
    check_multiply_adds: int = 0
    float64_checks: int = 0  # windows whose residual was evaluated in float64 (the rest: float32, bound charged)


def solve_multiply_adds(tokens: int, channels: int, dim: int, evaluations: int, windows: int = 1,
                        calls: int = 1, resumed: int = 0, dense: bool = True) -> int:
    """Multiply-adds of ``calls`` calls of :func:`_bb_solve` on ``windows`` windows in all, of ``tokens`` tokens and
    ``channels`` channels, with a (``dim``, ``channels``) weight and ``evaluations`` gradient evaluations in all:
    each evaluation takes the logits and the mix, ``2 N^2 D`` (all heads together), and the product by the Gram
    matrix, ``N D^2``; each window one projection of its input and one of its output, ``2 N C D``, and one more
    product by the Gram matrix if it is ``resumed`` from a given ``z``; each call forms the Gram matrix,
    ``D^2 C``. With a :class:`DiagonalWeight` (``dense=False``) the projections and Gram products are scalings:
    ``2 N^2 D`` an evaluation and nothing else. The elementwise passes (softmax, sums, scalings) are not counted,
    as fvcore does not count them."""
    n, c, d = tokens, channels, dim
    if not dense:
        return evaluations * 2 * n * n * d
    return (evaluations * (2 * n * n * d + n * d * d) + windows * 2 * n * c * d + resumed * n * d * d
            + calls * d * d * c)


def check_multiply_adds(tokens: int, channels: int, dim: int, windows: int, dense: bool = True) -> int:
    """Multiply-adds of :func:`prox_residual64` on ``windows`` windows: a projection, the logits and mix, and the
    gradient mapped back, ``2 N^2 D + 2 N C D`` each, in float64 (``2 N^2 D`` with a :class:`DiagonalWeight`)."""
    return windows * (2 * tokens * tokens * dim + (2 * tokens * channels * dim if dense else 0))


# windows solved together: about this many tokens x channels at once, so that a solve's working set stays in the
# CPU's caches (Swin-T stage 1 at batch 32, 2048 windows, solves several times faster in chunks of 128 windows
# than in one piece)
CHUNK_ELEMENTS = 2 ** 19


def _in_chunks(fn, x: torch.Tensor, *rest: Optional[torch.Tensor]):
    """``fn(x, *rest)`` on chunks of ``x``'s windows (its first dim) of about ``CHUNK_ELEMENTS`` values each,
    results concatenated; ``rest`` are tensors split alike (or None)."""
    size = max(1, CHUNK_ELEMENTS // max(1, x[0].numel()))
    if x.shape[0] <= size:
        return fn(x, *rest)
    parts = [fn(x[i:i + size], *(r if r is None else r[i:i + size] for r in rest)) for i in range(0, len(x), size)]
    if isinstance(parts[0], tuple):
        return tuple(torch.cat(p) for p in zip(*parts))
    return torch.cat(parts)


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Inner products of matching (N, D) slices, one per leading index."""
    return torch.linalg.vecdot(a.flatten(-2), b.flatten(-2))


def _bb_solve(x: torch.Tensor, weight: Weight, heads: int, eta: float, tol: float, max_steps: int,
              z: Optional[torch.Tensor] = None):
    """:func:`_bb_solve_windows` over the flattened windows of ``x``, in cache-sized chunks."""
    w = as_weight(weight)
    lead = x.shape[:-2]
    flat = x.reshape(-1, *x.shape[-2:])
    start = None if z is None else z.reshape(*flat.shape[:-1], w.dim)
    y, z, taken = _in_chunks(lambda a, b, g: _bb_solve_windows(a, w.regroup(g), heads, eta, tol, max_steps, b),
                             flat, start, w.groups)
    return y.reshape(*lead, *x.shape[-2:]), z.reshape(*lead, *z.shape[-2:]), taken.reshape(lead)


def _bb_solve_windows(x: torch.Tensor, weight, heads: int, eta: float, tol: float, max_steps: int,
                      z: Optional[torch.Tensor] = None):
    """Gradient descent on phi_x(y) = f(y) + ||y - x||^2 / (2 eta) with Barzilai-Borwein steps, per window (N, C).

    The step is closed-form from the last two iterates (BB1, ``s.s / s.(g' - g)``: the inverse of a secant estimate
    of the local curvature; AttLip Algorithm 2 allows any step rule), so no potential is evaluated. phi is
    (1 / eta)-strongly convex, so that estimate never exceeds ``eta``; the step is kept in [eta / 1000, eta]. A step
    that takes a window's residual above ``OVERSHOOT`` times its lowest so far is undone and retried at a quarter of
    its length, so no iterate's residual exceeds that multiple of the best one (the first step, eta / 2 unless the
    weight says otherwise, overshoots on long token groups). Each window stops once its residual
    ``||grad phi_x(y)||`` is at most ``tol`` in ``x``'s dtype, or once it has not reached a new low for
    ``STALLED_AFTER`` evaluations near its dtype's rounding floor (a stall, ``STALL_FLOOR``: the caller checks in
    float64), and only the windows still running are computed (the solves are batched, the finished ones leave the
    batch).

    Every gradient ``grad phi_x(y) = (Y + z / eta) W`` lies in the row space of the weight W (D, C) when
    ``y = x + z W`` (``grad f(y) = Y W``, :func:`grad_coefficients`), so the descent runs on ``z`` (N, D) and on
    ``v = y W^T = x W^T + z G`` with the Gram matrix ``G = W W^T`` (``weight``: :class:`DenseWeight`, one
    (N, D) x (D, D) product per evaluation instead of the two of projecting ``y`` and mapping the gradient back; or
    :class:`DiagonalWeight`, a scaling); norms and inner products of gradients are taken in the metric G. ``y`` is
    formed once at the end. The descent starts at ``z`` if given, else where the weight says (``weight.start``:
    ``y = x`` for a dense W). Returns ``y`` (``x``'s dtype), ``z`` and the gradient evaluations each window took
    (its first one included).
    """
    v_x = weight.project(x)
    if z is None:
        z = weight.start(x, heads, eta)
    v = v_x if z is None else v_x + weight.gram(z)
    z = torch.zeros_like(v_x) if z is None else z.clone()
    taken = torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
    if max_steps < 1:
        return x + weight.back(z), z, taken
    live = torch.arange(x.shape[0], device=x.device)
    zl = z
    floor = STALL_FLOOR * torch.finfo(x.dtype).eps * x.flatten(1).norm(dim=1) * weight.gram_norm().clamp_min(1)

    wl = weight  # for the windows still running

    def coefficients(v, z):  # u with grad phi = u W, u G, and ||grad phi||^2
        u = grad_coefficients(v, heads).add_(z, alpha=1 / eta)
        u_gram = wl.gram(u)
        return u, u_gram, _dot(u, u_gram).clamp_min(0)

    u, u_gram, g_sq = coefficients(v, zl)
    first = weight.first_step(heads, eta)
    lam = (torch.full((len(live),), eta / 2 if first is None else first, dtype=x.dtype, device=x.device)
           if not isinstance(first, torch.Tensor) else first.to(x.dtype).expand(len(live)).clone())
    best = torch.full((len(live),), math.inf, dtype=x.dtype, device=x.device)
    since_best = torch.zeros(len(live), dtype=torch.long, device=x.device)
    for k in range(max_steps):  # evaluation k + 1 is checked here
        taken[live] += 1
        residual = g_sq.sqrt()
        improved = residual < best
        best, since_best = torch.where(improved, residual, best), torch.where(improved, 0, since_best + 1)
        done = (residual <= tol) | ((since_best >= STALLED_AFTER) & (best <= floor))  # met, or at the floor
        if bool(done.any()):
            z[live[done]] = zl[done]
            keep = ~done
            live, zl, v, u, u_gram, g_sq, lam, floor = (t[keep] for t in (live, zl, v, u, u_gram, g_sq, lam, floor))
            best, since_best = best[keep], since_best[keep]
            wl = wl.regroup(None if wl.groups is None else wl.groups[keep])
            if not len(live):
                break
        if k + 1 == max_steps:
            break
        step = -lam[:, None, None]
        z_new, v_new = zl.addcmul(step, u), v.addcmul(step, u_gram)  # y - lam * grad, in z and in v
        u_new, u_gram_new, g_sq_new = coefficients(v_new, z_new)
        # BB1 with s = -lam g, d = g' - g: s.s = lam^2 |g|^2, s.d = lam (|g|^2 - <g, g'>), <g, g'> = <u, u' G>
        curvature = lam * (g_sq - _dot(u, u_gram_new))
        lam_new = torch.where(curvature > 0, lam.pow(2) * g_sq / curvature.clamp_min(1e-300),
                              torch.full_like(lam, eta)).clamp(eta / 1000, eta)
        overshot = g_sq_new > (OVERSHOOT * best).pow(2)
        if bool(overshot.any()):  # undo those steps and retry them shorter (a gradient step short enough lowers
            # the residual: phi's Hessian is positive definite); the evaluation counts, and toward a stall
            for new, old in ((z_new, zl), (v_new, v), (u_new, u), (u_gram_new, u_gram), (g_sq_new, g_sq)):
                new[overshot] = old[overshot]
            lam_new = torch.where(overshot, lam / 4, lam_new)
        zl, v, u, u_gram, g_sq, lam = z_new, v_new, u_new, u_gram_new, g_sq_new, lam_new
    if len(live) and zl is not z:  # (zl is z when no step was taken and no window finished: z holds it)
        z[live] = zl
    return x + weight.back(z), z, taken


def _differentiated(*tensors: torch.Tensor) -> bool:
    """Whether a derivative may be taken through ``tensors``: autograd records (one requires grad), a torch.func
    transform is active (``jvp`` / ``vjp`` in :mod:`lipsformer.lipschitz.estimate`, where no tensor need require
    grad), or one is a forward-mode dual tensor."""
    return (torch._C._are_functorch_transforms_active()
            or (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
            or any(forward_ad.unpack_dual(t).tangent is not None for t in tensors))


def _straight_through(y: torch.Tensor, x: torch.Tensor, weight: Weight, heads: int, eta: float,
                      grad_steps: int, tol: float = 0.0) -> torch.Tensor:
    """``y`` (a solve's output, computed without derivatives) carrying, where derivatives are taken (attacks,
    Jacobian estimates), those of at most ``grad_steps`` unrolled Armijo steps (:func:`attlip_prox`, stopping at
    ``tol``), which do not change its value: the derivatives of an approximation of the prox, not of the solve."""
    if _differentiated(x, *as_weight(weight).tensors()):
        unrolled = attlip_prox(x, weight, heads, eta, grad_steps, tol=tol)
        y = y + (unrolled - unrolled.detach())
    return y


def attlip_solve(x: torch.Tensor, weight: Weight, heads: int, eta: float, tol: float,
                 max_steps: int) -> torch.Tensor:
    """prox_{eta f}(x) at evaluation: the first pass of the certified solve (:func:`attlip_prox_certified`), its
    Barzilai-Borwein steps in ``x``'s dtype with each window stopping once its residual is at most ``tol / 2`` (or
    stalled at the dtype's rounding), here capped at ``max_steps`` gradient evaluations and not checked in float64.
    Where the certified solve needs neither more evaluations nor a float64 finish, the outputs are its outputs, bit
    for bit, in far fewer evaluations than Armijo's steps (which also evaluate the potential at every trial).
    Derivatives, where taken, are those of at most ``min(max_steps, GRAD_STEPS)`` unrolled Armijo steps stopping at
    ``tol``."""
    with torch.no_grad():
        y = _bb_solve(x.detach(), as_weight(weight).cast(x.dtype), heads, eta, tol / 2, max_steps)[0]
    return _straight_through(y, x, weight, heads, eta, min(max_steps, GRAD_STEPS), tol)


def attlip_prox_certified(x: torch.Tensor, weight: Weight, heads: int, eta: float, tol: float,
                          max_steps: int = 1000, grad_steps: int = GRAD_STEPS) -> Tuple[torch.Tensor, SolveStats]:
    """prox_{eta f}(x) to a verified tolerance, for certified inference: every window's residual
    ``||grad phi_x(y)||`` evaluated in float64 at the returned point is at most ``tol``, so that
    ``||y - prox(x)|| <= eta * tol`` (AttLip Proposition 3 (1)); past ``max_steps`` gradient evaluations a
    :class:`SolverToleranceError` is raised, never an early stop.

    The solve runs in ``x``'s dtype (:func:`_bb_solve`, to ``tol / 2``, at most ``FIRST_PASS_STEPS`` evaluations);
    the residual is then checked: for a :class:`DiagonalWeight` (the orthogonal form's problems) in float32
    with the proven bound on that evaluation's rounding (:func:`prox_residual32`: ``r + e``), and in float64 only
    for the windows where ``r + e`` exceeds ``tol``; for a dense W in float64 everywhere. Windows whose float64
    residual exceeds ``tol`` (float32 rounding can stall a solve near its floor) continue in float64 from where
    they are, and their result's rounding back to ``x``'s dtype, ``||y - y64|| / eta``, is charged to the residual.
    The float64 evaluation's own rounding (about 1e-16 relative, far below any usable ``tol``) is left out.
    Where gradients are needed (attacks) they are those of ``grad_steps`` unrolled Armijo steps (straight-through),
    which do not change the value.
    """
    w_in = as_weight(weight)
    with torch.no_grad():
        w = w_in.cast(x.dtype)
        y, z, taken = _bb_solve(x.detach(), w, heads, eta, tol / 2, min(max_steps, FIRST_PASS_STEPS))
        bounded = isinstance(w_in, DiagonalWeight) and x.dtype == torch.float32
        if bounded:  # float32 with its rounding bound; float64 where that does not settle it
            r, e = prox_residual32(y, x, w_in, eta)
            residual = r + e
            near = residual > tol
            if bool(near.any()):
                flat = near.flatten()
                residual[near] = prox_residual64(y[near], x[near], w_in.regroup(w_in.groups[flat]), heads, eta)
        else:
            residual = prox_residual64(y, x, w_in, heads, eta)
            near = torch.ones_like(residual, dtype=torch.bool)
        stalled = residual > tol
        rounding = torch.zeros_like(residual)
        if bool(stalled.any()):
            xs = x.detach()[stalled].double()
            ws = w_in.regroup(None if w_in.groups is None else w_in.groups[stalled.flatten()])
            y64, _, more = _bb_solve(xs, ws.cast(torch.float64), heads, eta, tol / 2,
                                     max(max_steps - int(taken.max()), 0), z[stalled].double())
            y[stalled] = y64.to(x.dtype)
            taken[stalled] += more
            rounding[stalled] = (y[stalled].double() - y64).pow(2).sum((-1, -2)).sqrt() / eta
            residual[stalled] = prox_residual64(y64, xs, ws, heads, eta) + rounding[stalled]
        worst = float(residual.max()) if residual.numel() else 0.0
        steps = int(taken.max()) if taken.numel() else 0
        if worst > tol:
            floor = float(rounding.max())
            why = (f"the rounding of the output to {x.dtype} alone is {floor:.3g}: raise attlip_tol above it"
                   if floor > tol / 2 else
                   "raise the cap (solve_to_tolerance(max_steps=...)) or attlip_tol")
            raise SolverToleranceError(
                f"AttLip's proximal solve left a window's residual at {worst:.3g} > tol {tol:g} after {steps} "
                f"gradient evaluations (hard cap {max_steps}; checked in float64, rounding to {x.dtype} included); "
                + why)
        (n, c), d, windows, again = x.shape[-2:], w_in.dim, taken.numel(), int(stalled.sum())
        checks64 = int(near.sum()) + again
        stats = SolveStats(steps, float(taken.double().mean()) if windows else 0.0, worst, tol, again,
                           solve_multiply_adds(n, c, d, int(taken.sum()), windows + again, 1 + bool(again), again,
                                               w_in.dense),
                           check_multiply_adds(n, c, d, checks64, w_in.dense)
                           + (check_multiply_adds(n, c, d, windows, dense=False) if bounded else 0), checks64)
    return _straight_through(y, x, weight, heads, eta, grad_steps), stats


def _descend(x, weight, heads, eta, steps, tol, beta, c, max_backtracks, step_init, callback):
    """Algorithms 1 and 2: at most ``steps`` Armijo gradient steps, each group (leading index) stopping once its
    residual is at most ``tol``; ``weight`` a :class:`DenseWeight` or :class:`DiagonalWeight`.

    The iterates are those of gradient descent on ``y`` (AttLip Algorithm 1), computed in the weight's row space
    as the certified solve does (:func:`_bb_solve_windows`): with ``y = x + z W``, ``grad phi(y) = u W`` for
    ``u = Y + z / eta``, ``v = y W^T = x W^T + z G`` (``G = W W^T``), ``||grad phi||^2 = <u, u G>`` and
    ``||y - x||^2 = <z, z G>``. So a step costs one (N, D) x (D, D) product (a scaling for a diagonal W), the
    potential at ``y`` comes from the logits its gradient already formed, and each of Armijo's trial points
    ``y - lam grad`` costs only its logits and their log-sum-exp (``v - lam u G`` is at hand): no token-by-weight
    product and no second gradient. The descent starts where the weight says (``y = x`` for a dense W)."""
    if steps < 1:
        return x
    v_x = weight.project(x)
    z = weight.start(x, heads, eta)
    z, v = (torch.zeros_like(v_x), v_x) if z is None else (z, v_x + weight.gram(z))
    lead = x.shape[:-2]
    step_init = torch.as_tensor(step_init, dtype=x.dtype, device=x.device).expand(lead)
    lam = step_init.clone()
    for k in range(steps):
        coefficients, f_y = grad_coefficients(v, heads, potential=True)
        u = coefficients + z / eta
        u_gram = weight.gram(u)
        if callback is not None:
            callback(k, x + weight.back(z), weight.back(u))
        with torch.no_grad():
            g_sq = _dot(u, u_gram).clamp_min(0)
            running = g_sq.sqrt() > tol
            if not bool(running.any()):
                break
            phi_y = f_y + _dot(z, v - v_x) / (2 * eta)
            # phi's terms are all >= 0 (squared norms and their log-sum-exps), so phi_y is their magnitude too
            slack = ARMIJO_SLACK * x.shape[-2] * torch.finfo(x.dtype).eps * phi_y
            lam = torch.minimum(lam / beta, step_init)  # let the step grow back
            for _ in range(max_backtracks):
                s = lam[..., None, None]
                z_t, v_t = z - s * u, v - s * u_gram
                f_t = projected_potential(v_t, heads)
                bad = f_t + _dot(z_t, v_t - v_x) / (2 * eta) > phi_y - c * lam * g_sq + slack
                bad &= running
                if not bad.any():
                    break
                lam = torch.where(bad, lam * beta, lam)
        s = torch.where(running, lam, 0.0)[..., None, None]
        z, v = z - s * u, v - s * u_gram
    return x + weight.back(z)
