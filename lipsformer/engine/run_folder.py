"""The layout of a train.py output folder, in one place.

The training loop writes it, the checkpoint code rotates checkpoints inside it, and ``lipsformer.weights``
reads finished runs from it::

    OUTPUT_DIR/
      config.yaml            the TrainConfig the run used
      metrics.jsonl          one JSON row per log event (kind: train | epoch)
      curves.png             loss, accuracy and |alpha| curves, drawn at the end
      last.safetensors       weights after the last epoch
      last_ema.safetensors   their EMA (when ema_decay is set)
      best.safetensors       the best of model / EMA by val top-1
      checkpoints/step_NNNNNNNNN/   Accelerate save_state folders, each with manifest.json
      lipsformer/            TensorBoard events
"""
import re
from pathlib import Path
from typing import List, Optional

CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
CURVES = "curves.png"
LAST = "last.safetensors"
LAST_EMA = "last_ema.safetensors"
BEST = "best.safetensors"
CHECKPOINTS = "checkpoints"
MANIFEST = "manifest.json"  # inside each checkpoint folder
TMP_PREFIX = ".tmp-"  # a checkpoint being written; never taken for a finished one

_CHECKPOINT = re.compile(r"^step_(\d{9})$")


class RunFolder:
    """Paths of one run's output folder (see the module docstring for the layout)."""

    def __init__(self, root):
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"RunFolder({str(self.root)!r})"

    @property
    def config(self) -> Path:
        return self.root / CONFIG

    @property
    def metrics(self) -> Path:
        return self.root / METRICS

    @property
    def curves(self) -> Path:
        return self.root / CURVES

    @property
    def best(self) -> Path:
        return self.root / BEST

    def weights(self, ema: bool = False) -> Path:
        """The final weights (``last.safetensors``), or their EMA."""
        return self.root / (LAST_EMA if ema else LAST)

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINTS

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / f"step_{step:09d}"

    @staticmethod
    def temporary(final: Path) -> Path:
        """Where ``final`` is written before its rename."""
        return final.with_name(TMP_PREFIX + final.name)

    def finished_checkpoints(self) -> List[Path]:
        """Renamed (complete) checkpoint folders, oldest first; half-written ``.tmp-*`` ones are left out."""
        if not self.checkpoints.is_dir():
            return []
        return sorted(p for p in self.checkpoints.iterdir() if p.is_dir() and _CHECKPOINT.match(p.name))

    def is_run(self) -> bool:
        return self.config.is_file()


def checkpoint_step(path) -> Optional[int]:
    """The optimizer step a checkpoint folder was written at, or None when the name is not a checkpoint's."""
    match = _CHECKPOINT.match(Path(path).name)
    return int(match.group(1)) if match else None
