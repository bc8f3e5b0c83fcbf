"""The training loop: Accelerate for devices and precision, timm for the recipe's parts."""
import contextlib
import functools
import json
import logging
import math
import os
import pickle
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import yaml
from accelerate import Accelerator, PartialState
from accelerate.data_loader import DataLoaderShard
from accelerate.utils import DataLoaderConfiguration, DistributedType, gather_object, set_seed
from safetensors import SafetensorError
from safetensors.torch import save_file
from timm.data import Mixup, resolve_data_config
from timm.data.readers.reader_image_folder import ReaderImageFolder
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.optim import create_optimizer_v2
from timm.scheduler import create_scheduler_v2
from torch.utils.data import DataLoader, IterableDataset
from tqdm.auto import tqdm

from ..data import collate_skip_failed, create_dataset, create_loader_transform, relabel
from ..data.augment import TransformError
from ..data.classes import check_class_folders, reader_classes, write_class_names
from ..errors import Interrupted, Preempted, Stopped
from ..layers.attlip import AttLip
from ..layers.normalized import PowerIterationState
from ..layers.residual import WeightedResidual
from ..lipschitz.bounds import lipschitz_report
from ..lipschitz.constraints import keep_bound
from ..models._base import LipsFormerBase
from ..weights import CheckpointError, input_size_metadata
from .checkpoint import (SaveFailed, TrainState, assert_finite, intact_checkpoint, latest_checkpoint,
                         save_checkpoint, verify_checkpoint)
from .config import RESTORED_ON_RESUME, ConfigError, TrainConfig, check_type
from .ema import ShardEma, _whole
from .finetune import ModelStart, build_model, eval_frozen, start_model  # noqa: F401 (build_model: API)
from .evaluate import TooManyBadSamples, check_unreadable, evaluate
from .margin import follow_bound, margin_criterion
from .run_folder import MANIFEST, RunFolder, checkpoint_step, read_metrics, readable_as_outputs
from .speed import compile_model, prepare_model, set_tf32

_logger = logging.getLogger(__name__)


class TrainingDiverged(Stopped, RuntimeError):
    """A non-finite loss or gradient stopped the run."""


# What a cluster scheduler sends before it stops a job (SLURM: ``--signal=USR1@120``; SIGTERM at preemption or
# at the time limit, SIGKILL some seconds later).
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class _Preemption:
    """Notes a preemption signal and nothing else: the loop acts on it between optimizer steps
    (:func:`_stop_if_preempted`), so a signal never interrupts a step or a checkpoint write, and a second one only
    notes it again."""

    def __init__(self):
        self.signal = 0  # the number of the last signal received, 0 for none

    def __call__(self, signum, frame) -> None:
        self.signal = signum

    @contextlib.contextmanager
    def watching(self):
        """Within the block the preemption signals set the flag; the previous handlers are restored after it.
        Blocking system calls interrupted by them are restarted (gloo, loader workers) rather than failing."""
        previous = {}
        if threading.current_thread() is threading.main_thread():  # Python sets handlers there only
            for sig in PREEMPTION_SIGNALS:
                previous[sig] = signal.signal(sig, self)
                signal.siginterrupt(sig, False)
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, signal.SIG_DFL if handler is None else handler)


def create_accelerator(cfg: TrainConfig) -> Accelerator:
    cpu = not torch.cuda.is_available()  # Accelerate needs cpu=True to run several CPU processes (gloo)
    if cpu and cfg.mixed_precision == "fp16":
        raise ConfigError("mixed_precision fp16 needs a GPU: on CPU Accelerate would quietly train in fp32; "
                          "use bf16 or no")
    accum = cfg.accumulation_steps(PartialState(cpu=cpu).num_processes)
    return Accelerator(
        cpu=cpu, mixed_precision=cfg.mixed_precision, gradient_accumulation_steps=accum, log_with="tensorboard",
        project_dir=cfg.output_dir,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=cfg.seed))


