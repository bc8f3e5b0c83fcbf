"""The layout of a train.py output folder, in one place.

The training loop writes it, the checkpoint code rotates checkpoints inside it, and ``lipsformer.weights``
reads finished runs from it::

    OUTPUT_DIR/
      config.yaml            the TrainConfig the run used
      classes.json           the train folder's class names in label order (lipsformer.data.classes)
      metrics.jsonl          one JSON row per log event (kind: train | epoch)
      curves.png             loss, accuracy and |alpha| curves, drawn at the end
      last.safetensors       weights after the last epoch
      last_ema.safetensors   their EMA (when ema_decay is set)
      best.safetensors       the best of model / EMA by val top-1
      checkpoints/step_NNNNNNNNN/   Accelerate save_state folders, each with manifest.json
      checkpoints/.damaged-step_N/  checkpoints --resume auto skipped, set aside so the run can write them again
      lipsformer/            TensorBoard events

Every file is written through :mod:`lipsformer.writer` (a temporary name, then a rename).
"""
import json
import re
from pathlib import Path
from typing import List, Optional

from ..errors import Mistake
from ..writer import TMP_PREFIX, check_target, replacing, to_json
from .config import ConfigError

CONFIG = "config.yaml"
CLASSES = "classes.json"
METRICS = "metrics.jsonl"
CURVES = "curves.png"
LAST = "last.safetensors"
LAST_EMA = "last_ema.safetensors"
BEST = "best.safetensors"
CHECKPOINTS = "checkpoints"
MANIFEST = "manifest.json"  # inside each checkpoint folder
DAMAGED_PREFIX = ".damaged-"  # a checkpoint that failed verification, set aside (kept for inspection)

_CHECKPOINT = re.compile(r"^step_(\d{9})$")


def read_metrics(path: Path) -> List[dict]:
    """The rows of a ``metrics.jsonl`` file in order; none when it does not exist. A last row cut short (the machine
    went down in the middle of an append) is left out."""
    path = Path(path)
    if not path.exists():
        return []
    text = path.read_text()
    lines = text.splitlines() if text.endswith("\n") else text.splitlines()[:-1]
    return [json.loads(line) for line in lines if line.strip()]


def check_output(folder: "RunFolder") -> None:
    """A ConfigError unless ``output_dir`` is (or can become) a folder this user can write in
    (:func:`~lipsformer.writer.check_target`)."""
    try:
        check_target(folder.root, folder=True)
    except Mistake as e:
        raise ConfigError(f"output_dir {e}; choose another output_dir") from None


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
    def classes(self) -> Path:
        return self.root / CLASSES

    @property
    def best(self) -> Path:
        return self.root / BEST

    def read_metrics(self) -> List[dict]:
        """The rows of ``metrics.jsonl`` in order (none when the run wrote none, e.g. it stopped at once)."""
        return read_metrics(self.metrics)

    def keep_metrics_until(self, step: int, epochs: int) -> None:
        """Drop the rows a resumed run logs again: train rows after optimizer ``step``, epoch rows after epoch
        ``epochs`` (what the checkpoint resumed from had finished), and a last row cut short. Rewritten beside the
        file and renamed."""
        rows = self.read_metrics()
        kept = [r for r in rows if (r["epoch"] <= epochs if r["kind"] == "epoch" else r["step"] <= step)]
        if len(kept) == len(rows) and (not rows or self.metrics.read_bytes().endswith(b"\n")):
            return
        with replacing(self.metrics) as tmp:
            tmp.write_text("".join(to_json(r) + "\n" for r in kept))

    def weights(self, ema: bool = False) -> Path:
        """The final weights (``last.safetensors``), or their EMA."""
        return self.root / (LAST_EMA if ema else LAST)

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINTS

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / f"step_{step:09d}"

    @staticmethod
    def set_aside(damaged: Path) -> Path:
        """A name beside ``damaged`` for a checkpoint that failed verification; no earlier one is overwritten."""
        n, target = 0, damaged.with_name(DAMAGED_PREFIX + damaged.name)
        while target.exists():
            n += 1
            target = damaged.with_name(f"{DAMAGED_PREFIX}{damaged.name}.{n}")
        return target

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
