"""The certificate is for the function computed: AttLip solved to its tolerance or refused, the solver's defect
charged off the margin (AttLip appendix, Proposition 3), margins in float32 whatever the forward precision."""
import pytest
import timm
import torch

from lipsformer.layers.attlip import AttLip, SolverToleranceError, attlip_grad, solve_to_tolerance
from lipsformer.lipschitz.certify import logit_margin, normalization, pgd_l2, pixel_lipschitz, predict_certified
from lipsformer.lipschitz.constraints import keep_bound


def small(tol=1e-6, **kw):
    torch.manual_seed(0)
    model = timm.create_model("lipsformer_swin_t", img_size=16, patch_size=2, embed_dim=16, depths=(1, 1),
                              num_heads=(2, 2), window_size=2, init="xavier", residual="convex", act="groupsort",
                              norm="none", attn="attlip", alpha_init=0.5, drop_path_rate=0.0, num_classes=4,
                              attlip_steps=(1, 3), attlip_tol=tol, stage_act="groupsort", **kw).eval()
    keep_bound(model, 1.01, weight_max=1.0, conv_max=1.0)
    return model


def set_tol(model, tol):
    for m in model.modules():
        if isinstance(m, AttLip):
            m.tol = tol


def test_early_stopped_solver_certifies_smaller_radii_never_larger():
    model = small()
    mean, std = normalization(model)
    images = (torch.rand(4, 3, 16, 16) - mean) / std
    with pytest.raises(SolverToleranceError, match="hard cap of 2 steps"):  # a cap fails loudly, never stops early
        predict_certified(model, images, max_steps=2)
    _, pred, tight = predict_certified(model, images)
    assert pixel_lipschitz(model).defect > 0
    set_tol(model, 3e-4)  # stopped earlier: a larger residual is allowed, and charged
    loose_L = pixel_lipschitz(model)
    loose_logits, loose_pred, loose = predict_certified(model, images, loose_L)
    assert loose_L.defect > 100 * pixel_lipschitz(small()).defect
    charged = (logit_margin(loose_logits).double() - 2 * 2 ** 0.5 * loose_L.defect) / (2 ** 0.5 * loose_L.bound)
    assert torch.allclose(loose, charged.clamp_min(0))  # 2 sqrt(2) D comes off each margin
    assert (tight > 0).any()
    assert (loose <= tight).all() and (loose < tight)[tight > 0].all()


def test_pgd_at_the_certified_radius_flips_none_on_inputs_hardest_for_the_solver():
    model = small()
    mean, std = normalization(model)
    candidates = torch.cat([torch.rand(4, 3, 16, 16), torch.ones(1, 3, 16, 16),
                            (torch.arange(16 * 16).view(1, 1, 16, 16) % 2).float().expand(1, 3, 16, 16)])
    worst = torch.zeros(len(candidates))  # the first block's initial residual ||grad f(x)||: what the solver must undo

    def hook(module, inputs, _):
        g = attlip_grad(inputs[0], module.weight, module.heads).pow(2).sum((-1, -2)).sqrt()
        worst.copy_(torch.maximum(worst, g.view(len(candidates), -1).amax(1)))

    layer = next(m for m in model.modules() if isinstance(m, AttLip))
    handle = layer.register_forward_hook(hook)
    with torch.no_grad():
        model((candidates - mean) / std)
    handle.remove()
    pixels = candidates[worst.topk(2).indices]
    _, pred, radius = predict_certified(model, (pixels - mean) / std)
    assert (radius > 0).all()
    with solve_to_tolerance(model):
        fooled = pgd_l2(model, pixels, pred, radius.float() * (1 - 1e-6), mean, std, steps=5, restarts=3)
    assert not fooled.any()


def test_bf16_forward_never_certifies_more_than_fp32_and_margins_stay_fp32(fresh_accelerate):
    from accelerate import Accelerator

    model = small()
    mean, std = normalization(model)
    images = (torch.rand(3, 3, 16, 16) - mean) / std
    _, _, fp32 = predict_certified(model, images)
    prepared = Accelerator(cpu=True, mixed_precision="bf16").prepare_model(model)
    logits, _, bf16 = predict_certified(prepared, images)
    assert logits.dtype == torch.float32 and torch.equal(bf16, fp32)  # the autocast wrapper is bypassed
    with pytest.raises(ValueError, match="float32 margins"):
        predict_certified(small().to(torch.bfloat16), images.to(torch.bfloat16))
