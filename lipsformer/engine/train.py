"""The training loop: Accelerate for devices and precision, timm for the recipe's parts."""
import contextlib
import functools
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, List, Optional

import torch
from accelerate import Accelerator, PartialState
from accelerate.data_loader import DataLoaderShard
from accelerate.utils import DataLoaderConfiguration, DistributedType, set_seed
from timm.data import Mixup, resolve_data_config
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.optim import create_optimizer_v2, get_optimizer_info
from timm.scheduler import create_scheduler_v2
from torch.utils.data import DataLoader, IterableDataset
from tqdm.auto import tqdm

from ..build import ModelStart, build_model
from ..config import TrainConfig
from ..data import collate_skip_failed, create_dataset, create_loader_transform, relabel
from ..data.augment import TransformError
from ..data.classes import reader_classes, write_class_names
from ..data.datasets import check_batches, scan_notes
from ..errors import ConfigError, Interrupted, Stopped
from ..layers.attlip import AttLip
from ..layers.normalized import PowerIterationState
from ..lipschitz.constraints import check_keepable, keep_bound
from ..run_folder import RunFolder, RunLock, check_output
from .checkpoint import TrainState, keep_best, save_checkpoint, save_weights
from .ema import ShardEma
from .finetune import eval_frozen, freeze, starting_weights
from .evaluate import TooManyBadSamples, check_unreadable, evaluate
from .margin import follow_bound, keep_bound_args, kept_record, margin_criterion, restore_kept
from .metrics import EpochMeter, MetricsLog, alpha_statistics, logged_lr, plot_curves
from .preemption import Preemption, stop_if_preempted
from .resume import RunFinished, begin, check_resumable, restore, resume_point, verified
from .speed import compile_model, prepare_model, set_tf32
from .step import StepTally, complete_window, fused, quiet_buffers
from .trackers import Trackers


class TrainingDiverged(Stopped, RuntimeError):
    """A non-finite loss or gradient stopped the run."""


def create_accelerator(cfg: TrainConfig) -> Accelerator:
    cpu = not torch.cuda.is_available()  # Accelerate needs cpu=True to run several CPU processes (gloo)
    if cpu and cfg.mixed_precision == "fp16":
        raise ConfigError("mixed_precision fp16 needs a GPU: on CPU Accelerate would quietly train in fp32; "
                          "use bf16 or no")
    accum = cfg.accumulation_steps(PartialState(cpu=cpu).num_processes)
    return Accelerator(
        cpu=cpu, mixed_precision=cfg.mixed_precision, gradient_accumulation_steps=accum, project_dir=cfg.output_dir,
        # non_blocking: a batch goes to the GPU without the host waiting for the device's queued work
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=cfg.seed, non_blocking=True))


def build_loaders(cfg: TrainConfig, model, accelerator: Accelerator):
    """Train and val loaders, each process holding its own part of the data, and the training data's class names
    in label order (None when the reader has none), by which the val data are labelled.

    Map-style data (folders, ``hfds/``) go through Accelerate's seedable sampler, sharded per process.
    Streamed data (``wds/``, ``hfids/``, ``tfds/``) shard themselves by process and loader worker (timm's
    readers), so Accelerate only moves their batches to the device. A missing folder is named by :func:`check_data`,
    which :func:`train` runs before it builds the model; the data are refused before anything is written when an
    optimizer update cannot run each epoch (:func:`~lipsformer.data.datasets.check_batches`).
    """
    loaders, classes, notes = [], None, []
    for split, training in ((cfg.train_split, True), (cfg.val_split, False)):
        transform = create_loader_transform(model, is_training=training, cfg=cfg)
        ds = create_dataset(cfg.dataset, cfg.data_dir, split, transform, is_training=training,
                            batch_size=cfg.batch_size, seed=cfg.seed)  # a folder: scanned (data/scanner.py)
        notes += scan_notes(ds)
        if training:
            classes = reader_classes(ds)
            check_batches(ds, cfg.batch_size, accelerator.num_processes, accelerator.gradient_accumulation_steps,
                          f"the training data ({cfg.dataset or Path(cfg.data_dir) / split})")
        elif classes is not None:  # val labels by class name, as train/ numbers them (data/classes.py)
            notes.append(relabel(ds, classes, f"{split}/", f"{cfg.train_split}/'s"))
        common = dict(batch_size=cfg.batch_size, num_workers=cfg.workers, collate_fn=collate_skip_failed,
                      drop_last=training)
        if isinstance(ds, IterableDataset):
            loaders.append(DataLoaderShard(ds, device=accelerator.device, **common))
            continue
        # A generator of its own keeps the loader from drawing on the global RNG (DropPath, mixup) whenever an
        # iterator starts, which a resumed run does at a different moment.
        loaders.append(accelerator.prepare_data_loader(DataLoader(
            ds, shuffle=training, generator=torch.Generator().manual_seed(cfg.seed), **common)))
    for note in filter(None, notes):
        accelerator.print(note)
    return (*loaders, classes)


