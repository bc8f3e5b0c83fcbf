"""Fine-tuning: start a run from published or trained weights, freeze part of the model, decay lr by layer.

Fine-tuning is loading plus a fresh optimizer. The weights come through timm's pretrained path
(``pretrained: MODEL.TAG``) or :func:`lipsformer.weights.create_from_checkpoint` (``init_checkpoint``: a
released-layout ``.pth``, an exported ``checkpoints/MODEL.TAG`` folder, a train.py run folder); the family's
``checkpoint_filter_fn`` converts released layouts and :func:`lipsformer.weights.fit_state_dict` refuses, by key, any
tensor that does not fit. A classifier of another class count is re-created, a first conv for another ``in_chans``
adapted; the start line says both. The optimizer, schedule and EMA start fresh;
``--resume`` restores a fine-tuning run like any other, so its starting weights are not loaded again.
"""
from dataclasses import dataclass, field
from typing import List, Tuple

import timm
import torch
from timm.utils import freeze as timm_freeze

from ..errors import DownloadFailed
from ..layers.init import init_weights
from .. import weights
from ..weights import CheckpointError, create_from_checkpoint
from .config import ConfigError, TrainConfig

BACKBONE = "backbone"  # freeze: every parameter but the classifier's (a linear probe)


class WeightsUnavailable(DownloadFailed, RuntimeError):
    """Published weights could not be fetched (no network, server down): a runtime fault, not a bad config."""


@dataclass
class ModelStart:
    """Where a run's weights came from and what of the model does not train."""

    source: str = "scratch"  # 'scratch', 'resumed', the pretrained name or the init_checkpoint path
    reinitialised: List[str] = field(default_factory=list)  # state-dict keys not taken from the source
    frozen: List[str] = field(default_factory=list)  # module names whose parameters do not train
    adapted: List[str] = field(default_factory=list)  # tensors changed to fit the model: "patch_embed.proj (3 -> 1 ..."

    def row(self) -> dict:
        return dict(source=self.source, reinitialised=self.reinitialised, adapted=self.adapted, frozen=self.frozen)

    def line(self) -> str:
        """train.py's start line: where the weights came from, and what of them the run does not take as they are."""
        adapted = f"adapted: {', '.join(self.adapted)}; " if self.adapted else ""
        return (f"weights: {self.source}; re-initialised: {', '.join(self.reinitialised) or 'none'}; {adapted}"
                f"frozen: {', '.join(self.frozen) or 'none'}")


def pretrained_name(cfg: TrainConfig) -> str:
    """``cfg.pretrained`` as a full timm name with published weights for ``cfg.model``, or a ConfigError."""
    name = cfg.pretrained
    arch = name.split(".", 1)[0]
    if arch != cfg.model:
        raise ConfigError(f"pretrained {name!r} names weights of {arch}, but model is {cfg.model}; "
                          f"set model: {arch}, or a pretrained tag of {cfg.model}")
    if not weights.has_published_weights(name):
        published = ", ".join(timm.list_pretrained(f"{arch}.*")) or "none"
        raise ConfigError(f"pretrained {name!r}: no published weights under that name (published for {arch}: "
                          f"{published}); use init_checkpoint for weights of your own")
    return name


def _load(cfg: TrainConfig) -> Tuple[torch.nn.Module, str]:
    args = cfg.model_args()
    if cfg.pretrained:
        name = pretrained_name(cfg)
        key, create = "pretrained", lambda: weights.build_model(name, pretrained=True, **args)
    else:
        name = cfg.init_checkpoint
        key, create = "init_checkpoint", lambda: create_from_checkpoint(
            name, cfg.model, use_ema=cfg.init_use_ema, new_head=True, **args)
    try:
        return create(), name
    except (CheckpointError, FileNotFoundError, RuntimeError) as e:  # RuntimeError: timm, e.g. a failed download
        raise ConfigError(f"{key}: {e}") from None
    except OSError as e:  # urllib's URLError, requests' ConnectionError: no network, or the server refused
        reason = getattr(e, "reason", None) or e
        raise WeightsUnavailable(f"{key} {name}: could not download its weights ({reason}); check the network, or "
                                 f"download them elsewhere and set init_checkpoint: FILE") from None


