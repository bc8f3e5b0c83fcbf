"""Datasets that report, rather than hide, the images they cannot read."""
import contextlib
import logging
import os
import random
from contextlib import contextmanager
from typing import Any, List, Optional, Tuple

import numpy as np
import torch
from timm.data import create_dataset as timm_create_dataset
from timm.data import create_transform, resolve_data_config
from torch.utils.data import Dataset, IterableDataset, default_collate, get_worker_info
from torchvision.transforms import Grayscale

from ..errors import Mistake
from ..models._base import LipsFormerBase
from .augment import apply_transform, portable
from .scanner import FolderReader, read_image, scan_classes

_logger = logging.getLogger(__name__)
_LUMA = (0.299, 0.587, 0.114)  # PIL's L = 0.299 R + 0.587 G + 0.114 B


class DataConfigError(Mistake, ValueError):
    """The data cannot be given to the model as it is set up: its input channels against its normalisation, or too
    few images for one optimizer update an epoch."""


@contextmanager
def _seeded_rngs(seed: int):
    """torch's CPU generator and Python's and NumPy's global RNGs seeded with ``seed`` inside the block.

    In the main process (a loader without workers) their states are given back after it, so the model's draws
    (DropPath, mixup) do not depend on the data. A loader worker draws from them only here, reseeded for every
    sample, so it neither saves nor restores them (a cost per sample). The CPU generator is seeded by
    ``torch.default_generator.manual_seed``: ``torch.manual_seed`` also seeds every CUDA generator (before CUDA
    starts it queues the call with a stack trace, for every sample) and, in the main process, would leave them at
    the last sample's seed, while the transforms draw on the CPU only. What the seeding costs a worker against
    decoding and augmenting a JPEG: ``benchmarks/loader.py``.
    """
    main = get_worker_info() is None
    if main:
        states = torch.get_rng_state(), random.getstate(), np.random.get_state()
    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    try:
        yield
    finally:
        if main:
            torch.set_rng_state(states[0])
            random.setstate(states[1])
            np.random.set_state(states[2])


class SafeImageDataset(Dataset):
    """Map-style dataset over a timm reader; an unreadable image yields ``(None, target, path)``.

    timm's own ImageDataset silently substitutes the next image; the training loop needs to count
    the failures instead, and stop when too many of an epoch's samples fail.

    With a ``seed``, each sample's augmentation draws from RNGs seeded by (seed, epoch, index) and
    forked from the global ones, so the augmented data do not depend on prefetching, worker
    count or where a resumed run restarted: resume is exact.
    """

    def __init__(self, reader, transform=None, seed: Optional[int] = None):
        self.reader = reader
        self.transform = transform
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Called by Accelerate's loader at each ``set_epoch``."""
        self.epoch = epoch

    def sample_seed(self, index: int) -> int:
        """The seed of sample ``index``'s augmentation in the current epoch."""
        return ((self.seed * 1_000_003 + self.epoch) * 10_000_019 + index) % (2 ** 32)

    def _transform(self, img, index: int):
        if self.seed is None:
            return apply_transform(self.transform, img, self.filename(index))
        with _seeded_rngs(self.sample_seed(index)):
            return apply_transform(self.transform, img, self.filename(index))

    def __len__(self) -> int:
        return len(self.reader)

    def filename(self, index: int) -> str:
        return str(self.reader.filename(index, absolute=True))

    def __getitem__(self, index: int) -> Tuple[Optional[Any], int, str]:
        target = None
        try:  # the reader opens the file: no permission, a dangling link or a folder fail here, not later
            source, target = self.reader[index][:2]
            with contextlib.closing(source) if hasattr(source, "close") else contextlib.nullcontext():
                img = read_image(source)  # decoded here, so truncated files fail here
        except Exception as e:  # noqa: BLE001 - PIL raises several kinds for corrupt or empty files, open() OSErrors
            path = self.filename(index)
            _logger.warning(f"skipped unreadable image {path}: {e}")
            return None, -1 if target is None else target, path
        if self.transform is not None:
            img = self._transform(img, index)
        return img, -1 if target is None else target, ""


