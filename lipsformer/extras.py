"""Optional dependencies, each brought by one extra of ``pip install "lipsformer[...]"`` (pyproject.toml)."""
import importlib
from types import ModuleType


class MissingExtra(ModuleNotFoundError):
    """An optional dependency is not installed; the message is one line naming the extra that brings it."""


def require(module: str, extra: str, purpose: str) -> ModuleType:
    """``import module``, or :class:`MissingExtra` saying that ``purpose`` needs ``pip install "lipsformer[extra]"``."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingExtra(f"{purpose} needs {module}, which is not installed ({e}): "
                           f'pip install "lipsformer[{extra}]"') from None