def classifier_name(model: torch.nn.Module) -> str:
    """The classifier's module name, from the model's pretrained config (timm's ``classifier`` field)."""
    return (model.pretrained_cfg or {}).get("classifier") or "head.fc"


def classifier_keys(model: torch.nn.Module) -> List[str]:
    return [k for k in model.state_dict() if k.startswith(classifier_name(model) + ".")]


def frozen_modules(model: torch.nn.Module, cfg: TrainConfig) -> List[str]:
    """Names of the modules ``freeze`` / ``freeze_stages`` hold fixed, or a ConfigError naming the bad value."""
    names: List[str] = []
    if cfg.freeze_stages:
        stages = len(model.stages)
        if cfg.freeze_stages > stages:
            raise ConfigError(f"freeze_stages {cfg.freeze_stages}: {cfg.model} has {stages} stages; "
                              f"use 0 to {stages}")
        names += ["patch_embed"] + [f"stages.{i}" for i in range(cfg.freeze_stages)]
    if cfg.freeze == BACKBONE:
        classifier = classifier_name(model)
        head = classifier.split(".")[0]
        names += [n for n, _ in model.named_children() if n != head]
        names += [f"{head}.{n}" for n, m in model.get_submodule(head).named_children()
                  if f"{head}.{n}" != classifier and any(True for _ in m.parameters())]
    elif cfg.freeze:
        known = dict(model.named_modules())
        for name in (n.strip() for n in cfg.freeze.split(",")):
            if not name or name not in known or not any(True for _ in known[name].parameters()):
                children = ", ".join(n for n, _ in model.named_children())
                raise ConfigError(f"freeze: {name!r} names no module with parameters in {cfg.model}; use "
                                  f"'{BACKBONE}' (linear probe) or module names such as {children}, stages.0")
            names.append(name)
    return list(dict.fromkeys(names))


def build_model(cfg: TrainConfig) -> torch.nn.Module:
    """The run's model from scratch: ``timm.create_model`` with the config's model arguments. A model argument the
    constructor refuses (an unknown name, a choice it does not have, a size that does not divide) is a
    ModelArgsError naming the model (:func:`lipsformer.weights.build_model`)."""
    return weights.build_model(cfg.model, **cfg.model_args())


def start_model(cfg: TrainConfig, load_weights: bool = True) -> Tuple[torch.nn.Module, ModelStart]:
    """The run's model: built, given its starting weights (unless ``load_weights`` is false: a resumed run
    restores its own) and frozen as configured. Every error here comes before the run writes anything."""
    if load_weights and (cfg.pretrained or cfg.init_checkpoint):
        model, source = _load(cfg)
        fit = weights.weights_fit(model)  # what the fit check re-created (another class count) or adapted
        start = ModelStart(source=source, reinitialised=list(fit.reinitialised), adapted=list(fit.adapted))
        if cfg.reset_head and not start.reinitialised:  # same class count, other classes: a new classifier
            init_weights(model.get_submodule(classifier_name(model)), model.lipschitz.init)
            start.reinitialised = classifier_keys(model)
            model.pretrained_cfg.pop("label_names", None)  # the source's classes, not the new classifier's
    else:
        model = build_model(cfg)
        start = ModelStart(source="scratch" if load_weights else "resumed")
    start.frozen = frozen_modules(model, cfg)
    if start.frozen:
        timm_freeze(model, start.frozen)
    return model, start


def eval_frozen(model: torch.nn.Module, frozen: List[str]) -> None:
    """Put the frozen modules back in eval mode after ``model.train()``: no dropout or drop-path, fixed features."""
    for name in frozen:
        model.get_submodule(name).eval()
