"""AttLip: attention as the proximal step of a convex potential (AttLip paper, Proposition 1, Theorem 4).

For tokens ``x`` (N, C) and per-head projections ``W^h`` (d_h, C) the potential is

.. math:: f(x) = \\sum_h \\tfrac12 \\sum_i \\mathrm{LSE}_j(S^h_{ij}),\\quad
          S^h_{ij} = \\|W^h (x_i + x_j)\\|^2 / \\sqrt{d_h}

(the score of Algorithm 4), and the block's output is :math:`\\mathrm{prox}_{\\eta f}(x) =
\\arg\\min_y f(y) + \\|y - x\\|^2 / 2\\eta`, which is firmly non-expansive, hence 1-Lipschitz for any eta and any
weights. The proximal problem is solved by gradient descent: in training with a few Armijo steps (Algorithms 1
and 2, unrolled: the paper trains with 1-3), at evaluation with Barzilai-Borwein steps until each window's residual
is at most ``tol`` (:func:`attlip_solve`; the paper evaluates with 20 Armijo steps), and in certified inference
with the same steps, verified in float64, to a tolerance the certificate charges (:func:`attlip_prox_certified`).
"""
import contextlib
import math
from typing import Callable, Iterator, NamedTuple, Optional, Tuple

import torch
from timm.layers import register_notrace_module
from torch.autograd import forward_ad
from torch import nn

from ..errors import Mistake
from .windows import pad_to_multiple, window_partition, window_reverse


