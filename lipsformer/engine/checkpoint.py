"""Atomic, rotating, verified training checkpoints on top of Accelerate's save_state / load_state, and the
weight files a run writes beside them (``last`` / ``best`` safetensors, the ``keep_best`` best in ``best/``).

Each checkpoint folder carries ``manifest.json``: the size and sha256 of every file, written before the
folder is renamed into place. Resuming verifies it, and reads every file Accelerate would unpickle without
running code, so a damaged or unsafe checkpoint is named instead of crashing (or being trusted) halfway.
"""
import json
import logging
import math
import os
import shutil
from pathlib import Path
from typing import Callable, ContextManager, List, Optional, Tuple

import torch
from accelerate.utils import load as accelerate_load
from accelerate.utils.other import TORCH_SAFE_GLOBALS  # what Accelerate's load allows: NumPy's arrays
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..layers.attlip import form_mismatch
from ..run_folder import MANIFEST, RunFolder
from ..weights import CheckpointError, input_size_metadata, load_pickled, sha256_of
from ..writer import WriteFailed, remove, replacing
from .processes import agree_on_outcome

_logger = logging.getLogger(__name__)


SaveFailed = WriteFailed  # a checkpoint or weight file could not be written (disk full, ...): exit 3


class TrainState:
    """Where the run is: epoch, optimizer step, batches consumed in this epoch, and bookkeeping.

    ``batch_in_epoch`` counts each process's batches of ``batch_size`` on ``processes`` processes: the run that
    wrote the state. A checkpoint that does not record them keeps the values the loading run gives.
    """

    def __init__(self, processes: int = 1, batch_size: int = 1, global_batch: int = 1, updates_per_epoch: int = 0):
        self.epoch = 0
        self.step = 0
        self.batch_in_epoch = 0
        self.best_top1 = -1.0
        self.best_k = []  # [epoch, top1] of the weights kept in best/ (keep_best), highest first (keep_best below)
        self.skipped_steps = 0
        self.processes = processes
        self.batch_size = batch_size
        self.global_batch = global_batch
        self.updates_per_epoch = updates_per_epoch  # optimizer steps an epoch takes in that geometry
        self.epoch_sums = {}  # the current epoch's sums so far (metrics.py's EpochMeter.totals), for a mid-epoch resume
        # the bound keeping's last projection (train.py's _Run.keep_bound: step, bound, the margin loss's L, the
        # settings), restored on resume rather than projected again; None: none yet, or a checkpoint that records none
        self.kept = None

    @property
    def samples_in_epoch(self) -> int:
        """Samples of this epoch consumed over all processes: the position whatever the number of processes.
        Accelerate's sharded batch sampler hands out the seeded permutation's batches in turn, so the first
        ``samples_in_epoch`` samples of the epoch's permutation are the ones used."""
        return self.batch_in_epoch * self.batch_size * self.processes

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