def check_data(cfg: TrainConfig) -> None:
    """A ConfigError naming the missing folder unless the data can be found (an image folder's splits)."""
    if not cfg.data_dir and not cfg.dataset:
        raise ConfigError("no data: set data_dir (--data-dir: a folder with train/ and val/) or dataset "
                          "(hfds/..., wds/...)")
    if cfg.dataset:  # timm's readers name what they cannot find
        return
    root = Path(cfg.data_dir)
    if not root.is_dir():
        raise ConfigError(f"data_dir {root}{' is a file, not a folder' if root.exists() else ': no such folder'} (it "
                          f"should hold {cfg.train_split}/ and {cfg.val_split}/, one sub-folder per class)")
    missing = [split for split in (cfg.train_split, cfg.val_split) if not (root / split).is_dir()]
    if missing:
        raise ConfigError(f"data_dir {root} has no {' and no '.join(m + '/' for m in missing)} folder (it should "
                          f"hold {cfg.train_split}/ and {cfg.val_split}/, one sub-folder per class)")


def check_classes(cfg: TrainConfig, classes: Optional[List[str]]) -> None:
    """A ConfigError unless the training data have ``num_classes`` classes (more index past the classifier, fewer
    leave outputs that ``classes.json`` cannot name); ``classes``: their names (None when the reader has none)."""
    if classes is not None and len(classes) != cfg.num_classes:
        raise ConfigError(f"num_classes is {cfg.num_classes} but the training data have {len(classes)} classes "
                          f"({', '.join(map(str, classes[:3]))}{', ...' if len(classes) > 3 else ''}): set "
                          f"num_classes: {len(classes)}")


def build_criterion(cfg: TrainConfig):
    """``(mixup or None, loss)`` for the recipe's mixup / cutmix / label smoothing."""
    if cfg.mixup > 0 or cfg.cutmix > 0:
        mixup = Mixup(mixup_alpha=cfg.mixup, cutmix_alpha=cfg.cutmix, label_smoothing=cfg.label_smoothing,
                      num_classes=cfg.num_classes)
        return mixup, SoftTargetCrossEntropy()
    if cfg.label_smoothing > 0:
        return None, LabelSmoothingCrossEntropy(cfg.label_smoothing)
    return None, torch.nn.CrossEntropyLoss()


