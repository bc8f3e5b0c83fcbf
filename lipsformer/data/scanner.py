"""One scanner for every image folder: which files are images, which folders are classes, what is left out (and
said), and how an image file becomes the RGB pixels the transforms take. Training, its validation and eval.py's three
datasets list their images with :func:`scan_classes` / :func:`scan_images` and read them with :func:`read_image`.

**Which files are images.** Every file whose extension a format Pillow decodes in this install registers
(:func:`image_extensions`, derived from Pillow's registry: .png, .jpg / .jpeg, .bmp, .webp, .tif / .tiff, .gif,
.ppm / .pgm / .pbm, .tga, .ico, .jp2, .avif where Pillow has it, ...). A format Pillow only identifies (MPEG, the stubs
BUFR / GRIB / HDF5 / WMF without a registered handler) or only writes (PDF, PALM) is not an image, nor is EPS
without Ghostscript. Every other file (``README.txt``, ``labels.csv``, ``Thumbs.db``) and every hidden file
(``.DS_Store``, macOS's ``._name.jpg``) is not a sample: they are counted and named in one note line. An image that
fails to decode is counted where it is read (the training and evaluation loops' rule for unreadable images).

**Which folders are skipped.** Hidden folders (a name starting with ``.``: ``.ipynb_checkpoints``, ``.git``) and the
folders of :data:`JUNK_FOLDERS` (``__MACOSX``, ...), at any depth, with one note line naming them. A folder reached
again through a symbolic link is scanned once.

**The layout** (:func:`scan_classes`): ``folder/CLASS/IMAGE``. Classes are numbered in timm's order (its
``natural_key`` of the folder names: ``class_2`` before ``class_10``) and samples come in timm's order (``natural_key``
of the path), so on a folder of .png / .jpg images the samples and labels are exactly timm's folder reader's. Refused
(:class:`FolderLayoutError`, one line naming what to fix): no image at all, images directly in ``folder``, images in a
folder inside a class folder (a class of its own to timm), a class folder without an image (its class would vanish
from the labels and the score; to use a subset of classes, leave the other folders out).

**How an image is read** (:func:`read_image`, :func:`to_rgb`): its first frame (GIF, TIFF pages, icons), decoded, as
RGB; a model of one input channel then gets PIL's ``L`` of it in the transform (exactly the grey level of a grey
image). Pillow's own ``convert("RGB")`` is used where it gives the right pixels (1, L, P, RGB, RGBX, CMYK, YCbCr, LAB,
HSV); three rules replace it where it does not:

- 16-bit and integer grey (``I;16``, ``I;16L``, ``I;16B``, ``I;16N``, and ``I``, which Pillow gives 16-bit PGM files
  and writes to PNG / PGM as 16 bits) are 16-bit levels, 0 to 65535, scaled to 8 bits by 1/257 and rounded
  (``convert`` clips every level above 255 to white). An ``I`` image with levels outside 0 to 65535 has no known
  scale and is not used (counted as unreadable, saying so).
- Floating-point grey (``F``) is intensity in [0, 1] (torchvision's convention), scaled by 255 and rounded
  (``convert`` reads it as 0 to 255, so a [0, 1] image is black). Values outside [0, 1], NaN or infinity: not used.
- Transparency (LA, La, PA, RGBA, RGBa, and a P / L / RGB image with a transparent colour) is composited on white,
  as a viewer shows it on a page (``convert`` drops the alpha and shows whatever colour the transparent pixels hold).
  An opaque pixel is kept exactly.

EXIF orientation and ICC profiles are not applied, as in timm's and torchvision's folder readers.
"""
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, FrozenSet, List, Optional, Sequence, Tuple

import numpy as np
from PIL import EpsImagePlugin, Image, ImageFile
from timm.data.readers.reader import Reader
from timm.utils.misc import natural_key

from ..errors import Mistake

# Folders that are never classes, besides every hidden one (a name starting with "."): macOS's resource forks in
# zip files, Python's caches, a Synology NAS's thumbnails, Windows' and ext4's own folders at a drive's root.
JUNK_FOLDERS = frozenset({"__MACOSX", "__pycache__", "@eaDir", "$RECYCLE.BIN", "System Volume Information",
                          "lost+found"})
_OPENED_BY = {"MPO": "JPEG"}  # formats Pillow opens through another format's plugin
_IDENTIFIED_ONLY = {"MPEG"}  # Pillow reads their size, not their pixels


class FolderLayoutError(Mistake, ValueError):
    """An image folder that is not one folder of images per class."""


def _decodable(fmt: str) -> bool:
    if fmt in _IDENTIFIED_ONLY:
        return False
    if fmt == "EPS":
        return bool(EpsImagePlugin.has_ghostscript())
    factory = Image.OPEN.get(_OPENED_BY.get(fmt, fmt), (None,))[0]
    if factory is None:
        return False
    if isinstance(factory, type) and issubclass(factory, ImageFile.StubImageFile):  # needs a registered handler
        module = sys.modules.get(factory.__module__)
        return getattr(factory, "_handler", None) is not None or getattr(module, "_handler", None) is not None
    return True


