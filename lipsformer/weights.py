"""Weight files users can trust: safe reading, sha256 checks, and the fit check of every tensor against the model.

Every file is read through safetensors or ``torch.load(weights_only=True)``: a checkpoint carrying
pickled code is refused before anything in it runs. Training checkpoints of the released code also
pickle their yacs config; it is read as an inert ``OrderedDict`` rather than refused.
"""
import argparse
import collections
import hashlib
import json
import logging
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, List, Optional, Tuple

import timm
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from timm.models import adapt_input_conv, get_pretrained_cfg

from .errors import ConfigError, Mistake, did_you_mean
from .layers.attlip import form_mismatch
from .writer import BEST, EXPORT_WEIGHTS

# what train.py's weight files record in their safetensors metadata (strings): the input size they were made at,
# as JSON [C, H, W], so a copy of best.safetensors away from its run folder still says it
INPUT_SIZE_KEY = "input_size"
_logger = logging.getLogger(__name__)


def input_size_metadata(input_size) -> dict:
    """The safetensors metadata that records ``input_size`` (C, H, W) for :func:`resolve_checkpoint`."""
    return {INPUT_SIZE_KEY: json.dumps([int(v) for v in input_size])}


class CheckpointError(Mistake, ValueError):
    """A weight file that cannot be used: unreadable, unsafe, for another model, or with the wrong hash."""


class ModelArgsError(ConfigError):
    """A model name timm does not know, or a model argument the model's constructor refuses (a config's or a
    command line's)."""


def check_model_name(name: str) -> str:
    """``name`` unless timm knows no such model (a tag after the dot is left to timm; ``hf-hub:`` and
    ``local-dir:`` sources too), else a :class:`ModelArgsError` with the closest registered names."""
    arch = str(name).split(".", 1)[0]
    if ":" not in arch and not timm.is_model(arch):
        raise ModelArgsError(f"unknown model {name!r}{did_you_mean(arch, timm.list_models())}; "
                             f"timm.list_models('lipsformer_*') lists the zoo")
    return name


def has_published_weights(name: str) -> bool:
    """Whether timm has weights to download for ``name`` (``MODEL`` or ``MODEL.TAG``); an unknown tag is no (timm's
    registry raises for it)."""
    try:
        cfg = get_pretrained_cfg(name)
    except RuntimeError:  # timm: "Invalid pretrained tag (TAG) for MODEL"
        return False
    return cfg is not None and bool(cfg.url or cfg.hf_hub_id or cfg.file)


class _InertConfig:
    """Stands in for ``yacs.config.CfgNode``: unpickles to a plain OrderedDict (code-free, like the config)."""

    def __new__(cls, *args):
        return collections.OrderedDict()


# Inert containers found in published checkpoints, allowed on top of torch's weights-only set.
_SAFE_GLOBALS = [(_InertConfig, "yacs.config.CfgNode"), argparse.Namespace]


def check_model_args(model_args) -> dict:
    """``--model-args`` of eval.py, convert and the Lipschitz command: a JSON object of model arguments."""
    if not isinstance(model_args, dict):
        raise ModelArgsError(f"--model-args must be a JSON object of model arguments, e.g. '{{\"img_size\": 32}}'; got "
                         f"{json.dumps(model_args)}")
    return model_args


