"""Fine-tuning: start a run from published or trained weights, freeze part of the model, decay lr by layer.

Fine-tuning is loading plus a fresh optimizer: :func:`starting_weights` turns the config into the arguments of
:func:`lipsformer.build.build_model` (``pretrained: MODEL.TAG``: timm's published weights; ``init_checkpoint``: a
released-layout ``.pth``, an exported ``checkpoints/MODEL.TAG`` folder, a train.py run folder); the family's
``checkpoint_filter_fn`` converts released layouts and :func:`lipsformer.weights.fit_state_dict` refuses, by key, any
tensor that does not fit. A classifier of another class count is re-created, a first conv for another ``in_chans``
adapted; the start line says both. The optimizer, schedule and EMA start fresh;
``--resume`` restores a fine-tuning run like any other, so its starting weights are not loaded again.
"""
import contextlib
from typing import Iterator, List

import timm
import torch
from timm.utils import freeze as timm_freeze

from .. import weights
from ..build import PUBLISHED, WeightsUnavailable, classifier_name
from ..config import TrainConfig
from ..errors import ConfigError
from ..weights import CheckpointError

BACKBONE = "backbone"  # freeze: every parameter but the classifier's (a linear probe)


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


@contextlib.contextmanager
def starting_weights(cfg: TrainConfig, resumed: bool) -> Iterator[dict]:
    """The arguments of :func:`lipsformer.build.build_model` but the model's own for a run: its name and weights
    (none when ``resumed``: the checkpoint restores its own). Inside, a source that cannot be used is a ConfigError
    naming its key (``pretrained`` / ``init_checkpoint``), and a failed download says how to do without it."""
    key = "pretrained" if cfg.pretrained else "init_checkpoint"
    if resumed or not (cfg.pretrained or cfg.init_checkpoint):
        yield dict(name=cfg.model, weights=None)
        return
    args = dict(name=cfg.model, weights=cfg.init_checkpoint, use_ema=cfg.init_use_ema, new_head=True,
                reset_head=cfg.reset_head)
    if cfg.pretrained:
        args.update(name=pretrained_name(cfg), weights=PUBLISHED, use_ema=False)
    try:
        yield args
    except WeightsUnavailable as e:
        raise WeightsUnavailable(f"{key} {e} (init_checkpoint: FILE)") from None
    except (CheckpointError, FileNotFoundError, RuntimeError) as e:  # RuntimeError: timm's
        raise ConfigError(f"{key}: {e}") from None


def freeze(model: torch.nn.Module, cfg: TrainConfig) -> List[str]:
    """Freeze what ``freeze`` / ``freeze_stages`` hold fixed (:func:`frozen_modules`); returns their names."""
    frozen = frozen_modules(model, cfg)
    if frozen:
        timm_freeze(model, frozen)
    return frozen


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


def eval_frozen(model: torch.nn.Module, frozen: List[str]) -> None:
    """Put the frozen modules back in eval mode after ``model.train()``: no dropout or drop-path, fixed features."""
    for name in frozen:
        model.get_submodule(name).eval()