@dataclass
class _Run:
    """Everything one run's epoch and evaluation functions share, built once by :func:`train`."""

    cfg: TrainConfig
    accelerator: Accelerator
    folder: RunFolder
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    ema: Optional[ShardEma]
    mixup: Optional[Mixup]
    criterion: torch.nn.Module
    train_loader: Any
    val_loader: Any
    state: TrainState
    log: MetricsLog
    keep: Optional[Callable[[], dict]]  # bound keeping (lipschitz_target), or None
    last_good: Optional[Path]  # the newest checkpoint written or resumed from
    start: ModelStart = field(default_factory=ModelStart)  # starting weights (build.py), frozen modules (finetune.py)
    preemption: Preemption = field(default_factory=Preemption)
    phase: Callable[[str], Any] = lambda part: contextlib.nullcontext()  # a hook around each "step" and "after"

    def diverged(self, what: str, step: int, epoch: int) -> TrainingDiverged:
        """The stop for a non-finite ``what`` first found at optimizer step ``step``, noticed at the current one."""
        noticed = f"; stopped at step {self.state.step}" if step != self.state.step else ""
        return TrainingDiverged(f"non-finite {what} at step {step} (epoch {epoch + 1}{noticed}); "
                                f"last good checkpoint: {self.last_good or 'none written yet'}")

    def keep_bound(self) -> None:
        """Project, and record in the checkpointed state what a resume restores (:func:`~.margin.kept_record`)."""
        self.state.kept = kept_record(self.state.step, self.keep()["bound"], self.criterion, self.cfg)


def build_optimizer(cfg: TrainConfig, model: torch.nn.Module, sharded: bool = False) -> torch.optim.Optimizer:
    """timm's optimizer over the trainable parameters; ``layer_decay``: timm's layer-wise lr scales over the
    model's ``group_matcher`` (patch embedding smallest, classifier 1). torch's Adam, AdamW and SGD are built fused
    where they can be (``sharded``: FSDP2), the form that skips an update on the device (step.py)."""
    opt_class = get_optimizer_info(cfg.opt.lower().split("_")[-1]).opt_class  # timm: NAME or lookahead_NAME
    return create_optimizer_v2(model, cfg.opt, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=cfg.betas,
                               eps=cfg.eps, layer_decay=cfg.layer_decay, **fused(opt_class, sharded))


def build_scheduler(cfg: TrainConfig, optimizer, updates_per_epoch: int):
    """timm's ``sched`` schedule over ``epochs``, stepped once per optimizer update; warmup (``warmup_epochs``)
    ramps linearly from ``min_lr`` to ``lr``; ``decay_*`` reach timm's step / multistep / poly / wsd / rsqrt."""
    decay = {k: v for k, v in dict(decay_epochs=cfg.decay_epochs, decay_milestones=cfg.decay_milestones,
                                   decay_rate=cfg.decay_rate).items() if v is not None}
    scheduler, _ = create_scheduler_v2(optimizer, cfg.sched, num_epochs=cfg.epochs, min_lr=cfg.min_lr, **decay,
                                       warmup_lr=cfg.min_lr, warmup_epochs=cfg.warmup_epochs,
                                       step_on_epochs=False, updates_per_epoch=updates_per_epoch)
    return scheduler