def sha256_of(path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def verify_sha256(path, expected: str, origin: str = "") -> None:
    """Raise naming the file, its origin and both hashes when the file's sha256 differs from ``expected``."""
    actual = sha256_of(path)
    if actual != expected.lower():
        raise CheckpointError(f"{path}{f' (from {origin})' if origin else ''} has sha256 {actual}, expected "
                              f"{expected}: the download is corrupt or is not the published file")


DDP_PREFIX = "module."  # what DistributedDataParallel puts before every key of the model it wraps


def unwrap_state_dict(checkpoint: dict, use_ema: bool = False) -> dict:
    """The state dict inside a training checkpoint (under 'model' / 'state_dict', or the EMA's with ``use_ema``);
    a raw state dict passes through. Keys that all carry DDP's ``module.`` prefix (a wrapped model saved as it is)
    are read without it, as timm's ``clean_state_dict`` reads them."""
    keys = ("state_dict_ema", "model_ema") if use_ema else ("model", "state_dict")
    state_dict = next((checkpoint[key] for key in keys if isinstance(checkpoint.get(key), dict)), None)
    if state_dict is None and use_ema:
        raise KeyError("no EMA weights ('state_dict_ema' or 'model_ema') in this checkpoint")
    state_dict = checkpoint if state_dict is None else state_dict
    if state_dict and all(isinstance(k, str) and k.startswith(DDP_PREFIX) for k in state_dict):
        return {k[len(DDP_PREFIX):]: v for k, v in state_dict.items()}
    return state_dict


def read_checkpoint(path, use_ema: bool = False) -> dict:
    """A state dict from ``.safetensors`` or a torch file, never running code stored in the file."""
    path = Path(path)
    if path.is_dir():  # e.g. pretrained_cfg_overlay=dict(file=RUN): its weights are a file inside
        raise FileNotFoundError(f"{path} is a folder, not a weight file: name the file inside it ("
                                f"{path / BEST} of a train.py run, {path / EXPORT_WEIGHTS} of an export)")
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint file {path}")
    if path.suffix == ".safetensors":
        try:
            checkpoint = load_file(str(path))
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"cannot read {path}: truncated or not a checkpoint ({_first_line(e)})") from None
    else:
        checkpoint = load_pickled(path, _SAFE_GLOBALS)
    if not isinstance(checkpoint, dict):
        raise CheckpointError(f"{path} holds a {type(checkpoint).__name__}, not a state dict")
    try:
        state_dict = unwrap_state_dict(checkpoint, use_ema)
    except KeyError as e:
        raise CheckpointError(f"{path}: {e.args[0]}") from None
    bad = [k for k, v in state_dict.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise CheckpointError(f"{path} is not a state dict: {', '.join(map(str, bad[:5]))} are not tensors")
    return state_dict


def load_pickled(path, safe_globals=(), load: Callable = torch.load,
                 damaged: str = "truncated or not a checkpoint") -> Any:
    """``load(path)`` with weights-only unpickling (``torch.load``, or Accelerate's ``load``, which adds NumPy's
    arrays), allowing ``safe_globals`` too. Damaged bytes make the unpickler raise almost any type (IndexError,
    KeyError, EOFError, struct.error, UnicodeDecodeError, UnpicklingError, ...): every failure here is a
    CheckpointError naming the file, and says it holds code only when its pickle names globals that weights-only
    loading refuses (found by reading the opcodes, not by running them)."""
    with warnings.catch_warnings():  # random bytes can claim any pickle protocol; torch warns about it
        warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
        with torch.serialization.safe_globals(list(safe_globals)):
            try:
                return load(path, map_location="cpu", weights_only=True)
            except Exception as e:  # noqa: BLE001 - see the docstring
                unsafe = _unsafe_globals(path)
                if unsafe:
                    raise CheckpointError(
                        f"refused to load {path}: it holds pickled objects that weights-only loading does not "
                        f"allow ({', '.join(unsafe[:5])}), which could run code; nothing in it was run. Load it only "
                        f"if you trust its origin, and save its state dict as safetensors") from None
                raise CheckpointError(f"cannot read {path}: {damaged} ({type(e).__name__}: {_first_line(e)})") from None


def _first_line(e: BaseException) -> str:
    """What an unpickler's error says, in one line: torch's weights-only errors open with a paragraph about
    ``weights_only`` and give the reason after ``WeightsUnpickler error:``."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    marker = "WeightsUnpickler error:"
    at = next((i for i, ln in enumerate(lines) if ln.startswith(marker) or ln.endswith(marker)), None)
    if at is not None:
        rest = lines[at].split(marker, 1)[1].strip()
        return (rest or (lines[at + 1] if at + 1 < len(lines) else ""))[:200]
    return (lines or [""])[0][:200]


def _unsafe_globals(path) -> List[str]:
    """The globals a torch file's pickle names that weights-only loading does not allow (call inside the same
    ``safe_globals``); none when the file cannot be disassembled (damaged bytes, not code)."""
    try:
        return sorted(torch.serialization.get_unsafe_globals_in_checkpoint(str(path)))
    except Exception:  # noqa: BLE001 - a damaged or legacy (not zip) file: nothing can be said about code in it
        return []


@dataclass
class WeightsFit:
    """What loading a weight file did beyond copying each tensor as it is (:func:`fit_state_dict` records it on the
    model as ``model.weights_fit``): train.py's start line, eval.py, the Lipschitz toolkit and convert say each event
    in one line (:meth:`lines`)."""

    source: str = ""
    reinitialised: List[str] = field(default_factory=list)  # the model's keys that keep their fresh initial values
    new_head: str = ""  # "head.fc (1000 -> 7 classes)": the classifier re-created for another class count
    adapted: List[str] = field(default_factory=list)  # "patch_embed.proj (3 -> 1 channels)"

    def lines(self) -> List[str]:
        return [f"re-initialised: {self.new_head}"] * bool(self.new_head) + [f"adapted: {a}" for a in self.adapted]


def weights_fit(model: torch.nn.Module) -> WeightsFit:
    """What :func:`fit_state_dict` recorded when ``model``'s weights were loaded (nothing for a model built without)."""
    return getattr(model, "weights_fit", None) or WeightsFit()


