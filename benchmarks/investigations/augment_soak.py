"""A finished investigation (docs/training.md cites its result): Soak each shipped recipe's training transform in
random images of random sizes and modes, against timm's own.

    python benchmarks/investigations/augment_soak.py     # every config with augmentation, 20,000 images each
    python benchmarks/investigations/augment_soak.py --images 2000 --configs configs/lipsformer_swin_t.yaml

For image i both transforms run from the same seed i (torch, random, numpy): ours (what train.py uses,
lipsformer.data.create_loader_transform) and timm's (lipsformer.data.recipe_transform: create_transform as is).
Ours must never raise; wherever timm's works the two tensors must be equal. Where timm's raises (a 0-bit posterize
on Pillow >= 13) ours gives Pillow < 13's black image for that op. Recipes with the same transform are soaked
once and reported together (the eight Table 6 recipes share one).
"""
import argparse
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from lipsformer.data import TransformError, create_loader_transform  # noqa: E402
from lipsformer.data.augment import apply_transform  # noqa: E402
from lipsformer.data.datasets import recipe_transform  # noqa: E402
from lipsformer.config import load_config  # noqa: E402

MODES = ("RGB", "L", "P", "RGBA", "CMYK")


class _Carrier(torch.nn.Module):
    """Stands in for the model: the transform reads only the model's pretrained config (mean, std)."""

    def __init__(self, pretrained_cfg: dict):
        super().__init__()
        self.pretrained_cfg = pretrained_cfg


def _pretrained_cfg(name: str) -> dict:
    import timm
    import lipsformer  # noqa: F401  (registers the models)
    return dict(timm.models.get_pretrained_cfg(name).to_dict())


def training_transforms(cfg):
    """``(ours, timm's)``: ``cfg``'s training transform as train.py builds it, and timm's own."""
    model = _Carrier(_pretrained_cfg(cfg.model))
    return create_loader_transform(model, True, cfg), recipe_transform(model, True, cfg)


def _seed(i: int) -> None:
    torch.manual_seed(i)
    random.seed(i)
    np.random.seed(i)


def soak(config: Path, images: int, img_size: int = None, max_side: int = 640, seed: int = 0) -> dict:
    """Run ``images`` random images through ``config``'s training transform (at ``img_size`` if given) and timm's.
    Returns counts: ours_raised (with the first messages), timm_raised, compared, mismatched."""
    cfg = load_config(config, [f"img_size={img_size}"] if img_size else [])
    ours, timms = training_transforms(cfg)
    rng = np.random.default_rng(seed)
    result = dict(images=images, ours_raised=0, errors=[], timm_raised=0, compared=0, mismatched=0)
    t0 = time.perf_counter()
    for i in range(images):
        w, h = (int(v) for v in rng.integers(1, max_side + 1, 2))
        img = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        img = img.convert(MODES[i % len(MODES)]).convert("RGB")  # as the datasets read every file
        _seed(seed + i)
        try:
            a = apply_transform(ours, img, f"random image {i} ({w}x{h})")
        except TransformError as e:
            result["ours_raised"] += 1
            result["errors"] = (result["errors"] + [e.line])[:5]
            continue
        _seed(seed + i)
        try:
            b = timms(img)
        except ValueError:
            result["timm_raised"] += 1
            continue
        result["compared"] += 1
        result["mismatched"] += int(not torch.equal(a, b))
    result["seconds"] = time.perf_counter() - t0
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", type=Path, help="default: every config in configs/ with `aa` set")
    parser.add_argument("--images", type=int, default=20_000, help="random images per distinct transform")
    parser.add_argument("--max-side", type=int, default=640, help="image sides are drawn from 1 .. this")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    configs = args.configs or [p for p in sorted((ROOT / "configs").glob("*.yaml")) if load_config(p).aa]
    groups = {}
    for path in configs:
        cfg = load_config(path)
        groups.setdefault(repr(training_transforms(cfg)[0]), []).append(path)
    import PIL
    import timm
    import torchvision
    print(f"Pillow {PIL.__version__}, timm {timm.__version__}, torchvision {torchvision.__version__}, "
          f"torch {torch.__version__}")
    failed = False
    for paths in groups.values():
        r = soak(paths[0], args.images, max_side=args.max_side, seed=args.seed)
        names = ", ".join(p.stem for p in paths)
        print(f"{names}: {r['images']} images in {r['seconds']:.0f} s | ours raised {r['ours_raised']} | "
              f"timm's raised {r['timm_raised']} | equal to timm's {r['compared'] - r['mismatched']} of "
              f"{r['compared']} where timm's works")
        for line in r["errors"]:
            print(f"  {line}")
        failed |= bool(r["ours_raised"] or r["mismatched"])
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
