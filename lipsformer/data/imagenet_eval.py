"""The three ImageNet evaluation sets, each with its own label rule.

Every sample is ``(path, labels)``: the labels an image may be given and be right. ``imagenet`` and
``imagenet_v2`` have one label per image; ``imagenet_real`` has the ReaL list, which may be empty
(such images are left out of the score). The images are listed and read by :mod:`.scanner`, as in training: the
same files are images, the same folders are skipped, a class folder without an image is refused.
"""
import logging
import re
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from timm.data import ImageNetInfo
from torch.utils.data import Dataset

from .augment import apply_transform
from .classes import ClassMismatch, LabelFileError, class_mapping, model_class_names, read_label_lists
from .scanner import read_image, scan_classes, scan_images

EVAL_DATASETS = ("imagenet", "imagenet_real", "imagenet_v2")
Sample = Tuple[str, Tuple[int, ...]]
_logger = logging.getLogger(__name__)
_VAL_NAME = re.compile(r"ILSVRC2012_val_(\d{8})\.")
_SYNSET = re.compile(r"^n\d{8}$")


class Samples(list):
    """A list of samples, with the notes of the scan that found them (files that are not images, folders skipped,
    labels mapped by class name), for the caller to say once."""

    def __init__(self, samples=(), notes: Sequence[str] = ()):
        super().__init__(samples)
        self.notes = [n for n in notes if n]


def val_folder(data_dir) -> Path:
    """``data_dir/val`` when there is one (the training layout), else ``data_dir`` itself."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise FileNotFoundError(f"no data folder {data_dir}")
    return data_dir / "val" if (data_dir / "val").is_dir() else data_dir


def imagenet_samples(folder, model=None) -> Samples:
    """One folder per class, found as training finds them (:func:`~.scanner.scan_classes`); each folder's label is
    the index of its name among ``model``'s classes (:mod:`lipsformer.data.classes`), or its sorted place without a
    model."""
    scan = scan_classes(folder)
    if model is None:
        return Samples([(path, (target,)) for path, target in scan.samples], scan.notes)
    mapping, note = class_mapping(scan.classes, model_class_names(model, scan.classes), model.num_classes, str(folder))
    return Samples([(path, (mapping[scan.classes[target]],)) for path, target in scan.samples], [*scan.notes, note])


def imagenet_v2_samples(folder, num_classes: Optional[int] = None) -> Samples:
    """Folders ``0`` ... ``999``: the folder name *is* the class index (sorting names would put 10 before 2)."""
    folder = Path(folder)

    def numbered(name: str) -> None:
        if not name.isdigit():
            raise ValueError(f"ImageNet-v2 class folders are named 0 ... 999; found {folder / name}")
        if num_classes is not None and int(name) >= num_classes:
            raise ClassMismatch(f"{folder / name} is class {int(name)}, but the model has {num_classes} classes")

    scan = scan_classes(folder, check_class=numbered)
    return Samples([(path, (int(scan.classes[target]),)) for path, target in scan.samples], scan.notes)


def imagenet_real_samples(folder, real_labels, num_classes: Optional[int] = None) -> Samples:
    """The val images (flat or in synset folders) with their ReaL label lists, matched by file name:
    ``ILSVRC2012_val_00000001.JPEG`` takes the first list of the JSON file (read by
    :func:`~.classes.read_label_lists`: every label a class of a head of ``num_classes`` outputs). Labels that give
    none of the images a label are refused: they would score nothing."""
    labels = read_real_labels(real_labels, num_classes)
    scan = scan_images(folder)
    samples, seen = Samples(notes=scan.notes), {}
    for path in map(Path, (p for p, _ in scan.samples)):
        match = _VAL_NAME.match(path.name)
        if match is None:
            raise ValueError(f"ReaL labels are keyed by ImageNet val file names (ILSVRC2012_val_NNNNNNNN.JPEG); "
                             f"{path} is not one")
        index = int(match.group(1)) - 1
        if not 0 <= index < len(labels):
            raise ValueError(f"{path} is image {index + 1}, but {real_labels} has labels for {len(labels)} images")
        if index in seen:
            raise ValueError(f"image {index + 1} appears twice: {seen[index]} and {path}")
        seen[index] = path
        samples.append((str(path), tuple(labels[index])))
    if not samples:
        raise FileNotFoundError(f"no images under {folder}")
    if not any(labels for _, labels in samples):
        raise LabelFileError(f"{real_labels} gives none of the {len(samples)} images under {folder} a label (an "
                             f"image without ReaL labels is left out of the score), so nothing would be scored: "
                             f"check that it is ReaL's real.json and the folder ImageNet val")
    return samples


def read_real_labels(path, num_classes: Optional[int] = None) -> List[List[int]]:
    """ReaL's ``real.json``: one label list per val image (:func:`~.classes.read_label_lists`)."""
    return read_label_lists(path, num_classes, what="the ReaL labels file")