def build_loaders(cfg: TrainConfig, model, accelerator: Accelerator):
    """Train and val loaders, each process holding its own part of the data.

    Map-style data (folders, ``hfds/``) go through Accelerate's seedable sampler, sharded per process.
    Streamed data (``wds/``, ``hfids/``, ``tfds/``) shard themselves by process and loader worker (timm's
    readers), so Accelerate only moves their batches to the device.
    """
    check_data(cfg)
    loaders, classes = [], None
    for split, training in ((cfg.train_split, True), (cfg.val_split, False)):
        transform = create_loader_transform(model, is_training=training, cfg=cfg)
        ds = create_dataset(cfg.dataset, cfg.data_dir, split, transform, is_training=training,
                            batch_size=cfg.batch_size, seed=cfg.seed)
        reader = getattr(ds, "reader", None)
        if isinstance(reader, ReaderImageFolder):  # one folder of images per class; a class without images is refused
            check_class_folders(reader.root, reader.samples, reader.class_to_idx, allow_empty=not training)
        if training:
            classes = reader_classes(ds)
        elif classes is not None:  # val labels by class name, as train/ numbers them (data/classes.py)
            note = relabel(ds, classes, f"{split}/", f"{cfg.train_split}/'s")
            if note:
                accelerator.print(note)
        common = dict(batch_size=cfg.batch_size, num_workers=cfg.workers, collate_fn=collate_skip_failed,
                      drop_last=training)
        if isinstance(ds, IterableDataset):
            loaders.append(DataLoaderShard(ds, device=accelerator.device, **common))
            continue
        # A generator of its own keeps the loader from drawing on the global RNG (DropPath, mixup) whenever an
        # iterator starts, which a resumed run does at a different moment.
        loaders.append(accelerator.prepare_data_loader(DataLoader(
            ds, shuffle=training, generator=torch.Generator().manual_seed(cfg.seed), **common)))
    return loaders


def check_data(cfg: TrainConfig) -> None:
    """A ConfigError naming the missing folder unless the data can be found (an image folder's splits)."""
    if not cfg.data_dir and not cfg.dataset:
        raise ConfigError("no data: set data_dir (--data-dir: a folder with train/ and val/) or dataset "
                          "(hfds/..., wds/...)")
    if cfg.dataset:  # timm's readers name what they cannot find
        return
    root = Path(cfg.data_dir)
    if not root.is_dir():
        raise ConfigError(f"data_dir {root}: no such folder (it should hold {cfg.train_split}/ and "
                          f"{cfg.val_split}/, one sub-folder per class)")
    missing = [split for split in (cfg.train_split, cfg.val_split) if not (root / split).is_dir()]
    if missing:
        raise ConfigError(f"data_dir {root} has no {' and no '.join(m + '/' for m in missing)} folder (it should "
                          f"hold {cfg.train_split}/ and {cfg.val_split}/, one sub-folder per class)")


def check_classes(cfg: TrainConfig, classes: Optional[List[str]]) -> None:
    """A ConfigError when the training data have more classes than the model's ``num_classes`` (their labels
    would index past the classifier); ``classes``: the training data's names (None when the reader has none)."""
    if classes is not None and len(classes) > cfg.num_classes:
        raise ConfigError(f"num_classes is {cfg.num_classes} but the training data have {len(classes)} classes "
                          f"({', '.join(map(str, classes[:3]))}, ...): set num_classes: {len(classes)}")


def build_criterion(cfg: TrainConfig):
    """``(mixup or None, loss)`` for the recipe's mixup / cutmix / label smoothing."""
    if cfg.mixup > 0 or cfg.cutmix > 0:
        mixup = Mixup(mixup_alpha=cfg.mixup, cutmix_alpha=cfg.cutmix, label_smoothing=cfg.label_smoothing,
                      num_classes=cfg.num_classes)
        return mixup, SoftTargetCrossEntropy()
    if cfg.label_smoothing > 0:
        return None, LabelSmoothingCrossEntropy(cfg.label_smoothing)
    return None, torch.nn.CrossEntropyLoss()


class _Log:
    """Metrics to a JSONL file (main process) and to Accelerate's trackers."""

    def __init__(self, accelerator, path: Path):
        self.accelerator, self.path = accelerator, path

    def __call__(self, kind: str, step: int, **values):
        if self.accelerator.is_main_process:
            with open(self.path, "a") as f:
                f.write(json.dumps(dict(kind=kind, step=step, **values)) + "\n")
        self.accelerator.log({f"{kind}/{k}": v for k, v in values.items() if isinstance(v, (int, float))}, step=step)