# A family's own adaptation of loaded tensors to the model's configuration (e.g. relative position bias tables to its
# window size): ``(state dict, one description per event)``; a tensor it cannot adapt is left for the shape check.
Adapter = Callable[[dict, torch.nn.Module], Tuple[dict, List[str]]]
REBUILD = "build the model the file was made for (its model name and model arguments: model_kwargs, --model-args)"


def fit_state_dict(state_dict: dict, model: torch.nn.Module, source, adapt: Optional[Adapter] = None) -> dict:
    """The one fit check between a weight file and the model it is loaded into; returns the state dict to load
    strictly (every key of the model, each of its shape and kind) and records what it changed as
    ``model.weights_fit`` (:class:`WeightsFit`). Anything else is a :class:`CheckpointError` of one line naming
    ``source``, the tensor and what to change, in this order:

    * names: a key the model lacks, or one the file lacks;
    * kind: a floating-point tensor for every floating-point parameter (an integer tensor is never converted); a
      float16, bfloat16 or float64 file is accepted and cast to the model's dtype by the load (float64 rounds);
    * values: every floating-point tensor finite in the model's dtype (the first non-finite one is named with its
      count);
    * shapes, after ``adapt`` (the family's, e.g. Swin's bias tables resized to the model's windows, each said).

    Two changes happen only where the model asks for them, as timm's ``load_pretrained`` decides: the weights'
    ``pretrained_cfg`` declares their class count and input channels (``num_classes``, ``input_size``), and a model
    built for another (an explicit ``num_classes`` / ``in_chans``) gets a new classifier (its own initial values:
    ``re-initialised: head.fc (1000 -> 7 classes)``) or the file's first conv adapted by timm's ``adapt_input_conv``
    (``adapted: patch_embed.proj (3 -> 1 channels)``). A model built for the declared values and a file that differs
    is refused, naming ``num_classes`` / ``in_chans``. Afterwards ``pretrained_cfg`` declares what the model holds, so
    timm's own adaptation after a ``pretrained_filter_fn`` finds nothing to do.
    """
    ours = model.state_dict()
    cfg = getattr(model, "pretrained_cfg", None)
    cfg = cfg if cfg is not None else {}
    name = cfg.get("architecture", type(model).__name__)
    form = form_mismatch(state_dict, ours)
    if form:
        raise CheckpointError(f"{source} does not fit {name}: {form}")
    classifier = cfg.get("classifier") or "head.fc"
    head = (f"{classifier}.weight", f"{classifier}.bias")
    new_head = getattr(model, "num_classes", None) != cfg.get("num_classes", getattr(model, "num_classes", None))
    dropped = set(head) if new_head else set()  # a file's classifier is dropped where the model asks for another
    missing = [k for k in ours if k not in state_dict and k not in dropped]
    unexpected = [k for k in state_dict if k not in ours and k not in dropped]
    if missing or unexpected:  # another model or configuration: its shape mismatches too, in the same line
        _refuse(source, name, missing, unexpected, _shapes(state_dict, ours, dropped))
    _check_values(state_dict, ours, source, name)
    fit = WeightsFit(str(source))
    if adapt is not None:
        state_dict, fit.adapted = adapt(state_dict, model)
    out = {k: v for k, v in state_dict.items() if k in ours}
    _fit_head(out, ours, model, cfg, head, new_head, fit, source, name)
    _fit_stem(out, ours, cfg, fit, source, name)
    shapes = _shapes(out, ours)
    if shapes:
        _refuse(source, name, [], [], shapes)
    if fit.new_head:
        cfg.pop("label_names", None)  # they name the file's classes, not the new classifier's
    check_label_names(cfg.get("label_names"), getattr(model, "num_classes", None), f"{source}'s config")
    if hasattr(model, "num_classes"):  # the config now declares what the model holds (timm's load then changes
        cfg["num_classes"] = model.num_classes  # nothing more: its own adaptation sees nothing to adapt)
    stem = ours.get(f"{cfg.get('first_conv')}.weight")
    if stem is not None and stem.dim() == 4:
        cfg["input_size"] = (stem.shape[1], *tuple(cfg.get("input_size") or (3, 224, 224))[1:])
    model.weights_fit = fit
    for line in fit.lines():
        _logger.info(f"{source}: {line}")
    return out


