"""A tool users run (docs/speed.md, the loader): Decoded-and-augmented images per second per loader worker:
train.py's loader against timm's create_loader.

    python benchmarks/loader.py                       # swin_t recipe, 384 generated 500x375 JPEGs, workers 1 and 0
    python benchmarks/loader.py --data /tmp/jpegs --images 1024 --rounds 7 --workers 1 --json loader.json

Ours is the training loader exactly as train.py builds it (lipsformer.engine.train.build_loaders: the config's
transform from create_loader_transform, create_dataset's SafeImageDataset with per-sample seeding for exact resume,
collate_skip_failed, Accelerate's seedable sampler). timm's is ``timm.data.create_loader`` over timm's ImageDataset
of the same folder with the config's augmentation arguments (no prefetcher: that is its CUDA path); the transform it
builds is checked to be the recipe's, then given the same Pillow-portable posterize as ours (timm's raises on Pillow
13 about once in 900 images). A third loader is ours with the per-sample seeding switched off, which prices the
seeding. The loaders run interleaved (timm, ours, ours unseeded; then ours, ours unseeded, timm; ...) for
``--rounds`` epochs each, after one epoch each that warms the file cache; an epoch is the whole folder. A rate is an
epoch's images over the time from asking for its first batch to receiving its last. Both loaders start their workers
anew each epoch (train.py's do; timm's are made so with ``persistent_workers=False``), so both pay the same
start-up, and timing whole epochs is fair to Accelerate's loader, which holds one batch back to know the last.
Printed are the median rate of each loader and the median over rounds of its rate divided by timm's in the same
round (neighbours in time share the machine's load). With ``--workers 1`` one worker process decodes and augments
while the main process only receives (one decode pipeline per core); ``--workers 0`` is the same work in the main
process. torch runs single-threaded, as it does in a loader worker. The folder is ``--data`` (made there if it has
no JPEGs) or a temporary one.

Also printed: what the per-sample seeding costs on its own, microseconds per sample, timed in a loader worker and in
the main process (SafeImageDataset with an identity transform, seeded against unseeded).
"""
import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lipsformer.data import SafeImageDataset, eval_data_config  # noqa: E402
from lipsformer.data.augment import portable  # noqa: E402
from lipsformer.data.datasets import recipe_transform  # noqa: E402
from lipsformer.config import load_config  # noqa: E402
from lipsformer.engine.train import build_loaders, create_accelerator  # noqa: E402

CLASSES = 4


