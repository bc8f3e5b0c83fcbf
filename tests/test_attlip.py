"""AttLip (convex-potential attention): exact gradient, the proximal step it claims, and 1-Lipschitz outputs."""
import pytest
import torch

from lipsformer.layers.attlip import AttLip
from lipsformer.layers.attlip_potential import attlip_grad, attlip_potential
from lipsformer.layers.attlip_solver import attlip_prox, attlip_solve
from lipsformer.lipschitz import maximize_difference_quotient

N, C, H = 6, 8, 2


@pytest.fixture
def weight():
    return torch.randn(C, C, dtype=torch.double, generator=torch.Generator().manual_seed(1)) / C ** 0.5


def tokens(seed=0, batch=2, scale=1.0):
    return scale * torch.randn(batch, N, C, dtype=torch.double, generator=torch.Generator().manual_seed(seed))


def test_potential_is_theorem_4s_sum_of_log_sum_exps(weight):
    """f(x) = sum_h 1/2 sum_i LSE_j(||W^h (x_i + x_j)||^2 / sqrt(d_h)), written out here term by term."""
    x = tokens()
    d = C // H
    expected = torch.zeros(x.shape[0], dtype=x.dtype)
    for h in range(H):
        v = x @ weight[h * d:(h + 1) * d].T
        scores = (v.unsqueeze(-2) + v.unsqueeze(-3)).pow(2).sum(-1) / d ** 0.5
        expected += 0.5 * torch.logsumexp(scores, dim=-1).sum(-1)
    assert torch.allclose(attlip_potential(x, weight, H), expected, rtol=1e-13, atol=0)


def test_closed_form_gradient_is_the_potentials_gradient(weight):
    x = tokens().requires_grad_()
    (auto,) = torch.autograd.grad(attlip_potential(x, weight, H).sum(), x)
    assert torch.allclose(attlip_grad(x.detach(), weight, H), auto, atol=1e-12)


