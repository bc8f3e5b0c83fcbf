"""Optional dependencies, each brought by one extra of ``pip install "lipsformer[...]"`` (pyproject.toml), and the
experiment trackers ``log_with`` names, with what each needs installed (the config checks the names against
:data:`TRACKERS`; :mod:`lipsformer.engine.trackers` starts them)."""
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


# Accelerate's trackers (accelerate.utils.LoggerType, less 'all'): the module each imports, and what installs it (an
# extra of ours, or the package itself).
TRACKERS = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "lipsformer[wandb]"),
    "mlflow": ("mlflow", "lipsformer[mlflow]"),
    "aim": ("aim", "aim"),
    "comet_ml": ("comet_ml", "comet-ml"),
    "clearml": ("clearml", "clearml"),
    "dvclive": ("dvclive", "dvclive"),
    "swanlab": ("swanlab", "swanlab"),
    "trackio": ("trackio", "trackio"),
}