@torch.no_grad()
def alpha_statistics(model: torch.nn.Module) -> Dict[str, float]:
    """Per-stage mean and standard deviation of |alpha| over every WeightedResidual alpha of the stage (all
    channels pooled; population std), as ``alpha_mean_s{i}`` / ``alpha_std_s{i}``: LipsFormer Figure 5's
    curves. Empty for a model that is not a LipsFormer."""
    if not isinstance(model, LipsFormerBase):
        return {}
    stats = {}
    for i, stage in enumerate(model.stages):
        alphas = [_whole(m.alpha).detach().float().abs().flatten() for m in stage.modules()
                  if isinstance(m, WeightedResidual)]
        if alphas:
            a = torch.cat(alphas)
            stats[f"alpha_mean_s{i}"] = a.mean().item()
            stats[f"alpha_std_s{i}"] = a.std(correction=0).item()
    return stats


def draw_curves(rows: List[dict], title: str):
    """The figure of ``curves.png`` from ``metrics.jsonl`` rows: training loss per logged step with the val loss
    of each evaluated epoch (at its last step), val top-1 per epoch, and per-stage |alpha| per epoch."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    train = [r for r in rows if r["kind"] == "train"]
    epochs = [r for r in rows if r["kind"] == "epoch"]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4))
    fig.suptitle(title)
    ax1.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss (epoch running mean)")
    for key, label in (("val_loss", "val loss"), ("ema_val_loss", "EMA val loss")):
        pts = [(r["step"], r[key]) for r in epochs if r.get(key) is not None]
        if pts:
            ax1.plot(*zip(*pts), marker="o", label=label)
    ax1.set(xlabel="optimizer step", ylabel="cross-entropy", yscale="log")
    ax1.legend()
    for key, label in (("top1", "model"), ("ema_top1", "EMA")):
        pts = [(r["epoch"], r[key]) for r in epochs if r.get(key) is not None]
        if pts:
            ax2.plot(*zip(*pts), marker="o", label=label)
    ax2.set(xlabel="epoch", ylabel="val top-1 (%)")
    if ax2.lines:
        ax2.legend()
    stages = sorted({k.rsplit("_s", 1)[1] for r in epochs for k in r if k.startswith("alpha_mean_s")}, key=int)
    for i in stages:  # LipsFormer Figure 5: "alpha first grows, then stabilises"
        pts = [(r["epoch"], r[f"alpha_mean_s{i}"], r[f"alpha_std_s{i}"]) for r in epochs if f"alpha_mean_s{i}" in r]
        x, mean, std = (torch.tensor(v, dtype=torch.float64) for v in zip(*pts))
        ax3.plot(x, mean, marker="o", label=f"stage {i}")
        ax3.fill_between(x, mean - std, mean + std, alpha=0.2)
    ax3.set(xlabel="epoch", ylabel="|alpha| per stage (mean +- std)")
    if stages:
        ax3.legend()
    for ax in (ax1, ax2, ax3):  # steps and epochs are whole numbers
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    return fig


def plot_curves(metrics_path: Path, png_path: Path, title: str = "") -> None:
    import matplotlib.pyplot as plt
    fig = draw_curves(read_metrics(metrics_path), title or str(Path(metrics_path).parent))
    fig.savefig(png_path, dpi=100)
    plt.close(fig)


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
    log: "_Log"
    keep: Optional[Callable[[], dict]]  # bound keeping (lipschitz_target), or None
    last_good: Optional[Path]  # the newest checkpoint written or resumed from
    kept: Optional[Tuple[int, float]] = None  # (step, bound) of keep()'s last projection
    start: ModelStart = field(default_factory=ModelStart)  # starting weights and frozen modules (finetune.py)
    preemption: _Preemption = field(default_factory=_Preemption)

    def diverged(self, what: str, epoch: int) -> TrainingDiverged:
        return TrainingDiverged(f"non-finite {what} at step {self.state.step} (epoch {epoch + 1}); "
                                f"last good checkpoint: {self.last_good or 'none written yet'}")

    def keep_bound(self) -> None:
        self.kept = (self.state.step, self.keep()["bound"])


@dataclass
class _EpochMeter:
    """The running sums of one epoch's training batches; ``carried`` holds the sums of the batches before a
    mid-epoch resume (checkpointed as ``TrainState.epoch_sums``), so a resumed epoch's row counts the whole epoch."""

    failed: List[str] = field(default_factory=list)  # paths of images that could not be read
    seen: int = 0  # samples in this process's batches
    loss_sum: float = 0.0
    loss_n: int = 0
    images: int = 0  # over all processes, for the speed shown
    window_bad: bool = False  # a non-finite loss or gradient in the current accumulation window
    t0: float = field(default_factory=time.time)
    carried: Dict[str, Any] = field(default_factory=dict)  # :meth:`totals` at the checkpoint resumed from

    @property
    def loss(self) -> float:  # this process's mean batch loss over the epoch so far
        return (self.carried.get("loss_sum", 0.0) + self.loss_sum) / max(self.carried.get("loss_n", 0) + self.loss_n, 1)

    def totals(self, accelerator) -> Dict[str, Any]:
        """The epoch so far, carried part included: samples and unreadable ones over all processes (a collective
        call), this process's loss sums, wall seconds, and a few unreadable paths of any process for messages."""
        counts = accelerator.reduce(torch.tensor([float(len(self.failed)), float(self.seen)],
                                                 device=accelerator.device), "sum")
        c = self.carried
        failed = gather_object(self.failed[:5]) if accelerator.num_processes > 1 else self.failed
        return dict(failed=c.get("failed", 0) + int(counts[0]), seen=c.get("seen", 0) + int(counts[1]),
                    loss_sum=c.get("loss_sum", 0.0) + self.loss_sum, loss_n=c.get("loss_n", 0) + self.loss_n,
                    seconds=c.get("seconds", 0.0) + time.time() - self.t0,
                    failed_paths=(list(c.get("failed_paths", [])) + list(failed))[:5])