def image_extensions() -> FrozenSet[str]:
    """The extensions (lower case, with the dot) of every format Pillow can decode here."""
    return frozenset(ext for ext, fmt in Image.registered_extensions().items() if _decodable(fmt))


def is_image_name(name: str, extensions: Optional[FrozenSet[str]] = None) -> bool:
    """Whether a file of this name is read as an image (a hidden file never is)."""
    return not name.startswith(".") and os.path.splitext(name)[1].lower() in (extensions or image_extensions())


def is_junk_folder(name: str) -> bool:
    return name.startswith(".") or name in JUNK_FOLDERS


def describe_extensions() -> str:
    common = [e for e in (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".tif", ".tiff", ".gif") if e in image_extensions()]
    return f"{', '.join(common)} or another format Pillow reads"


def listed(names: Sequence[str], n: int = 5) -> str:
    """The first ``n`` names, and how many there are in all when there are more."""
    return ", ".join(map(str, names[:n])) + (f", ... ({len(names)} in all)" if len(names) > n else "")


@dataclass
class Scan:
    """What a scan found under ``root``: ``samples`` (path, label) in timm's order; ``classes`` in label order (empty
    for :func:`scan_images`); the paths, relative to ``root``, of the files that are not images and of the folders
    skipped."""

    root: str
    samples: List[Tuple[str, int]]
    classes: List[str] = field(default_factory=list)
    not_images: List[str] = field(default_factory=list)
    skipped: List[str] = field(default_factory=list)

    @property
    def class_to_idx(self) -> Dict[str, int]:
        return {c: i for i, c in enumerate(self.classes)}

    @property
    def notes(self) -> List[str]:
        """One line for the files that are not images and one for the folders skipped (none when there are none)."""
        notes = []
        if self.not_images:
            notes.append(f"{self.root}: {len(self.not_images)} file(s) are not images and are left out: "
                         f"{listed(self.not_images)} (images: {describe_extensions()})")
        if self.skipped:
            notes.append(f"{self.root}: skipped {len(self.skipped)} hidden or system folder(s), not classes: "
                         f"{listed([s + '/' for s in self.skipped])}")
        return notes


def _raise(error: OSError) -> None:
    raise error


def _walk(root: str) -> Tuple[List[Tuple[Tuple[str, ...], str]], List[str], List[str]]:
    """``(images, not_images, skipped)`` under ``root``: each image as (its folders below ``root``, its path), the
    relative paths of other files and of the folders skipped. Follows links to folders, each folder once; a folder
    that cannot be listed raises its OSError (naming it), rather than dropping its images."""
    extensions = image_extensions()
    images, not_images, skipped, seen = [], [], [], {os.path.realpath(root)}
    for dirpath, dirnames, filenames in os.walk(root, onerror=_raise, followlinks=True):
        rel = os.path.relpath(dirpath, root)
        parts = () if rel == "." else tuple(Path(rel).parts)
        keep = []
        for d in sorted(dirnames):
            real = os.path.realpath(os.path.join(dirpath, d))
            if is_junk_folder(d) or real in seen:
                skipped.append(os.path.join(*parts, d))
            else:
                seen.add(real)
                keep.append(d)
        dirnames[:] = keep
        for f in filenames:
            if is_image_name(f, extensions):
                images.append((parts, os.path.join(dirpath, f)))
            else:
                not_images.append(os.path.join(*parts, f))
    return images, sorted(not_images, key=natural_key), sorted(skipped, key=natural_key)


def no_images_message(folder, not_images: Sequence[str] = (), skipped: Sequence[str] = ()) -> str:
    """What a folder without a single image holds, and what it should hold."""
    found = [*not_images[:3], *(s + "/ (skipped)" for s in skipped[:2])]
    held = f"; found {', '.join(found)}" if found else " (it is empty)"
    return (f"{folder} holds no images ({describe_extensions()}) in class folders{held}; it should hold one "
            f"sub-folder of images per class")