def _start(cfg: TrainConfig, resume: Optional[str], lock: Optional[RunLock] = None,
           trackers: Optional[Trackers] = None) -> "_Run":
    """Build the run: accelerator, model, loaders, optimizer, schedule, EMA, criterion, ``trackers`` (``log_with``);
    resume if asked. Every check comes before the first write, which takes the folder's ``lock`` (one writer per run
    folder). :class:`~.resume.RunFinished` where the checkpoint resumed from had finished the run (nothing to do,
    nothing written)."""
    trackers, folder = trackers or Trackers(cfg.log_with), RunFolder(cfg.output_dir)
    check_output(folder, cfg.data_dir)  # the one check of every output (writer.py): not inside the data
    accelerator = create_accelerator(cfg)
    lock = lock or RunLock(folder.root)
    lock.check(accelerator)  # another run writes there: refused before any work
    set_tf32(cfg.tf32)
    if cfg.lipschitz_target is not None and accelerator.distributed_type == DistributedType.FSDP:
        raise ConfigError("lipschitz_target needs whole weights on every process; it does not run under FSDP "
                          "(use DDP, or leave lipschitz_target unset)")
    if cfg.ema_decay and accelerator.distributed_type == DistributedType.FSDP and not accelerator.is_fsdp2:
        raise ConfigError("the EMA under FSDP needs FSDP2 (fsdp_version: 2 in the accelerate config), whose "
                          "parameters are DTensor shards; or set ema_decay: null")
    resume_from = resume_point(folder, resume)
    check_resumable(cfg, resume_from)
    check_data(cfg)
    set_seed(cfg.seed)
    with starting_weights(cfg, resumed=resume_from is not None) as source:  # bad ones stop before any write
        model, start = build_model(**source, **cfg.model_args())
    start.frozen = freeze(model, cfg)
    if cfg.attlip_train_steps is not None and not any(isinstance(m, AttLip) for m in model.modules()):
        raise ConfigError(f"attlip_train_steps sets the proximal steps of AttLip attention, which {cfg.model} does "
                          f"not use here: set model_kwargs.attn: attlip, or unset attlip_train_steps")
    if cfg.lipschitz_target is not None:  # a bound no projection can keep: refused before anything is written
        check_keepable(model)
    model = prepare_model(model, cfg.channels_last, cfg.grad_checkpointing)
    resume_from, damaged = verified(folder, resume, resume_from, model, cfg)  # a changed model is named
    set_seed(cfg.seed, device_specific=True)  # different augmentation randomness on each process
    train_loader, val_loader, classes = build_loaders(cfg, model, accelerator)
    check_classes(cfg, classes)
    optimizer = build_optimizer(cfg, model, sharded=accelerator.distributed_type == DistributedType.FSDP)
    model, optimizer = accelerator.prepare(model, optimizer)
    quiet_buffers(model)  # no buffer broadcast per step where the buffers are constants (step.py)
    if cfg.compile:  # in place, after DDP / FSDP2 wrapping: names, unwrap_model and checkpoints are unchanged
        compile_model(model, cfg.compile_mode, cfg.compile_memory_budget)
    updates_per_epoch = math.ceil(len(train_loader) / accelerator.gradient_accumulation_steps)
    scheduler = build_scheduler(cfg, optimizer, updates_per_epoch)
    ema = ShardEma(model, cfg.ema_decay) if cfg.ema_decay else None
    mixup, criterion = build_criterion(cfg)
    criterion = margin_criterion(criterion, cfg.margin_eps, cfg.margin_bound)  # Lipschitz margin (margin.py)
    state = TrainState(accelerator.num_processes, cfg.batch_size, cfg.global_batch, updates_per_epoch)
    power = PowerIterationState(accelerator.unwrap_model(model))  # normalised layers' vectors (linear=normalized)
    accelerator.register_for_checkpointing(state, scheduler, *[ema] * bool(ema), *[power] * bool(power.layers))
    if resume_from is not None:  # RunFinished where the checkpoint ends the run: nothing to do, nothing written
        restore(accelerator, resume_from, state, cfg, folder, train_loader, updates_per_epoch)
    lock.take(accelerator)  # every check above came first: a refused run writes nothing
    if accelerator.is_main_process:  # what the folder keeps from earlier starts (resume.py)
        begin(folder, resume_from, damaged, state, accelerator.print)
    trackers.start(accelerator, cfg, folder, resumed=resume_from is not None)  # one that fails: no file of ours
    if accelerator.is_main_process:  # this run's files
        cfg.save(folder.config)
        if classes is not None:  # the weights' class names, for eval.py and exports (data/classes.py)
            write_class_names(folder.classes, classes)
    accelerator.wait_for_everyone()  # damaged checkpoints are set aside before any process writes one again
    if resume_from is None:
        scheduler.step_update(0)
    keep = None
    if cfg.lipschitz_target is not None:
        keep = functools.partial(keep_bound, accelerator.unwrap_model(model), **keep_bound_args(cfg))
        if cfg.margin_eps and cfg.margin_bound is None:  # the margin follows the kept bound, in pixel space
            std = resolve_data_config({}, model=accelerator.unwrap_model(model))["std"]
            keep = follow_bound(keep, criterion, 1.0 / min(std))
    run = _Run(cfg, accelerator, folder, model, optimizer, scheduler, ema, mixup, criterion, train_loader,
               val_loader, state, MetricsLog(accelerator, folder), keep, last_good=resume_from, start=start)
    if resume_from is None:
        run.log("init", 0, **start.row())
        accelerator.print(start.line())
    if keep is not None and not (resume_from is not None and restore_kept(state.kept, criterion, cfg)):
        run.keep_bound()
    return run


