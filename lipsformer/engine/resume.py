"""The resume policy: which checkpoint a run continues from (a path, a run folder, ``--resume auto`` and its
damaged checkpoints), what a resume refuses (a changed schedule or global batch), a run that had already finished,
and the place in the epoch carried over to another number of processes."""
import logging
import os
import pickle
from pathlib import Path
from typing import Callable, List, Optional, Tuple

from accelerate import Accelerator
from safetensors import SafetensorError
from torch.utils.data import IterableDataset

from ..config import BUILDS_MODEL, RESTORED_ON_RESUME, TrainConfig, check_type
from ..errors import ConfigError
from ..run_folder import MANIFEST, RunFolder, checkpoint_step
from ..settings import read_yaml
from ..weights import CheckpointError
from .checkpoint import TrainState, intact_checkpoint, latest_checkpoint, verify_checkpoint
from .trackers import read_record

_logger = logging.getLogger(__name__)


class RunFinished(Exception):
    """The checkpoint a run resumes from ends it: nothing to do, nothing written. ``summary`` is what
    :func:`lipsformer.engine.train.train` returns for it (``finished_before`` set)."""

    def __init__(self, summary: dict):
        super().__init__(f"{summary['checkpoint']} ends the run: nothing to do")
        self.summary = summary


def resume_point(folder: RunFolder, resume: Optional[str]) -> Optional[Path]:
    """The checkpoint to resume from (``resume="auto"``: decided once the model exists, see :func:`verified`).
    ``resume`` may name a run folder: its newest checkpoint (the output folder's own: as ``auto``)."""
    if resume == "auto":
        found = latest_checkpoint(folder.root)
        if found is None:
            why = "does not exist" if not folder.root.exists() else "holds no checkpoint"
            _logger.warning(f"--resume auto: {folder.root} {why}; starting a new run there")
        return found
    if resume:
        path = Path(resume)
        if not path.is_dir():
            what = " is a file, not a folder" if path.is_file() else ": no such folder"
            hint = f" (to start a new run from a weight file: --set init_checkpoint={resume})" if path.is_file() else ""
            raise FileNotFoundError(f"--resume {resume}{what}; pass a checkpoint folder (RUN/checkpoints/step_N), a "
                                    f"run folder, or auto{hint}")
        if RunFolder(path).is_run() or RunFolder(path).checkpoints.is_dir():  # a run folder: its newest checkpoint
            found = latest_checkpoint(path)
            if found is None:
                raise FileNotFoundError(f"--resume {resume}: that run folder holds no checkpoint "
                                        f"({RunFolder(path).checkpoints} is empty or missing)")
            return found
        if checkpoint_step(path) is None and not (path / MANIFEST).is_file():
            raise FileNotFoundError(f"--resume {resume}: not a checkpoint folder (RUN/checkpoints/step_N) nor a run "
                                    f"folder (with {RunFolder(path).config.name})")
        return path
    if latest_checkpoint(folder.root) is not None:
        raise ConfigError(f"{folder.root} already holds checkpoints; pass --resume auto to continue that run, "
                          f"or choose another output_dir")
    return None


def check_resumable(cfg: TrainConfig, resume_from: Optional[Path]) -> None:
    """Refuse a resume whose config changes what the checkpoint restores (the optimizer's hyperparameters, the lr
    schedule): the checkpoint's values would win silently. Compared with the run's ``config.yaml``. The run's rows
    (``metrics.jsonl``) and tracker runs (``trackers.json``), which a resume continues, are read here, before
    anything is written: one edited into another shape is a SettingError naming the file."""
    if resume_from is None:
        return
    folder = RunFolder(cfg.output_dir)
    folder.read_metrics()
    if cfg.log_with:
        read_record(folder.tracker_runs)
    saved_config = RunFolder(resume_from.parent.parent).config
    if not saved_config.is_file():
        return
    saved = read_yaml(saved_config) or {}
    for key in BUILDS_MODEL:  # the checkpoint holds that model: another one cannot continue it
        if key in saved and saved[key] != getattr(cfg, key):
            raise ConfigError(
                f"--resume: {key} is {getattr(cfg, key)!r} here but {saved[key]!r} in {saved_config}; a resume "
                f"continues that run's model. Resume with the run's own value, or start a new run from its weights "
                f"with init_checkpoint: {saved_config.parent}")
    for key in RESTORED_ON_RESUME:
        if key not in saved:
            continue
        try:
            before = check_type(key, saved[key])
        except ConfigError:
            continue
        if before != getattr(cfg, key):
            raise ConfigError(
                f"--resume: {key} is {getattr(cfg, key)!r} here but {before!r} in {saved_config}; the checkpoint "
                f"restores the optimizer and the lr schedule as they were set up over that run's {key}, so the new "
                f"value would not act (lr would stay where the old schedule is). Resume with the run's own value, or "
                f"start a new run from its weights with init_checkpoint: {saved_config.parent} (fresh optimizer and "
                f"schedule)")