def scan_classes(folder, check_class: Optional[Callable[[str], None]] = None) -> Scan:
    """The images of a ``folder/CLASS/IMAGE`` folder, labelled by the class folders' order (timm's); raises
    :class:`FolderLayoutError` naming what to fix. ``check_class(name)``, when given, is called for every class
    folder before the layout is checked (ImageNet-v2's numbered folders)."""
    root = str(folder)
    if not os.path.isdir(root):
        raise FileNotFoundError(f"no data folder {root}")
    images, not_images, skipped = _walk(root)
    folders = sorted((e.name for e in os.scandir(root) if e.is_dir() and e.name not in skipped), key=natural_key)
    if check_class is not None:
        for name in folders:
            check_class(name)
    if not images:
        raise FolderLayoutError(no_images_message(root, not_images, skipped))
    loose = [os.path.basename(p) for parts, p in images if not parts]
    if loose:
        raise FolderLayoutError(f"{root} holds images directly ({listed(sorted(loose, key=natural_key), 3)}): put "
                                f"each image in its class's folder, {root}/CLASS/IMAGE")
    nested = sorted({os.path.join(root, *parts) for parts, _ in images if len(parts) > 1}, key=natural_key)
    if nested:
        raise FolderLayoutError(f"{nested[0]} is a folder inside a class folder, and its images would be a class of "
                                f"their own to timm ({os.path.basename(nested[0])!r}); keep one level of folders, "
                                f"{root}/CLASS/IMAGE")
    held = {parts[0] for parts, _ in images}
    empty = [c for c in folders if c not in held]
    if empty:
        others = [f for f in not_images if Path(f).parts[0] == empty[0]]
        holds = f" (it holds {listed(others, 3)})" if others else ""
        raise FolderLayoutError(
            f"{root}/{empty[0]} holds no images ({describe_extensions()}){holds}"
            f"{f' (nor do {listed(empty[1:], 3)})' if len(empty) > 1 else ''}: add its images or remove the folder; "
            f"every class folder needs at least one (to use a subset of classes, leave the others' folders out)")
    classes = sorted(held, key=natural_key)
    index = {c: i for i, c in enumerate(classes)}
    samples = sorted(((p, index[parts[0]]) for parts, p in images), key=lambda s: natural_key(s[0]))
    return Scan(root, samples, classes, not_images, skipped)


def scan_images(folder) -> Scan:
    """Every image under ``folder`` at any depth (ImageNet-ReaL's val images, flat or in synset folders), labelled 0,
    in timm's order of their paths; hidden and system folders skipped, other files named."""
    root = str(folder)
    images, not_images, skipped = _walk(root)
    samples = sorted(((p, 0) for _, p in images), key=lambda s: natural_key(s[0]))
    return Scan(root, samples, [], not_images, skipped)


class FolderReader(Reader):
    """A :class:`Scan` as a timm reader: item ``i`` is ``(open file, label)``."""

    def __init__(self, scan: Scan):
        super().__init__()
        self.scan = scan
        self.root = scan.root
        self.samples = list(scan.samples)
        self.class_to_idx = scan.class_to_idx

    def __getitem__(self, index: int):
        path, target = self.samples[index]
        return open(path, "rb"), target

    def __len__(self) -> int:
        return len(self.samples)

    def _filename(self, index: int, basename: bool = False, absolute: bool = False) -> str:
        filename = self.samples[index][0]
        if basename:
            return os.path.basename(filename)
        return filename if absolute else os.path.relpath(filename, self.root)


# -- reading ---------------------------------------------------------------------------------------------------
_TRANSPARENT = {"LA", "La", "PA", "RGBA", "RGBa"}


def _grey(levels: np.ndarray) -> Image.Image:
    return Image.fromarray(levels.astype(np.uint8), "L")


def _sixteen_bit(img: Image.Image) -> Image.Image:
    a = np.asarray(img).astype(np.int64)
    lo, hi = (int(a.min()), int(a.max())) if a.size else (0, 0)
    if lo < 0 or hi > 65535:
        raise ValueError(f"a mode {img.mode} image with levels from {lo} to {hi}: read as 16-bit levels (0 to 65535), "
                         f"these have no known scale")
    return _grey((a * 255 + 32767) // 65535)  # round(a / 257): 257 v -> v


def _float(img: Image.Image) -> Image.Image:
    a = np.asarray(img).astype(np.float64)
    if a.size and not (np.isfinite(a).all() and a.min() >= 0.0 and a.max() <= 1.0):
        raise ValueError(f"a mode F image with values from {np.nanmin(a):g} to {np.nanmax(a):g}: read as intensities "
                         f"in [0, 1], these are outside")
    return _grey(np.floor(a * 255.0 + 0.5))


def _on_white(img: Image.Image) -> Image.Image:
    rgba = img.convert("LA").convert("RGBA") if img.mode == "La" else img.convert("RGBA")
    return Image.alpha_composite(Image.new("RGBA", img.size, (255, 255, 255, 255)), rgba).convert("RGB")


def to_rgb(img: Image.Image) -> Image.Image:
    """``img`` decoded as RGB by the rules of this module's docstring (raises ValueError where a mode's levels have
    no known scale)."""
    if img.mode == "I" or img.mode.startswith("I;16"):
        return _sixteen_bit(img).convert("RGB")
    if img.mode == "F":
        return _float(img).convert("RGB")
    if img.mode in _TRANSPARENT or "transparency" in img.info:
        return _on_white(img)
    return img.convert("RGB")  # convert() decodes, so a truncated file fails here


def read_image(source) -> Image.Image:
    """The image in ``source`` (a path or an open binary file) as RGB (:func:`to_rgb`)."""
    with Image.open(source) as img:
        return to_rgb(img)
