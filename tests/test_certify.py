"""Certificates: margin / (sqrt(2) L) radii that no attack breaks, certified <= attacked <= clean, bad eps refused."""
import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
from PIL import Image

from lipsformer.lipschitz import lipschitz_report
from lipsformer.lipschitz.certify import (certified_accuracy, certified_radius, logit_margin, normalization, parse_eps,
                                          pgd_l2, pixel_lipschitz)
from lipsformer.sources import export

from conftest import TINY, load_script, reset_accelerate

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
# Kim's tied L2 attention in the CSwin family (no position bias: a finite bound) with small residual weights
CERTIFIABLE = dict(TINY["cswin"], attn="l2", tied_qk=True, alpha_init=1e-3, num_classes=4)


def certifiable():
    return timm.create_model("lipsformer_cswin_t", **CERTIFIABLE).eval()


def normalised(model, *shape):
    """Random pixels in [0, 1] normalised with ``model``'s mean and std: what the certificate API takes."""
    mean, std = normalization(model)
    return (torch.rand(*shape) - mean) / std


def test_pixel_lipschitz_is_the_reports_bound_times_the_normalisations():
    model = certifiable()
    L = pixel_lipschitz(model)
    _, std = normalization(model)
    # ImageNet std (0.229, 0.224, 0.225): the normalisation stretches pixel distances by up to 1 / 0.224
    assert L.network == lipschitz_report(model).bound and L.input_scale == pytest.approx(1 / 0.224, rel=1e-6)
    # the pairwise rule's backbone L_b: everything before the classifier's Linear, the normalisation included
    assert L.backbone_bound == lipschitz_report(model).backbone().bound * L.input_scale
    assert L.gaps.shape == (4, 4) and float(L.gaps.max()) <= 2 ** 0.5 * float(lipschitz_report(model).rows[-1].lip)
    assert L.bound == pytest.approx(L.network / float(std.min())) and L.finite and L.reason == ""
    logits = torch.tensor([[3.0, 1.0, 0.5], [0.0, 2.0, 2.0]])
    assert certified_radius(logits, 2.0).tolist() == pytest.approx([2.0 / (math.sqrt(2) * 2.0), 0.0])


def test_images_of_another_size_than_the_bound_are_refused():
    """strict_img_size=False runs any size, but the bound holds at the size the model was built for: certifying
    other sizes would be a wrong answer, so it stops naming both sizes."""
    from accelerate import Accelerator
    from lipsformer.lipschitz import NoBoundError
    from lipsformer.lipschitz.certify import certify_dataset
    model = timm.create_model("lipsformer_cswin_t", **dict(CERTIFIABLE, strict_img_size=False)).eval()
    try:
        accelerator = Accelerator(cpu=True)
        loader = [(normalised(model, 2, 3, 32, 32), torch.tensor([0, 1]))]
        assert certify_dataset(model, loader, accelerator, [[0], [1]], certify_eps=[0.1])["count"] == 2
        with pytest.raises(NoBoundError, match="for 32x32 inputs, the model was given 40x40"):
            certify_dataset(model, [(normalised(model, 2, 3, 40, 40), torch.tensor([0, 1]))], accelerator, [[0], [1]])
    finally:
        reset_accelerate()