def verified(folder: RunFolder, resume: Optional[str], resume_from: Optional[Path], model,
             cfg: Optional[TrainConfig] = None) -> Tuple[Optional[Path], List[Tuple[Path, str]]]:
    """``resume_from`` once verified; with ``--resume auto`` the newest intact checkpoint, and ``(folder, what was
    wrong)`` for each newer one (:func:`begin`, which sets them aside once the run holds the folder). When the
    checkpoints do not fit the model because ``cfg`` builds another one than the run's ``config.yaml`` (a changed
    ``model_kwargs`` key, ``img_size``), the settings that differ are named (:func:`changed_model`), not the
    checkpoints as damaged."""
    if resume_from is None:
        return None, []
    if resume != "auto":
        try:
            verify_checkpoint(resume_from, model)
        except CheckpointError as e:
            changed_model(cfg, resume_from, [str(e)])
            raise
        return resume_from, []
    intact, problems = intact_checkpoint(folder.root, model)
    if intact is None:
        changed_model(cfg, resume_from, [why for _, why in problems])
        raise CheckpointError(f"--resume auto: no intact checkpoint in {folder.checkpoints}: "
                              + "; ".join(f"{damaged.name}: {why}" for damaged, why in problems))
    return intact, problems


MODEL_SETTINGS = ("img_size",)  # beside model_kwargs: settings that build the model (model, num_classes: BUILDS_MODEL)


def changed_model(cfg: Optional[TrainConfig], checkpoint: Path, problems: List[str]) -> None:
    """A ConfigError naming the settings that build the model and differ from the run's ``config.yaml``, when
    ``problems`` (what verifying the checkpoints found) include weights that do not fit the model: the first cause,
    where "damaged" would send the user after the files. Nothing when the model's settings are the run's."""
    saved_config = RunFolder(checkpoint.parent.parent).config
    if cfg is None or not saved_config.is_file() or not any("does not fit this run's model" in p for p in problems):
        return
    saved = read_yaml(saved_config) or {}
    ours, theirs = dict(cfg.model_kwargs or {}), dict(saved.get("model_kwargs") or {})
    differ = [f"model_kwargs.{k} is {ours.get(k, '(unset)')!r} here but {theirs.get(k, '(unset)')!r}"
              for k in sorted(set(ours) | set(theirs), key=str) if ours.get(k) != theirs.get(k)]
    differ += [f"{k} is {getattr(cfg, k)!r} here but {saved[k]!r}" for k in MODEL_SETTINGS
               if k in saved and saved[k] != getattr(cfg, k)]
    if differ:
        raise ConfigError(f"--resume: {'; '.join(differ)} in {saved_config}, so the model built here does not fit "
                          f"the run's checkpoints ({problems[0]}). Resume with the run's own values, or start a new "
                          f"run from its weights with init_checkpoint: {saved_config.parent}")


def begin(folder: RunFolder, resume_from: Optional[Path], damaged: List[Tuple[Path, str]], state: TrainState,
          say: Callable[[str], None]) -> None:
    """What the folder keeps from earlier starts, settled by the main process once it holds the folder's lock (its
    first writes): newer checkpoints that failed verification set aside, so that the run writes those steps again;
    resumed, the rows logged after the checkpoint dropped (they are logged again); not resumed, the outputs of an
    earlier start that left no checkpoint moved to ``attempt-N/`` (:meth:`RunFolder.set_aside_attempt`), so that
    none of its rows or events is taken for this run's."""
    for path, why in damaged:
        aside = RunFolder.set_aside(path)
        _logger.warning(f"--resume auto: skipped damaged checkpoint {path.name}: {why}; falling back to "
                        f"{resume_from.name} (the damaged one is kept as {aside.name})")
        os.replace(path, aside)
    if resume_from is not None:
        folder.keep_metrics_until(state.step, state.epoch)
        return
    aside = folder.set_aside_attempt()
    if aside is not None:
        say(f"{folder.root} held the outputs of an earlier start that left no checkpoint: moved to {aside}; this run "
            f"starts the folder afresh")