def build_optimizer(cfg: TrainConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    """timm's optimizer over the trainable parameters; ``layer_decay``: timm's layer-wise lr scales over the
    model's ``group_matcher`` (patch embedding smallest, classifier 1)."""
    return create_optimizer_v2(model, cfg.opt, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=cfg.betas,
                               eps=cfg.eps, layer_decay=cfg.layer_decay)


def build_scheduler(cfg: TrainConfig, optimizer, updates_per_epoch: int):
    """timm's ``sched`` schedule over ``epochs``, stepped once per optimizer update; warmup (``warmup_epochs``)
    ramps linearly from ``min_lr`` to ``lr``; ``decay_*`` reach timm's step / multistep / poly / wsd / rsqrt."""
    decay = {k: v for k, v in dict(decay_epochs=cfg.decay_epochs, decay_milestones=cfg.decay_milestones,
                                   decay_rate=cfg.decay_rate).items() if v is not None}
    scheduler, _ = create_scheduler_v2(optimizer, cfg.sched, num_epochs=cfg.epochs, min_lr=cfg.min_lr, **decay,
                                       warmup_lr=cfg.min_lr, warmup_epochs=cfg.warmup_epochs,
                                       step_on_epochs=False, updates_per_epoch=updates_per_epoch)
    return scheduler


def _resume_point(folder: RunFolder, resume: Optional[str]) -> Optional[Path]:
    """The checkpoint to resume from (``resume="auto"``: decided once the model exists, see :func:`_verified`).
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
            raise FileNotFoundError(f"--resume {resume}: no such folder; pass a checkpoint folder "
                                    f"(RUN/checkpoints/step_N), a run folder, or auto")
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


def _check_resumable(cfg: TrainConfig, resume_from: Optional[Path]) -> None:
    """Refuse a resume whose config changes what the checkpoint restores (the optimizer's hyperparameters, the lr
    schedule): the checkpoint's values would win silently. Compared with the run's ``config.yaml``."""
    if resume_from is None:
        return
    saved_config = RunFolder(resume_from.parent.parent).config
    if not saved_config.is_file():
        return
    saved = yaml.safe_load(saved_config.read_text()) or {}
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


def _verified(folder: RunFolder, resume: Optional[str], resume_from: Optional[Path], model) -> Optional[Path]:
    """``resume_from`` once verified; with ``--resume auto`` the newest intact checkpoint, with a warning
    naming what was wrong with each newer one."""
    if resume_from is None:
        return None
    if resume != "auto":
        verify_checkpoint(resume_from, model)
        return resume_from
    intact, problems = intact_checkpoint(folder.root, model)
    if intact is None:
        raise CheckpointError(f"--resume auto: no intact checkpoint in {folder.checkpoints}: "
                              + "; ".join(f"{damaged.name}: {why}" for damaged, why in problems))
    processes = PartialState()
    for damaged, why in problems:  # set aside, so the resumed run writes that step again
        aside = RunFolder.set_aside(damaged)
        _logger.warning(f"--resume auto: skipped damaged checkpoint {damaged.name}: {why}; falling back to "
                        f"{intact.name} (the damaged one is kept as {aside.name})")
        processes.wait_for_everyone()
        if processes.is_main_process:
            os.replace(damaged, aside)
    processes.wait_for_everyone()
    return intact


def _start(cfg: TrainConfig, resume: Optional[str]):
    """Build the run: accelerator, model, loaders, optimizer, schedule, EMA, criterion; resume if asked. Every check
    comes before the first write. Returns the :class:`_Run`, or the summary of a run that the checkpoint resumed from
    had finished (nothing to do, nothing written)."""
    folder = RunFolder(cfg.output_dir)
    check_output(folder)
    accelerator = create_accelerator(cfg)
    set_tf32(cfg.tf32)
    if cfg.lipschitz_target is not None and accelerator.distributed_type == DistributedType.FSDP:
        raise ConfigError("lipschitz_target needs whole weights on every process; it does not run under FSDP "
                          "(use DDP, or leave lipschitz_target unset)")
    if cfg.ema_decay and accelerator.distributed_type == DistributedType.FSDP and not accelerator.is_fsdp2:
        raise ConfigError("the EMA under FSDP needs FSDP2 (fsdp_version: 2 in the accelerate config), whose "
                          "parameters are DTensor shards; or set ema_decay: null")
    resume_from = _resume_point(folder, resume)
    _check_resumable(cfg, resume_from)
    check_data(cfg)
    set_seed(cfg.seed)
    # starting weights (pretrained / init_checkpoint, unless resuming) and freezing: bad ones stop before any write
    model, start = start_model(cfg, load_weights=resume_from is None)
    if cfg.attlip_train_steps is not None and not any(isinstance(m, AttLip) for m in model.modules()):
        raise ConfigError(f"attlip_train_steps sets the proximal steps of AttLip attention, which {cfg.model} does "
                          f"not use here: set model_kwargs.attn: attlip, or unset attlip_train_steps")
    model = prepare_model(model, cfg.channels_last, cfg.grad_checkpointing)
    resume_from = _verified(folder, resume, resume_from, model)
    set_seed(cfg.seed, device_specific=True)  # different augmentation randomness on each process
    train_loader, val_loader = build_loaders(cfg, model, accelerator)
    classes = reader_classes(train_loader.dataset)
    check_classes(cfg, classes)
    optimizer = build_optimizer(cfg, model)
    model, optimizer = accelerator.prepare(model, optimizer)
    if cfg.compile:  # in place, after DDP / FSDP2 wrapping: names, unwrap_model and checkpoints are unchanged
        compile_model(model, cfg.compile_mode, cfg.compile_memory_budget)
    updates_per_epoch = math.ceil(len(train_loader) / accelerator.gradient_accumulation_steps)
    scheduler = build_scheduler(cfg, optimizer, updates_per_epoch)
    ema = ShardEma(model, cfg.ema_decay) if cfg.ema_decay else None
    mixup, criterion = build_criterion(cfg)
    criterion = margin_criterion(criterion, cfg.margin_eps, cfg.margin_bound)  # Lipschitz margin (margin.py)
    state = TrainState(accelerator.num_processes, cfg.batch_size, cfg.global_batch, updates_per_epoch)
    power = PowerIterationState(accelerator.unwrap_model(model))  # normalised layers' vectors (linear=normalized)
    accelerator.register_for_checkpointing(state, scheduler, *([ema] if ema else []), *([power] if power.layers else []))
    if resume_from is not None:
        try:
            accelerator.load_state(str(resume_from))
        except (RuntimeError, OSError, EOFError, KeyError, ValueError, pickle.UnpicklingError, SafetensorError) as e:
            raise CheckpointError(f"cannot resume from {resume_from}: {str(e).splitlines()[0][:300]}") from None
        notice = _move_position(state, cfg, accelerator, train_loader, updates_per_epoch)
        if _finished(state, cfg, folder, len(train_loader) * cfg.batch_size * accelerator.num_processes):
            return dict(output_dir=str(folder.root), checkpoint=str(resume_from), epochs=cfg.epochs, step=state.step,
                        last=str(folder.weights()), finished_before=True)
        accelerator.print(f"resumed from {resume_from} (step {state.step}: epoch {state.epoch + 1}, "
                          f"{state.batch_in_epoch} of its batches done)")
        if notice:
            accelerator.print(notice)
    if accelerator.is_main_process:  # every check above came first: a refused run writes nothing
        folder.root.mkdir(parents=True, exist_ok=True)
        cfg.save(folder.config)
        if classes is not None:  # the weights' class names, for eval.py and exports (data/classes.py)
            write_class_names(folder.classes, classes)
        if resume_from is not None:  # rows logged after that checkpoint are logged again from here
            folder.keep_metrics_until(state.step, state.epoch)
    if resume_from is None:
        scheduler.step_update(0)
    accelerator.init_trackers("lipsformer")
    keep = None
    if cfg.lipschitz_target is not None:
        keep = functools.partial(keep_bound, accelerator.unwrap_model(model), cfg.lipschitz_target,
                                 cfg.lipschitz_gamma_max, tau_max=cfg.lipschitz_tau_max,
                                 weight_max=cfg.lipschitz_weight_max,
                                 conv_max=cfg.lipschitz_conv_max)
        if cfg.margin_eps and cfg.margin_bound is None:  # the margin follows the kept bound, in pixel space
            std = resolve_data_config({}, model=accelerator.unwrap_model(model))["std"]
            keep = follow_bound(keep, criterion, 1.0 / min(std))
    run = _Run(cfg, accelerator, folder, model, optimizer, scheduler, ema, mixup, criterion, train_loader,
               val_loader, state, _Log(accelerator, folder.metrics), keep, last_good=resume_from, start=start)
    if resume_from is None:
        run.log("init", 0, **start.row())
        accelerator.print(f"weights: {start.source}; re-initialised: {', '.join(start.reinitialised) or 'none'}; "
                          f"frozen: {', '.join(start.frozen) or 'none'}")
    if keep is not None:
        run.keep_bound()
    return run


def _finished(state: TrainState, cfg: TrainConfig, folder: RunFolder, epoch_samples: int) -> bool:
    """Whether the checkpoint resumed from ends the run: every epoch's batches used (``epoch_samples``: the samples an
    epoch takes here) and the final weights written after them."""
    done = state.epoch >= cfg.epochs or (state.epoch == cfg.epochs - 1 and state.samples_in_epoch >= epoch_samples)
    return done and folder.weights().is_file() and (not cfg.ema_decay or folder.weights(ema=True).is_file())


def check_output(folder: RunFolder) -> None:
    """A ConfigError unless ``output_dir`` is (or can become) a folder: it and every parent that exists are folders."""
    for path in (folder.root, *folder.root.parents):
        if path.exists():
            if not path.is_dir():
                raise ConfigError(f"output_dir {folder.root}: {path} is a file, not a folder; choose another "
                                  f"output_dir")
            return


def _move_position(state: TrainState, cfg: TrainConfig, accelerator: Accelerator, train_loader,
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


def _stop_if_preempted(run: _Run, meter: Optional[_EpochMeter] = None) -> None:
    """Between optimizer steps: when any process was sent a preemption signal (the flag is reduced, so every
    process stops at the same step), write this step's checkpoint and raise Preempted."""
    accelerator, state = run.accelerator, run.state
    received = int(accelerator.reduce(torch.tensor([float(run.preemption.signal)], device=accelerator.device),
                                      "max").item())
    if not received:
        return
    if meter is not None:  # mid-epoch: the resumed run completes the epoch's sums
        state.epoch_sums = meter.totals(accelerator)
    run.last_good = save_checkpoint(accelerator, run.model, run.folder.root, state, run.cfg.keep_last)
    accelerator.end_training()
    raise Preempted(f"{signal.Signals(received).name} received: every process finished step {state.step} and "
                    f"checkpoint {run.last_good} is written (epoch {state.epoch + 1}, {state.samples_in_epoch} of its "
                    f"samples used); continue with --resume auto")