def test_no_certified_image_changes_its_prediction_under_pgd_at_its_radius():
    """Try to break each certificate: PGD with many random restarts at each image's own certified radius. The
    same attack at a larger radius flips most images (it has teeth)."""
    model = certifiable()
    mean, std = normalization(model)
    pixels = torch.rand(16, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model((pixels - mean) / std)
    pred = logits.argmax(-1)
    radius = certified_radius(logits, pixel_lipschitz(model)).float()
    assert bool((radius > 0).all()) and float(radius.max()) > 0.01
    fooled = pgd_l2(model, pixels, pred, radius, mean, std, steps=20, restarts=6, seed=1)
    assert not bool(fooled.any())
    fooled_far = pgd_l2(model, pixels, pred, 0.2, mean, std, steps=20, restarts=1)
    assert float(fooled_far.float().mean()) > 0.5


def test_certified_accuracy_is_monotone_in_eps_and_below_attacked_and_clean():
    model = certifiable()
    mean, std = normalization(model)
    pixels = torch.rand(24, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    labels = torch.randint(0, 4, (24,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = model((pixels - mean) / std)
    pred = logits.argmax(-1)
    radius = certified_radius(logits, pixel_lipschitz(model))
    correct = pred == labels
    eps = [0.0, 0.001, 0.003, 0.01, 0.03, 0.1]
    cert = certified_accuracy(radius, correct, eps)
    values = [cert[e] for e in eps]
    assert values == sorted(values, reverse=True) and values[0] == pytest.approx(100 * float(correct.float().mean()))
    assert values[-1] < values[1]  # the radii spread over the eps range: the check has something to compare
    for e in eps[1:]:
        robust = correct & ~pgd_l2(model, pixels, pred, e, mean, std, steps=10, restarts=1)
        assert cert[e] <= 100 * float(robust.float().mean()) <= values[0]


def test_an_infinite_bound_certifies_nothing_and_says_why():
    model = timm.create_model("lipsformer_swin_t", **TINY["swin"], num_classes=4).eval()  # released: unnormalised v
    L = pixel_lipschitz(model)
    assert not L.finite and "unnormalised v" in L.reason
    logits = torch.tensor([[10.0, 0.0, 0.0, 0.0]])
    assert certified_radius(logits, L).tolist() == [0.0]
    assert certified_accuracy(certified_radius(logits, L), torch.tensor([True]), [0.1]) == {0.1: 0.0}
    assert logit_margin(logits).tolist() == [10.0]


@pytest.mark.parametrize("values", [["-0.1"], ["abc"], ["0.1", "nan"], ["inf"]])
def test_eps_must_be_non_negative_numbers(values):
    with pytest.raises(ValueError, match=r"--certify-eps takes non-negative numbers .* got '"):
        parse_eps(values, "--certify-eps")
    assert parse_eps(["0", "0.25"], "--attack-eps") == (0.0, 0.25)


def write_folder(root: Path, n: int = 10) -> Path:
    rng = np.random.default_rng(0)
    for i in range(n):
        folder = root / str(i % 4)
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray((rng.random((32, 32, 3)) * 255).astype(np.uint8)).save(folder / f"{i}.png")
    return root


def run_eval(*args):
    return subprocess.run([PY, str(ROOT / "eval.py"), *map(str, args)], capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))


@pytest.fixture
def eval_main():
    """eval.py's main, in this process (no interpreter start per call)."""
    main = load_script("eval.py").main
    yield lambda *args: main([str(a) for a in args])
    reset_accelerate()


def test_eval_cli_certifies_attacks_and_writes_each_radius(tmp_path):
    model = certifiable()
    export(model, tmp_path / "weights")
    data = write_folder(tmp_path / "v2")
    out = tmp_path / "r.json"
    proc = run_eval("--checkpoint", tmp_path / "weights", "--data-dir", data, "--dataset", "imagenet_v2",
                    "--workers", 0, "--batch-size", 4, "--certify-eps", 0, 0.001, 0.01, "--attack-eps", 0.001, 0.01,
                    "--attack-steps", 5, "--attack-restarts", 1, "--output", out, "--predictions", tmp_path / "p.csv")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    r = result["robustness"]
    cert, att = r["certified"], r["attacked"]
    assert cert["0.0"] == pytest.approx(result["top1"])
    assert cert["0.01"] <= cert["0.001"] <= cert["0.0"]
    for e in ("0.001", "0.01"):
        assert cert[e] <= att[e] <= result["top1"]
    assert r["lipschitz"] == pytest.approx(pixel_lipschitz(model).bound, rel=1e-6) and r["reason"] == ""
    assert r["rule"] == "pairwise" and r["backbone_lipschitz"] == pytest.approx(pixel_lipschitz(model).backbone_bound)
    assert "robustness: clean" in proc.stdout and "certified (pairwise rule, backbone L_b = " in proc.stdout
    assert "certified by the global rule margin / (sqrt(2) L)" in proc.stdout and "PGD-attacked" in proc.stdout
    rows = list(csv.DictReader((tmp_path / "p.csv").open()))
    assert len(rows) == 10 and all(float(row["certified_radius"]) > 0 for row in rows)
    correct = [row["top1"] in row["targets"].split() for row in rows]
    radii = [float(row["certified_radius"]) for row in rows]
    radii_global = [float(row["certified_radius_global"]) for row in rows]
    assert cert["0.001"] == pytest.approx(100 * sum(c and x > 0.001 for c, x in zip(correct, radii)) / 10)
    for e in ("0.001", "0.01"):  # the JSON's global rule is the CSV's global radii, and never above the pairwise
        assert r["certified_global"][e] == pytest.approx(
            100 * sum(c and x > float(e) for c, x in zip(correct, radii_global)) / 10)
        assert r["certified_global"][e] <= cert[e]
    assert all(g <= p * (1 + 1e-5) for g, p in zip(radii_global, radii)) and radii != radii_global


def test_eval_cli_rejects_bad_eps_with_one_line_and_an_infinite_bound_says_why(tmp_path, eval_main, capsys):
    data = write_folder(tmp_path / "v2", n=4)
    for flag, bad in (("--certify-eps", "-0.5"), ("--attack-eps", "x1")):
        args = ("--checkpoint", tmp_path / "none", "--data-dir", data, "--dataset", "imagenet_v2", flag, bad)
        assert eval_main(*args) == 2
        err = capsys.readouterr().err
        assert err.strip().count("\n") == 0 and err.startswith(f"error: {flag} takes non-negative numbers")
        assert repr(bad) in err
    export(timm.create_model("lipsformer_swin_t", **TINY["swin"], num_classes=4), tmp_path / "released")
    assert eval_main("--checkpoint", tmp_path / "released", "--data-dir", data, "--dataset", "imagenet_v2",
                     "--workers", 0, "--certify-eps", 0.1) == 0
    out = capsys.readouterr().out
    assert "nothing certifies: the certified bound is infinite: SCSA with unnormalised v" in out
    assert "eps 0.1: 0.000%" in out


def test_certifying_gives_the_model_back_in_its_mode_and_says_why_nothing_certifies():
    """predict_certified gives a model in train mode back in train mode, and on a model with an infinite bound
    says why its radii are all zero; pgd_l2 and certify_dataset give train mode back too."""
    import warnings
    from accelerate import Accelerator
    from lipsformer.lipschitz import predict_certified
    from lipsformer.lipschitz.certify import certify_dataset
    model = timm.create_model("lipsformer_cswin_t", **dict(CERTIFIABLE, attn="dot", tied_qk=False)).train()
    images = normalised(model, 2, 3, 32, 32)
    model.stages[0].eval()  # a frozen part, as training keeps it
    modes = [m.training for m in model.modules()]
    with pytest.warns(UserWarning, match=r"nothing is certified \(every radius is 0\): the certified bound is "
                                         r"infinite: .*dot"):
        _, _, radius = predict_certified(model, images)
    assert (radius == 0).all()
    assert [m.training for m in model.modules()] == modes
    pgd_l2(model, images.clamp(0, 1), torch.tensor([0, 1]), 0.1, *normalization(model), steps=1, restarts=1)
    assert [m.training for m in model.modules()] == modes
    finite = certifiable().train()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a finite bound: no warning
        assert (predict_certified(finite, images)[2] >= 0).all()
    try:
        certify_dataset(finite, [(images, torch.tensor([0, 1]))], Accelerator(cpu=True), [[0], [1]], [0.1])
    finally:
        reset_accelerate()
    assert finite.training and all(m.training for m in finite.modules())
