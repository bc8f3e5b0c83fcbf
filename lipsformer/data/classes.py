"""Which label each class folder is: decided by the folder's name, never by its place in a sorted listing.

A folder dataset numbers its class folders in sorted order, so a val folder lacking one class (or holding a
subset, or other names) numbers them differently from the folders the model was trained on. Training's
validation and eval.py both map the folders they find onto the model's class names here; a folder that is
not one of the model's classes, or a class count that cannot be matched without names, is refused.

The names travel with the weights: a train.py run folder holds ``classes.json`` (its train/ folder's classes
in label order), read back as timm's ``pretrained_cfg["label_names"]``, which ``lipsformer.convert`` writes
into the exported ``config.json``. A 1000-class model without names is taken to know ImageNet-1k's synsets
(timm's ``infer_imagenet_subset``) when the folder is named by synsets.
"""
import itertools
import json
import os
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from timm.data import ImageNetInfo, get_img_extensions, infer_imagenet_subset
from timm.data.readers.reader_image_folder import ReaderImageFolder

from ..errors import Mistake
from ..writer import write_json


class ClassMismatch(Mistake, ValueError):
    """The class folders found cannot be matched to the model's classes."""


class FolderLayoutError(Mistake, ValueError):
    """An image folder that is not one folder of images per class."""


def _listed(names: Sequence[str], n: int = 5) -> str:
    return ", ".join(map(str, names[:n])) + (f", ... ({len(names)} in all)" if len(names) > n else "")


def class_mapping(found: Sequence[str], known: Optional[Sequence[str]], num_classes: Optional[int],
                  where: str, known_as: str = "the model's") -> Tuple[Dict[str, int], str]:
    """``(label of each found class name, note)``.

    ``found``: the class folders present, in the data's own order; ``known``: the model's class names in label
    order (None when unknown); ``num_classes``: the model's class count. With names, every found class must be
    one of them and takes its label; the note says so when the folder's own numbering would have differed (a
    subset, or another order). Without names, the folders must be exactly ``num_classes`` and keep their order.
    """
    found = list(found)
    if known is None:
        if num_classes is not None and len(found) != num_classes:
            raise ClassMismatch(
                f"{where} has {len(found)} class folders but the model has {num_classes} classes and does not "
                f"record their names, so which label each folder is cannot be told; evaluate on a folder with all "
                f"{num_classes} classes, or use weights that record their classes (train.py runs and their exports "
                f"do)")
        return {c: i for i, c in enumerate(found)}, ""
    index = {str(c): i for i, c in enumerate(known)}
    unknown = [c for c in found if c not in index]
    if unknown:
        raise ClassMismatch(f"{where} has class folders that are not among {known_as} {len(index)} classes: "
                            f"{_listed(unknown)} ({known_as} classes: {_listed(list(index))})")
    mapping = {c: index[c] for c in found}
    if list(mapping.values()) == list(range(len(found))) and len(found) == len(index):
        return mapping, ""
    missing = [c for c in index if c not in mapping]
    absent = f" (absent: {_listed(missing)})" if missing else ""
    return mapping, (f"{where}: {len(found)} of {known_as} {len(index)} classes{absent}; labels mapped by class "
                     f"name")


def model_class_names(model, found: Sequence[str] = ()) -> Optional[List[str]]:
    """The model's class names in label order: its ``pretrained_cfg["label_names"]``, else ImageNet-1k's synsets for
    a 1000-class model when every ``found`` name is one, else None."""
    cfg = getattr(model, "pretrained_cfg", None) or {}
    if cfg.get("label_names"):
        return [str(c) for c in cfg["label_names"]]
    subset = infer_imagenet_subset(model)
    if subset == "imagenet-1k":
        synsets = ImageNetInfo(subset).label_names()
        if found and set(found) <= set(synsets):
            return list(synsets)
    return None


def _extensions() -> str:
    return ", ".join(sorted(get_img_extensions()))


def no_images_message(folder) -> str:
    """What a folder without a single image holds, and what it should hold."""
    folder = Path(folder)
    files = [Path(r, f) for r, _, fs in itertools.islice(os.walk(folder), 1000) for f in fs][:3]
    found = f"; found {', '.join(str(f.relative_to(folder)) for f in files)}" if files else " (it is empty)"
    return (f"{folder} holds no images ({_extensions()}) in class folders{found}; it should hold one sub-folder of "
            f"images per class")


def check_class_folders(root, samples: Sequence[Tuple[str, int]], class_to_idx: Dict[str, int],
                        allow_empty: bool = False) -> None:
    """A :class:`FolderLayoutError` naming what to fix unless ``root`` is one folder of images per class, as timm's
    folder reader found it (``samples``: ``(path, label)``; ``class_to_idx``: by the folder's leaf name): images lying
    directly in ``root``, images in a folder inside a class folder (timm would take its name for a class of its own),
    and, unless ``allow_empty``, a class folder holding no image (timm drops it: another class count, other labels)."""
    root = Path(root)
    loose = [Path(p).name for p, _ in samples if Path(p).parent == root]
    if loose:
        raise FolderLayoutError(f"{root} holds images directly ({_listed(loose, 3)}): put each image in its class's "
                                f"folder, {root}/CLASS/IMAGE")
    nested = next((Path(p).parent for p, _ in samples if Path(p).parent.parent != root), None)
    if nested is not None:
        raise FolderLayoutError(f"{nested} is a folder inside a class folder: timm would take its images for a class "
                                f"of its own, {nested.name!r}; keep one level of folders, {root}/CLASS/IMAGE")
    if not allow_empty:
        empty = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith(".")
                       and e.name not in class_to_idx)
        if empty:
            raise FolderLayoutError(f"{root}/{empty[0]} holds no images ({_extensions()})"
                                    f"{f' (nor do {_listed(empty[1:], 3)})' if len(empty) > 1 else ''}: add its images "
                                    f"or remove the folder; every class folder needs at least one")


def reader_classes(dataset) -> Optional[List[str]]:
    """A timm folder dataset's class names in label order (None for data whose reader does not name them)."""
    class_to_idx = getattr(getattr(dataset, "reader", None), "class_to_idx", None)
    if not class_to_idx:
        return None
    return sorted(class_to_idx, key=class_to_idx.get)


def relabel(dataset, known: Sequence[str], where: str, known_as: str) -> str:
    """Give a timm folder dataset's samples the labels their class names have in ``known``, in place; returns the
    note of :func:`class_mapping` (raises :class:`ClassMismatch`). Other data pass unchanged: a Hugging Face or
    webdataset source labels every split from one class list of its own."""
    found = reader_classes(dataset)
    if found is None or not isinstance(dataset.reader, ReaderImageFolder):
        return ""
    mapping, note = class_mapping(found, known, len(known), where, known_as)
    reader = dataset.reader
    reader.samples = [(path, mapping[found[target]]) for path, target in reader.samples]
    reader.class_to_idx = mapping
    return note


def write_class_names(path, names: Sequence[str]) -> None:
    """``classes.json``: the class names in label order (:func:`lipsformer.writer.write_json`)."""
    write_json(path, [str(c) for c in names], indent=None)


def read_class_names(path) -> Optional[List[str]]:
    """The names in a ``classes.json`` (None when there is none)."""
    path = Path(path)
    if not path.is_file():
        return None
    names = json.loads(path.read_text())
    if not isinstance(names, list):
        raise ClassMismatch(f"{path} must be a JSON list of class names")
    return [str(c) for c in names]