def _shapes(state_dict: dict, ours: dict, skip=()) -> List[str]:
    return [f"{k}: file {tuple(state_dict[k].shape)} vs model {tuple(v.shape)}" for k, v in ours.items()
            if k in state_dict and k not in skip and state_dict[k].shape != v.shape]


def _refuse(source, name: str, missing: List[str], unexpected: List[str], shapes: List[str]) -> None:
    problems = [f"{what} ({len(keys)}): {', '.join(keys[:5])}" for what, keys in
                (("missing keys", missing), ("unexpected keys", unexpected), ("shape mismatches", shapes)) if keys]
    raise CheckpointError(f"{source} does not fit {name}: {'; '.join(problems)}: {REBUILD}")


def _check_values(state_dict: dict, ours: dict, source, name: str) -> None:
    """Kind and finiteness of every file tensor the model has (see :func:`fit_state_dict`)."""
    broken = []
    for key, theirs in state_dict.items():
        mine = ours.get(key)
        if mine is None:
            continue
        if not mine.is_floating_point():
            if theirs.dtype != mine.dtype:
                raise CheckpointError(f"{source}: {key} is {_dtype(theirs)}, {name}'s is {_dtype(mine)}: the file "
                                      f"holds another kind of tensor there; {REBUILD}")
            continue
        if not theirs.is_floating_point():
            raise CheckpointError(f"{source}: {key} is {_dtype(theirs)}, {name}'s is {_dtype(mine)}: weights are "
                                  f"floating-point numbers (an integer tensor is not converted); save the model's "
                                  f"floating-point state dict")
        values = theirs if theirs.dtype == mine.dtype else theirs.to(mine.dtype)
        bad = int(values.numel() - torch.isfinite(values).sum())
        if bad:
            broken.append((key, bad, theirs.numel(), theirs.dtype != mine.dtype and f" as {_dtype(mine)}"))
    if broken:
        key, bad, total, cast = broken[0]
        more = f" (and {len(broken) - 1} more tensors)" if len(broken) > 1 else ""
        raise CheckpointError(f"{source}: {key} holds {bad} non-finite value{'s' * (bad > 1)} (NaN or Inf{cast or ''}) "
                              f"of {total}{more}: these weights are broken (a diverged run or a damaged file); load "
                              f"another checkpoint")


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def _fit_head(out: dict, ours: dict, model, cfg: dict, head, new_head: bool, fit: WeightsFit, source, name) -> None:
    """The classifier: the file's where it fits; the model's own where the model asks for another class count."""
    theirs, mine = out.get(head[0]), ours.get(head[0])
    if not new_head:
        if mine is not None and theirs is not None and theirs.dim() == 2 and theirs.shape[1:] == mine.shape[1:] \
                and theirs.shape[0] != mine.shape[0]:
            raise CheckpointError(f"{source}: {head[0]} is a classifier of {theirs.shape[0]} classes, {name} is "
                                  f"built for {mine.shape[0]}: set num_classes to {theirs.shape[0]} (a new classifier "
                                  f"is for fine-tuning: train.py's init_checkpoint, or reset_head for other classes)")
        return
    mine_keys = [k for k in head if k in ours]
    if not mine_keys or all(k in out and out[k].shape == ours[k].shape for k in mine_keys):
        return  # no classifier to fill (num_classes=0), or the file's fits the model
    for key in mine_keys:
        out[key] = ours[key]
        fit.reinitialised.append(key)
    classes = cfg.get("num_classes") if theirs is None else theirs.shape[0]
    fit.new_head = f"{head[0].rsplit('.', 1)[0]} ({classes} -> {model.num_classes} classes)"


