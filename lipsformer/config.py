"""The training recipe: one typed dataclass, loaded from YAML, overridden by ``--set key=value``.

How to add a config key: one field of :class:`TrainConfig`, declared with :func:`key`: its default, its help text
and its properties (``range=`` for every number, ``choices=`` for a fixed set of names, ``path=True``,
``restored=True`` where a checkpoint restores what it set up, ``keep_bound=`` / ``margin=True`` where bound keeping
reads it, ``model_arg=`` where ``timm.create_model`` gets it, ``weights=True`` where it says what a run's weights
are). Validation, ``train.py --list-keys``, the resume check, bound keeping's arguments, reading a run's weights
back and docs/keys.md all read them from there; then give the key a ``Case`` in tests/test_config_keys.py that shows
it acts, and regenerate docs/keys.md (``key_table()``).
"""
import copy
import dataclasses
import io
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import yaml

from .errors import ConfigError, did_you_mean
from .extras import TRACKERS
from .settings import SettingError, expand_path, load_yaml, read_yaml
from .weights import check_model_name
from .writer import write_text


# timm.scheduler.create_scheduler_v2 names that can step per optimizer update ('plateau' steps per epoch on a
# metric; 'none' leaves nothing to checkpoint: use 'constant').
SCHEDULERS = ("cosine", "tanh", "step", "multistep", "poly", "constant", "wsd", "rsqrt")
# timm.data.create_dataset's sources besides an image folder (dataset: '').
DATASET_PREFIXES = ("hfds", "hfids", "wds", "tfds", "torch")
# timm's str_to_interp_mode
INTERPOLATIONS = ("bicubic", "bilinear", "nearest", "lanczos", "box", "hamming")
# torch.compile's modes (lipsformer.engine.speed.compile_model)
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


class Range(NamedTuple):
    """The values a number may take (each value of a list or tuple key); ``says``: how a message puts it."""

    low: float
    high: float = math.inf
    low_in: bool = True
    high_in: bool = False
    says: str = ""

    def __contains__(self, v) -> bool:
        return (self.low <= v if self.low_in else self.low < v) and (v <= self.high if self.high_in else v < self.high)

    def describe(self) -> str:
        return self.says or (f"in {'[' if self.low_in else '('}{self.low:g}, {self.high:g}"
                             f"{']' if self.high_in else ')'}")


_AT_LEAST_1, _ZERO_OR_MORE = Range(1, says="at least 1"), Range(0, says="0 or more")
_POSITIVE = Range(0, low_in=False, says="positive (or null)")
_PROBABILITY, _FRACTION = Range(0, 1, True, True), Range(0, 1, False, True)


@dataclass(frozen=True)
class Key:
    """What a TrainConfig field is besides its type and default: the one place each of a key's properties lives.
    Every number has a ``range`` (values torch / timm would refuse late, after the run wrote its folder, or would
    quietly misuse: a negative clip_grad flips the gradients)."""

    help: str  # what the key does: train.py --list-keys, docs/keys.md
    range: Optional[Range] = None  # each number (of a list or tuple) lies in it
    choices: Tuple[str, ...] = ()  # each value (of a list) is one of these
    path: bool = False  # a file or folder: its ~ and $VARIABLES are expanded (settings.expand_path)
    section: str = ""  # the heading of the group of keys this one opens
    restored: bool = False  # a checkpoint restores what it set up (optimizer, schedule): a resume must keep it
    builds_model: bool = False  # the checkpoint holds the model it builds: a resume cannot change it
    keep_bound: str = ""  # the keep_bound argument it is (lipsformer.lipschitz.constraints)
    margin: bool = False  # the margin loss reads it (a checkpoint's record of the kept bound compares it too)
    model_arg: str = ""  # the timm.create_model argument it sets (model_kwargs may not set it again)
    weights: bool = False  # says what a run's weights are (the model built, its input and preprocessing): a run's
    # config.yaml must hold it (read_run_config)