def eval_samples(dataset: str, data_dir, real_labels: Optional[str] = None, model=None) -> Samples:
    """The samples of ``dataset`` under ``data_dir``, labelled for ``model``'s classes when given (a folder's
    classes by name; a v2 folder or a ReaL label past the model's classes is refused), with the scan's notes."""
    num_classes = None if model is None else model.num_classes
    if dataset == "imagenet":
        return imagenet_samples(val_folder(data_dir), model)
    if dataset == "imagenet_real":
        if not real_labels:
            raise ValueError("imagenet_real needs --real-labels real.json "
                             "(github.com/google-research/reassessed-imagenet)")
        return imagenet_real_samples(val_folder(data_dir), real_labels, num_classes)
    if dataset == "imagenet_v2":
        if not Path(data_dir).is_dir():
            raise FileNotFoundError(f"no data folder {data_dir}")
        return imagenet_v2_samples(data_dir, num_classes)
    raise ValueError(f"unknown dataset {dataset!r}; choose one of {', '.join(EVAL_DATASETS)}")


def label_names(dataset: str, samples: Sequence[Sample], model) -> Optional[List[str]]:
    """The class name of each of ``model``'s labels where it is known, else None: the names its weights record
    (a run's ``classes.json``, an export's ``label_names``), ImageNet-1k's synsets for a 1000-class model on synset
    folders or on ImageNet-v2 / ReaL (their labels are ImageNet-1k's indices), or else, for an ``imagenet`` folder,
    the class folders' own names (without recorded names the folders are the model's classes in order)."""
    folders = sorted({Path(path).parent.name for path, _ in samples})
    names = model_class_names(model, folders)
    if names is None and dataset in ("imagenet_v2", "imagenet_real"):
        names = model_class_names(model, ImageNetInfo("imagenet-1k").label_names())
    if names is None and dataset == "imagenet":
        by_label = {labels[0]: Path(path).parent.name for path, labels in samples}
        if sorted(by_label) == list(range(model.num_classes)):
            names = [by_label[i] for i in range(model.num_classes)]
    return names


def describe_samples(dataset: str, samples: Sequence[Sample]) -> str:
    """What was evaluated, in words: ``ImageNet val (1000 synset folders)``, ``image folder (9 classes)``,
    ``ImageNet-ReaL``, ``ImageNet-v2 layout (10 class folders)``."""
    folders = {Path(path).parent.name for path, _ in samples}
    if dataset == "imagenet_real":
        return "ImageNet-ReaL labels"
    if dataset == "imagenet_v2":
        return f"ImageNet-v2 layout, {len(folders)} class folders"
    if all(_SYNSET.match(f) for f in folders):
        return f"ImageNet val layout, {len(folders)} synset folders"
    return f"image folder, {len(folders)} classes"


class EvalDataset(Dataset):
    """Yields ``(image, index, "")``, or ``(None, index, path)`` for an image that cannot be read (counted and
    reported by the evaluation, as training counts its own); labels stay with the samples, so scoring never
    depends on loader order. Batch it with :func:`~lipsformer.data.collate_skip_failed`."""

    def __init__(self, samples: Sequence[Sample], transform):
        self.samples = list(samples)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        path = self.samples[index][0]
        try:
            img = read_image(path)  # decoded here, so truncated files fail here
        except Exception as e:  # noqa: BLE001 - PIL raises several kinds for corrupt or empty files
            _logger.warning(f"skipped unreadable image {path}: {e}")
            return None, index, str(path)
        return apply_transform(self.transform, img, str(path)), index, ""