def test_proximal_step_matches_a_high_precision_solve(weight):
    x = tokens()
    ref = x.clone().requires_grad_()
    opt = torch.optim.LBFGS([ref], lr=1, max_iter=1000, tolerance_grad=1e-14, tolerance_change=1e-16,
                            line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = (attlip_potential(ref, weight, H) + (ref - x).pow(2).sum((-1, -2)) / 2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    y = attlip_prox(x, weight, H, eta=1.0, steps=500, tol=1e-12)
    assert (y - ref.detach()).abs().max() < 1e-6
    errors = [float((attlip_prox(x, weight, H, steps=k) - y).abs().max()) for k in (5, 10, 20)]
    assert errors[0] > errors[1] > errors[2]  # more steps, closer: the train/eval step counts trade accuracy


@pytest.mark.parametrize("scale", [0.1, 1.0, 10.0])
def test_output_differences_never_exceed_input_differences(weight, scale):
    x1, x2 = tokens(0, 16, scale), tokens(1, 16, scale)
    y1, y2 = (attlip_prox(x, weight, H, steps=300, tol=1e-10) for x in (x1, x2))
    ratio = (y1 - y2).flatten(1).norm(dim=1) / (x1 - x2).flatten(1).norm(dim=1)
    assert float(ratio.max()) <= 1 + 1e-6


def test_maximised_difference_quotient_stays_at_most_one(weight):
    f = lambda z: attlip_prox(z, weight, H, steps=200, tol=1e-10)  # noqa: E731
    found = maximize_difference_quotient(f, tokens(batch=1)[0], radius=1.0, steps=30)["lower_bound"]
    assert 0.5 < found <= 1 + 1e-6


def test_module_uses_fewer_steps_while_training_and_is_differentiable():
    layer = AttLip(C, heads=H, train_steps=1, eval_steps=20).double()
    x = tokens()
    layer.train()
    layer(x).pow(2).sum().backward()
    assert layer.weight.grad is not None and torch.isfinite(layer.weight.grad).all()
    one = attlip_prox(x, layer.weight.detach(), H, steps=1)
    assert torch.allclose(layer(x).detach(), one)
    layer.eval()  # evaluation: Barzilai-Borwein steps to tol (the certified solve's), at most eval_steps of them
    w = layer.weight.detach()
    with torch.no_grad():
        out = layer(x)
    assert torch.equal(out, attlip_solve(x, w, H, 1.0, layer.tol, 20))
    exact = attlip_prox(x, w, H, steps=500, tol=1e-12)

    def error(y):
        return float((y - exact).flatten(1).norm(dim=1).max())

    assert error(out) < error(attlip_prox(x, w, H, steps=20)) / 3  # closer than Armijo's 20 steps
    layer.eval_steps = 100  # enough here to meet tol: then within eta * tol (Proposition 3 (1))
    with torch.no_grad():
        assert error(layer(x)) <= layer.eta * layer.tol
    xg = x.clone().requires_grad_()
    layer(xg).sum().backward()  # gradients at evaluation: those of the unrolled Armijo steps
    assert xg.grad is not None and torch.isfinite(xg.grad).all()
    with pytest.raises(ValueError, match="eta must be positive"):
        AttLip(C, eta=0)


def test_attlip_in_both_families_uses_the_configured_solver():
    import timm

    from conftest import TINY, family
    from lipsformer.layers import AttLipMixer
    for name in ("lipsformer_swin_t", "lipsformer_cswin_t"):
        model = timm.create_model(name, **TINY[family(name)], attn="attlip", attlip_eta=0.5, attlip_steps=(1, 7),
                                  attlip_tol=1e-9)
        mixers = [m for m in model.modules() if isinstance(m, AttLipMixer)]
        assert len(mixers) == 5
        layer = mixers[0].branches[0]
        assert (layer.eta, layer.train_steps, layer.eval_steps, layer.tol) == (0.5, 1, 7, 1e-9)
        x = torch.randn(2, 3, 32, 32)
        model.train()
        model(x).sum().backward()
        assert layer.weight.grad is not None
    assert [m.windows for m in mixers] == [[(8, 1), (1, 8)], [(4, 2), (2, 4)], [(2, 2)], [(2, 2)], [(1, 1)]]


def literal_descent(x, weight, steps, tol=0.0, eta=1.0, beta=0.5, c=1e-4):
    """AttLip Algorithms 1 and 2 as printed, on y, one group at a time: the reference for the row-space solver."""
    outs = []
    for x0 in x:
        y, lam = x0, 1.0
        for _ in range(steps):
            g = attlip_grad(y, weight, H) + (y - x0) / eta
            g_sq = float(g.detach().pow(2).sum())
            if g_sq ** 0.5 <= tol:
                break
            def phi(t):
                with torch.no_grad():
                    return float(attlip_potential(t, weight, H) + (t - x0).pow(2).sum() / (2 * eta))

            f_y, lam = phi(y.detach()), min(lam / beta, 1.0)
            for _ in range(20):
                if phi((y - lam * g).detach()) <= f_y - c * lam * g_sq:
                    break
                lam *= beta
            y = y - lam * g
        outs.append(y)
    return torch.stack(outs)


@pytest.mark.parametrize("steps", [1, 3, 20])
def test_descent_takes_the_iterates_of_algorithms_1_and_2_with_their_gradients(weight, steps):
    """The solver of training and plain evaluation iterates in the weight's row space, with the potential read off
    its gradient's logits: the same iterates, and the same gradients through them, as the algorithm run on y."""
    x = tokens(batch=3, scale=3.0).requires_grad_()
    w = weight.clone().requires_grad_()
    ours, ref = attlip_prox(x, w, H, steps=steps, tol=0.0), literal_descent(x, w, steps)
    assert (ours - ref).abs().max() < 1e-12 and (ours - x).abs().max() > 0.1
    probe = torch.randn_like(x)
    grads = [torch.autograd.grad((y * probe).sum(), (x, w)) for y in (ours, ref)]
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-10)


def test_groups_are_solved_independently_in_chunks_and_stop_at_their_own_tolerance(weight, monkeypatch):
    """A group's output does not depend on the batch around it: chunked as a large batch is (forced here), the same
    forward and backward; a group that meets ``tol`` stops there while the others go on."""
    from lipsformer.layers import attlip_solver as attlip
    x = tokens(batch=5, scale=3.0)
    x[2] *= 0.01  # its residual falls below 0.1 after three steps, the others' stay above it for six
    whole = attlip_prox(x, weight, H, steps=6, tol=0.1)
    assert torch.allclose(whole, literal_descent(x, weight, 6, tol=0.1), atol=1e-12)
    assert torch.allclose(whole[2], literal_descent(x[2:3], weight, 3)[0], atol=1e-12)
    assert (whole[2] - literal_descent(x[2:3], weight, 6)[0]).abs().max() > 1e-4
    monkeypatch.setattr(attlip, "CHUNK_ELEMENTS", 2 * N * C)  # chunks of two groups
    xs = x.clone().requires_grad_()
    chunked = attlip_prox(xs, weight, H, steps=6, tol=0.1)
    assert torch.allclose(chunked, whole, atol=1e-12)
    (grad,) = torch.autograd.grad(chunked.pow(2).sum(), xs)
    xr = x.clone().requires_grad_()
    (ref,) = torch.autograd.grad(literal_descent(xr, weight, 6, tol=0.1).pow(2).sum(), xr)
    assert torch.allclose(grad, ref, atol=1e-10)


# -- the orthogonal form: W = diag(s_h) Q, solved per head in rotated coordinates -------------------
def orthogonal(scales=(-1.0, 1.5), dtype=torch.double, **kw):
    from lipsformer.layers.attlip import OrthogonalAttLip
    torch.manual_seed(3)
    layer = OrthogonalAttLip(C, heads=H, **kw).to(dtype).eval()
    with torch.no_grad():
        layer.scale.copy_(torch.tensor(scales))
    return layer


def test_orthogonal_form_is_attlip_with_its_scaled_orthogonal_weight():
    """The block is prox_{eta f_W} of Theorem 4's potential with W = diag(s_h) Q (W W^T = diag(s_h^2)): its
    output is the general form's prox with that W (a high-precision solve), within eta * tol per group."""
    layer = orthogonal(tol=1e-9, eval_steps=500)
    w = layer.weight.detach()
    s2 = layer.head_scales().detach().repeat_interleave(C // H).pow(2)
    assert torch.allclose(w @ w.T, torch.diag(s2), atol=1e-12)
    x = tokens(batch=3, scale=2.0)
    a = x @ layer._rotation().T
    per_head = sum(attlip_potential(a[..., h * (C // H):(h + 1) * (C // H)] * layer.head_scales()[h].detach(),
                                    torch.eye(C // H, dtype=x.dtype), 1) for h in range(H))
    assert torch.allclose(attlip_potential(x, w, H), per_head, rtol=1e-12)  # f_W(x) = g(x Q^T), head by head
    with torch.no_grad():
        y = layer(x)
    exact = attlip_solve(x, w, H, 1.0, 1e-12, 5000)  # the general form's solve, dense W, to 1e-12
    assert float((y - exact).flatten(1).norm(dim=1).max()) <= layer.eta * 1e-9
    assert float((y - x).abs().max()) > 0.1  # it moves the tokens


def test_orthogonal_warm_start_is_the_prox_at_uniform_attention():
    """The solvers start at the prox of the potential linearised where all scores are equal: y + eta c (2 y + 2
    mean(y)) = x, c = s^2 / sqrt(d); with scores that small the start already meets a tight tolerance."""
    from lipsformer.layers.attlip_solver import DiagonalWeight, _bb_solve
    x = tokens(batch=4)
    s = torch.tensor([0.3, 1.0, 2.0, 5.0], dtype=x.dtype).view(-1, 1, 1)
    w = DiagonalWeight(s, C)
    y0 = x + w.back(w.start(x, 1, 0.5))
    c = s.pow(2) * C ** -0.5
    assert torch.allclose(y0 + 0.5 * c * (2 * y0 + 2 * y0.mean(-2, keepdim=True)), x, atol=1e-12)
    tiny = DiagonalWeight(torch.full((4, 1, 1), 1e-3, dtype=x.dtype), C)  # scores ~1e-6 apart: nearly uniform
    assert int(_bb_solve(x, tiny, 1, 1.0, 1e-9, 50)[2].max()) == 1  # the start's residual is already below 1e-9


def test_orthogonal_prox_is_one_lipschitz_by_difference_quotients():
    """A projected-gradient search for the largest ||F(x + d) - F(x)|| / ||d|| (values solved to 1e-8 and checked,
    derivatives through 3 unrolled steps) climbs to near 1 and finds nothing above it (up to the solver's
    2 eta tol / ||d|| and the float64 rotation's rounding), with scores spread enough for attention to act."""
    from lipsformer.layers.attlip import solve_to_tolerance
    from lipsformer.lipschitz import maximize_difference_quotient
    layer = orthogonal(scales=(-2.0, -1.0), tol=1e-8, eval_steps=3)
    x = tokens(batch=1, scale=2.0)[0]
    with solve_to_tolerance(layer, 500):
        found = maximize_difference_quotient(lambda z: layer(z[None])[0], x, radius=1.0, steps=10)
    assert layer.last_solve.steps > 5  # not a near-identity map: the solve works
    assert 0.85 < found["lower_bound"] <= 1 + 2e-8 + 4 * layer.rotation_defect()
    assert found["history"][-1] > found["history"][0]  # the search climbs


def test_orthogonal_form_trains_its_rotation_and_scales_and_one_step_from_the_start_is_close():
    layer = orthogonal(dtype=torch.float32, train_steps=1)
    x = tokens(batch=4).float()
    layer.train()
    out = layer(x)
    out.pow(2).sum().backward()
    assert torch.isfinite(layer.rotation.grad).all() and layer.rotation.grad.abs().max() > 0
    assert layer.scale.grad.abs().min() > 0
    layer.eval()
    with torch.no_grad():
        exact = layer(x)
    relative = (out.detach() - exact).norm() / (exact - x).norm()
    assert relative < 0.05  # one Armijo step from the uniform-attention start, against the solved prox


def test_armijo_steps_near_the_prox_are_not_halved_on_rounding_noise(monkeypatch):
    """Near the prox the decrease Armijo asks for falls below the rounding of phi in float32: the test must not fail
    on that noise (halving the steps ten times a step, each trial over every window, and leaving the iterate where it
    is). Three training steps on mildly curved windows: one trial per step, and closer to the prox than one."""
    from lipsformer.layers import attlip_solver
    from lipsformer.layers.attlip_potential import DiagonalWeight
    g, n, d = 64, 49, 32
    x = torch.randn(g, n, d, generator=torch.Generator().manual_seed(0))
    w = DiagonalWeight(torch.full((g, 1, 1), 0.3), d)
    exact, _ = attlip_solver.attlip_prox_certified(x.double(), DiagonalWeight(w.scale.double(), d), 1, 1.0, 1e-10,
                                                   5000)
    trials = []
    potential = attlip_solver.projected_potential
    monkeypatch.setattr(attlip_solver, "projected_potential", lambda v, h: trials.append(1) or potential(v, h))

    def error(steps):
        trials.clear()
        y = attlip_solver.attlip_prox(x, w, 1, 1.0, steps, tol=1e-6)
        return float(((y.double() - exact).flatten(1).norm(dim=1) / exact.flatten(1).norm(dim=1)).max())

    one = error(1)
    three = error(3)
    assert len(trials) <= 3  # one trial a step (before: 20 or more in all)
    assert three < one / 20 and three < 2e-5