def key(default: Any, help: str, **properties) -> Any:
    """A TrainConfig field: ``default`` (a list or mapping is copied for each config) and its :class:`Key`."""
    metadata = {"key": Key(help, **properties)}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class TrainConfig:
    """Every knob of a training run. Defaults are the paper's Table 6 recipe for the Tiny models."""

    model: str = key("lipsformer_cswin_t", "a timm model name (lipsformer_swin_t, lipsformer_cswin_s, ...)",
                     section="model", builds_model=True, weights=True)
    model_kwargs: Dict[str, Any] = key({}, "extra timm.create_model arguments", weights=True)
    num_classes: int = key(1000, "classes of the classifier", model_arg="num_classes", builds_model=True,
                           range=Range(2, says="at least 2 (cross-entropy over one class has nothing to learn)"),
                           weights=True)
    drop_path: float = key(0.2, "stochastic depth rate (timm's drop_path_rate)", range=Range(0, 1),
                           model_arg="drop_path_rate")
    img_size: int = key(224, "input height and width", range=_AT_LEAST_1, model_arg="img_size", weights=True)
    crop_pct: float = key(0.9, "evaluation resizes to img_size / crop_pct, then center-crops img_size (timm's "
                          "crop_pct)", range=Range(0, 2, False, True), weights=True)
    interpolation: str = key("bicubic", "resize interpolation", choices=INTERPOLATIONS, weights=True)
    data_dir: Optional[str] = key(None, "the image folder (train/, val/), or the root a timm dataset reads", path=True,
                                  section="data: a folder with train/ and val/ (one folder per "
                                  "class), or any timm dataset name (hfds/..., wds/...)")
    dataset: str = key("", "a timm dataset, PREFIX/NAME ('': the image folder data_dir)")
    train_split: str = key("train", "the training split: a subfolder of data_dir, or the dataset's split")
    val_split: str = key("val", "the evaluation split: a subfolder of data_dir, or the dataset's split")
    workers: int = key(8, "data loader workers per process", range=_ZERO_OR_MORE)
    max_bad_fraction: float = key(0.01, "stop when more of an epoch's samples than this fail to load",
                                  range=_PROBABILITY)
    epochs: int = key(300, "epochs of the run and its lr schedule", range=_AT_LEAST_1, restored=True,
                      section="optimisation (Table 6)")
    global_batch: int = key(2048, "= batch_size x processes x accumulation steps", range=_AT_LEAST_1)
    batch_size: int = key(128, "per process", range=_AT_LEAST_1)
    opt: str = key("adamw", "a timm optimizer (timm.optim.list_optimizers())", restored=True)
    lr: float = key(2e-3, "the peak learning rate", range=Range(0, low_in=False), restored=True)
    betas: Tuple[float, float] = key((0.9, 0.999), "the optimizer's betas", range=Range(0, 1), restored=True)
    eps: float = key(1e-8, "the optimizer's eps", range=Range(0), restored=True)
    weight_decay: float = key(0.05, "weight decay (timm's create_optimizer_v2)", range=Range(0), restored=True)
    sched: str = key("cosine", "a timm scheduler (create_scheduler_v2), stepped per optimizer update",
                     choices=SCHEDULERS, restored=True)
    decay_epochs: Optional[float] = key(None, "step: epochs between decays (required); wsd / rsqrt: decay phase "
                                        "length", range=_POSITIVE, restored=True)
    decay_milestones: Optional[List[int]] = key(None, "multistep: the epochs to decay at (required)",
                                                range=_AT_LEAST_1, restored=True)
    decay_rate: Optional[float] = key(None, "step / multistep: lr factor per decay; poly: the power (null: timm's "
                                      "0.1)", range=_POSITIVE, restored=True)
    warmup_epochs: int = key(0, "the paper's point: no warmup (linear from min_lr to lr when set)",
                             range=Range(0, says="at least 0"), restored=True)
    min_lr: float = key(1e-5, "the lr the schedule ends at, and warmup starts from", range=Range(0), restored=True)
    clip_grad: Optional[float] = key(None, "clip the gradient norm to this (null: no clipping)", range=_POSITIVE)
    label_smoothing: float = key(0.1, "label smoothing", range=Range(0, 1))
    aa: Optional[str] = key("rand-m9-mstd0.5-inc1", "timm's augmentation policy (null: none)")
    reprob: float = key(0.25, "random erasing probability", range=_PROBABILITY)
    hflip: float = key(0.5, "horizontal flip probability", range=_PROBABILITY)
    scale: Tuple[float, float] = key((0.08, 1.0), "RandomResizedCrop area range", range=_FRACTION)
    mixup: float = key(0.8, "mixup alpha (0: off)", range=Range(0))
    cutmix: float = key(1.0, "cutmix alpha (0: off)", range=Range(0))
    ema_decay: Optional[float] = key(0.99984, "decay of the weights' exponential moving average",
                                     range=Range(0, 1, says="in [0, 1) (0 or null: no EMA)"), weights=True)
    mixed_precision: str = key("bf16", "Accelerate's mixed precision (fp16: GPUs only)", choices=("bf16", "fp16", "no"))
    seed: int = key(0, "seed of the init, the data order and the augmentation",
                    range=Range(0, 2 ** 32 - 1, True, True, "in [0, 2**32 - 1]"), section="run")
    output_dir: str = key("output/run", "the run folder: config, checkpoints, metrics, weights", path=True)
    checkpoint_every_steps: int = key(1000, "optimizer steps; a checkpoint is also written at every epoch end",
                                      range=_AT_LEAST_1)
    keep_last: int = key(3, "the newest checkpoints kept", range=_AT_LEAST_1)
    keep_best: int = key(10, "weight files of the best epochs by val top-1, in best/ (timm's checkpoint-hist; 0: "
                         "none)", range=_ZERO_OR_MORE)
    on_nonfinite: str = key("stop", "a non-finite loss or gradient: stop the run, or skip the update and count it",
                            choices=("stop", "skip"))
    log_every_steps: int = key(50, "optimizer steps between logged rows", range=_AT_LEAST_1)
    eval_every_epochs: int = key(1, "epochs between evaluations", range=_AT_LEAST_1)
    log_with: List[str] = key(["tensorboard"], "Accelerate's trackers ([]: none)", choices=tuple(TRACKERS))
    tracker_project: str = key("lipsformer", "the trackers' project: wandb's project, MLflow's experiment")
    tracker_run_name: Optional[str] = key(None, "the run's name in wandb / MLflow (null: output_dir's folder name)")
    lipschitz_target: Optional[float] = key(None, "keep the certified bound under this (null: off)", range=_POSITIVE,
                                            keep_bound="target",
                                            section="bound keeping (lipsformer.lipschitz.constraints): keep the "
                                            "certified network bound under a target")
    lipschitz_gamma_max: float = key(1.0, "CenterNorm gammas are clipped to [-this, this]", range=_POSITIVE,
                                     keep_bound="gamma_max")
    lipschitz_tau_max: Optional[float] = key(None, "a learnable SCSA tau is clipped to (0, this] (None: free)",
                                             range=_POSITIVE, keep_bound="tau_max")
    lipschitz_weight_max: Optional[float] = key(None, "Linear weights scaled back to this spectral norm (None: free)",
                                                range=_POSITIVE, keep_bound="weight_max")
    lipschitz_every_steps: int = key(1, "project after every N optimizer steps (the bound costs one SVD per "
                                     "matrix)", range=_AT_LEAST_1)
    lipschitz_conv_max: Optional[float] = key(None, "Conv2d scaled back to this operator norm at its input size "
                                              "(None: free)", range=_POSITIVE, keep_bound="conv_max")
    margin_eps: float = key(0.0, "0: off", range=Range(0, says="a number >= 0"), margin=True,
                            section="Lipschitz-margin loss (Tsuzuku et al. 2018; lipsformer.engine.margin): the true "
                            "logit lowered by sqrt(2) L eps")
    margin_bound: Optional[float] = key(None, "L: a fixed value, or None for the bound kept by lipschitz_target",
                                        range=_POSITIVE, margin=True)
    attlip_train_steps: Optional[List[int]] = key(
        None, "AttLip's proximal steps in training by phase: the epochs split into len(list) equal phases, phase i "
        "trains with list[i] steps (the AttLip paper: [1, 2, 3]); evaluation keeps model_kwargs.attlip_steps[1]",
        range=Range(1, says="a non-empty list of step counts >= 1 (null: the model's own)"),
        section="AttLip (lipsformer.layers.attlip)")
    compile: bool = key(False, "torch.compile the prepared model, static shapes", section="speed "
                        "(lipsformer.engine.speed; README GPU): none of these changes the outputs beyond rounding")
    compile_mode: str = key("default", "torch.compile's mode", choices=COMPILE_MODES)
    compile_memory_budget: Optional[float] = key(None, "partitioner's activation memory budget in (0, 1]; None: 1.0",
                                                 range=_FRACTION)
    channels_last: bool = key(False, "NHWC weights and input batches")
    grad_checkpointing: bool = key(False, "recompute each block's activations in backward")
    tf32: bool = key(False, "TF32 tensor cores for fp32 matmuls / convolutions on CUDA (bf16 / fp16 runs: no effect)")
    pretrained: Optional[str] = key(None, "published weights, as a timm name: lipsformer_swin_t.official_in1k",
                                    section="fine-tuning (lipsformer.engine.finetune): start from weights; --resume "
                                    "takes precedence over both sources")
    init_checkpoint: Optional[str] = key(None, "weights to start from: .pth, checkpoints/MODEL.TAG or a run",
                                         path=True)
    init_use_ema: bool = key(False, "take init_checkpoint's EMA weights")
    reset_head: bool = key(False, "re-create the classifier even at the source's class count (other classes)")
    layer_decay: Optional[float] = key(None, "timm's layer-wise lr decay in (0, 1] over the model's group_matcher",
                                       range=_FRACTION, restored=True)
    freeze: Optional[str] = key(None, "'backbone' (linear probe) or comma-separated module names "
                                "(patch_embed,stages.0)")
    freeze_stages: int = key(0, "hold patch_embed and the first N stages fixed", range=_ZERO_OR_MORE)

    def __post_init__(self):
        """Every check a config can fail without running anything lives here, each naming its key. Path keys get
        their ``~`` and ``$VARIABLES`` expanded first."""
        for key in path_keys():
            if isinstance(getattr(self, key), str):
                try:
                    setattr(self, key, expand_path(getattr(self, key), key))
                except SettingError as e:
                    raise ConfigError(str(e)) from None
        for key, allowed in CHOICES.items():
            value = getattr(self, key)
            for v in value if isinstance(value, list) else [value]:
                if v not in allowed:
                    raise ConfigError(f"{key} must be one of {allowed}, got {v!r}{_choice_hint(v, allowed, value)}")
        for key, allowed in RANGES.items():
            value = getattr(self, key)
            values = value if isinstance(value, (list, tuple)) else () if value is None else (value,)
            if any(v not in allowed for v in values):
                raise ConfigError(f"{key} must be {allowed.describe()}, got {value}")
        self._check_names()
        self._check_trackers()
        duplicated = sorted(set(self.model_kwargs) & set(MODEL_ARGS))
        if duplicated:
            raise ConfigError(", ".join(f"model_kwargs.{k} duplicates the top-level key {MODEL_ARGS[k]}"
                                        for k in duplicated) + "; set the top-level key instead")
        if (self.mixup > 0 or self.cutmix > 0) and self.batch_size % 2:
            raise ConfigError(f"mixup/cutmix need an even batch_size, got {self.batch_size}")
        if self.pretrained and self.init_checkpoint:
            raise ConfigError("set one of pretrained (published weights) and init_checkpoint (a file or folder)")
        if self.init_use_ema and not self.init_checkpoint:
            raise ConfigError("init_use_ema applies to init_checkpoint, which is not set")
        if self.reset_head and not (self.pretrained or self.init_checkpoint):
            raise ConfigError("reset_head applies to pretrained or init_checkpoint weights; neither is set")
        if (self.freeze or self.freeze_stages) and self.lipschitz_target is not None:
            raise ConfigError("lipschitz_target rescales the residual weights (and lipschitz_weight_max / "
                              "lipschitz_conv_max the weights) of the whole model after every step, frozen ones "
                              "included: unset freeze / freeze_stages or lipschitz_target")

        if self.margin_eps and self.margin_bound is None and self.lipschitz_target is None:
            raise ConfigError("margin_eps with margin_bound: null follows the bound kept by lipschitz_target; "
                              "set lipschitz_target, or a fixed margin_bound")
        if self.lipschitz_conv_max is not None and self.lipschitz_target is None:
            raise ConfigError("lipschitz_conv_max is applied when the bound is kept: set lipschitz_target too")
        if self.attlip_train_steps is not None:
            steps = self.attlip_train_steps
            if not steps:
                raise ConfigError(f"attlip_train_steps must be {RANGES['attlip_train_steps'].describe()}, got {steps}")
            if len(steps) > self.epochs:
                raise ConfigError(f"attlip_train_steps has {len(steps)} phases but the run has {self.epochs} epochs: "
                                  f"each phase needs at least one epoch")
        self._check_schedule()
        self._check_weight_source()

    def _check_names(self) -> None:
        """The keys that name something timm knows: the model, the optimizer, the augmentation policy; and the
        crop scale's order."""
        check_model_name(self.model)
        from timm.optim import list_optimizers
        known = list_optimizers()
        if self.opt.lower().split("_")[-1] not in known:  # timm: NAME or lookahead_NAME
            raise ConfigError(f"opt {self.opt!r} is not a timm optimizer{did_you_mean(self.opt.lower(), known)} "
                              f"(timm.optim.list_optimizers() lists them)")
        if self.aa:
            from timm.data import create_transform
            try:  # timm parses the policy string when the transform is built; here, before the run starts
                create_transform(8, is_training=True, auto_augment=self.aa)
            except (AssertionError, ValueError, KeyError, IndexError) as e:
                raise ConfigError(f"aa {self.aa!r} is not a timm augmentation policy ({e}); e.g. "
                                  f"rand-m9-mstd0.5-inc1, augmix-m5-w4-d2, v0, original (null: none)") from None
        prefix, slash, name = self.dataset.partition("/")
        if self.dataset and not (slash and name and prefix.lower() in DATASET_PREFIXES):
            raise ConfigError(f"dataset {self.dataset!r} is not a timm dataset name: PREFIX/NAME with PREFIX one of "
                              f"{', '.join(DATASET_PREFIXES)}, or '' for the image folder data_dir"
                              f"{did_you_mean(prefix.lower(), DATASET_PREFIXES)}")
        if self.scale[0] > self.scale[1]:
            raise ConfigError(f"scale must be (low, high) with low <= high, got {list(self.scale)}")

    def _check_trackers(self) -> None:
        """``log_with`` names each tracker once; the project and run names are names (wandb's project takes none of
        ``/ \\ # ? % :``)."""
        twice = sorted({t for t in self.log_with if self.log_with.count(t) > 1})
        if twice:
            raise ConfigError(f"log_with names {', '.join(twice)} more than once; give each tracker once")
        for key in ("tracker_project", "tracker_run_name"):
            if getattr(self, key) is not None and not getattr(self, key).strip():
                raise ConfigError(f"{key} must not be empty" + (" (null: output_dir's folder name)"
                                                               if key == "tracker_run_name" else ""))
        if "wandb" in self.log_with and set(self.tracker_project) & set("/\\#?%:"):
            raise ConfigError(f"tracker_project {self.tracker_project!r}: a wandb project name cannot hold any of "
                              f"/ \\ # ? % :")

    def _check_schedule(self) -> None:
        """The decay keys: required where the schedule needs them, refused where it would ignore them."""
        uses = {"decay_epochs": ("step", "wsd", "rsqrt"), "decay_milestones": ("multistep",),
                "decay_rate": ("step", "multistep", "poly")}
        for key, scheds in uses.items():
            if getattr(self, key) is not None and self.sched not in scheds:
                raise ConfigError(f"{key} applies to sched {' / '.join(scheds)}, not {self.sched}: unset it or "
                                  f"change sched")
        if self.sched == "step" and self.decay_epochs is None:
            raise ConfigError("sched step needs decay_epochs (the epochs between two decays of the lr)")
        if self.sched == "multistep" and not self.decay_milestones:
            raise ConfigError("sched multistep needs decay_milestones (the epochs at which the lr decays)")
        if self.decay_epochs is not None and not 0 < self.decay_epochs <= self.epochs:
            raise ConfigError(f"decay_epochs must be in (0, epochs={self.epochs}], got {self.decay_epochs}")
        late = [m for m in self.decay_milestones or [] if not 0 < m < self.epochs]
        if late:
            raise ConfigError(f"decay_milestones must lie in (0, epochs={self.epochs}) to decay the lr, got {late}")

    def _check_weight_source(self) -> None:
        """Keys that only act on loaded weights need a source; a source spelled another way is named."""
        source = self.pretrained or self.init_checkpoint
        if self.pretrained and self.pretrained.startswith(("local-dir:", "hf-hub:", "hf_hub:")):
            where = self.pretrained.split(":", 1)[1]
            raise ConfigError(f"pretrained takes a timm name with published weights (MODEL.TAG), not "
                              f"{self.pretrained!r}; for weights in a folder or file set init_checkpoint: {where}")
        if "pretrained" in self.model_kwargs:
            raise ConfigError("model_kwargs.pretrained: set the top-level key pretrained (MODEL.TAG) or "
                              "init_checkpoint instead")
        overlay = self.model_kwargs.get("pretrained_cfg_overlay") or {}
        files = sorted(k for k in ("file", "url", "hf_hub_id", "state_dict") if isinstance(overlay, dict)
                       and overlay.get(k))
        if files and not self.pretrained:
            raise ConfigError(f"model_kwargs.pretrained_cfg_overlay.{files[0]} is read only when pretrained weights "
                              f"load: set init_checkpoint: {overlay[files[0]]} instead (or pretrained: MODEL.TAG)")
        if (self.freeze or self.freeze_stages) and not source:
            raise ConfigError("freeze / freeze_stages hold pretrained weights fixed, but neither pretrained nor "
                              "init_checkpoint is set: the frozen modules would stay at their random init")

    def attlip_steps_at(self, epoch: int) -> Optional[int]:
        """AttLip's proximal steps in training at ``epoch`` (from 0) under ``attlip_train_steps``, or None."""
        steps = self.attlip_train_steps
        return None if steps is None else steps[epoch * len(steps) // self.epochs]

    def model_args(self) -> Dict[str, Any]:
        """``timm.create_model`` arguments: the top-level model keys (MODEL_ARGS) plus ``model_kwargs``."""
        return dict({arg: getattr(self, key) for arg, key in MODEL_ARGS.items()}, **self.model_kwargs)

    def accumulation_steps(self, num_processes: int) -> int:
        """Gradient accumulation derived from the global batch; it must divide exactly."""
        per_step = self.batch_size * num_processes
        if self.global_batch % per_step:
            raise ConfigError(f"global_batch {self.global_batch} is not a multiple of batch_size {self.batch_size} "
                              f"x {num_processes} processes; change global_batch or batch_size")
        return self.global_batch // per_step

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    def save(self, path) -> None:
        """The config as YAML, through the one writer (:func:`lipsformer.writer.write_text`)."""
        data = self.to_dict()
        data["betas"], data["scale"] = list(data["betas"]), list(data["scale"])
        write_text(path, yaml.safe_dump(data, sort_keys=False))


_HINTS = typing.get_type_hints(TrainConfig)
# Each key's Key, and the views of them that their readers take (each in the fields' order).
KEYS: Dict[str, Key] = {f.name: f.metadata.get("key", Key("")) for f in dataclasses.fields(TrainConfig)}
RANGES = {name: spec.range for name, spec in KEYS.items() if spec.range}
CHOICES = {name: spec.choices for name, spec in KEYS.items() if spec.choices}
RESTORED_ON_RESUME = tuple(name for name, spec in KEYS.items() if spec.restored)
BUILDS_MODEL = tuple(name for name, spec in KEYS.items() if spec.builds_model)
KEEP_BOUND_KEYS = {name: spec.keep_bound for name, spec in KEYS.items() if spec.keep_bound}  # key -> keep_bound arg
MARGIN_KEYS = tuple(name for name, spec in KEYS.items() if spec.margin)
MODEL_ARGS = {spec.model_arg: name for name, spec in KEYS.items() if spec.model_arg}  # timm argument -> key


def path_keys() -> List[str]:
    """The TrainConfig keys that hold a path (``key(..., path=True)``)."""
    return [name for name, spec in KEYS.items() if spec.path]


def _check_type(key: str, value: Any, hint) -> Any:
    """Coerce ``value`` to the field's declared type, or raise a ConfigError naming ``key``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union:  # Optional[X]
        if value is None:
            return None
        return _check_type(key, value, next(a for a in args if a is not type(None)))
    if origin in (tuple, Tuple):
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{key} must be a list of {len(args)} values, got {value!r}")
        return tuple(_check_type(key, v, a) for v, a in zip(value, args))
    if origin in (list, List):
        if isinstance(value, str) and args[0] is str:  # a list of names takes one name: log_with: wandb
            value = [value]
        if not isinstance(value, (list, tuple)):
            got = "null (an empty list is [])" if value is None else repr(value)
            raise ConfigError(f"{key} must be a list, got {got}")
        return [_check_type(key, v, args[0]) for v in value]
    if origin in (dict, Dict):
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping, got {value!r}")
        return dict(value)
    if hint is float and not isinstance(value, bool) and isinstance(value, (int, str)):
        try:  # YAML reads 1e-3 (no dot) as a string
            return float(value)
        except ValueError:
            raise ConfigError(f"{key} must be a number, got {value!r}") from None
    if hint in (int, float, str, bool) and (type(value) is not hint):
        raise ConfigError(f"{key} must be of type {hint.__name__}, got {value!r} ({type(value).__name__})")
    return value


def _choice_hint(v, allowed, value) -> str:
    """What to write instead of the value ``v`` of a choice key (of a list of them when ``value`` is a list): the
    list that a comma-separated string meant, ``[]`` for none, or the closest names."""
    if isinstance(value, list):
        parts = [p.strip() for p in str(v).split(",")]
        if len(parts) > 1 and set(parts) <= set(allowed):
            return f": a list is written [{', '.join(parts)}]"
        return did_you_mean(v, allowed) + ("; [] for none" if str(v).lower() in ("none", "null", "") else "")
    return did_you_mean(v, allowed)


def _type_name(hint) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union:
        return " | ".join(_type_name(a) for a in args if a is not type(None)) + " | null"
    if origin in (list, List):
        return f"list of {_type_name(args[0])}"
    if origin in (tuple, Tuple):
        return "[" + ", ".join(_type_name(a) for a in args) + "]"
    if origin in (dict, Dict):
        return "mapping"
    return getattr(hint, "__name__", str(hint))


def describe_keys() -> str:
    """Every TrainConfig key with its type, its default and what it does (its :class:`Key`): the table of
    ``train.py --list-keys``, each group of keys under its heading."""
    lines = []
    for f in dataclasses.fields(TrainConfig):
        spec = KEYS[f.name]
        if spec.section:
            lines.append(f"# {spec.section}")
        lines.append(f"{f.name:<24} {_type_name(_HINTS[f.name]):<22} {_default(f):<22} {_says(f.name)}".rstrip())
    return "\n".join(lines)


def key_table() -> str:
    """docs/keys.md: every TrainConfig key as :func:`describe_keys` lists it, one Markdown table per group."""
    lines = ["# Config keys", "",
             "Every key of `TrainConfig` (`lipsformer/config.py`), generated from its fields by `key_table()`",
             "(`tests/test_config_keys.py` holds this page to it); `python train.py --list-keys` prints the same.",
             "A key marked *resume keeps it* is restored by a checkpoint with the optimizer or the schedule: a resume",
             "that changes it is refused ([training.md](training.md#resuming))."]
    for f in dataclasses.fields(TrainConfig):
        spec = KEYS[f.name]
        if spec.section:
            lines += ["", f"**{spec.section}**", "", "| key | type | default | what it does |",
                      "| --- | --- | --- | --- |"]
        says = _says(f.name) + ("; *resume keeps it*" if spec.restored else "")
        cells = (f"`{f.name}`", _type_name(_HINTS[f.name]), f"`{_default(f)}`", says)
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def _default(f: dataclasses.Field) -> str:
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    return yaml.safe_dump(list(default) if isinstance(default, tuple) else default, default_flow_style=True,
                          width=1000).strip().removesuffix("...").strip()


def _says(name: str) -> str:
    """The key's help text and the values it takes."""
    spec = KEYS[name]
    takes = (f"one of {', '.join(spec.choices)}" if spec.choices else
             spec.range.describe().replace(" (or null)", "") if spec.range else "")
    return "; ".join(s for s in (spec.help, takes) if s)


def _unknown(keys) -> ConfigError:
    return ConfigError("unknown config key(s): " + ", ".join(f"{k}{did_you_mean(k, _HINTS)}" for k in keys)
                       + "; train.py --list-keys lists them")


def check_type(key: str, value: Any) -> Any:
    """``value`` coerced to the type of TrainConfig's ``key``, or a ConfigError naming the key."""
    if key not in _HINTS:
        raise _unknown([key])
    return _check_type(key, value, _HINTS[key])


class _Named(io.StringIO):
    """Text PyYAML reads under a name of ours, which its errors then give (``--set lr=[1``)."""

    def __init__(self, text: str, name: str):
        super().__init__(text)
        self.name = name


def _is_list(key: str) -> bool:
    return key.startswith("model_kwargs.") or typing.get_origin(_strip_optional(_HINTS.get(key))) in (list, tuple)


def _strip_optional(hint):
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if typing.get_origin(hint) is typing.Union and len(args) == 1 else hint


def parse_override(item: str) -> Tuple[str, Any]:
    """``key=value`` of ``--set``: the value as YAML; ``1,1,2`` is a list where the key takes one (a model
    argument, or a list key such as betas), and ``no`` stays a word where the key's choices have it."""
    if "=" not in item:
        raise ConfigError(f"--set {item!r} must look like key=value")
    key, raw = (s.strip() for s in item.split("=", 1))
    value = load_yaml(_Named(raw, f"--set {item}"))
    if isinstance(value, str) and "," in raw and raw[:1] not in "[{\"'" and _is_list(key):
        value = load_yaml(_Named(f"[{raw}]", f"--set {item}"))  # --set model_kwargs.depths=1,1,2,1
    if isinstance(value, bool) and raw in CHOICES.get(key, ()):
        value = raw  # YAML 1.1 reads no as a boolean: --set mixed_precision=no means the word
    return key, value


def load_config(path=None, overrides: Optional[List[str]] = None, flags: Optional[Dict[str, Tuple[str, Any]]] = None
                ) -> TrainConfig:
    """TrainConfig from a YAML file, then ``key=value`` overrides (values parsed as YAML), then ``flags``: ``key ->
    (flag, value)`` from a command's own options (``--data-dir``), values already typed. The file and the overrides
    are read strictly (:mod:`lipsformer.settings`: a key given twice is refused); a key set twice on the command
    line (two ``--set``, or ``--set`` and its flag) is refused too. A file that is not YAML (or not text) raises
    PyYAML's error naming the file and the place."""
    data: Dict[str, Any] = {}
    if path is not None:
        if not Path(path).is_file():
            raise ConfigError(f"config file {path} is a folder, not a YAML file" if Path(path).is_dir() else
                              f"config file {path}: no such file")
        loaded = read_yaml(path)
        if not isinstance(loaded, (dict, type(None))):
            raise ConfigError(f"{path}: a config file must be a mapping of keys to values")
        data.update(loaded or {})
        for key, value in data.items():  # YAML 1.1 reads no as false: `mixed_precision: no` means the word, as in --set
            if value is False and "no" in CHOICES.get(key, ()):
                data[key] = "no"
    given: Dict[str, str] = {}  # key -> where the command line set it
    items = [(f"--set {item}", *parse_override(item)) for item in overrides or []]
    items += [(f"{flag} {value}", key, value) for key, (flag, value) in (flags or {}).items() if value is not None]
    for where, key, value in items:
        if key in given:
            raise ConfigError(f"{key} is set twice on the command line ({given[key]}, then {where}); give it once")
        given[key] = where
        if key.startswith("model_kwargs."):
            kwargs = data.get("model_kwargs") or {}
            if not isinstance(kwargs, dict):
                raise ConfigError(f"model_kwargs must be a mapping, got {kwargs!r}")
            data["model_kwargs"] = dict(kwargs, **{key.split(".", 1)[1]: value})
            continue
        data[key] = value
    unknown = sorted(str(k) for k in set(data) - set(_HINTS))
    if unknown:
        raise _unknown(unknown)
    return TrainConfig(**{k: _check_type(k, v, _HINTS[k]) for k, v in data.items()})


# The keys of a run's config.yaml that say what its weights are (sources.py reads them to build the model, its input
# size and its preprocessing): a run writes every key, so one of these missing was removed by hand.
WEIGHTS_KEYS = tuple(name for name, spec in KEYS.items() if spec.weights)


def read_run_config(path, needed: Tuple[str, ...] = WEIGHTS_KEYS) -> TrainConfig:
    """A run's ``config.yaml``, as train.py wrote it, read with the strictness of a user's config (:func:`load_config`:
    a key given twice, an unknown key, a wrong type or range), each refusal a ConfigError naming the file; a key of
    ``needed`` that is missing is one too, rather than a default that would describe other weights."""
    path = Path(path)
    loaded = read_yaml(path)
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: a run's config must be a mapping of keys to values (train.py writes every key)")
    missing = [key for key in needed if key not in loaded]
    if missing:
        raise ConfigError(f"{path} has no {', '.join(missing)}: a run's config.yaml holds every key the run was "
                          f"started with (train.py writes them all); put {'it' if len(missing) == 1 else 'them'} "
                          f"back as the run had {'it' if len(missing) == 1 else 'them'}")
    try:
        return load_config(path)
    except ConfigError as e:
        if str(path) in str(e):
            raise
        raise ConfigError(f"{path}: {e}") from None
