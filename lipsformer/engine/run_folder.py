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
"""
import json
import os
import re
from pathlib import Path
from typing import List, Optional

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
TMP_PREFIX = ".tmp-"  # a checkpoint being written; never taken for a finished one
DAMAGED_PREFIX = ".damaged-"  # a checkpoint that failed verification, set aside (kept for inspection)

_CHECKPOINT = re.compile(r"^step_(\d{9})$")


def umask() -> int:
    """The process's file-mode creation mask (Linux's /proc/self/status states it; elsewhere read by setting it and
    setting it back)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def readable_as_outputs(path: Path) -> None:
    """Give ``path`` (a file, or every file under a folder) the mode ``open()`` gives any other output, 0666 less the
    umask (0644 under umask 022): safetensors writes through a temporary file of mode 0600, which a colleague on a
    shared file system could not read."""
    path = Path(path)
    mode = 0o666 & ~umask()
    for file in [path] if path.is_file() else (p for p in path.rglob("*") if p.is_file()):
        if file.stat().st_mode & 0o777 != mode:
            os.chmod(file, mode)


def read_metrics(path: Path) -> List[dict]:
    """The rows of a ``metrics.jsonl`` file in order; none when it does not exist."""
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def check_output(folder: "RunFolder") -> None:
    """A ConfigError unless ``output_dir`` is (or can become) a folder: it and every parent that exists are folders."""
    for path in (folder.root, *folder.root.parents):
        if path.exists():
            if not path.is_dir():
                raise ConfigError(f"output_dir {folder.root}: {path} is a file, not a folder; choose another "
                                  f"output_dir")
            return


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
        ``epochs`` (what the checkpoint resumed from had finished). Rewritten beside the file and renamed."""
        rows = self.read_metrics()
        kept = [r for r in rows if (r["epoch"] <= epochs if r["kind"] == "epoch" else r["step"] <= step)]
        if len(kept) == len(rows):
            return
        tmp = self.temporary(self.metrics)
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, self.metrics)

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