def train(cfg: TrainConfig, resume: Optional[str] = None) -> dict:
    """Train per ``cfg``; ``resume`` is ``None``, ``"auto"`` (newest checkpoint in the output folder) or a path.

    SIGTERM and SIGUSR1 (:data:`.preemption.PREEMPTION_SIGNALS`) stop the run after the optimizer step they arrive
    in, with that step's checkpoint written, by raising :class:`Preempted`; Ctrl-C raises :class:`Interrupted`
    naming the newest checkpoint. Returns the run's summary; resumed from the checkpoint that ended a finished run,
    nothing is done and the summary says ``finished_before``.
    """
    preemption = Preemption()  # the lock is let go of (and removed) however the run ends; the trackers finished
    with preemption.watching(), RunLock(cfg.output_dir) as lock, Trackers(cfg.log_with) as trackers:
        try:
            run = _start(cfg, resume, lock, trackers)
        except RunFinished as done:  # the checkpoint resumed from is the end of the run: nothing to do
            return done.summary
        run.preemption = preemption
        try:
            return _train(run)
        except KeyboardInterrupt as e:
            raise Interrupted(f"training stopped at step {run.state.step} (Ctrl-C); newest checkpoint: "
                              f"{run.last_good or 'none written yet'}; continue with --resume auto") from e
        except TransformError as e:
            raise TransformError(f"{e.line}; the newest checkpoint is the last one written before it") from e


def _train(run: _Run) -> dict:
    cfg, state, accelerator = run.cfg, run.state, run.accelerator
    for epoch in range(state.epoch, cfg.epochs):  # epochs count from 1 wherever a user reads them (epoch + 1)
        row = dict(epoch=epoch + 1, **train_one_epoch(run, epoch))
        row.update(alpha_statistics(accelerator.unwrap_model(run.model)), lr=logged_lr(run.optimizer))
        state.epoch, state.batch_in_epoch, state.epoch_sums = epoch + 1, 0, {}
        if (epoch + 1) % cfg.eval_every_epochs == 0 or epoch + 1 == cfg.epochs:
            row.update(evaluate_and_keep_best(run))
        run.log("epoch", state.step, **row)
        run.last_good = save_checkpoint(accelerator, run.model, run.folder.root, state, cfg.keep_last)
        if epoch + 1 < cfg.epochs:  # a signal during the evaluation: the epoch's checkpoint is the one
            stop_if_preempted(run)

    save_weights(accelerator, accelerator.get_state_dict(run.model), run.folder.weights(), cfg)
    if run.ema is not None:
        with run.ema.applied(run.model):
            save_weights(accelerator, accelerator.get_state_dict(run.model), run.folder.weights(ema=True), cfg)
    accelerator.end_training()
    summary = dict(output_dir=str(run.folder.root), checkpoint=str(run.last_good), best_top1=state.best_top1,
                   best=str(run.folder.best), last=str(run.folder.weights()), epochs=state.epoch,
                   step=state.step, skipped_steps=state.skipped_steps, curves=str(run.folder.curves))
    if accelerator.is_main_process:
        plot_curves(run.folder.metrics, run.folder.curves, f"{cfg.model}: {run.folder.root}")
    return summary