def write_manifest(folder: Path) -> None:
    """Record the size and sha256 of every file under ``folder`` in ``folder/manifest.json``."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)
    entries = {str(p.relative_to(folder)): dict(bytes=p.stat().st_size, sha256=sha256_of(p)) for p in files}
    with open(folder / MANIFEST, "w") as f:
        json.dump(dict(files=entries), f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def verify_manifest(folder: Path) -> None:
    """Raise a CheckpointError naming the first file of ``folder`` that is missing, truncated or altered."""
    try:
        entries = json.loads((folder / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        raise CheckpointError(f"{folder / MANIFEST} is missing") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{folder / MANIFEST} is unreadable ({e})") from None
    for name, entry in entries.items():
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"{path} is missing")
        if path.stat().st_size != entry["bytes"]:
            raise CheckpointError(f"{path} has {path.stat().st_size} bytes, the manifest says {entry['bytes']} "
                                  f"(truncated or overwritten)")
        if sha256_of(path) != entry["sha256"]:
            raise CheckpointError(f"{path} does not match its sha256 in the manifest (damaged or altered)")


def check_loadable(folder: Path, model: torch.nn.Module) -> None:
    """Read what ``accelerator.load_state`` would read, safely: the model weights' names and shapes against
    ``model``, and every pickle with weights-only loading (Accelerate unpickles its custom states in full, and
    skips unreadable random states silently). Raises a CheckpointError naming the file."""
    weights = folder / "model.safetensors"
    if weights.is_file():  # FSDP writes a sharded folder instead, checked by its own loader
        try:
            with safe_open(str(weights), "pt") as f:
                saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"cannot read {weights}: truncated or not safetensors ({str(e)[:200]})") from None
        ours = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        wrong = sorted(set(saved) ^ set(ours)) + [f"{k} {saved[k]} vs {ours[k]}" for k in sorted(set(saved) & set(ours))
                                                   if saved[k] != ours[k]]
        form = form_mismatch(saved, ours)
        if form:
            raise CheckpointError(f"{weights} does not fit this run's model: {form}")
        if wrong:  # resuming needs every tensor as it was (fit_state_dict would let a new classifier through)
            raise CheckpointError(f"{weights} does not fit this run's model: {len(wrong)} tensors differ in name or "
                                  f"shape, e.g. {', '.join(wrong[:3])}")
    for path in sorted(folder.glob("*.pkl")) + sorted(folder.glob("*.bin")):
        load_pickled(path, TORCH_SAFE_GLOBALS, load=accelerate_load, damaged="truncated or damaged")


def verify_checkpoint(folder: Path, model: torch.nn.Module) -> None:
    """The manifest's hashes, then :func:`check_loadable`; a checkpoint without a manifest (written before
    manifests existed) is only checked for loadability."""
    if (folder / MANIFEST).is_file():
        verify_manifest(folder)
    else:
        _logger.warning(f"{folder} has no {MANIFEST}: its files cannot be verified against their hashes")
    check_loadable(folder, model)


def intact_checkpoint(output_dir, model: torch.nn.Module) -> Tuple[Optional[Path], List[Tuple[Path, str]]]:
    """The newest checkpoint of a run that passes :func:`verify_checkpoint`, and ``(folder, what was wrong)`` for
    each newer one that did not. ``(None, [...])`` when there are checkpoints but none is intact."""
    problems = []
    for folder in reversed(RunFolder(output_dir).finished_checkpoints()):
        try:
            verify_checkpoint(folder, model)
        except CheckpointError as e:
            problems.append((folder, str(e)))
            continue
        return folder, problems
    return None, problems


def save_checkpoint(accelerator, model, output_dir, state: TrainState, keep_last: int) -> Path:
    """Write to ``.tmp-step_N``, add the manifest, then rename to ``step_N`` (:func:`lipsformer.writer.replacing`),
    so a crash never leaves a partial checkpoint that looks complete; keep the newest ``keep_last``. A failed write
    (disk full) removes the partial folder, leaves the earlier checkpoints as they were, and raises WriteFailed; the
    processes agree on the outcome where they would wait for each other
    (:func:`~lipsformer.engine.processes.agree_on_outcome`), so a write that fails on one stops every one."""
    folder = RunFolder(output_dir)
    final = folder.checkpoint(state.step)
    assert_finite(model.named_parameters(), final)
    if final.exists():
        return final
    earlier = folder.finished_checkpoints()
    note = (f"the partial folder was removed and {earlier[-1] if earlier else 'no earlier checkpoint'} is intact: "
            f"free space and continue with --resume auto")
    agreed, error = False, None
    try:
        with replacing(final, note, f"checkpoint {final}", main=accelerator.is_main_process) as tmp:
            accelerator.wait_for_everyone()  # the main process has cleared a stale temporary
            try:
                accelerator.save_state(str(tmp))
            except Exception as e:  # noqa: BLE001 - every process learns of it before any waits again
                error = e
            agree_on_outcome(accelerator, error, f"checkpoint {final}")
            agreed = True
            if accelerator.is_main_process:
                write_manifest(tmp)
        if accelerator.is_main_process:
            for old in folder.finished_checkpoints()[:-keep_last]:
                shutil.rmtree(old)
    except Exception as e:
        if not agreed:  # every process raises here
            raise
        error = e  # the main process's manifest, rename or pruning: the others learn of it below
    agree_on_outcome(accelerator, error, f"checkpoint {final}")
    return final


def save_weights(accelerator, state_dict: dict, path: Path, cfg) -> None:
    """Weights only, as safetensors (``get_state_dict`` gathers them under FSDP / DeepSpeed) whose metadata records
    the input size they were made at, ``(in_chans, img_size, img_size)`` of the run's config ``cfg``
    (:func:`~lipsformer.sources.recorded_input_size` reads it where no run folder is beside the file), written
    beside the target and renamed over it: a failed write leaves the previous file as it was."""
    if accelerator.is_main_process:
        tensors = {k: v.detach().cpu().contiguous() for k, v in state_dict.items()}
        assert_finite(tensors.items(), path)
        with replacing(path) as tmp:
            save_file(tensors, str(tmp), metadata=input_size_metadata(
                (cfg.model_kwargs.get("in_chans", 3), cfg.img_size, cfg.img_size)))


def keep_best(accelerator, model, weights: Callable[[], ContextManager], folder: RunFolder, state: TrainState,
              top1: float, cfg) -> bool:
    """Keep the epoch's weights that scored ``top1`` (the model holds them inside ``weights()``: the EMA applied,
    or its own) as ``best.safetensors`` when they beat every earlier epoch, and as
    ``best/epoch_E_top1_S.safetensors`` while they rank among the ``cfg.keep_best`` highest scores (an earlier epoch
    first among equal ones, as best.safetensors keeps the first; 0 keeps none). The ranking is part of the
    checkpointed state (``state.best_k``), and every file in ``best/`` it does not name is removed (one that dropped
    out, or one written after the checkpoint a run resumed from), so a resumed run keeps the files the uninterrupted
    one keeps; a file removed for another reason than the new epoch's place (written after that checkpoint, or cut by
    a ``keep_best`` lowered on resume) is said in a warning naming it. Every process calls it (the weights are
    gathered under FSDP); the main one writes. Returns whether ``best.safetensors`` was written. A NaN ``top1`` (no
    image scored) ranks nowhere."""
    if not math.isfinite(top1):
        return False
    epoch, better = state.epoch, top1 > state.best_top1
    ranked = sorted([*state.best_k, [epoch, top1]], key=lambda e: (-e[1], e[0]))[:cfg.keep_best]
    kept = [epoch, top1] in ranked
    if better or kept:
        with weights():
            tensors = accelerator.get_state_dict(model)
            if better:
                save_weights(accelerator, tensors, folder.best, cfg)
            if kept:
                save_weights(accelerator, tensors, folder.best_kept(epoch, top1), cfg)
    before = {folder.best_kept(e, s): [e, s] for e, s in state.best_k}
    lowered = len(state.best_k) > cfg.keep_best  # a resume lowered keep_best: the earlier ranking is cut
    state.best_top1, state.best_k = max(state.best_top1, top1), ranked
    if accelerator.is_main_process:
        named = {folder.best_kept(e, s) for e, s in ranked}
        for path in folder.kept_files():
            if path not in named:
                remove(path)
                if path not in before:  # not in the ranking the run resumed with: say so, it was no choice of ours
                    _logger.warning(f"keep_best: removed {path}, which the ranking of the checkpoint this run "
                                    f"resumed from does not name (written after that checkpoint)")
                elif lowered:
                    _logger.warning(f"keep_best is {cfg.keep_best}, lower than the {len(before)} best the run kept "
                                    f"before: removed {path}")
    return better