def train(cfg: TrainConfig, resume: Optional[str] = None) -> dict:
    """Train per ``cfg``; ``resume`` is ``None``, ``"auto"`` (newest checkpoint in the output folder) or a path.

    SIGTERM and SIGUSR1 (:data:`PREEMPTION_SIGNALS`) stop the run after the optimizer step they arrive in, with
    that step's checkpoint written, by raising :class:`Preempted`; Ctrl-C raises :class:`Interrupted` naming the
    newest checkpoint. Returns the run's summary; resumed from the checkpoint that ended a finished run, nothing is
    done and the summary says ``finished_before``.
    """
    preemption = _Preemption()
    with preemption.watching():
        run = _start(cfg, resume)
        if isinstance(run, dict):  # the checkpoint resumed from is the end of the run: nothing to do
            return run
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
        row.update(alpha_statistics(accelerator.unwrap_model(run.model)))
        state.epoch, state.batch_in_epoch, state.epoch_sums = epoch + 1, 0, {}
        if (epoch + 1) % cfg.eval_every_epochs == 0 or epoch + 1 == cfg.epochs:
            row.update(evaluate_and_keep_best(run))
        run.log("epoch", state.step, **row)
        run.last_good = save_checkpoint(accelerator, run.model, run.folder.root, state, cfg.keep_last)
        if epoch + 1 < cfg.epochs:  # a signal during the evaluation: the epoch's checkpoint is the one
            _stop_if_preempted(run)

    _save_weights(run, accelerator.get_state_dict(run.model), run.folder.weights())
    if run.ema is not None:
        with run.ema.applied(run.model):
            _save_weights(run, accelerator.get_state_dict(run.model), run.folder.weights(ema=True))
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
    meter = _EpochMeter(carried=dict(state.epoch_sums) if state.batch_in_epoch else {})
    # closed however the loop ends, so an error line printed after it starts on a line of its own; a bar only when
    # stderr is a terminal (tqdm's disable=None), else a plain line every log_every_steps (_after_update)
    with tqdm(total=len(run.train_loader), initial=state.batch_in_epoch, desc=f"epoch {epoch + 1}/{cfg.epochs}",
              disable=None if accelerator.is_main_process else True, dynamic_ncols=True) as bar:
        for images, targets, bad in loader:
            meter.failed += bad
            if images is None:
                raise TooManyBadSamples(f"every image of a batch failed to load, e.g. {bad[:3]}")
            meter.seen += targets.shape[0]
            loss = _train_step(run, meter, images, targets, epoch)
            state.batch_in_epoch += 1
            bar.update(1)
            if loss is not None:
                meter.loss_sum, meter.loss_n = meter.loss_sum + loss, meter.loss_n + 1
            meter.images += targets.shape[0] * accelerator.num_processes
            if accelerator.sync_gradients:
                _after_update(run, meter, epoch, bar)

    totals = meter.totals(accelerator)  # every process's counts and examples, said once by the main process
    check_unreadable(f"epoch {epoch + 1}", totals["failed"], totals["seen"], cfg.max_bad_fraction,
                     totals["failed_paths"], say=accelerator.is_main_process)
    row = dict(train_loss=meter.loss, bad_samples=totals["failed"], train_samples=totals["seen"],
               processes=accelerator.num_processes, skipped_steps=state.skipped_steps, seconds=totals["seconds"])
    if attlip_steps is not None:
        row["attlip_train_steps"] = attlip_steps
    if run.keep is not None:  # keep()'s own bound when it projected after this step, else the report's
        step, bound = run.kept
        row["lipschitz_bound"] = bound if step == state.step else \
            lipschitz_report(accelerator.unwrap_model(run.model)).bound
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


