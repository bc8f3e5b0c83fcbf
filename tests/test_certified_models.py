"""The certifiable configuration as registered timm models: ``timm.create_model`` builds them at
224 with the zoo's sizes, their bound is finite, and one call gives predictions and certified radii."""
import math

import pytest
import timm
import torch

from conftest import family
from helpers import CERTIFIED
from lipsformer.layers.options import CERTIFIABLE
from lipsformer.lipschitz import lipschitz_report, predict_certified
from lipsformer.lipschitz.certify import normalization

@pytest.mark.parametrize("name", sorted(CERTIFIED))
def test_certified_model_is_the_zoo_size_at_224_with_the_certifiable_options(name):
    """Meta device (no memory, no init): the same layers and shapes as the zoo's model of that size built with the
    certifiable options by hand, at 224, with std-1 preprocessing and no weights."""
    with torch.device("meta"):
        model = timm.create_model(name)
        by_hand = timm.create_model(CERTIFIED[name], **CERTIFIABLE)
    assert model.lipschitz == by_hand.lipschitz
    assert {k: v.shape for k, v in model.state_dict().items()} == {k: v.shape for k, v in by_hand.state_dict().items()}
    assert model.patch_embed.img_size == (224, 224) and model.num_classes == 1000
    cfg = model.pretrained_cfg
    assert cfg["input_size"] == (3, 224, 224) and tuple(cfg["std"]) == (1.0, 1.0, 1.0)
    assert tuple(cfg["mean"]) == (0.5, 0.5, 0.5) and not cfg["url"]
    # a keyword still replaces a preset choice
    with torch.device("meta"):
        assert timm.create_model(name, attn="scsa", v_norm=True).lipschitz.attn == "scsa"


# four stages to one final token (no pooling factor in the bound), windows / stripes the size of the digits configs
SMALL = {"swin": dict(window_size=4, num_heads=(1, 2, 4, 8)),
         "cswin": dict(split_size=(2, 2, 2, 1), num_heads=(2, 2, 4, 8))}


@pytest.mark.parametrize("name", sorted(CERTIFIED))
def test_certified_model_bounds_and_certifies_a_batch_in_one_call(name):
    """A small size for speed (a 1-token last stage, so the bound is that of the layers): the bound is 1 up to
    rounding but for the last attention residual, ``(1 - a) + a lam`` with its one-token prox's gain
    ``lam = 1 / (1 + 4 s_h^2 / sqrt(d_h))`` (s_h = 1 at initialisation), and the one call returns predictions equal to
    the argmax of its logits and radii >= 0. (The certificate itself is attacked in tests/test_certified_solver.py.)"""
    model = timm.create_model(name, img_size=32, embed_dim=16, depths=(1, 1, 1, 1), num_classes=5,
                              **SMALL[family(name)]).eval()
    last = model.stages[-1].blocks[-1]
    (branch,), a = last.attn.branches, float(last.res_attn.alpha)
    lam = 1 / (1 + 4 / math.sqrt(branch.rotation.shape[0] // branch.heads))
    assert lipschitz_report(model).bound == pytest.approx((1 - a) + a * lam, abs=1e-4)
    mean, std = normalization(model)
    logits, pred, radius = predict_certified(model, (torch.rand(6, 3, 32, 32) - mean) / std)
    assert logits.shape == (6, 5) and torch.isfinite(logits).all() and torch.equal(pred, logits.argmax(-1))
    assert (radius >= 0).all() and (radius > 0).any()


def test_predict_certified_bounds_the_evaluation_map_whatever_mode_it_finds_the_model_in():
    """The bound is taken after the switch to eval mode, so it is the bound of the map the certified forward
    computes: a model left in train mode with power-iteration divisors (whose training-mode bound differs)
    certifies exactly what it certifies in eval mode."""
    name = "lipsformer_swin_t_cert"
    torch.manual_seed(0)
    model = timm.create_model(name, img_size=32, embed_dim=16, depths=(1, 1, 1, 1), num_classes=5,
                              linear="normalized_power", **SMALL[family(name)])
    images = torch.rand(4, 3, 32, 32) - 0.5
    model.train()(images)  # the first power iterates: exact vectors
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))  # the iterates now lag: the training-mode bound exceeds 1
    model.train()
    assert lipschitz_report(model).bound > 1.0 + 1e-3
    from_train = predict_certified(model, images)[2]
    assert torch.equal(from_train, predict_certified(model.eval(), images)[2])
