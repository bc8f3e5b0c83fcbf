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
