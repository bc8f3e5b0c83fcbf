"""benchmarks/paper/certified.py in miniature: every dataset, the LipsFormers with branches on, forced off and with
the shift mixer, our CNN and deel-torchlip's, trained by the same loop, certified under the pairwise and the global
rule."""
import argparse
import json
import sys

import numpy as np
import pytest
from PIL import Image

from conftest import ROOT, reset_accelerate


@pytest.fixture
def data(tmp_path):
    """Tiny stand-ins for every dataset (marked complete, so the benchmark does not write the real ones): digits as
    32x32 RGB, MNIST as 28x28 grey, grids as 56x56 grey of two classes, 2 train and 1 val image per class."""
    rng = np.random.default_rng(0)
    for name, shape, classes in (("digits", (32, 32, 3), 10), ("mnist", (28, 28), 10), ("grid", (56, 56), 2)):
        for split, n in (("train", 2), ("val", 1)):
            for c in range(classes):
                d = tmp_path / name / split / str(c)
                d.mkdir(parents=True)
                for i in range(n):
                    Image.fromarray((rng.random(shape) * 25 * (c + 1)).astype(np.uint8)).save(d / f"{i}.png")
        (tmp_path / name / ".complete").touch()
    return tmp_path


def test_every_model_on_both_datasets_under_both_rules(data, tmp_path, capsys):
    pytest.importorskip("deel.torchlip")
    sys.path.insert(0, str(ROOT / "benchmarks" / "paper"))
    import certified as bench  # a module of its own (timm registers the CNN under the module's name)
    try:
        rows = bench.main(["--datasets", "mnist", "digits", "--epochs", "1", "--data", str(data), "--out",
                           str(tmp_path / "out"), "--attack-images", "3", "--pgd-steps", "2", "--restarts", "1",
                           "--quotient-images", "1", "--quotient-steps", "2", "--set", "batch_size=4", "global_batch=8",
                           "model_kwargs.embed_dim=8", "model_kwargs.num_heads=[2, 2, 4, 8]"])
    finally:
        reset_accelerate()
    assert [(r["dataset"], r["model"]) for r in rows] == [(d, m) for d in ("mnist", "digits") for m in bench.MODELS]
    for r in rows:
        eps = bench.DATASETS[r["dataset"]].eps
        assert eps == ((0.5, 1.0, 1.58) if r["dataset"] == "mnist" else (0.1, 0.25, 0.5))
        for e in eps:  # the pairwise rule never certifies less than the global one; no certified image is broken
            assert r[f"certified_global@{e}"] <= r[f"certified@{e}"] <= r["clean"]
            assert r[f"certified_but_broken@{e}"] == 0
        assert r["seconds"] > 0 and r["backbone_bound"] <= r["bound"] * 1.5 + 1e-9
        used, total = r["branches_in_use"]
        if "branches off" in r["model"]:
            assert used == 0 and total == 8 and set(r["alphas"]) == {0.0}
        elif "CNN" in r["model"]:
            assert (used, total) == (0, 0)
        else:
            assert total == 8 and len(r["alphas"]) == 8
    saved = json.loads((tmp_path / "out" / "certified.json").read_text())
    assert len(saved["rows"]) == 2 * len(bench.MODELS) and saved["wall_s"] > 0
    out = capsys.readouterr().out
    assert "\nmnist (1 epochs; certified images broken by PGD: 0;" in out and "| cert. 1.58 |" in out
    assert "| global 0.25 |" in out and "wall time" in out
    # the grids: 64 px frames, 8 px patches, two classes; the shift mixer's blocks keep their branches
    try:
        rows = bench.main(["--datasets", "grid", "--epochs", "1", "--data", str(data), "--out", str(tmp_path / "out2"),
                           "--models", "LipsFormer-CSwin", "LipsFormer-Swin (shift mixer)", "--attack-images", "2",
                           "--pgd-steps", "2", "--restarts", "1", "--quotient-images", "1", "--quotient-steps", "2",
                           "--set", "batch_size=2", "global_batch=4", "model_kwargs.embed_dim=8"])
    finally:
        reset_accelerate()
    assert [r["model"] for r in rows] == ["LipsFormer-CSwin", "LipsFormer-Swin (shift mixer)"]
    for r in rows:
        assert r["branches_in_use"][1] == 8 and all(r[f"certified_but_broken@{e}"] == 0 for e in (0.25, 0.5, 1.0))
    with pytest.raises(SystemExit):  # argparse's one line
        bench.main(["--datasets", "cifar"])