def _train_step(run: _Run, meter: _EpochMeter, images, targets, epoch: int) -> Optional[float]:
    """Forward and backward of one batch, and the optimizer step at the end of an accumulation window;
    returns the loss, or None when it was not finite."""
    accelerator, model, cfg = run.accelerator, run.model, run.cfg
    with accelerator.accumulate(model):
        if run.mixup is not None:
            images, targets = run.mixup(images, targets)
        with accelerator.autocast():
            loss = run.criterion(model(images), targets)
        nonfinite = accelerator.reduce(torch.tensor([float(not torch.isfinite(loss))], device=loss.device),
                                       "sum").item()
        if nonfinite:
            meter.window_bad = True
            if cfg.on_nonfinite == "stop":
                raise run.diverged("loss", epoch)
        else:
            accelerator.backward(loss)
        if accelerator.sync_gradients and not meter.window_bad:
            norm = accelerator.clip_grad_norm_(model.parameters(), cfg.clip_grad or float("inf"))
            if accelerator.scaler is None and not torch.isfinite(norm):
                meter.window_bad = True
                if cfg.on_nonfinite == "stop":
                    raise run.diverged("gradient", epoch)
        if not meter.window_bad:
            run.optimizer.step()
        run.optimizer.zero_grad()
    return None if nonfinite else loss.item()


