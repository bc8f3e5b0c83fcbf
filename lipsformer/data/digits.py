"""scikit-learn's digits (1,797 real 8x8 handwritten digits) written once as an ImageNet-style folder.

    python -m lipsformer.data.digits output/digits [--size 32]
"""
import sys
from pathlib import Path

import numpy as np
from PIL import Image

from ..cli import ArgumentParser, command, positive_int
from ..errors import Mistake
from ..writer import mark, output_folder, replacing, written, written_as


def write_digits_folder(root, size: int = 32, val_every: int = 5) -> Path:
    """Write ``root/train/<digit>/*.png`` and ``root/val/<digit>/*.png`` (every ``val_every``-th image to val), as a
    folder beside it renamed into place once complete.

    Idempotent: a folder already written with these settings (its mark, :func:`lipsformer.writer.written_as`) is
    left as it is; one written by a data writer with other settings is replaced; a non-empty folder written by
    anything else is refused (a Mistake, before any work).
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise Mistake("the digits come from scikit-learn, which is not installed: pip install scikit-learn "
                      "(or the dev extra: pip install -e '.[dev]')") from None

    root = Path(root)
    settings = dict(written_by="python -m lipsformer.data.digits", size=size, val_every=val_every)
    if written_as(root, settings):
        return root
    digits = load_digits()
    with replacing(root, exclusive=True) as tmp:
        for i, (image, label) in enumerate(zip(digits.images, digits.target)):
            folder = tmp / ("val" if i % val_every == 0 else "train") / str(label)
            folder.mkdir(parents=True, exist_ok=True)
            pixels = (image / 16.0 * 255).astype(np.uint8)
            Image.fromarray(pixels).resize((size, size), Image.BICUBIC).convert("RGB").save(folder / f"{i:04d}.png")
        mark(tmp, settings)
    return root


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="python -m lipsformer.data.digits", description=__doc__)
    parser.add_argument("root", type=output_folder, help="the folder to write (train/ and val/ inside)")
    parser.add_argument("--size", type=positive_int, default=32, help="image side in pixels")
    return parser


@command
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    root = write_digits_folder(args.root, args.size)
    if root not in written():  # else the boundary's "wrote:" line names it
        print(f"{root} holds these digits already: left as it is")
    return 0


if __name__ == "__main__":
    sys.exit(main())