def _fit_stem(out: dict, ours: dict, cfg: dict, fit: WeightsFit, source, name) -> None:
    """The first conv: the file's where its input channels are the model's; adapted (timm's ``adapt_input_conv``)
    where the model asks for other channels than the weights declare."""
    if not cfg.get("first_conv"):
        return
    key = f"{cfg['first_conv']}.weight"
    theirs, mine = out.get(key), ours.get(key)
    if theirs is None or mine is None or mine.dim() != 4 or theirs.dim() != 4 or theirs.shape == mine.shape \
            or (theirs.shape[0], *theirs.shape[2:]) != (mine.shape[0], *mine.shape[2:]):
        return  # the same shape, or not a matter of channels (a plain shape mismatch)
    have, want = theirs.shape[1], mine.shape[1]
    declared = (cfg.get("input_size") or (3,))[0]
    if want == declared:
        raise CheckpointError(f"{source}: {key} takes {have} input channels, {name} is built for {want}: set "
                              f"in_chans to {have}")
    try:
        adapted = adapt_input_conv(want, theirs, base_chans=have)
    except (NotImplementedError, ValueError):
        adapted = None
    if adapted is None or adapted.shape != mine.shape:
        raise CheckpointError(f"{source}: {key} takes {have} input channels and timm's adapt_input_conv cannot adapt "
                              f"it to in_chans {want}: set in_chans to {have}")
    out[key] = adapted
    fit.adapted.append(f"{cfg['first_conv']} ({have} -> {want} channels)")


def check_label_names(names, num_classes, where) -> None:
    """A CheckpointError unless ``names`` (the weights' class names, when known: a run's classes.json, an export's
    label_names) has one name per output of the classifier."""
    if names is not None and num_classes is not None and len(names) != num_classes:
        raise CheckpointError(f"{where} names {len(names)} classes, the classifier has {num_classes} outputs: it "
                              f"needs one name per output, in label order")
