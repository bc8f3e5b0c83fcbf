"""scikit-learn's digits (1,797 real 8x8 handwritten digits) written once as an ImageNet-style folder.

    python -m lipsformer.data.digits output/digits [--size 32]
"""
import argparse
from pathlib import Path

import numpy as np
from PIL import Image


def write_digits_folder(root, size: int = 32, val_every: int = 5) -> Path:
    """Write ``root/train/<digit>/*.png`` and ``root/val/<digit>/*.png`` (every ``val_every``-th image to val).

    Idempotent: a folder already complete (marked by ``root/.complete``) is left as it is.
    """
    from sklearn.datasets import load_digits

    root = Path(root)
    if (root / ".complete").exists():
        return root
    digits = load_digits()
    for i, (image, label) in enumerate(zip(digits.images, digits.target)):
        split = "val" if i % val_every == 0 else "train"
        folder = root / split / str(label)
        folder.mkdir(parents=True, exist_ok=True)
        pixels = (image / 16.0 * 255).astype(np.uint8)
        Image.fromarray(pixels).resize((size, size), Image.BICUBIC).convert("RGB").save(folder / f"{i:04d}.png")
    (root / ".complete").touch()
    return root


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root")
    parser.add_argument("--size", type=int, default=32)
    args = parser.parse_args()
    print(write_digits_folder(args.root, args.size))