def train_one_epoch(run: _Run, epoch: int) -> dict:
    """One pass over the training data (the rest of it, after a mid-epoch resume); returns the epoch row's
    training figures. Checkpoints are written every ``checkpoint_every_steps`` optimizer steps."""
    cfg, accelerator, state = run.cfg, run.accelerator, run.state
    run.model.train()
    eval_frozen(accelerator.unwrap_model(run.model), run.start.frozen)
    attlip_steps = set_attlip_steps(accelerator.unwrap_model(run.model), cfg, epoch)
    run.train_loader.set_epoch(epoch)
    if hasattr(run.train_loader.dataset, "set_epoch"):  # the augmentation's seeds: Accelerate's set_epoch stops at
        run.train_loader.dataset.set_epoch(epoch)  # a sharded sampler (several processes) and never reaches them
    loader = run.train_loader
    if state.batch_in_epoch:
        loader = accelerator.skip_first_batches(run.train_loader, state.batch_in_epoch)
    meter = EpochMeter(carried=dict(state.epoch_sums) if state.batch_in_epoch else {},
                       tally=StepTally(accelerator.device, cfg.log_every_steps, accelerator.scaler is not None))
    # closed however the loop ends (an error line then starts a line); a bar on a terminal, else _after_update's lines
    with tqdm(total=len(run.train_loader), initial=state.batch_in_epoch, desc=f"epoch {epoch + 1}/{cfg.epochs}",
              disable=None if accelerator.is_main_process else True, dynamic_ncols=True) as bar:
        for images, targets, bad in loader:
            meter.failed += bad
            if images is None:
                raise TooManyBadSamples(f"every image of a batch failed to load, e.g. {bad[:3]}")
            meter.seen += targets.shape[0]
            with run.phase("step"):
                _train_step(run, meter, images, targets, epoch)
            state.batch_in_epoch += 1
            bar.update(1)
            meter.images += targets.shape[0] * accelerator.num_processes
            if accelerator.sync_gradients:
                with run.phase("after"):
                    _after_update(run, meter, epoch, bar)

    _read(run, meter, epoch)
    totals = meter.totals(accelerator)  # every process's counts and examples, said once by the main process
    check_unreadable(f"epoch {epoch + 1}", totals["failed"], totals["seen"], cfg.max_bad_fraction,
                     totals["failed_paths"], say=accelerator.is_main_process)
    row = dict(**meter.loss_figures("train_loss"), bad_samples=totals["failed"], train_samples=totals["seen"],
               processes=accelerator.num_processes, skipped_steps=state.skipped_steps, seconds=totals["seconds"])
    if attlip_steps is not None:
        row["attlip_train_steps"] = attlip_steps
    if run.keep is not None:  # the weights evaluated and saved are projected, whatever lipschitz_every_steps
        if state.kept["step"] != state.step:  # kept or restored at the start, so never None here
            run.keep_bound()
        row["lipschitz_bound"] = state.kept["bound"]
    return row


def set_attlip_steps(model: torch.nn.Module, cfg: TrainConfig, epoch: int) -> Optional[int]:
    """``attlip_train_steps``: every AttLip module's training steps for ``epoch`` (a function of the epoch alone, so
    a run resumed mid-schedule trains as the uninterrupted one); returns them, or None when the key is unset."""
    steps = cfg.attlip_steps_at(epoch)
    if steps is not None:
        for m in model.modules():
            if isinstance(m, AttLip):
                m.train_steps = steps
    return steps


def _train_step(run: _Run, meter: EpochMeter, images, targets, epoch: int) -> None:
    """Forward and backward of one batch, and the optimizer update at the end of an accumulation window, skipped on
    the device when a loss or gradient is not finite (:class:`~.step.StepTally`): nothing here waits for the device."""
    accelerator, model = run.accelerator, run.model
    with accelerator.accumulate(model):
        if run.mixup is not None:
            images, targets = run.mixup(images, targets)
        with accelerator.autocast():
            loss = run.criterion(model(images), targets)
        accelerator.backward(meter.tally.checked(loss))
        if accelerator.sync_gradients:
            complete_window(model.parameters(), run.state.batch_in_epoch, accelerator.gradient_accumulation_steps)
            meter.tally.update(accelerator, run.optimizer, model.parameters(), run.cfg.clip_grad)
        run.optimizer.zero_grad()


def _read(run: _Run, meter: EpochMeter, epoch: int) -> None:
    """The steps' device-side record into the meter and state; with ``on_nonfinite: stop``, stop at a skipped update."""
    got = meter.read(run.accelerator, cause=run.cfg.on_nonfinite == "stop")
    run.state.skipped_steps += len(got.skipped)
    if got.what:  # asked for, and an update was skipped
        raise run.diverged(got.what, run.state.step - got.updates + got.skipped[0] + 1, epoch)


