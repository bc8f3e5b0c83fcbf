"""The training recipe: one typed dataclass, loaded from YAML, overridden by ``--set key=value``."""
import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import yaml

from .speed import COMPILE_MODES


class ConfigError(ValueError):
    """A config file or override names an unknown key or gives a value of the wrong type."""


# timm.create_model argument -> the TrainConfig key that sets it (model_kwargs may not set these again).
MODEL_ARGS = {"num_classes": "num_classes", "drop_path_rate": "drop_path", "img_size": "img_size"}
# timm.scheduler.create_scheduler_v2 names that can step per optimizer update ('plateau' steps per epoch on a
# metric; 'none' leaves nothing to checkpoint: use 'constant').
# Keys whose values a checkpoint restores (optimizer param groups, scheduler state): a resume may not change them.
RESTORED_ON_RESUME = ("epochs", "opt", "lr", "betas", "eps", "weight_decay", "layer_decay", "sched",
                      "warmup_epochs", "min_lr", "decay_epochs", "decay_milestones", "decay_rate")
SCHEDULERS = ("cosine", "tanh", "step", "multistep", "poly", "constant", "wsd", "rsqrt")


# Keys with a fixed set of values.
CHOICES = {
    "mixed_precision": ("bf16", "fp16", "no"),
    "on_nonfinite": ("stop", "skip"),
    "sched": SCHEDULERS,
    "compile_mode": COMPILE_MODES,
}


