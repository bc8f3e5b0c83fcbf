"""Measured lower bounds on Lipschitz constants: the Jacobian's largest singular value at an input, and its
maximisation over inputs (Kim et al. Sec. 5.1; AttLip Table 1). Any measured value is at most the true
constant, so it must stay under the certified bounds of :mod:`lipsformer.lipschitz.bounds`.

Modules with attention should be built with ``fused_attn=False`` (or ``fused=False`` kernels) when inputs are
optimised: the explicit softmax can be differentiated through a Jacobian-vector product.
"""
from typing import Callable, Optional

import torch
from torch.func import jvp, vjp


def jacobian_norm(f: Callable, x: torch.Tensor, iters: int = 50, v: Optional[torch.Tensor] = None,
                  return_vector: bool = False):
    """Largest singular value of the Jacobian of ``f`` at ``x`` by power iteration on ``J^T J``
    (jvp for ``J v``, vjp for ``J^T u``). ``x`` is one input (any shape); norms are of the flattened tensor."""
    x = x.detach()
    v = torch.randn_like(x) if v is None else v.detach().clone()
    v = v / v.norm()
    _, pullback = vjp(f, x)
    sigma = 0.0
    for _ in range(iters):
        _, jv = jvp(f, (x,), (v,))
        sigma = float(jv.detach().norm())
        (jtjv,) = pullback(jv)
        norm = jtjv.norm()
        if norm == 0:
            break
        v = jtjv / norm
    return (sigma, v) if return_vector else sigma


def maximize_jacobian_norm(f: Callable, x0: torch.Tensor, steps: int = 100, lr: float = 0.05,
                           power_iters: int = 5, project: Optional[Callable] = None) -> dict:
    """Projected gradient ascent on ``||J_f(x) v||`` over inputs ``x`` (``v`` the current top right singular
    vector, refreshed by a few power iterations each step). Each step moves ``x`` by ``lr * max(||x||, 1)``
    along the normalised gradient, then applies ``project`` (e.g. :func:`ball`, or pinning a token to zero as
    in Kim et al.'s proof of Theorem 3.1). Returns the best measured norm, the input that gave it and the
    history."""
    x = x0.detach().clone()
    _, v = jacobian_norm(f, x, power_iters * 4, return_vector=True)
    best, best_x, history = 0.0, x.clone(), []
    for _ in range(steps):
        sigma, v = jacobian_norm(f, x, power_iters, v=v, return_vector=True)
        history.append(sigma)
        if sigma > best:
            best, best_x = sigma, x.clone()
        x.requires_grad_(True)
        _, jv = jvp(f, (x,), (v,))
        (grad,) = torch.autograd.grad(jv.norm(), x)
        with torch.no_grad():
            x = x + lr * grad / grad.norm().clamp_min(1e-12) * x.norm().clamp_min(1.0)
            if project is not None:
                x = project(x)
        x = x.detach()
    sigma = jacobian_norm(f, x, power_iters * 4, v=v)
    history.append(sigma)
    if sigma > best:
        best, best_x = sigma, x.clone()
    return dict(lower_bound=best, x=best_x, history=history)


def ball(radius: float) -> Callable:
    """Projection onto ``||x|| <= radius``, for :func:`maximize_jacobian_norm`."""
    return lambda x: x * min(1.0, radius / float(x.norm()))


def maximize_difference_quotient(f: Callable, x: torch.Tensor, radius: float = 1.0, steps: int = 50,
                                 lr: float = 0.1, seed: int = 0) -> dict:
    """Projected gradient ascent on ``||f(x + d) - f(x)|| / ||d||`` over ``0 < ||d|| <= radius`` (AttLip Table 1's
    "PGD"). Needs only reverse-mode autograd, so ``f`` may branch on values (a solver with backtracking)."""
    x = x.detach()
    with torch.no_grad():
        fx = f(x)
    d = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed), dtype=x.dtype).to(x.device)
    d = d * (radius / float(d.norm()))
    best, history = 0.0, []
    for _ in range(steps):
        d.requires_grad_(True)
        ratio = (f(x + d) - fx).norm() / d.norm()
        (grad,) = torch.autograd.grad(ratio, d)
        history.append(float(ratio.detach()))
        best = max(best, history[-1])
        with torch.no_grad():
            d = d + lr * radius * grad / grad.norm().clamp_min(1e-12)
            d = d * min(1.0, radius / float(d.norm()))
    return dict(lower_bound=best, history=history)