def _after_update(run: _Run, meter: EpochMeter, epoch: int, bar) -> None:
    """Bookkeeping after an optimizer update: step count, bound keeping, schedule, EMA, logging, checkpoint, and
    the stop when a preemption signal came. The device is read only at read steps: log steps, checkpoints and
    bound keeping (and the epoch's end, in :func:`train_one_epoch`); a preemption signal is acted on at the next
    read step on several processes (the flag is reduced there), at once on one."""
    cfg, state, accelerator = run.cfg, run.state, run.accelerator
    state.step += 1
    log, checkpoint = state.step % cfg.log_every_steps == 0, state.step % cfg.checkpoint_every_steps == 0
    keep = run.keep is not None and state.step % cfg.lipschitz_every_steps == 0
    read = log or checkpoint or keep or (accelerator.num_processes == 1 and run.preemption.signal)
    if read:
        _read(run, meter, epoch)
    if keep:
        run.keep_bound()
    run.scheduler.step_update(state.step)
    if run.ema is not None:
        run.ema.update(run.model, state.step)
    if log:
        lr, loss = logged_lr(run.optimizer), meter.loss_text()
        speed = meter.images / max(time.time() - meter.t0, 1e-9)
        bar.set_postfix(loss=loss, lr=f"{lr:.2e}", img_s=f"{speed:.0f}")
        run.log("train", state.step, epoch=epoch + 1, **meter.loss_figures("loss"), lr=lr, img_per_s=speed)
        if bar.disable and accelerator.is_main_process:  # a log file, not a terminal: one plain line
            accelerator.print(f"epoch {epoch + 1}/{cfg.epochs} step {state.step} ({state.batch_in_epoch}/"
                              f"{len(run.train_loader)} batches): loss {loss}, lr {lr:.2e}, "
                              f"{speed:.0f} img/s", flush=True)
    if checkpoint:
        state.epoch_sums = meter.totals(accelerator)  # a resume from this checkpoint completes these sums
        run.last_good = save_checkpoint(accelerator, run.model, run.folder.root, state, cfg.keep_last)
    if read:
        stop_if_preempted(run, meter)


def evaluate_and_keep_best(run: _Run) -> dict:
    """Validation top-1 / top-5 of the model (and of its EMA); the better of the two is saved as
    ``best.safetensors`` when it beats every earlier epoch, and in ``best/`` among the ``keep_best`` best
    (:func:`~.checkpoint.keep_best`). Returns the epoch row's validation figures."""
    accelerator, model, state, ema = run.accelerator, run.model, run.state, run.ema
    metrics = evaluate(model, run.val_loader, accelerator, run.cfg.max_bad_fraction)
    row = dict(top1=metrics["top1"], top5=metrics["top5"], val_loss=metrics["loss"], val_count=metrics["count"],
               val_bad_samples=metrics["unreadable"])
    candidates = {"model": metrics["top1"]}
    if ema is not None:
        with ema.applied(model):
            ema_metrics = evaluate(model, run.val_loader, accelerator, run.cfg.max_bad_fraction)
        row.update(ema_top1=ema_metrics["top1"], ema_top5=ema_metrics["top5"], ema_val_loss=ema_metrics["loss"])
        candidates["ema"] = ema_metrics["top1"]
    which = max(candidates, key=lambda k: candidates[k] if math.isfinite(candidates[k]) else -math.inf)
    weights = functools.partial(ema.applied, model) if which == "ema" else contextlib.nullcontext
    if keep_best(accelerator, model, weights, run.folder, state, candidates[which], run.cfg):
        row["best"] = which
    accelerator.print(f"epoch {state.epoch}: top-1 {metrics['top1']:.2f}"
                      + (f", EMA {row['ema_top1']:.2f}" if ema is not None else ""))
    return row
