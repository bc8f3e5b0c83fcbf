"""Invertible residual blocks (Kim et al. Sec. 4) and Theorem 3.2's l-infinity bound (Kim et al. Fig. 2)."""
import math

import pytest
import torch
from torch.func import jacrev

from lipsformer.layers.attention import KimL2Attention
from lipsformer.lipschitz import ContractiveL2Attention, InvertibleResidual, branch_bound, invert
from lipsformer.lipschitz.layer_bounds import kim_l2_bound, kim_l2_inf_bound, lambert_phi_inverse


def _block(c, norm="2", dim=16, heads=2):
    return InvertibleResidual(ContractiveL2Attention(dim, heads, norm=norm, fused=False).double(), c, norm)


@pytest.mark.parametrize("norm", ["2", "inf"])
def test_invert_reconstructs_within_tolerance(norm):
    block = _block(0.9, norm)
    # the Thm 3.1 regime: one token at 0, the others spread wide
    x = torch.empty(6, 8, 16, dtype=torch.double).uniform_(-5, 5)
    x[:, 0] = 0
    for tol in (1e-4, 1e-10):
        out = invert(block, block(x), tol=tol, max_iter=500)
        assert out.converged
        err = (out.x - x).flatten(1)
        err = err.norm(dim=1) if norm == "2" else err.abs().amax(1)
        assert float(err.max()) <= tol
    assert float(err.max()) > 0  # the iteration really ran (x = y would not reconstruct)


def test_contractive_attention_is_certified_one_and_measured_below():
    f = ContractiveL2Attention(16, heads=2, fused=False).double()
    assert branch_bound(f, 8) == pytest.approx(1.0, rel=1e-12)
    x = torch.randn(8, 16, dtype=torch.double) * 3
    jac = jacrev(lambda z: f(z.unsqueeze(0))[0])(x).reshape(128, 128).detach()
    assert 0 < float(torch.linalg.matrix_norm(jac, ord=2)) < 1.0
    # the other norm's certificate: Thm 3.2 in l-inf divided by the l2 normaliser
    assert branch_bound(f, 8, "inf") == pytest.approx(kim_l2_inf_bound(f.attn, 8) / kim_l2_bound(f.attn, 8))


def test_invert_refuses_a_branch_not_certified_contractive():
    attn = KimL2Attention(16, heads=2).double()
    lip = branch_bound(attn, 8)
    y = torch.randn(2, 8, 16, dtype=torch.double)
    with pytest.raises(ValueError, match="not below 1"):
        invert(InvertibleResidual(attn, 1.001 / lip), y)  # c Lip(f) just above 1: refused
    invert(InvertibleResidual(attn, 0.99 / lip), y)  # just below: accepted
    for norm in ("2", "inf"):  # the contractive form is certified 1 (up to rounding): c > 1 is refused
        with pytest.raises(ValueError, match="not below 1"):
            invert(_block(1.001, norm), y)
    with pytest.raises(TypeError, match="no Lipschitz bound is registered .*Tanh"):
        invert(InvertibleResidual(torch.nn.Tanh(), 0.5), y)
    with pytest.raises(TypeError, match="no certified Lipschitz-inf bound for GELU"):
        invert(InvertibleResidual(torch.nn.GELU(), 0.5, norm="inf"), y)
    with pytest.raises(TypeError, match="InvertibleResidual"):
        invert(attn, y)


def test_invert_iterations_fall_as_c_falls():
    torch.manual_seed(1)
    block = _block(0.5)
    x = torch.empty(4, 8, 16, dtype=torch.double).uniform_(-3, 3)
    iters = []
    for c in (0.95, 0.7, 0.4, 0.1):
        block.c = c
        out = invert(block, block(x), tol=1e-10, max_iter=1000)
        assert out.converged
        iters.append(out.iterations)
    assert iters == sorted(iters, reverse=True) and iters[0] > iters[-1], iters


def test_theorem_3_2_inf_bound_scalar_case_and_soundness():
    # H = D = 1, identity weights (Kim et al. Fig. 2): the bound is 4 phi^-1(N-1) + 1
    attn = KimL2Attention(1, 1).double()
    for m in (attn.q, attn.v, attn.proj):
        torch.nn.init.ones_(m.weight)
    for n in (2, 100, 1000):
        assert kim_l2_inf_bound(attn, n) == pytest.approx(4 * lambert_phi_inverse(n - 1) + 1)
    assert lambert_phi_inverse(99) * math.exp(lambert_phi_inverse(99) + 1) == pytest.approx(99)
    # random weights, several heads: the measured l-inf Jacobian norm (largest row sum) stays under the bound
    torch.manual_seed(0)
    attn = KimL2Attention(4, heads=2, fused=False).double()
    bound = kim_l2_inf_bound(attn, 6)
    worst = 0.0
    for scale in (0.1, 1.0, 3.0, 10.0):
        x = (torch.rand(6, 4, dtype=torch.double) * 2 - 1) * scale
        x.requires_grad_(True)
        opt = torch.optim.Adam([x], lr=0.1)
        for _ in range(30):  # ascend the l-inf Jacobian norm
            jac = jacrev(lambda z: attn(z.unsqueeze(0))[0])(x).reshape(24, 24)
            norm = jac.abs().sum(1).max()
            worst = max(worst, float(norm))
            opt.zero_grad()
            (-norm).backward()
            opt.step()
    assert 0 < worst <= bound