def collate_skip_failed(batch: List[Tuple[Any, ...]]):
    """Collate ``(image, target, path)`` samples (or ``(image, target)`` from streamed datasets, whose readers
    skip bad records themselves) to ``(images, targets, failed_paths)``; failed samples are replaced by copies
    of good ones from the same batch, so the batch keeps its size (mixup needs an even one)."""
    good = [(s[0], s[1]) for s in batch if s[0] is not None]
    failed = [s[2] for s in batch if s[0] is None]
    if not good:
        return None, None, failed
    good += [good[i % len(good)] for i in range(len(batch) - len(good))]
    images, targets = default_collate(good)
    return images, targets, failed


def eval_data_config(model, crop_pct=None, interpolation=None) -> dict:
    """timm's data config from the model's pretrained config, at the size the model is built for (a model built
    at 32 px gets 32 px images, whatever size its published config names); ``crop_pct`` / ``interpolation``
    override the config, as in timm's validate.py. Another timm model (e.g. benchmarks/paper/certified.py's CNN)
    keeps the input size its pretrained config names."""
    size = None
    if isinstance(model, LipsFormerBase):
        size = (model.patch_embed.proj.in_channels, *model.patch_embed.img_size)
    return resolve_data_config(dict(input_size=size, crop_pct=crop_pct, interpolation=interpolation), model=model)


def recipe_transform(model, is_training: bool, cfg=None, crop_pct=None, interpolation=None):
    """timm's own preprocessing per :func:`eval_data_config`; training adds the recipe's augmentations. A
    ``crop_pct`` above 1 pads: evaluation resizes to ``floor(img_size / crop_pct)`` and zero-pads the centre crop to
    ``img_size`` (timm's center crop mode), and training augments that padded image (MNIST's 28x28 digits in the
    32x32 frame the models need: zero padding is an l2 isometry, so a radius certified on the padded image holds for
    the 28x28 one). A model of one input channel gets grey images (PIL's ``L``: exactly the grey value of a grey
    image read as RGB). What
    training and evaluation use is :func:`create_loader_transform` (this, made portable across Pillow versions);
    this one is the reference it is compared with."""
    data_cfg = eval_data_config(model, crop_pct, interpolation)
    if cfg is not None:
        data_cfg.update(input_size=(data_cfg["input_size"][0], cfg.img_size, cfg.img_size), crop_pct=cfg.crop_pct,
                        interpolation=cfg.interpolation)
    check_normalisation(data_cfg)
    grey = [Grayscale(1)] if data_cfg["input_size"][0] == 1 else []  # images are read as RGB
    if not is_training:
        evaluation = create_transform(**data_cfg, is_training=False)
        evaluation.transforms[:0] = grey
        return evaluation
    train = create_transform(
        data_cfg["input_size"], is_training=True, interpolation=data_cfg["interpolation"], mean=data_cfg["mean"],
        std=data_cfg["std"], auto_augment=cfg.aa, re_prob=cfg.reprob, re_mode="pixel", hflip=cfg.hflip,
        scale=tuple(cfg.scale))
    if data_cfg["crop_pct"] > 1:  # padded as evaluation pads, before the augmentation crops and resizes
        train.transforms[:0] = create_transform(**data_cfg, is_training=False).transforms[:2]
    train.transforms[:0] = grey
    return train