def _after_update(run: _Run, meter: _EpochMeter, epoch: int, bar) -> None:
    """Bookkeeping after an optimizer update: step count, bound keeping, schedule, EMA, logging, checkpoint, and
    the stop when a preemption signal came."""
    cfg, state = run.cfg, run.state
    if meter.window_bad:
        state.skipped_steps += 1
        meter.window_bad = False
    state.step += 1
    if run.keep is not None and state.step % cfg.lipschitz_every_steps == 0:
        run.keep_bound()
    run.scheduler.step_update(state.step)
    if run.ema is not None:
        run.ema.update(run.model, state.step)
    lr = run.optimizer.param_groups[0]["lr"]
    speed = meter.images / max(time.time() - meter.t0, 1e-9)
    bar.set_postfix(loss=f"{meter.loss:.4f}", lr=f"{lr:.2e}", img_s=f"{speed:.0f}")
    if state.step % cfg.log_every_steps == 0:
        run.log("train", state.step, epoch=epoch + 1, loss=meter.loss, lr=lr, img_per_s=speed)
        if bar.disable and run.accelerator.is_main_process:  # a log file, not a terminal: one plain line
            run.accelerator.print(f"epoch {epoch + 1}/{cfg.epochs} step {state.step} ({state.batch_in_epoch}/"
                                  f"{len(run.train_loader)} batches): loss {meter.loss:.4f}, lr {lr:.2e}, "
                                  f"{speed:.0f} img/s", flush=True)
    if state.step % cfg.checkpoint_every_steps == 0:
        state.epoch_sums = meter.totals(run.accelerator)  # a resume from this checkpoint completes these sums
        run.last_good = save_checkpoint(run.accelerator, run.model, run.folder.root, state, cfg.keep_last)
    _stop_if_preempted(run, meter)


