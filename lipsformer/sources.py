"""Where weights come from besides a bare file, and what each source records of the model that made it: a train.py
run folder (or one of its periodic checkpoints, or a weight file inside it), an exported folder (timm's hub layout,
written by :func:`export`), a lone safetensors file (the input size train.py writes into its metadata).

:func:`resolve_checkpoint` turns any of them into the weight file to read and what is known of its model;
:func:`lipsformer.build.build_model` builds from it, and every tensor then passes the fit check of
:mod:`lipsformer.weights`. A run folder's layout is :mod:`lipsformer.run_folder`'s, its config the recipe of
:mod:`lipsformer.config`.
"""
import json
from pathlib import Path
from typing import Optional, Tuple

import torch
from safetensors import SafetensorError, safe_open
from timm.models import save_for_hf

from .data.classes import read_class_names
from .data.datasets import eval_data_config
from .config import read_run_config
from .run_folder import BEST_KEPT, LAST_EMA, RunFolder, checkpoint_step
from .weights import INPUT_SIZE_KEY, CheckpointError, check_label_names, sha256_of
from .writer import EXPORT_CONFIG, EXPORT_WEIGHTS, replacing


def resolve_checkpoint(path, use_ema: bool = False) -> Tuple[Path, dict]:
    """The weight file behind ``path`` and what is known about the model that made it.

    ``path`` is a weight file, a train.py output folder (``last.safetensors`` or ``last_ema.safetensors``,
    with ``config.yaml``), or an exported folder (``model.safetensors`` with timm's ``config.json``).
    Returns ``(file, meta)`` with meta keys ``model``, ``model_args`` and ``pretrained_cfg`` where known.
    """
    path = Path(path)
    if path.is_dir() and checkpoint_step(path) is not None and RunFolder(path.parent.parent).is_run():
        if use_ema:  # Accelerate's folder keeps the EMA as the optimizer keeps its state, not as a state dict
            raise CheckpointError(f"{path} is a periodic training checkpoint: --use-ema takes the EMA of a finished "
                                  f"run (its {LAST_EMA}); evaluate this checkpoint's model weights without it")
        return path / EXPORT_WEIGHTS, _run_meta(RunFolder(path.parent.parent))
    if path.is_dir():
        run = RunFolder(path)
        if run.is_run():
            file = run.weights(ema=use_ema)
            if use_ema and not file.is_file() and not read_run_config(run.config).ema_decay:
                raise CheckpointError(f"{path} was trained without an EMA (ema_decay is not set in its "
                                      f"{run.config.name}); drop --use-ema")
            if not file.is_file():
                raise FileNotFoundError(f"{path} is a training run without {file.name} (has it finished?); "
                                        f"pass one of its .safetensors files instead")
            return file, _run_meta(run)
        if (path / EXPORT_CONFIG).is_file():
            if use_ema:
                raise CheckpointError(f"{path} is an exported weight folder: it holds one set of weights, no EMA")
            return path / EXPORT_WEIGHTS, _hub_meta(path / EXPORT_CONFIG)
        raise FileNotFoundError(f"{path} holds neither {run.config.name} (a training run) nor {EXPORT_CONFIG} "
                                f"(an export), nor sub-folders that do (a folder of runs, which eval.py takes)")
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint {path}")
    if path.suffix == ".safetensors":
        if use_ema and path.name != LAST_EMA:  # a safetensors file holds one set of weights
            raise CheckpointError(f"{path} holds one set of weights, not an EMA beside them; drop --use-ema, or "
                                  f"pass the run's {LAST_EMA}")
        run = _run_of(path)
        if run is not None:
            return path, _run_meta(run)
        if (path.parent / EXPORT_CONFIG).is_file():
            return path, _hub_meta(path.parent / EXPORT_CONFIG)
        return path, _file_meta(path)
    return path, {}


def _run_of(file: Path) -> Optional[RunFolder]:
    """The training run a weight file belongs to: the run folder it lies in, or the one above ``best/`` (the
    keep_best epochs' weights); None for a file outside a run."""
    for folder in (file.parent, file.parent.parent) if file.parent.name == BEST_KEPT else (file.parent,):
        if RunFolder(folder).is_run():
            return RunFolder(folder)
    return None


