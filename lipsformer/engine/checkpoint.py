"""Atomic, rotating training checkpoints on top of Accelerate's save_state / load_state."""
import os
import shutil
from pathlib import Path
from typing import Optional

import torch

from .run_folder import RunFolder


class TrainState:
    """Where the run is: epoch, optimizer step, batches consumed in this epoch, and bookkeeping."""

    def __init__(self):
        self.epoch = 0
        self.step = 0
        self.batch_in_epoch = 0
        self.best_top1 = -1.0
        self.skipped_steps = 0

    def state_dict(self) -> dict:
        return dict(vars(self))

    def load_state_dict(self, state: dict) -> None:
        vars(self).update(state)


def latest_checkpoint(output_dir) -> Optional[Path]:
    """The newest complete checkpoint; half-written ones (``.tmp-*``) are ignored."""
    done = RunFolder(output_dir).finished_checkpoints()
    return done[-1] if done else None


def assert_finite(named_tensors, target) -> None:
    """Refuse to write non-finite weights to ``target``, naming the first offending tensors."""
    bad = [n for n, t in named_tensors if t.is_floating_point() and not torch.isfinite(t).all()]
    if bad:
        raise FloatingPointError(f"refusing to write non-finite weights to {target}: {', '.join(bad[:5])}")


def save_checkpoint(accelerator, model, output_dir, state: TrainState, keep_last: int) -> Path:
    """Write to ``.tmp-step_N`` then rename to ``step_N``, so a crash never leaves a partial checkpoint
    that looks complete; keep the newest ``keep_last``."""
    folder = RunFolder(output_dir)
    final = folder.checkpoint(state.step)
    assert_finite(model.named_parameters(), final)
    if final.exists():
        return final
    tmp = folder.temporary(final)
    if accelerator.is_main_process and tmp.exists():
        shutil.rmtree(tmp)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        os.replace(tmp, final)
        for old in folder.finished_checkpoints()[:-keep_last]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final