def evaluate_and_keep_best(run: _Run) -> dict:
    """Validation top-1 / top-5 of the model (and of its EMA); the better of the two is saved as
    ``best.safetensors`` when it beats every earlier epoch. Returns the epoch row's validation figures."""
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
    which = max(candidates, key=candidates.get)
    if candidates[which] > state.best_top1:
        state.best_top1 = candidates[which]
        row["best"] = which
        with ema.applied(model) if which == "ema" else contextlib.nullcontext():
            _save_weights(run, accelerator.get_state_dict(model), run.folder.best)
    accelerator.print(f"epoch {state.epoch}: top-1 {metrics['top1']:.2f}"
                      + (f", EMA {row['ema_top1']:.2f}" if ema is not None else ""))
    return row


def _save_weights(run: _Run, state_dict: dict, path: Path) -> None:
    """Weights only, as safetensors (``get_state_dict`` gathers them under FSDP / DeepSpeed) whose metadata records
    the input size they were made at (:func:`~lipsformer.weights.recorded_input_size` reads it where no run folder
    is beside the file), written beside the target and renamed over it: a failed write leaves the previous file as
    it was."""
    if run.accelerator.is_main_process:
        tensors = {k: v.detach().cpu().contiguous() for k, v in state_dict.items()}
        assert_finite(tensors.items(), path)
        tmp = RunFolder.temporary(path)
        try:
            save_file(tensors, str(tmp), metadata=input_size_metadata((3, run.cfg.img_size, run.cfg.img_size)))
            readable_as_outputs(tmp)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise SaveFailed(f"could not write {path}: {e.strerror or e}; "
                             f"{'the previous file is intact' if path.exists() else 'nothing was written'}") from None
        os.replace(tmp, path)