@dataclass
class TrainConfig:
    """Every knob of a training run. Defaults are the paper's Table 6 recipe for the Tiny models."""

    # model
    model: str = "lipsformer_cswin_t"
    model_kwargs: Dict[str, Any] = field(default_factory=dict)  # extra timm.create_model arguments
    num_classes: int = 1000
    drop_path: float = 0.2
    img_size: int = 224
    crop_pct: float = 0.9
    interpolation: str = "bicubic"
    # data: a folder with train/ and val/ (one folder per class), or any timm dataset name (hfds/..., wds/...)
    data_dir: Optional[str] = None
    dataset: str = ""
    train_split: str = "train"
    val_split: str = "val"
    workers: int = 8
    max_bad_fraction: float = 0.01  # stop when more of an epoch's samples than this fail to load
    # optimisation (Table 6)
    epochs: int = 300
    global_batch: int = 2048  # = batch_size x processes x accumulation steps
    batch_size: int = 128  # per process
    opt: str = "adamw"
    lr: float = 2e-3
    betas: Tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.05
    sched: str = "cosine"  # a timm scheduler (create_scheduler_v2), stepped per optimizer update: see SCHEDULERS
    decay_epochs: Optional[float] = None  # step: epochs between decays (required); wsd / rsqrt: decay phase length
    decay_milestones: Optional[List[int]] = None  # multistep: the epochs to decay at (required)
    decay_rate: Optional[float] = None  # step / multistep: lr factor per decay; poly: the power (null: timm's 0.1)
    warmup_epochs: int = 0  # the paper's point: no warmup (linear from min_lr to lr when set)
    min_lr: float = 1e-5
    clip_grad: Optional[float] = None
    label_smoothing: float = 0.1
    aa: Optional[str] = "rand-m9-mstd0.5-inc1"
    reprob: float = 0.25
    hflip: float = 0.5
    scale: Tuple[float, float] = (0.08, 1.0)  # RandomResizedCrop area range
    mixup: float = 0.8
    cutmix: float = 1.0
    ema_decay: Optional[float] = 0.99984
    mixed_precision: str = "bf16"  # bf16 | fp16 | no
    # run
    seed: int = 0
    output_dir: str = "output/run"
    checkpoint_every_steps: int = 1000  # optimizer steps; a checkpoint is also written at every epoch end
    keep_last: int = 3
    on_nonfinite: str = "stop"  # stop | skip
    log_every_steps: int = 50
    eval_every_epochs: int = 1
    # bound keeping (lipsformer.lipschitz.constraints): keep the certified network bound under a target
    lipschitz_target: Optional[float] = None  # None: off
    lipschitz_gamma_max: float = 1.0  # CenterNorm gammas are clipped to [-this, this]
    lipschitz_weight_max: Optional[float] = None  # Linear weights scaled back to this spectral norm (None: free)
    lipschitz_every_steps: int = 1  # project after every N optimizer steps (the bound costs one SVD per matrix)
    lipschitz_conv_max: Optional[float] = None  # Conv2d scaled back to this operator norm at its input size (None: free)
    # Lipschitz-margin loss (Tsuzuku et al. 2018; lipsformer.engine.margin): the true logit lowered by sqrt(2) L eps
    margin_eps: float = 0.0  # 0: off
    margin_bound: Optional[float] = None  # L: a fixed value, or None for the bound kept by lipschitz_target
    lipschitz_tau_max: Optional[float] = None  # a learnable SCSA tau is clipped to (0, this] (None: free)
    # AttLip's proximal steps in training, by phase: the epochs split into len(list) equal consecutive phases, every
    # AttLip module trains with list[i] steps in phase i (the AttLip paper: 1-3, starting at one: [1, 2, 3]);
    # null: the model's own (model_kwargs.attlip_steps[0]). Evaluation keeps attlip_steps[1].
    attlip_train_steps: Optional[List[int]] = None
    # speed (lipsformer.engine.speed; README GPU): none of these changes the outputs beyond rounding
    compile: bool = False  # torch.compile the prepared model, static shapes
    compile_mode: str = "default"  # default | reduce-overhead | max-autotune | max-autotune-no-cudagraphs
    compile_memory_budget: Optional[float] = None  # partitioner's activation memory budget in (0, 1]; None: 1.0
    channels_last: bool = False  # NHWC weights and input batches
    grad_checkpointing: bool = False  # recompute each block's activations in backward
    tf32: bool = False  # TF32 tensor cores for fp32 matmuls / convolutions on CUDA (bf16 / fp16 runs: no effect)
    # fine-tuning (lipsformer.engine.finetune): start from weights; --resume takes precedence over both sources
    pretrained: Optional[str] = None  # published weights, as a timm name: lipsformer_swin_t.official_in1k
    init_checkpoint: Optional[str] = None  # released .pth, checkpoints/MODEL.TAG folder, or a train.py run folder
    init_use_ema: bool = False  # take init_checkpoint's EMA weights
    reset_head: bool = False  # re-create the classifier even at the source's class count (other classes)
    layer_decay: Optional[float] = None  # timm's layer-wise lr decay in (0, 1] over the model's group_matcher
    freeze: Optional[str] = None  # 'backbone' (linear probe) or comma-separated module names (patch_embed,stages.0)
    freeze_stages: int = 0  # hold patch_embed and the first N stages fixed

    def __post_init__(self):
        """Every check a config can fail without running anything lives here, each naming its key."""
        for key, allowed in CHOICES.items():
            if getattr(self, key) not in allowed:
                raise ConfigError(f"{key} must be one of {allowed}, got {getattr(self, key)!r}")
        for key in ("epochs", "global_batch", "batch_size", "checkpoint_every_steps", "keep_last",
                    "lipschitz_every_steps", "num_classes", "log_every_steps", "eval_every_epochs"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key} must be at least 1, got {getattr(self, key)}")
        if self.ema_decay is not None and not 0.0 <= self.ema_decay < 1.0:
            raise ConfigError(f"ema_decay must be in [0, 1) (0 or null: no EMA), got {self.ema_decay}")
        for key in ("lipschitz_target", "lipschitz_tau_max", "lipschitz_weight_max"):
            if getattr(self, key) is not None and getattr(self, key) <= 0:
                raise ConfigError(f"{key} must be positive, got {getattr(self, key)}")
        ranges = {  # (low, high, low inclusive, high inclusive): values torch / timm would refuse late or misuse
            "lr": (0.0, float("inf"), False, False), "min_lr": (0.0, float("inf"), True, False),
            "weight_decay": (0.0, float("inf"), True, False), "label_smoothing": (0.0, 1.0, True, False),
            "drop_path": (0.0, 1.0, True, False), "crop_pct": (0.0, 2.0, False, True),
            "mixup": (0.0, float("inf"), True, False), "cutmix": (0.0, float("inf"), True, False),
            "reprob": (0.0, 1.0, True, True), "hflip": (0.0, 1.0, True, True)}
        for key, (low, high, low_in, high_in) in ranges.items():
            v = getattr(self, key)
            if not ((low <= v if low_in else low < v) and (v <= high if high_in else v < high)):
                raise ConfigError(f"{key} must be in {'[' if low_in else '('}{low:g}, {high:g}{']' if high_in else ')'}"
                                  f", got {v}")
        if self.workers < 0:
            raise ConfigError(f"workers must be 0 or more, got {self.workers}")
        if self.warmup_epochs < 0:
            raise ConfigError(f"warmup_epochs must be at least 0, got {self.warmup_epochs}")
        if not 0.0 <= self.max_bad_fraction <= 1.0:
            raise ConfigError(f"max_bad_fraction must be in [0, 1], got {self.max_bad_fraction}")
        duplicated = sorted(set(self.model_kwargs) & set(MODEL_ARGS))
        if duplicated:
            raise ConfigError(", ".join(f"model_kwargs.{k} duplicates the top-level key {MODEL_ARGS[k]}"
                                        for k in duplicated) + "; set the top-level key instead")
        if (self.mixup > 0 or self.cutmix > 0) and self.batch_size % 2:
            raise ConfigError(f"mixup/cutmix need an even batch_size, got {self.batch_size}")
        if self.compile_memory_budget is not None and not 0.0 < self.compile_memory_budget <= 1.0:
            raise ConfigError(f"compile_memory_budget must be in (0, 1] (null: the compiler's default), "
                              f"got {self.compile_memory_budget}")
        if self.pretrained and self.init_checkpoint:
            raise ConfigError("set one of pretrained (published weights) and init_checkpoint (a file or folder)")
        if self.init_use_ema and not self.init_checkpoint:
            raise ConfigError("init_use_ema applies to init_checkpoint, which is not set")
        if self.reset_head and not (self.pretrained or self.init_checkpoint):
            raise ConfigError("reset_head applies to pretrained or init_checkpoint weights; neither is set")
        if self.layer_decay is not None and not 0.0 < self.layer_decay <= 1.0:
            raise ConfigError(f"layer_decay must be in (0, 1] (null: off), got {self.layer_decay}")
        if self.freeze_stages < 0:
            raise ConfigError(f"freeze_stages must be 0 or more, got {self.freeze_stages}")
        if (self.freeze or self.freeze_stages) and self.lipschitz_target is not None:
            raise ConfigError("lipschitz_target rescales the residual weights (and lipschitz_weight_max / "
                              "lipschitz_conv_max the weights) of the whole model after every step, frozen ones "
                              "included: unset freeze / freeze_stages or lipschitz_target")

        for key in ("lipschitz_conv_max", "margin_bound"):
            if getattr(self, key) is not None and not getattr(self, key) > 0:
                raise ConfigError(f"{key} must be positive (or null), got {getattr(self, key)}")
        if not 0.0 <= self.margin_eps < float("inf"):
            raise ConfigError(f"margin_eps must be a number >= 0 (0: off), got {self.margin_eps}")
        if self.margin_eps and self.margin_bound is None and self.lipschitz_target is None:
            raise ConfigError("margin_eps with margin_bound: null follows the bound kept by lipschitz_target; "
                              "set lipschitz_target, or a fixed margin_bound")
        if self.lipschitz_conv_max is not None and self.lipschitz_target is None:
            raise ConfigError("lipschitz_conv_max is applied when the bound is kept: set lipschitz_target too")
        if self.attlip_train_steps is not None:
            steps = self.attlip_train_steps
            if not steps or min(steps) < 1:
                raise ConfigError(f"attlip_train_steps must be a non-empty list of step counts >= 1 (null: the "
                                  f"model's own), got {steps}")
            if len(steps) > self.epochs:
                raise ConfigError(f"attlip_train_steps has {len(steps)} phases but the run has {self.epochs} epochs: "
                                  f"each phase needs at least one epoch")
        self._check_schedule()
        self._check_weight_source()

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
        if self.decay_rate is not None and not self.decay_rate > 0:
            raise ConfigError(f"decay_rate must be positive, got {self.decay_rate}")

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
        data = self.to_dict()
        data["betas"], data["scale"] = list(data["betas"]), list(data["scale"])
        Path(path).write_text(yaml.safe_dump(data, sort_keys=False))