def make_jpegs(root: Path, images: int, size, seed: int = 0) -> None:
    """``images`` JPEGs of ``size`` (w, h) in ``root/train/<class>/`` (and one a class in ``root/val/``, which
    train.py's loaders also open): smooth colour fields with grain, about the bytes of an ImageNet photo."""
    rng = np.random.default_rng(seed)
    w, h = size
    for split, count in (("train", images), ("val", CLASSES)):
        for i in range(count):
            folder = root / split / f"class{i % CLASSES}"
            folder.mkdir(parents=True, exist_ok=True)
            coarse = Image.fromarray(rng.integers(0, 256, (max(h // 24, 1), max(w // 24, 1), 3), dtype=np.uint8))
            img = np.asarray(coarse.resize((w, h), Image.BICUBIC), dtype=np.float32)
            img += rng.normal(0, 6, img.shape)
            Image.fromarray(img.clip(0, 255).astype(np.uint8)).save(folder / f"{i:06d}.jpg", quality=90)


def timm_loader(cfg, model, workers: int):
    """``timm.data.create_loader`` with the recipe's augmentation arguments; its transform must be the recipe's."""
    from timm.data import create_dataset, create_loader
    data_cfg = eval_data_config(model)
    ds = create_dataset("", root=cfg.data_dir, split=cfg.train_split, is_training=True, batch_size=cfg.batch_size)
    loader = create_loader(
        ds, (3, cfg.img_size, cfg.img_size), cfg.batch_size, is_training=True, auto_augment=cfg.aa,
        re_prob=cfg.reprob, re_mode="pixel", hflip=cfg.hflip, scale=tuple(cfg.scale), interpolation=cfg.interpolation,
        mean=data_cfg["mean"], std=data_cfg["std"], num_workers=workers, use_prefetcher=False,
        persistent_workers=False, device=torch.device("cpu"))
    expected = recipe_transform(model, True, cfg)
    if repr(loader.dataset.transform) != repr(expected):
        raise SystemExit(f"timm's create_loader built another transform than the recipe's:\n"
                         f"{loader.dataset.transform}\n!=\n{expected}")
    portable(loader.dataset.transform)
    return loader


def epoch_rate(loader, batch_size: int, epoch: int) -> float:
    """Images per second of one epoch, from asking for its first batch to receiving its last."""
    if hasattr(loader, "set_epoch"):
        loader.set_epoch(epoch)
    batches, start = 0, time.perf_counter()
    for batch in loader:
        assert batch[0].shape[0] == batch_size
        batches += 1
    return batches * batch_size / (time.perf_counter() - start)


class _SeedingCost(Dataset):
    """Item ``seeded``: microseconds per sample of ``SafeImageDataset._transform`` with an identity transform."""

    def __init__(self, reader, samples: int):
        self.reader, self.samples = reader, samples

    def __len__(self) -> int:
        return 2

    def __getitem__(self, seeded: int) -> float:
        ds = SafeImageDataset(self.reader, lambda img: img, seed=0 if seeded else None)
        n = len(self.reader)
        start = time.perf_counter()
        for i in range(self.samples):
            ds._transform(None, i % n)
        return (time.perf_counter() - start) / self.samples * 1e6


def seeding_cost(reader, samples: int, rounds: int) -> dict:
    """Median microseconds a sample's seeding adds (seeded minus unseeded), in a loader worker and in-process."""
    probe = _SeedingCost(reader, samples)
    out = {}
    for where, workers in (("worker", 1), ("main", 0)):
        diffs = []
        for _ in range(rounds):
            unseeded, seeded = DataLoader(probe, batch_size=None, num_workers=workers)
            diffs.append(float(seeded - unseeded))
        out[where] = statistics.median(diffs)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "lipsformer_swin_t.yaml"))
    parser.add_argument("--data", default=None, help="folder of JPEGs (made here if it has none); default: a temp one")
    parser.add_argument("--images", type=int, default=384, help="training images to generate (one epoch)")
    parser.add_argument("--size", default="500x375", help="generated image size WxH")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seeding-samples", type=int, default=5000)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)

    with tempfile.TemporaryDirectory() as tmp:
        data = Path(args.data or tmp)
        if not any(data.rglob("*.jpg")):
            make_jpegs(data, args.images, tuple(int(v) for v in args.size.split("x")))
        import timm
        import lipsformer  # noqa: F401  (registers the models)
        rows = []
        for workers in args.workers:
            cfg = load_config(args.config, [f"data_dir={data}", f"batch_size={args.batch}",
                                            f"global_batch={args.batch}", f"workers={workers}"])
            with torch.device("meta"):
                model = timm.create_model(cfg.model, **cfg.model_args())
            ours = build_loaders(cfg, model, create_accelerator(cfg))[0]
            ours_ds = ours.dataset
            assert isinstance(ours_ds, SafeImageDataset) and ours_ds.seed is not None
            baseline = timm_loader(cfg, model, workers)
            candidates = {"timm": (baseline, None), "ours": (ours, cfg.seed), "ours unseeded": (ours, None)}
            rates = {name: [] for name in candidates}
            for epoch in range(-1, args.rounds):  # epoch -1 warms the file cache and is not counted
                names = list(candidates)
                for name in names[epoch % 3:] + names[:epoch % 3]:  # each loader takes each place in turn
                    loader, seed = candidates[name]
                    ours_ds.seed = seed
                    rate = epoch_rate(loader, args.batch, epoch)
                    if epoch >= 0:
                        rates[name].append(rate)
            ours_ds.seed = cfg.seed
            for name, values in rates.items():  # ratio: per round, to timm's epoch of the same round, then median
                ratios = [v / b for v, b in zip(values, rates["timm"])]
                rows.append(dict(workers=workers, loader=name, img_s=statistics.median(values),
                                 ratio=statistics.median(ratios), rounds=values))
            del baseline, ours
        cost = seeding_cost(ours_ds.reader, args.seeding_samples, args.rounds)
        images = len(ours_ds)

    print(f"{Path(args.config).name}: {images} JPEGs {args.size}, batch {args.batch}, "
          f"{args.rounds} interleaved epochs, median img/s per loader (workers 0: in the main process) and median "
          f"ratio to timm's epoch of the same round")
    print(f"{'workers':>7}  {'loader':<14} {'img/s':>8} {'vs timm':>8}")
    for r in rows:
        print(f"{r['workers']:>7}  {r['loader']:<14} {r['img_s']:>8.1f} {r['ratio']:>7.3f}x")
    print(f"per-sample seeding: {cost['worker']:.1f} us a sample in a loader worker, {cost['main']:.1f} us in the "
          f"main process")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(rows=rows, seeding_us=cost, images=images, size=args.size,
                                                   batch=args.batch, config=args.config), indent=1))


if __name__ == "__main__":
    main()
