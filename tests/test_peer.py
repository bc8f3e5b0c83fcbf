"""The peer baseline (lipsformer.models.peer): deel-torchlip's 1-Lipschitz CNN as timm's torchlip_cnn, certified
from its weights by our report, cross-checked against the library's own Lipschitz estimate, attacked at its radii."""
import sys

import pytest
import timm
import torch

import lipsformer  # noqa: F401  (registers torchlip_cnn)
from lipsformer.extras import MissingExtra
from lipsformer.lipschitz import lipschitz_report
from lipsformer.lipschitz.certify import certified_radius, normalization, pgd_l2, pixel_lipschitz, predict_certified


def test_without_deel_torchlip_building_it_is_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "deel.torchlip", None)
    with pytest.raises(MissingExtra, match=r'^the peer CNN \(torchlip_cnn\) needs deel.torchlip, which is not '
                                           r'installed .*: pip install "lipsformer\[torchlip\]"$'):
        timm.create_model("torchlip_cnn")


def test_an_argument_it_does_not_take_is_refused_by_name(monkeypatch):
    monkeypatch.setitem(sys.modules, "deel.torchlip", None)  # refused before the library is needed
    with pytest.raises(TypeError, match="unexpected keyword argument 'widht'"):
        timm.create_model("torchlip_cnn", widht=(8, 16))


def test_its_bound_is_computed_from_the_weights_and_holds_against_the_librarys_estimate_and_an_attack():
    pytest.importorskip("deel.torchlip")
    from deel.torchlip.utils import evaluate_lip_const

    torch.manual_seed(0)
    model = timm.create_model("torchlip_cnn", in_chans=1, img_size=16, num_classes=4).eval()
    assert model.net[0].weight.shape == (16, 1, 3, 3) and model.net[7].in_features == 32 * 4 * 4  # the docs' layers
    report = lipschitz_report(model)
    assert torch.equal(report.head, model.net[9].weight.detach().double())  # the last SpectralLinear: the head
    L = pixel_lipschitz(model)
    assert L.bound <= 1.0 + 1e-3  # the library's promise (k_coef_lip = 1, up to its iterations), verified
    mean, std = normalization(model)
    pixels = torch.rand(8, 1, 16, 16, generator=torch.Generator().manual_seed(1))
    estimate = evaluate_lip_const(model, (pixels - mean) / std, eps=1e-4)  # the library's own (lower) estimate
    assert 0 < estimate <= L.bound
    logits, pred, radius = predict_certified(model, (pixels - mean) / std)
    assert (radius >= certified_radius(logits, L)).all() and (radius > 0).all()
    assert not pgd_l2(model, pixels, pred, radius.float(), mean, std, steps=10, restarts=3).any()
    assert pgd_l2(model, pixels, pred, 3 * radius.float() + 1.0, mean, std, steps=10, restarts=3).any()