def restore(accelerator: Accelerator, resume_from: Path, state: TrainState, cfg: TrainConfig, folder: RunFolder,
            train_loader, updates_per_epoch: int) -> None:
    """Load the checkpoint ``resume_from`` into everything registered for checkpointing, carry its place in the
    epoch over to this run (:func:`move_position`) and say where the run resumes; :class:`RunFinished` where that
    checkpoint had finished the run (nothing to do, nothing written)."""
    try:
        accelerator.load_state(str(resume_from))
    except (RuntimeError, OSError, EOFError, KeyError, ValueError, pickle.UnpicklingError, SafetensorError) as e:
        raise CheckpointError(f"cannot resume from {resume_from}: {str(e).splitlines()[0][:300]}") from None
    notice = move_position(state, cfg, accelerator, train_loader, updates_per_epoch)
    if finished(state, cfg, folder, len(train_loader) * cfg.batch_size * accelerator.num_processes):
        raise RunFinished(dict(output_dir=str(folder.root), checkpoint=str(resume_from), epochs=cfg.epochs,
                               step=state.step, last=str(folder.weights()), finished_before=True))
    accelerator.print(f"resumed from {resume_from} (step {state.step}: epoch {state.epoch + 1}, "
                      f"{state.batch_in_epoch} of its batches done)")
    if notice:
        accelerator.print(notice)


def finished(state: TrainState, cfg: TrainConfig, folder: RunFolder, epoch_samples: int) -> bool:
    """Whether the checkpoint resumed from ends the run: every epoch's batches used (``epoch_samples``: the samples an
    epoch takes here) and the final weights written after them."""
    done = state.epoch >= cfg.epochs or (state.epoch == cfg.epochs - 1 and state.samples_in_epoch >= epoch_samples)
    return done and folder.weights().is_file() and (not cfg.ema_decay or folder.weights(ema=True).is_file())


def move_position(state: TrainState, cfg: TrainConfig, accelerator: Accelerator, train_loader,
                   updates_per_epoch: int) -> Optional[str]:
    """After loading a checkpoint written on another number of processes (or another ``batch_size``): express
    its place in the epoch in this run's batches, so that the epoch continues with the first sample not yet
    used, and return the line that says what carried over and what did not (None when nothing changed)."""
    if state.global_batch != cfg.global_batch:
        raise ConfigError(f"global_batch {cfg.global_batch} differs from the checkpoint's {state.global_batch}: "
                          f"the optimizer state, the schedule and the place in the epoch are in its steps; resume "
                          f"with global_batch={state.global_batch} (the number of processes may change)")
    processes, old = accelerator.num_processes, (state.processes, state.batch_size)
    if old == (processes, cfg.batch_size):
        return None
    samples, per_batch = state.samples_in_epoch, cfg.batch_size * processes
    # written after an optimizer step: a whole number of global batches, which divide into this run's batches
    state.batch_in_epoch, state.processes, state.batch_size = samples // per_batch, processes, cfg.batch_size
    old_updates, state.updates_per_epoch = state.updates_per_epoch, updates_per_epoch
    accelerator.step = state.batch_in_epoch  # the accumulation window counts this run's batches of the epoch
    streamed = isinstance(train_loader.dataset, IterableDataset)
    return (f"resumed on {processes} process(es) x batch {cfg.batch_size} from a checkpoint written on {old[0]} x "
            f"batch {old[1]}: global batch {cfg.global_batch} kept ({accelerator.gradient_accumulation_steps} "
            f"accumulation step(s)), schedule at step {state.step}, epoch {state.epoch + 1} continues after its first "
            f"{samples} samples"
            + (" (streamed data shard by process: which samples the rest of this epoch holds cannot carry over, "
               "some may repeat or be missed)" if streamed else "")
            + (f" (an epoch now takes {updates_per_epoch} optimizer steps, not {old_updates}: the batches that do "
               f"not fill the last round or accumulation window differ, while the schedule keeps its length in "
               f"steps)" if old_updates and old_updates != updates_per_epoch else "")
            + "; no longer bit-exact: gradients are summed in another order and each process's random draws "
              "(drop path, mixup) follow other streams"
            + (f" (processes {old[0]}.. had none saved)" if processes > old[0] else ""))