_HINTS = typing.get_type_hints(TrainConfig)


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
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} must be a list, got {value!r}")
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


def check_type(key: str, value: Any) -> Any:
    """``value`` coerced to the type of TrainConfig's ``key``, or a ConfigError naming the key."""
    if key not in _HINTS:
        raise ConfigError(f"unknown config key(s): {key}")
    return _check_type(key, value, _HINTS[key])


def load_config(path=None, overrides: Optional[List[str]] = None) -> TrainConfig:
    """TrainConfig from a YAML file plus ``key=value`` overrides (values parsed as YAML)."""
    data: Dict[str, Any] = {}
    if path is not None:
        loaded = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: a config file must be a mapping of keys to values")
        data.update(loaded)
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value")
        key, raw = item.split("=", 1)
        key = key.strip()
        if key.startswith("model_kwargs."):
            data.setdefault("model_kwargs", {})
            data["model_kwargs"] = dict(data["model_kwargs"], **{key.split(".", 1)[1]: yaml.safe_load(raw)})
            continue
        value = yaml.safe_load(raw)
        if isinstance(value, bool) and raw.strip() in CHOICES.get(key, ()):
            value = raw.strip()  # YAML 1.1 reads no as a boolean: --set mixed_precision=no means the word
        data[key] = value
    unknown = sorted(set(data) - set(_HINTS))
    if unknown:
        raise ConfigError(f"unknown config key(s): {', '.join(unknown)}")
    return TrainConfig(**{k: _check_type(k, v, _HINTS[k]) for k, v in data.items()})
