"""AttLip (convex-potential attention): exact gradient, the proximal step it claims, and 1-Lipschitz outputs."""
import pytest
import torch

from lipsformer.layers.attlip import AttLip, attlip_grad, attlip_potential, attlip_prox
from lipsformer.lipschitz import maximize_difference_quotient

N, C, H = 6, 8, 2


@pytest.fixture
def weight():
    return torch.randn(C, C, dtype=torch.double, generator=torch.Generator().manual_seed(1)) / C ** 0.5


def tokens(seed=0, batch=2, scale=1.0):
    return scale * torch.randn(batch, N, C, dtype=torch.double, generator=torch.Generator().manual_seed(seed))


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
    layer.eval()
    assert torch.allclose(layer(x).detach(), attlip_prox(x, layer.weight.detach(), H, steps=20))
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