def _run_meta(run: RunFolder) -> dict:
    cfg = read_run_config(run.config)  # as strictly as a user's config: a key removed by hand is named
    size, kwargs = cfg.img_size, dict(cfg.model_kwargs or {})
    pretrained = dict(num_classes=cfg.num_classes, input_size=(kwargs.get("in_chans", 3), size, size),
                      crop_pct=cfg.crop_pct, interpolation=cfg.interpolation)
    names = read_class_names(run.classes, cfg.num_classes)  # one name per output (data/classes.py)
    if names is not None:
        pretrained["label_names"] = tuple(names)
    return dict(model=cfg.model, model_args=dict(kwargs, num_classes=cfg.num_classes, img_size=size),
                pretrained_cfg=pretrained)


def _file_meta(path: Path) -> dict:
    """What a lone safetensors file records of itself: the input size train.py writes into its metadata."""
    try:
        with safe_open(str(path), "pt") as f:
            recorded = (f.metadata() or {}).get(INPUT_SIZE_KEY)
        size = tuple(json.loads(recorded)) if recorded else None
    except (SafetensorError, OSError, ValueError, TypeError):  # unreadable or foreign: read_checkpoint says so
        return {}
    if size is None or len(size) != 3 or not all(isinstance(v, int) and v > 0 for v in size):
        return {}
    return dict(pretrained_cfg=dict(input_size=size))


def recorded_input_size(path, use_ema: bool = False) -> Optional[Tuple[int, int, int]]:
    """The input size (C, H, W) the weights at ``path`` were made at, as what travels with them records it: a run
    folder's ``config.yaml``, an export's ``config.json``, a safetensors file's metadata (train.py writes it);
    None where nothing does (a bare state dict, a released-layout file): then nothing is claimed."""
    _, meta = resolve_checkpoint(path, use_ema)
    size = (meta.get("pretrained_cfg") or {}).get("input_size")
    return tuple(int(v) for v in size) if size else None


def _hub_meta(config_path: Path) -> dict:
    cfg = json.loads(config_path.read_text())
    pretrained = dict(cfg.get("pretrained_cfg") or {})
    if cfg.get("label_names") and "label_names" not in pretrained:  # timm's exports keep them at the top
        pretrained["label_names"] = cfg["label_names"]
    pretrained = {k: tuple(v) if isinstance(v, list) else v for k, v in pretrained.items()}
    check_label_names(pretrained.get("label_names"), pretrained.get("num_classes", cfg.get("num_classes")),
                      f"{config_path}'s label_names")
    return dict(model=cfg["architecture"], model_args=dict(cfg.get("model_args") or {}), pretrained_cfg=pretrained)


def export(model: torch.nn.Module, out_dir, source: str = "", tag: Optional[str] = None) -> Path:
    """Write ``model`` as timm's hub folder (``model.safetensors`` + ``config.json``), loadable with
    ``timm.create_model("local-dir:OUT", pretrained=True)`` or
    ``pretrained_cfg_overlay=dict(file=OUT/model.safetensors)``.

    ``config.json`` records the pretrained ``tag`` (the one the folder is named by), the input and pooled feature
    sizes the model is built for, ``source`` and ``source_sha256``: the hash of the weight file the model was read
    from (the source itself, or the file inside a run / export folder)."""
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} already exists; remove it or choose another output folder")
    saved_cfg = model.pretrained_cfg
    read_from = saved_cfg.get("file")  # the weight file lipsformer.build.build_model read
    weights = Path(source) if source and Path(source).is_file() else Path(read_from) if read_from else None
    current = dict(input_size=tuple(eval_data_config(model)["input_size"]))  # the channels it is built for
    if hasattr(model, "patch_embed") and hasattr(model, "_stage_resolutions"):  # ours: the last stage's grid
        current["pool_size"] = tuple(model._stage_resolutions()[-1])
    if tag is not None:
        current["tag"] = tag
    model.pretrained_cfg = {**{k: v for k, v in saved_cfg.items() if k not in ("sha256", "state_dict")}, **current}
    try:
        # save_for_hf's model.safetensors is written 0600: given the outputs' mode
        with replacing(out_dir, exclusive=True) as tmp:
            save_for_hf(model, str(tmp), safe_serialization=True,
                        model_config=dict(source=str(source), source_sha256=sha256_of(weights)
                                          if weights is not None and weights.is_file() else None))
    finally:
        model.pretrained_cfg = saved_cfg
    return out_dir