def _heads(v: torch.Tensor, heads: int) -> torch.Tensor:
    """Projected tokens (..., N, D) as per-head groups (..., H, N, D / H)."""
    return v.unflatten(-1, (heads, v.shape[-1] // heads)).transpose(-3, -2)


def _logits(v: torch.Tensor, heads: int):
    """From projected tokens ``v = x W^T`` (..., N, D): the per-head tokens ``vh`` (L * H, N, d_h) (L the leading
    indices flattened), ``|w_i|^2`` and the logits ``2 w_i.w_j + |w_j|^2`` (L * H, N, N) with ``w = vh / d_h^(1/4)``:
    the score ``S_ij = ||v_i + v_j||^2 / sqrt(d_h)`` less its row term ``|w_i|^2``, one batched product."""
    n, d = v.shape[-2:]
    d_h = d // heads
    vh = _heads(v, heads).reshape(-1, n, d_h)
    w = vh * d_h ** -0.25
    sq = w.pow(2).sum(-1)
    return vh, sq, torch.baddbmm(sq.unsqueeze(-2), w, w.transpose(-1, -2), alpha=2.0)


def _lse_potential(logits: torch.Tensor, sq: torch.Tensor, lead: torch.Size, heads: int) -> torch.Tensor:
    """f = sum_h 1/2 sum_i LSE_j(S_ij) per leading index, from :func:`_logits`' logits and row terms (the
    log-sum-exp shifted by the row maximum, exponentiated in place: half the time of ``torch.logsumexp`` here)."""
    top = logits.detach().amax(-1, keepdim=True)
    lse = (logits - top).exp_().sum(-1).log_() + top.squeeze(-1)
    return 0.5 * (lse + sq).sum(-1).view(*lead, heads).sum(-1)


def _potential(v: torch.Tensor, heads: int) -> torch.Tensor:
    """f per leading index from projected tokens ``v = x W^T`` (..., N, D)."""
    _, sq, logits = _logits(v, heads)
    return _lse_potential(logits, sq, v.shape[:-2], heads)


def attlip_potential(x: torch.Tensor, weight: torch.Tensor, heads: int) -> torch.Tensor:
    """f(x) of Theorem 4 for tokens ``x`` (..., N, C); one value per leading index."""
    return _potential(x @ weight.T, heads)


def _grad_coefficients(v: torch.Tensor, heads: int, potential: bool = False):
    """For projected tokens ``v = x W^T`` (..., N, D), the ``Y`` (..., N, D) with ``grad f(x) = Y W``: the gradient
    in the weight's row space, where the solvers iterate. ``potential=True`` also returns f(x) per leading index,
    from the same logits and without gradient tracking (what Armijo's test compares against).

    The row softmax of S drops S's row term ``|v_i|^2 / sqrt(d_h)`` (constant along a row), so with
    ``w = v / d_h^(1/4)`` the logits are ``2 w_i.w_j + |w_j|^2``, one batched product; the mix is ``(a + a^T) v``
    as two products and the self term is added in place: few passes over the (N, N) scores, which bound the cost
    at Swin's small windows."""
    lead, d_h = v.shape[:-2], v.shape[-1] // heads
    vh, sq, logits = _logits(v, heads)
    a = logits.softmax(-1)
    y = torch.baddbmm(torch.bmm(a, vh), a.transpose(-1, -2), vh)  # (a + a^T) v
    y = y.addcmul(a.sum(-2).add(1.0).unsqueeze(-1), vh).mul(d_h ** -0.5)  # + (1 + sum_i a_ik) v_k, / sqrt(d_h)
    y = y.unflatten(0, (*lead, heads)).transpose(-3, -2).flatten(-2)
    if not potential:
        return y
    with torch.no_grad():
        return y, _lse_potential(logits, sq, lead, heads)


def attlip_grad(x: torch.Tensor, weight: torch.Tensor, heads: int) -> torch.Tensor:
    """The gradient of :func:`attlip_potential` in closed form (Proposition 1, per head, as in Algorithm 4):

    :math:`\\nabla f(x)_k = \\sum_h W^{h\\top}\\big[(1 + \\sum_i \\alpha_{ik}) v_k + \\sum_i (\\alpha_{ik} + \\alpha_{ki}) v_i\\big]
    / \\sqrt{d_h}` with :math:`\\alpha = \\mathrm{softmax}_{\\mathrm{row}}(S)` and :math:`v_i = W^h x_i`.
    (Algorithm 4 as printed adds the identity once more and drops the :math:`1/\\sqrt{d_h}`; this is the exact
    gradient, checked against autograd in the tests.)
    """
    return _grad_coefficients(x @ weight.T, heads) @ weight


# The AttLip solver tolerance by default (``attlip_tol``): each window's residual ||grad phi_x(y)||, so each block's
# output is within eta * tol per window of the exact prox in certified inference. Float32 outputs cannot carry much
# less than about 1e-6 at Swin-T's window sizes (their rounding alone is charged); 1e-4 costs the certifiable
# Swin-T at 224 about 8e-4 of l2 radius (benchmarks/certified_speed.py prints the figure), a few fewer solver steps
# than 1e-5.
DEFAULT_TOL = 1e-4


class SolverToleranceError(Mistake, RuntimeError):
    """AttLip's proximal solve did not reach its tolerance within the hard cap of :func:`solve_to_tolerance`:
    a certificate resting on that tolerance would be unsound, so none is given."""


def prox_residual64(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, heads: int, eta: float) -> torch.Tensor:
    """||grad phi_x(y)||_2 per leading index (one token group), evaluated in float64 at the float32 iterate ``y``:
    the residual g_K of AttLip Proposition 3, with the float32 rounding of its evaluation left out."""
    w64 = weight.detach().double()

    def residual(y_part, x_part):
        y64, x64 = y_part.double(), x_part.double()
        g = attlip_grad(y64, w64, heads) + (y64 - x64) / eta
        return g.pow(2).sum((-1, -2)).sqrt()

    lead = y.shape[:-2]
    flat = (y.detach().reshape(-1, *y.shape[-2:]), x.detach().reshape(-1, *x.shape[-2:]))
    return _in_chunks(residual, *flat).reshape(lead)


def attlip_prox(x: torch.Tensor, weight: torch.Tensor, heads: int, eta: float = 1.0, steps: int = 20,
                tol: float = DEFAULT_TOL, beta: float = 0.5, c: float = 1e-4, max_backtracks: int = 20,
                step_init: float = 1.0, callback: Optional[Callable] = None) -> torch.Tensor:
    """prox_{eta f}(x) by gradient descent with Armijo backtracking (Algorithms 1 and 2), per leading index (a group
    of tokens): at most ``steps`` steps, each group stopping once its residual is at most ``tol`` (training, and the
    gradients of evaluation's solves).

    The step sizes are chosen without gradient tracking, so the output stays differentiable through the
    (unrolled) descent steps, as in training with a few steps. The groups are independent and are solved in
    cache-sized chunks (:data:`CHUNK_ELEMENTS`), forward and backward. ``callback(k, y_k, g_k)``, if given, sees
    each iterate and the subproblem's gradient there, all groups at once (k = 0 is the input; AttLip Fig. 1 plots
    ``||g_k||``). Evaluation uses :func:`attlip_solve`, certified inference :func:`attlip_prox_certified`.
    """
    gram = weight @ weight.T

    def descend(part, callback=None):
        return _descend(part, weight, gram, heads, eta, steps, tol, beta, c, max_backtracks, step_init, callback)

    if callback is not None or x.dim() < 3:
        return descend(x, callback)
    return _in_chunks(descend, x.reshape(-1, *x.shape[-2:])).reshape(x.shape)


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
# that many made the PGD attacks and difference quotients of benchmarks/certified.py 2.5x slower
GRAD_STEPS = 20
# a Barzilai-Borwein step that takes a window's residual above this multiple of its lowest so far is undone and
# retried at a quarter of its length (BB's rises on these windows stay under 4x; a first step of eta / 2 on 1024
# tokens took the residual from 520 to 8.9e3 and on to 3.6e5, from which BB took 30 evaluations to come back)
OVERSHOOT = 10.0


class SolveStats(NamedTuple):
    """What one certified solve took: gradient evaluations of the slowest window, their mean over windows, the
    largest verified residual (float64, rounding to the output dtype included), the tolerance it met, how many
    windows had to finish in float64, and the multiply-adds of the solve and of its float64 check
    (:func:`solve_multiply_adds`, counted as fvcore counts a matmul)."""

    steps: int
    mean_steps: float
    residual: float
    tol: float
    float64_windows: int = 0
    multiply_adds: int = 0
    check_multiply_adds: int = 0


def solve_multiply_adds(tokens: int, channels: int, dim: int, evaluations: int, windows: int = 1,
                        calls: int = 1, resumed: int = 0) -> int:
    """Multiply-adds of ``calls`` calls of :func:`_bb_solve` on ``windows`` windows in all, of ``tokens`` tokens and
    ``channels`` channels, with a (``dim``, ``channels``) weight and ``evaluations`` gradient evaluations in all:
    each evaluation takes the logits and the mix, ``3 N^2 D`` (all heads together), and the product by the Gram
    matrix, ``N D^2``; each window one projection of its input and one of its output, ``2 N C D``, and one more
    product by the Gram matrix if it is ``resumed`` from a given ``z``; each call forms the Gram matrix,
    ``D^2 C``. The elementwise passes (softmax, sums) are not counted, as fvcore does not count them."""
    n, c, d = tokens, channels, dim
    return (evaluations * (3 * n * n * d + n * d * d) + windows * 2 * n * c * d + resumed * n * d * d
            + calls * d * d * c)


def check_multiply_adds(tokens: int, channels: int, dim: int, windows: int) -> int:
    """Multiply-adds of :func:`prox_residual64` on ``windows`` windows: a projection, the logits and mix, and the
    gradient mapped back, ``3 N^2 D + 2 N C D`` each, in float64."""
    return windows * (3 * tokens * tokens * dim + 2 * tokens * channels * dim)


# windows solved together: about this many tokens x channels at once, so that a solve's working set stays in the
# CPU's caches (Swin-T stage 1 at batch 32, 2048 windows: 7.3 s in one piece, 1.8 s in chunks of 128)
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


def _bb_solve(x: torch.Tensor, weight: torch.Tensor, heads: int, eta: float, tol: float, max_steps: int,
              z: Optional[torch.Tensor] = None):
    """:func:`_bb_solve_windows` over the flattened windows of ``x``, in cache-sized chunks."""
    lead = x.shape[:-2]
    flat = x.reshape(-1, *x.shape[-2:])
    start = None if z is None else z.reshape(*flat.shape[:-1], weight.shape[0])
    gram = weight @ weight.T
    y, z, taken = _in_chunks(lambda a, b: _bb_solve_windows(a, weight, gram, heads, eta, tol, max_steps, b),
                             flat, start)
    return y.reshape(*lead, *x.shape[-2:]), z.reshape(*lead, *z.shape[-2:]), taken.reshape(lead)


def _bb_solve_windows(x: torch.Tensor, weight: torch.Tensor, gram: torch.Tensor, heads: int, eta: float,
                      tol: float, max_steps: int, z: Optional[torch.Tensor] = None):
    """Gradient descent on phi_x(y) = f(y) + ||y - x||^2 / (2 eta) with Barzilai-Borwein steps, per window (N, C).

    The step is closed-form from the last two iterates (BB1, ``s.s / s.(g' - g)``: the inverse of a secant estimate
    of the local curvature; AttLip Algorithm 2 allows any step rule), so no potential is evaluated. phi is
    (1 / eta)-strongly convex, so that estimate never exceeds ``eta``; the step is kept in [eta / 1000, eta]. A step
    that takes a window's residual above ``OVERSHOOT`` times its lowest so far is undone and retried at a quarter of
    its length, so no iterate's residual exceeds that multiple of the best one (the first step, eta / 2, overshoots
    on long token groups). Each window stops once its residual ``||grad phi_x(y)||`` is at most ``tol`` in ``x``'s
    dtype, or once it has not reached a new low for ``STALLED_AFTER`` evaluations near its dtype's rounding floor (a
    stall, ``STALL_FLOOR``: the caller checks in float64), and only the windows still running are computed (the
    solves are batched, the finished ones leave the batch).

    Every gradient ``grad phi_x(y) = (Y + z / eta) W`` lies in the row space of the weight W (D, C) when
    ``y = x + z W`` (``grad f(y) = Y W``, :func:`_grad_coefficients`), so the descent runs on ``z`` (N, D) and on
    ``v = y W^T = x W^T + z G`` with the Gram matrix ``gram = W W^T``: one (N, D) x (D, D) product per evaluation
    instead of the two of projecting ``y`` and mapping the gradient back; norms and inner products of gradients are
    taken in the metric G. ``y`` is formed once at the end. Returns ``y`` (``x``'s dtype), ``z`` and the gradient
    evaluations each window took (its first one included).
    """
    v_x = x @ weight.T
    v = v_x if z is None else v_x + z @ gram
    z = torch.zeros_like(v_x) if z is None else z.clone()
    taken = torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
    if max_steps < 1:
        return x + z @ weight, z, taken
    live = torch.arange(x.shape[0], device=x.device)
    zl = z
    floor = STALL_FLOOR * torch.finfo(x.dtype).eps * x.flatten(1).norm(dim=1) * gram.norm().clamp_min(1)

    def coefficients(v, z):  # u with grad phi = u W, u G, and ||grad phi||^2
        u = _grad_coefficients(v, heads).add_(z, alpha=1 / eta)
        u_gram = u @ gram
        return u, u_gram, _dot(u, u_gram).clamp_min(0)

    u, u_gram, g_sq = coefficients(v, zl)
    lam = torch.full((len(live),), eta / 2, dtype=x.dtype, device=x.device)
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
    if len(live):
        z[live] = zl
    return x + z @ weight, z, taken


def _differentiated(*tensors: torch.Tensor) -> bool:
    """Whether a derivative may be taken through ``tensors``: autograd records (one requires grad), a torch.func
    transform is active (``jvp`` / ``vjp`` in :mod:`lipsformer.lipschitz.estimate`, where no tensor need require
    grad), or one is a forward-mode dual tensor."""
    return (torch._C._are_functorch_transforms_active()
            or (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
            or any(forward_ad.unpack_dual(t).tangent is not None for t in tensors))


def _straight_through(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, heads: int, eta: float,
                      grad_steps: int, tol: float = 0.0) -> torch.Tensor:
    """``y`` (a solve's output, computed without derivatives) carrying, where derivatives are taken (attacks,
    Jacobian estimates), those of at most ``grad_steps`` unrolled Armijo steps (:func:`attlip_prox`, stopping at
    ``tol``), which do not change its value: the derivatives of an approximation of the prox, not of the solve."""
    if _differentiated(x, weight):
        unrolled = attlip_prox(x, weight, heads, eta, grad_steps, tol=tol)
        y = y + (unrolled - unrolled.detach())
    return y


def attlip_solve(x: torch.Tensor, weight: torch.Tensor, heads: int, eta: float, tol: float,
                 max_steps: int) -> torch.Tensor:
    """prox_{eta f}(x) at evaluation: the first pass of the certified solve (:func:`attlip_prox_certified`), its
    Barzilai-Borwein steps in ``x``'s dtype with each window stopping once its residual is at most ``tol / 2`` (or
    stalled at the dtype's rounding), here capped at ``max_steps`` gradient evaluations and not checked in float64.
    Where the certified solve needs neither more evaluations nor a float64 finish, the outputs are its outputs, bit
    for bit, in far fewer evaluations than Armijo's steps (which also evaluate the potential at every trial).
    Derivatives, where taken, are those of at most ``min(max_steps, GRAD_STEPS)`` unrolled Armijo steps stopping at
    ``tol``."""
    with torch.no_grad():
        y = _bb_solve(x.detach(), weight.detach().to(x.dtype), heads, eta, tol / 2, max_steps)[0]
    return _straight_through(y, x, weight, heads, eta, min(max_steps, GRAD_STEPS), tol)


def attlip_prox_certified(x: torch.Tensor, weight: torch.Tensor, heads: int, eta: float, tol: float,
                          max_steps: int = 1000, grad_steps: int = GRAD_STEPS) -> Tuple[torch.Tensor, SolveStats]:
    """prox_{eta f}(x) to a verified tolerance, for certified inference: every window's residual
    ``||grad phi_x(y)||`` evaluated in float64 at the returned point is at most ``tol``, so that
    ``||y - prox(x)|| <= eta * tol`` (AttLip Proposition 3 (1)); past ``max_steps`` gradient evaluations a
    :class:`SolverToleranceError` is raised, never an early stop.

    The solve runs in ``x``'s dtype (:func:`_bb_solve`, to ``tol / 2``, at most ``FIRST_PASS_STEPS`` evaluations);
    the residual is then checked in float64. Windows whose float64 residual exceeds ``tol`` (float32 rounding can
    stall a solve near its floor) continue in float64 from where they are, and their result's rounding back to ``x``'s dtype, ``||y - y64|| / eta``, is charged to the residual.
    The float64 evaluation's own rounding (about 1e-16 relative, far below any usable ``tol``) is left out.
    Where gradients are needed (attacks) they are those of ``grad_steps`` unrolled Armijo steps (straight-through),
    which do not change the value.
    """
    with torch.no_grad():
        w = weight.detach()
        y, z, taken = _bb_solve(x.detach(), w.to(x.dtype), heads, eta, tol / 2,
                                min(max_steps, FIRST_PASS_STEPS))
        residual = prox_residual64(y, x, w, heads, eta)
        stalled = residual > tol
        rounding = torch.zeros_like(residual)
        if bool(stalled.any()):
            xs = x.detach()[stalled].double()
            y64, _, more = _bb_solve(xs, w.double(), heads, eta, tol / 2, max(max_steps - int(taken.max()), 0),
                                     z[stalled].double())
            y[stalled] = y64.to(x.dtype)
            taken[stalled] += more
            rounding[stalled] = (y[stalled].double() - y64).pow(2).sum((-1, -2)).sqrt() / eta
            residual[stalled] = prox_residual64(y64, xs, w, heads, eta) + rounding[stalled]
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
        (n, c), d, windows, again = x.shape[-2:], weight.shape[0], taken.numel(), int(stalled.sum())
        stats = SolveStats(steps, float(taken.double().mean()) if windows else 0.0, worst, tol, again,
                           solve_multiply_adds(n, c, d, int(taken.sum()), windows + again, 1 + bool(again), again),
                           check_multiply_adds(n, c, d, windows + again))
    return _straight_through(y, x, weight, heads, eta, grad_steps), stats


def _descend(x, weight, gram, heads, eta, steps, tol, beta, c, max_backtracks, step_init, callback):
    """Algorithms 1 and 2: at most ``steps`` Armijo gradient steps, each group (leading index) stopping once its
    residual is at most ``tol``; ``gram`` is ``W W^T``.

    The iterates are those of gradient descent on ``y`` (AttLip Algorithm 1), computed in the weight's row space
    as the certified solve does (:func:`_bb_solve_windows`): with ``y = x + z W``, ``grad phi(y) = u W`` for
    ``u = Y + z / eta``, ``v = y W^T = x W^T + z G`` (``G = W W^T``), ``||grad phi||^2 = <u, u G>`` and
    ``||y - x||^2 = <z, z G>``. So a step costs one (N, D) x (D, D) product, the potential at ``y`` comes from the
    logits its gradient already formed, and each of Armijo's trial points ``y - lam grad`` costs only its logits
    and their log-sum-exp (``v - lam u G`` is at hand): no token-by-weight product and no second gradient."""
    if steps < 1:
        return x
    v_x = x @ weight.T
    z, v = torch.zeros_like(v_x), v_x
    lead = x.shape[:-2]
    lam = torch.full(lead, step_init, dtype=x.dtype, device=x.device)
    for k in range(steps):
        coefficients, f_y = _grad_coefficients(v, heads, potential=True)
        u = coefficients + z / eta
        u_gram = u @ gram
        if callback is not None:
            callback(k, x + z @ weight, u @ weight)
        with torch.no_grad():
            g_sq = _dot(u, u_gram).clamp_min(0)
            running = g_sq.sqrt() > tol
            if not bool(running.any()):
                break
            phi_y = f_y + _dot(z, v - v_x) / (2 * eta)
            lam = torch.minimum(lam / beta, torch.full_like(lam, step_init))  # let the step grow back
            for _ in range(max_backtracks):
                s = lam[..., None, None]
                z_t, v_t = z - s * u, v - s * u_gram
                bad = _potential(v_t, heads) + _dot(z_t, v_t - v_x) / (2 * eta) > phi_y - c * lam * g_sq
                bad &= running
                if not bad.any():
                    break
                lam = torch.where(bad, lam * beta, lam)
        s = torch.where(running, lam, 0.0)[..., None, None]
        z, v = z - s * u, v - s * u_gram
    return x + z @ weight


class AttLip(nn.Module):
    """The AttLip block on token groups (B, N, C): returns prox_{eta f}(x), 1-Lipschitz by construction.

    Args:
        dim: channels C. heads: number of heads H (C divisible by H).
        eta: proximal step (any eta > 0 keeps the block 1-Lipschitz; the paper uses 1).
        train_steps / eval_steps: descent steps while training (Armijo, :func:`attlip_prox`) / gradient evaluations
            at most at evaluation (:func:`attlip_solve`) (paper: 1-3 / 20).
        tol: stop when the subproblem's gradient norm is below this.

    Certified inference (:func:`solve_to_tolerance`) solves to ``tol`` with a hard cap and verifies
    (:func:`attlip_prox_certified`); plain evaluation takes the same first pass without the check, so its outputs
    are the certified forward's wherever ``eval_steps`` suffice and no window needs a float64 finish.
    """

    def __init__(self, dim: int, heads: int = 1, eta: float = 1.0, train_steps: int = 2, eval_steps: int = 20,
                 tol: float = DEFAULT_TOL):
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} must be divisible by heads {heads}")
        if eta <= 0:
            raise ValueError(f"eta must be positive, got {eta}")
        self.heads, self.eta, self.tol = heads, eta, tol
        self.train_steps, self.eval_steps = train_steps, eval_steps
        self.solve_cap: Optional[int] = None  # set by solve_to_tolerance: strict solving with this hard cap
        self.last_solve: Optional[SolveStats] = None  # what the last certified solve took
        self.weight = nn.Parameter(torch.randn(dim, dim) / math.sqrt(dim))  # rows: the heads' W^h stacked

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.solve_cap is not None and not self.training:
            y, self.last_solve = attlip_prox_certified(x, self.weight, self.heads, self.eta, self.tol,
                                                       self.solve_cap, min(self.eval_steps, GRAD_STEPS))
            return y
        if self.training:
            return attlip_prox(x, self.weight, self.heads, self.eta, self.train_steps, self.tol)
        return attlip_solve(x, self.weight, self.heads, self.eta, self.tol, self.eval_steps)

    def extra_repr(self) -> str:
        return f"heads={self.heads}, eta={self.eta}, steps={self.train_steps}/{self.eval_steps}"


@register_notrace_module  # reason: windows, padding and the descent's stopping test read shapes and values
class AttLipMixer(nn.Module):
    """AttLip as a LipsBlock token mixer on (B, H, W, C), the ``attn="attlip"`` choice of both families.

    The channels are split evenly over ``windows`` (Swin: one window shape; CSwin: vertical then horizontal
    stripes, or the whole map); each group of tokens goes through its branch's :class:`AttLip`. The mixer
    returns ``prox(x) - x``, so the block's weighted residual ``x + alpha * (prox(x) - x)`` moves from ``x``
    toward ``prox(x)``. ``I - prox`` is firmly non-expansive like ``prox``, so the mixer is 1-Lipschitz.
    ``delta=False`` returns ``prox(x)`` itself (for a convex residual ``(1 - a) x + a prox(x)``; also 1-Lipschitz);
    ``reflect=True`` returns the reflected resolvent ``2 prox(x) - x``, non-expansive as ``prox`` is firmly so (an
    isometry where ``prox`` is a linear projection), so ``(1 - a) x + a (2 prox(x) - x)`` need not contract.
    """

    def __init__(self, dim: int, heads: int, windows, eta: float = 1.0, train_steps: int = 2, eval_steps: int = 20,
                 tol: float = DEFAULT_TOL, delta: bool = True, reflect: bool = False):
        super().__init__()
        self.delta, self.reflect = delta, reflect
        nb = len(windows)
        if dim % nb or heads % nb:
            raise ValueError(f"dim {dim} and heads {heads} must divide over {nb} window shapes")
        self.windows = [tuple(w) for w in windows]
        self.branches = nn.ModuleList(
            AttLip(dim // nb, heads // nb, eta, train_steps, eval_steps, tol) for _ in self.windows)

    def set_windows(self, windows) -> None:
        """Other window shapes, one per branch (the weights do not depend on them)."""
        if len(windows) != len(self.windows):
            raise ValueError(f"{len(self.windows)} window shapes are built, got {len(windows)}")
        self.windows = [tuple(w) for w in windows]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """A size a window does not divide is padded with zeros and cropped back (``strict_img_size=False``)."""
        B, H, W, C = x.shape
        parts = x.chunk(len(self.windows), dim=-1)
        outs = []
        for part, window, layer in zip(parts, self.windows, self.branches):
            part = pad_to_multiple(part, window)
            tokens = window_partition(part, window)
            out = layer(tokens)
            out = 2 * out - tokens if self.reflect else out - tokens if self.delta else out
            out = window_reverse(out, window, *part.shape[1:3])
            outs.append(out[:, :H, :W] if out.shape[1:3] != (H, W) else out)
        return torch.cat(outs, dim=-1) if len(outs) > 1 else outs[0]

    def solver_defect(self, hw) -> float:
        """Per image, a bound on ``||computed - exact||_2`` of this mixer's output on an ``hw`` token grid when every
        window is solved to its branch's ``tol`` (:func:`solve_to_tolerance`): AttLip Proposition 3 (1) gives
        ``eta * tol`` per window; windows and branches are disjoint blocks of the output, so their squares add.
        ``I - prox`` deviates by as much as ``prox``, ``2 prox - I`` by twice as much; zero padding and cropping do not
        increase it."""
        H, W = hw
        sq = 0.0
        for window, layer in zip(self.windows, self.branches):
            n = math.ceil(H / window[0]) * math.ceil(W / window[1])
            sq += n * (layer.eta * layer.tol) ** 2
        return (2.0 if self.reflect else 1.0) * math.sqrt(sq)

    def extra_repr(self) -> str:
        return f"windows={self.windows}, delta={self.delta}, reflect={self.reflect}"


@contextlib.contextmanager
def solve_to_tolerance(model: nn.Module, max_steps: int = 1000) -> Iterator[nn.Module]:
    """Certified inference: inside, every :class:`AttLip` of ``model`` in eval mode solves its proximal problem
    until each window's residual (float64) is at most its ``tol``, raising :class:`SolverToleranceError` past
    ``max_steps`` rather than stopping early; that tolerance is what the certificate's defect charges."""
    if max_steps < 1:
        raise ValueError(f"max_steps must be at least 1, got {max_steps}")
    layers = [m for m in model.modules() if isinstance(m, AttLip)]
    saved = [m.solve_cap for m in layers]
    for m in layers:
        m.solve_cap = max_steps
    try:
        yield model
    finally:
        for m, cap in zip(layers, saved):
            m.solve_cap = cap
