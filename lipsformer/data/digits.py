"""scikit-learn's digits (1,797 real 8x8 handwritten digits) written once as an ImageNet-style folder.

    python -m lipsformer.data.digits output/digits [--size 32]
"""
import sys
from pathlib import Path

import numpy as np
from PIL import Image

from ..cli import ArgumentParser, command, path, positive_int
from ..errors import Mistake


def write_digits_folder(root, size: int = 32, val_every: int = 5) -> Path:
    """Write ``root/train/<digit>/*.png`` and ``root/val/<digit>/*.png`` (every ``val_every``-th image to val).

    Idempotent: a folder already complete (marked by ``root/.complete``) is left as it is.
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise Mistake("the digits come from scikit-learn, which is not installed: pip install scikit-learn "
                      "(or the dev extra: pip install -e '.[dev]')") from None

    root = Path(root)
    if (root / ".complete").exists():
        return root
    for path in (root, *root.parents):  # found before the first image is written
        if path.exists():
            if not path.is_dir():
                raise Mistake(f"{root}: {path} is a file, not a folder; choose another folder for the digits")
            break
    digits = load_digits()
    for i, (image, label) in enumerate(zip(digits.images, digits.target)):
        split = "val" if i % val_every == 0 else "train"
        folder = root / split / str(label)
        folder.mkdir(parents=True, exist_ok=True)
        pixels = (image / 16.0 * 255).astype(np.uint8)
        Image.fromarray(pixels).resize((size, size), Image.BICUBIC).convert("RGB").save(folder / f"{i:04d}.png")
    (root / ".complete").touch()
    return root


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="python -m lipsformer.data.digits", description=__doc__)
    parser.add_argument("root", type=path, help="the folder to write (train/ and val/ inside)")
    parser.add_argument("--size", type=positive_int, default=32, help="image side in pixels")
    return parser


@command
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    print(write_digits_folder(args.root, args.size))
    return 0


if __name__ == "__main__":
    sys.exit(main())
