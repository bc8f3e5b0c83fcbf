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
import json
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from timm.data import ImageNetInfo, infer_imagenet_subset

from ..errors import Mistake
from ..writer import write_json
from .scanner import FolderReader, listed


class ClassMismatch(Mistake, ValueError):
    """The class folders found cannot be matched to the model's classes."""


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
                            f"{listed(unknown)} ({known_as} classes: {listed(list(index))})")
    mapping = {c: index[c] for c in found}
    if list(mapping.values()) == list(range(len(found))) and len(found) == len(index):
        return mapping, ""
    missing = [c for c in index if c not in mapping]
    absent = f" (absent: {listed(missing)})" if missing else ""
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


def reader_classes(dataset) -> Optional[List[str]]:
    """A timm folder dataset's class names in label order (None for data whose reader does not name them)."""
    class_to_idx = getattr(getattr(dataset, "reader", None), "class_to_idx", None)
    if not class_to_idx:
        return None
    return sorted(class_to_idx, key=class_to_idx.get)


def relabel(dataset, known: Sequence[str], where: str, known_as: str) -> str:
    """Give a scanned folder's samples (:class:`~.scanner.FolderReader`) the labels their class names have in
    ``known``, in place; returns the note of :func:`class_mapping` (raises :class:`ClassMismatch`). Other data pass
    unchanged: a Hugging Face or webdataset source labels every split from one class list of its own."""
    found = reader_classes(dataset)
    if found is None or not isinstance(dataset.reader, FolderReader):
        return ""
    mapping, note = class_mapping(found, known, len(known), where, known_as)
    reader = dataset.reader
    reader.samples = [(path, mapping[found[target]]) for path, target in reader.samples]
    reader.class_to_idx = mapping
    return note


def write_class_names(path, names: Sequence[str]) -> None:
    """``classes.json``: the class names in label order (:func:`lipsformer.writer.write_json`)."""
    write_json(path, [str(c) for c in names], indent=None)


# -- the files that name classes or give labels: one reader, one set of rules -------------------------------------
class LabelFileError(ClassMismatch):
    """A class-names or labels file that cannot be used as it is (unreadable, of the wrong types, a class out of
    range, a count that does not match): its line names the file, the entry and the rule."""


def _json_list(path, what: str, form: str) -> list:
    """The JSON list in ``path`` (``what``: how a line names the file; ``form``: what its entries must be)."""
    path = Path(path)
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        cause = e.strerror if isinstance(e, OSError) and e.strerror else e
        raise LabelFileError(f"cannot read {what} {path}: {cause}") from None
    if not isinstance(value, list):
        raise LabelFileError(f"{path} must be a JSON list of {form}, not a {_kind(value)}")
    return value


def _kind(value) -> str:
    return {bool: "boolean", int: "number", float: "number", str: "string", list: "list", dict: "JSON object",
            type(None): "null"}.get(type(value), type(value).__name__)


def _class_index(value) -> bool:
    return type(value) is int  # a JSON true is no class index, nor 1.0


def check_class_range(path, where: str, label: int, num_classes: Optional[int]) -> None:
    """A LabelFileError unless ``label`` is a class of a head of ``num_classes`` outputs (0 .. num_classes - 1; no
    class is negative, whatever the head)."""
    if label < 0 or (num_classes is not None and label >= num_classes):
        head = f"the model's {num_classes} classes are 0 .. {num_classes - 1}" if num_classes is not None else \
            "class indices start at 0"
        raise LabelFileError(f"{path}: {where} is class {label}, which no output of the classifier is ({head})")


def read_class_names(path, num_classes: Optional[int] = None) -> Optional[List[str]]:
    """The names in a ``classes.json`` (None when there is none): a JSON list of distinct, non-empty strings, one
    per output of a head of ``num_classes`` outputs when it is given (a LabelFileError naming the entry
    otherwise)."""
    path = Path(path)
    if not path.is_file():
        return None
    names = _json_list(path, "the class names file", "class names (strings, in label order)")
    for i, name in enumerate(names):
        if not isinstance(name, str) or not name:
            raise LabelFileError(f"{path}: entry {i} is {json.dumps(name)} ({_kind(name)}); each entry is a class "
                                 f"name, a non-empty string")
    seen = {}
    for i, name in enumerate(names):
        if name in seen:
            raise LabelFileError(f"{path}: {name!r} is both entry {seen[name]} and entry {i}; each class has one "
                                 f"name")
        seen[name] = i
    if num_classes is not None and len(names) != num_classes:
        raise LabelFileError(f"{path} names {len(names)} classes, the classifier has {num_classes} outputs: it "
                             f"needs one name per output, in label order")
    return names


def read_label_lists(path, num_classes: Optional[int] = None, what: str = "the labels file") -> List[List[int]]:
    """A labels file as ReaL's ``real.json`` is: a JSON list with, per image, the list of its labels (class indices,
    empty for an image that has none). The rules of :func:`read_class_names`: every entry of the right type, every
    label a class of the head (``num_classes``, when given); a LabelFileError naming the entry otherwise."""
    rows = _json_list(path, what, "label lists (one per image, in file-name order)")
    for i, row in enumerate(rows):
        if not isinstance(row, list):
            raise LabelFileError(f"{path}: entry {i} (image {i + 1}) is {json.dumps(row)} ({_kind(row)}); each "
                                 f"entry is the list of that image's labels, e.g. [417] or []")
        for label in row:
            if not _class_index(label):
                raise LabelFileError(f"{path}: image {i + 1}'s labels {json.dumps(row)} hold {json.dumps(label)} "
                                     f"({_kind(label)}); a label is a class index, a whole number")
            check_class_range(path, f"image {i + 1}'s label", label, num_classes)
    return rows
