"""The recipe's augmentation as timm builds it, made to run the same on every Pillow, and named when it fails.

timm's RandAugment / AutoAugment / AugMix ops call ``PIL.ImageOps.posterize`` with however many bits the magnitude
maps to. ``PosterizeIncreasing`` (the ``inc1`` in the Table 6 recipe ``rand-m9-mstd0.5-inc1``) keeps
``4 - int(m / 10 * 4)`` bits, 0 at magnitude 10; ``Posterize`` keeps ``int(m / 10 * 4)``, 0 below magnitude 2.5.
With ``mstd0.5`` a magnitude of 10 (the clip) is drawn for about 2.3% of the ops at m9. Pillow < 13 turned 0 (or
fewer) bits into a black image (its mask ``~(2 ** (8 - bits) - 1)`` clears every bit); Pillow 13 raises
``ValueError: bits must be between or equal to 1 and 8``, about once in 900 training images, so no ImageNet
epoch would end. :func:`portable` points those ops at :func:`posterize`, which gives Pillow < 13's
black image for bits <= 0 and Pillow's own result otherwise: the same recipe, the same distribution, on every
Pillow the project allows.
"""
import sys
import traceback
from typing import Any, Callable, Iterator

from PIL import Image, ImageOps
from timm.data import auto_augment

from ..errors import Stopped


def posterize(img: Image.Image, bits_to_keep: int, **_) -> Image.Image:
    """timm's posterize op with Pillow < 13's result at bits <= 0: every channel value 0 (a black image)."""
    if bits_to_keep >= 8:
        return img
    if bits_to_keep <= 0:
        return img.point([0] * 256 * len(img.getbands()))
    return ImageOps.posterize(img, bits_to_keep)


def _children(transform: Any) -> Iterator[Any]:
    """The transforms inside a container: torchvision's Compose (``transforms``), timm's RandAugment and AugMix
    (``ops``), timm's AutoAugment (``policy``, a list of sub-policies)."""
    for attr in ("transforms", "ops", "policy"):
        items = getattr(transform, attr, None)
        if isinstance(items, (list, tuple)):
            for item in items:
                if isinstance(item, (list, tuple)):
                    yield from item
                else:
                    yield item


def portable(transform: Any) -> Any:
    """``transform`` with every timm posterize op routed through :func:`posterize` (in place; returned)."""
    if isinstance(transform, auto_augment.AugmentOp):
        if transform.aug_fn is auto_augment.posterize:
            transform.aug_fn = posterize
        return transform
    for child in _children(transform):
        portable(child)
    return transform


class TransformError(Stopped, RuntimeError):
    """An image's transform raised: a bug in the pipeline, not a bad image, so the run stops.

    :attr:`line` is the one line to show: the image, the transform (with the magnitude it drew) and the exception.
    Raised in a loader worker, the DataLoader re-raises it in the main process with the worker's traceback around
    that line; :attr:`line` recovers it.
    """

    def __init__(self, message: str):
        super().__init__(message)
        marker = f"{TransformError.__name__}: "
        last = [ln for ln in str(message).strip().splitlines() if ln.strip()][-1:] or [""]
        self.line = last[0].split(marker, 1)[1] if marker in last[0] else str(message)


def _culprit(tb) -> str:
    """The innermost transform object on the traceback (timm's AugmentOp with the magnitude and arguments it drew,
    or any other transform class), as text."""
    found = ""
    for frame, _ in traceback.walk_tb(tb):
        owner = frame.f_locals.get("self")
        if owner is None or not callable(owner) or frame.f_code.co_name not in ("__call__", "forward"):
            continue
        found = repr(owner).splitlines()[0]
        if isinstance(owner, auto_augment.AugmentOp) and "magnitude" in frame.f_locals:
            drawn = frame.f_locals["magnitude"]
            found = f"{found} at magnitude {drawn:.3g}"
    return found or "the transform"


def apply_transform(transform: Callable, img: Image.Image, path: str) -> Any:
    """``transform(img)``; an exception becomes a :class:`TransformError` naming the image, the transform and the
    exception."""
    try:
        return transform(img)
    except Exception as e:
        culprit = _culprit(sys.exc_info()[2])
        raise TransformError(f"transform failed on {path}: {culprit} raised {type(e).__name__}: {e}") from e