def test_the_peer_cnn_trains_on_the_grids(data, tmp_path):
    """deel-torchlip's CNN at the grids' 64 px (an 8,192-wide flattening) diverges at the shared lr 5e-3 (its
    Bjorck orthonormalisation, after one step); the grids give it its own lr, and it trains."""
    pytest.importorskip("deel.torchlip")
    sys.path.insert(0, str(ROOT / "benchmarks" / "paper"))
    import certified as bench
    peer = "deel-torchlip CNN (peer)"
    args = argparse.Namespace(epochs={"grid": 2, "mnist": 2}, out=str(tmp_path), data="d", seeds=[0], set=["lr=0.5"])
    assert "lr=1e-3" in bench.run_overrides("grid", peer, 0, args)[-2:]  # --set still comes last
    assert not any(s.startswith("lr=1e-3") for s in bench.run_overrides("mnist", peer, 0, args))
    try:
        rows = bench.main(["--datasets", "grid", "--epochs", "3", "--data", str(data), "--out", str(tmp_path / "out"),
                           "--models", peer, "--attack-images", "2", "--pgd-steps", "2", "--restarts", "1",
                           "--quotient-images", "1", "--quotient-steps", "2", "--set", "batch_size=2",
                           "global_batch=4"])
    finally:
        reset_accelerate()
    assert "diverged" not in rows[0] and rows[0]["clean"] >= 0


def test_the_images_certified_are_the_images_the_run_validated_on(data):
    """The recipe's crop_pct above 1 pads the 28x28 digits (56x56 grids) into the frame, as the run's validation
    does: the certified pixels are the dataset's own, a zero border around them, not an enlarged crop."""
    import timm

    sys.path.insert(0, str(ROOT / "benchmarks" / "paper"))
    import certified as bench
    from lipsformer.config import load_config
    from lipsformer.data.scanner import read_image, scan_classes

    for dataset, side, frame in (("mnist", 28, 32), ("grid", 56, 64)):
        cfg = load_config(ROOT / "configs" / bench.DATASETS[dataset].configs["swin"], [])
        model = timm.create_model(cfg.model, **dict(cfg.model_args(), embed_dim=8))
        pixels, labels = bench.load_images(str(data / dataset / "val"), model, cfg)
        first = np.asarray(read_image(scan_classes(str(data / dataset / "val")).samples[0][0]).convert("L"))
        pad = (frame - side) // 2
        assert pixels.shape[1:] == (1, frame, frame) and labels[0] == 0
        np.testing.assert_allclose(pixels[0, 0, pad:pad + side, pad:pad + side].numpy(), first / 255, atol=1e-6)
        assert pixels[:, :, :pad].abs().max() == 0 and pixels[:, :, :, -pad:].abs().max() == 0


def test_a_diverged_run_is_a_row_saying_so_and_the_others_go_on(data, tmp_path, capsys, monkeypatch):
    sys.path.insert(0, str(ROOT / "benchmarks" / "paper"))
    import certified as bench
    from lipsformer.engine.train import TrainingDiverged

    trained = bench.train_run

    def train_run(dataset, name, seed, args):
        if seed == 1:
            raise TrainingDiverged("non-finite loss at step 2 (epoch 1; stopped at step 2)")
        return trained(dataset, name, seed, args)

    monkeypatch.setattr(bench, "train_run", train_run)
    try:
        rows = bench.main(["--datasets", "mnist", "--epochs", "1", "--data", str(data), "--out", str(tmp_path / "out"),
                           "--models", "1-Lipschitz CNN (ours)", "--seeds", "0", "1", "--attack-images", "2",
                           "--pgd-steps", "1", "--restarts", "1", "--quotient-images", "1", "--quotient-steps", "1",
                           "--set", "batch_size=4", "global_batch=8"])
    finally:
        reset_accelerate()
    assert [("diverged" in r, r["seed"]) for r in rows] == [(False, 0), (True, 1)]
    out = capsys.readouterr().out
    assert "| 1-Lipschitz CNN (ours) | 1 (1 diverged) |" in out
    assert "1-Lipschitz CNN (ours), seed 1: non-finite loss at step 2" in out
    assert "| x | 0 (2 diverged) |" + " |" * 9 in bench.table([dict(model="x", diverged="d")] * 2)