def check_normalisation(data_cfg: dict) -> None:
    """A :class:`DataConfigError` naming what to set unless the model's input channels are 1 (grey, PIL's ``L``) or 3
    (RGB) and its normalisation's ``mean`` and ``std`` (timm's ``resolve_data_config``: the model's
    ``pretrained_cfg``, which keeps ImageNet's 3 values for a model built with ``in_chans: 1``) have one value each
    or one per channel."""
    chans, mean, std = data_cfg["input_size"][0], tuple(data_cfg["mean"]), tuple(data_cfg["std"])
    if chans not in (1, 3):
        raise DataConfigError(f"the model takes {chans} input channels, but images are read as RGB (3 channels) or "
                              f"grey (1): set model_kwargs.in_chans to 3 or 1")
    if len(mean) in (1, chans) and len(std) in (1, chans):
        return
    if chans == 1 and len(mean) == len(std) == 3:
        grey = [round(sum(w * v for w, v in zip(_LUMA, values)), 3) for values in (mean, std)]
        what = (f"mean: [{grey[0]}], std: [{grey[1]}]}} (the RGB values weighted as in L = 0.299 R + 0.587 G + "
                f"0.114 B), or your data's own")
    else:
        what = f"mean: [...], std: [...]}} with one value each, or {chans}"
    raise DataConfigError(f"the model takes {chans} input channel(s) but its normalisation has {len(mean)} mean and "
                          f"{len(std)} std values (mean {list(mean)}, std {list(std)}): set "
                          f"model_kwargs.pretrained_cfg_overlay: {{{what} (eval.py: --model-args "
                          f"'{{\"pretrained_cfg_overlay\": {{...}}}}')")


def create_loader_transform(model, is_training: bool, cfg=None, crop_pct=None, interpolation=None):
    """:func:`recipe_transform` with timm's posterize ops made to give the same images on every Pillow
    (:func:`~lipsformer.data.augment.portable`)."""
    return portable(recipe_transform(model, is_training, cfg, crop_pct, interpolation))


def check_batches(dataset, batch_size: int, processes: int, accumulation: int, where: str) -> None:
    """A :class:`DataConfigError` unless every process gets an optimizer update each epoch. Training batches drop the
    last partial one, and Accelerate gives each process ``(images // batch_size) // processes`` =
    ``images // (batch_size * processes)`` batches, of which an update takes ``accumulation``: the data must hold one
    global batch. Streamed data, whose length is an estimate, are not checked."""
    if isinstance(dataset, IterableDataset):
        return
    images, need = len(dataset), batch_size * processes * accumulation
    if images < need:
        raise DataConfigError(
            f"{where} has {images} images, fewer than one optimizer update takes: {need} (global_batch) = batch_size "
            f"{batch_size} x {processes} process(es) x {accumulation} accumulation step(s), and each process drops "
            f"its last partial batch, so no update would run in an epoch: lower global_batch (and batch_size), or add "
            f"images")


def scan_notes(dataset) -> List[str]:
    """The scanner's notes on a folder dataset (files that are not images, folders skipped); none for other data."""
    reader = getattr(dataset, "reader", None)
    return reader.scan.notes if isinstance(reader, FolderReader) else []


def create_dataset(name: str, root: Optional[str], split: str, transform, is_training: bool = False,
                   batch_size: int = 1, seed: Optional[int] = None):
    """A folder (``name=''``: ``root/split``, listed by :func:`~.scanner.scan_classes`) or any timm dataset name;
    map-style ones count unreadable images and, given a ``seed``, augment each sample reproducibly; streamed ones
    (``wds/``, ``hfids/``) shuffle with it."""
    if not name:
        return SafeImageDataset(FolderReader(scan_classes(os.path.join(root, split))), transform, seed=seed)
    streamed = {} if seed is None else dict(seed=seed)  # wds/, hfids/, tfds/ shuffle shards and samples with it
    try:
        ds = timm_create_dataset(name, root=root, split=split, is_training=is_training, batch_size=batch_size,
                                 **streamed)
    except (ValueError, RuntimeError) as e:  # timm's readers: hfds/ 'Unknown split', wds/ 'split not found'
        if "split" not in str(e).lower():
            raise
        shards = " (wds/: the folder must hold _info.json naming its splits)" if name.startswith("wds/") else ""
        raise DataConfigError(f"dataset {name} in {root}: no split {split!r}: {str(e).rstrip('.')}; set "
                              f"{'train_split' if is_training else 'val_split'} to one of its splits{shards}") \
            from None
    if hasattr(ds, "reader") and isinstance(ds, torch.utils.data.Dataset) and hasattr(ds.reader, "__getitem__"):
        return SafeImageDataset(ds.reader, transform, seed=seed)
    ds.transform = transform  # iterable (wds/...) datasets: timm's own error handling applies
    return ds
