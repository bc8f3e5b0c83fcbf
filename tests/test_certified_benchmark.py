"""benchmarks/paper/certified.py in miniature: both datasets, the LipsFormers with branches on and forced off,
our CNN and deel-torchlip's, trained by the same loop, certified under the pairwise and the global rule."""
import json
import sys

import numpy as np
import pytest
from PIL import Image

from conftest import ROOT, reset_accelerate


@pytest.fixture
def data(tmp_path):
    """Tiny stand-ins for both datasets (marked complete, so the benchmark does not write the real ones): digits as
    32x32 RGB, MNIST as 28x28 grey, 2 train and 1 val image per class."""
    rng = np.random.default_rng(0)
    for name, shape in (("digits", (32, 32, 3)), ("mnist", (28, 28))):
        for split, n in (("train", 2), ("val", 1)):
            for c in range(10):
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
    assert len(saved["rows"]) == 12 and saved["wall_s"] > 0
    out = capsys.readouterr().out
    assert "\nmnist (1 epochs; certified images broken by PGD: 0;" in out and "| cert. 1.58 |" in out
    assert "| global 0.25 |" in out and "wall time" in out
    with pytest.raises(SystemExit):  # argparse's one line
        bench.main(["--datasets", "cifar"])
