"""One way to build a model with its weights from a source: :func:`build_model`.

``timm.create_model(name)`` builds a bare model; :func:`build_model` is for a model whose weights come from
somewhere, and every entry point builds through it (training and fine-tuning, ``eval.py``, ``python -m
lipsformer.lipschitz``, ``python -m lipsformer.convert``, the FLOP counter)::

    from lipsformer.build import PUBLISHED, build_model
    model, start = build_model("lipsformer_swin_t")                               # no weights: fresh init
    model, start = build_model("lipsformer_swin_t.official_in1k", PUBLISHED)      # timm's published weights
    model, start = build_model(None, "runs/demo")                                 # a run folder, export or file
    model, start = build_model("lipsformer_swin_t", "swin_t.pth", num_classes=7, new_head=True)  # fine-tuning

It sits beside :mod:`lipsformer.weights` (which reads files and holds the fit check, :func:`fit_state_dict`) rather
than in ``models/``: the families know nothing of run folders, exports and published-weight policies. Every tensor
that comes from a source passes the fit check; ``start`` (:class:`ModelStart`) says what the model did not take
from the source as it is.
"""
import os
from dataclasses import dataclass, field
from typing import List, NamedTuple, Optional, Union

import timm
import torch

from .errors import DownloadFailed, Mistake
from .layers.attlip import state_dict_form
from .layers.init import init_weights
from .sources import resolve_checkpoint
from .weights import CheckpointError, ModelArgsError, check_model_name, read_checkpoint, weights_fit


class WeightsUnavailable(DownloadFailed, RuntimeError):
    """Published weights could not be fetched (no network, server down): a runtime fault, not a bad request."""


class Published:
    """The weights source "timm's published weights of the model name" (its tag, or the default one)."""

    def __repr__(self) -> str:
        return "PUBLISHED"


PUBLISHED = Published()
# None (no weights: the model's own initialisation), PUBLISHED, or a weight file / run folder / export folder
WeightsSource = Union[None, Published, str, os.PathLike]


@dataclass
class ModelStart:
    """Where a model's weights came from and what of the model does not take them as they are."""

    source: str = "scratch"  # 'scratch' (no weights loaded), the published name, or the weights' path
    reinitialised: List[str] = field(default_factory=list)  # state-dict keys not taken from the source
    frozen: List[str] = field(default_factory=list)  # module names whose parameters do not train (fine-tuning)
    adapted: List[str] = field(default_factory=list)  # tensors changed to fit the model: "patch_embed.proj (3 -> 1 ..."

    def row(self) -> dict:
        return dict(source=self.source, reinitialised=self.reinitialised, adapted=self.adapted, frozen=self.frozen)

    def line(self) -> str:
        """train.py's start line: where the weights came from, and what of them the run does not take as they are."""
        adapted = f"adapted: {', '.join(self.adapted)}; " if self.adapted else ""
        return (f"weights: {self.source}; re-initialised: {', '.join(self.reinitialised) or 'none'}; {adapted}"
                f"frozen: {', '.join(self.frozen) or 'none'}")


class Built(NamedTuple):
    model: torch.nn.Module
    start: ModelStart


def build_model(name: Optional[str], weights: WeightsSource = None, *, use_ema: bool = False, new_head: bool = False,
                reset_head: bool = False, **model_args) -> Built:
    """The model ``name`` (``MODEL`` or ``MODEL.TAG``) built with ``model_args`` and given the weights of ``weights``:

    * ``None``: none; the model's own initialisation (as ``timm.create_model``);
    * :data:`PUBLISHED`: timm's published weights of ``name`` (the released LipsFormer-Swin-T checkpoint is
      ``lipsformer_swin_t.official_in1k``), downloaded and checked against their sha256;
    * a path (:func:`lipsformer.sources.resolve_checkpoint`): a weight file (ours, or the released code's layout,
      converted by the family's ``checkpoint_filter_fn``), a train.py run folder or one of its checkpoints, an
      exported folder. The model name and its arguments come from the run / export config where there is one
      (``name`` may then be None, and must agree); ``num_classes`` and ``in_chans`` default to the file's
      classifier and first conv; ``use_ema`` takes a run's EMA weights.

    Every tensor passes :func:`lipsformer.weights.fit_state_dict`. A ``num_classes`` other than the weights'
    classifier is refused unless ``new_head`` (fine-tuning), which re-creates the classifier; ``reset_head`` re-creates
    it even for the same class count (other classes). An ``in_chans`` other than the weights' adapts the first conv.
    A name or model argument the constructor refuses is a :class:`~lipsformer.weights.ModelArgsError`; a failed
    download a :class:`WeightsUnavailable`. Returns the model and its :class:`ModelStart`.
    """
    if weights is None:
        if use_ema or new_head or reset_head:
            raise ModelArgsError(f"{name}: use_ema, new_head and reset_head apply to weights from a source; none given")
        return Built(_create(name, **model_args), ModelStart())
    if isinstance(weights, Published):
        model = _published(name, new_head, model_args)
        source = name
    else:
        model = _from_file(weights, name, use_ema, new_head, model_args)
        source = str(weights)
    fit = weights_fit(model)  # what the fit check re-created (another class count) or adapted
    start = ModelStart(source=source, reinitialised=list(fit.reinitialised), adapted=list(fit.adapted))
    if reset_head and not start.reinitialised:  # same class count, other classes: a new classifier
        init_weights(model.get_submodule(classifier_name(model)), model.lipschitz.init)
        start.reinitialised = classifier_keys(model)
        model.pretrained_cfg.pop("label_names", None)  # the source's classes, not the new classifier's
    return Built(model, start)


def classifier_name(model: torch.nn.Module) -> str:
    """The classifier's module name, from the model's pretrained config (timm's ``classifier`` field)."""
    return (model.pretrained_cfg or {}).get("classifier") or "head.fc"


def classifier_keys(model: torch.nn.Module) -> List[str]:
    return [k for k in model.state_dict() if k.startswith(classifier_name(model) + ".")]


def _create(name: str, **kwargs) -> torch.nn.Module:
    """``timm.create_model(name, **kwargs)`` for a name and arguments a user gave: an unknown name, or an argument the
    constructor refuses (an unknown keyword, a choice it does not have, a size that does not divide), is a
    :class:`ModelArgsError` naming the model."""
    check_model_name(name)
    try:
        return timm.create_model(name, **kwargs)
    except (TypeError, ValueError) as e:
        if isinstance(e, Mistake):  # ours already says what to fix (a CheckpointError, ...)
            raise
        raise ModelArgsError(f"{name}: {e}") from None


def _published(name: str, new_head: bool, model_args: dict) -> torch.nn.Module:
    """timm's published weights of ``name``; without ``new_head`` the weights' config is told the class count asked
    for, so that the fit check refuses a classifier of another (timm's own rule would re-create it quietly)."""
    args = dict(model_args)
    if not new_head and "num_classes" in args:
        args["pretrained_cfg_overlay"] = dict(args.get("pretrained_cfg_overlay") or {}, num_classes=args["num_classes"])
    try:
        return _create(name, pretrained=True, **args)
    except OSError as e:  # urllib's URLError, requests' ConnectionError: no network, or the server refused
        reason = getattr(e, "reason", None) or e
        raise WeightsUnavailable(f"{name}: could not download its published weights ({reason}); check the network, "
                                 f"or download them elsewhere and load that file") from None


def _from_file(path, name: Optional[str], use_ema: bool, new_head: bool, model_args: dict) -> torch.nn.Module:
    """The model with the weights at ``path`` (:func:`build_model`'s path source)."""
    file, meta = resolve_checkpoint(path, use_ema)
    # read first: a damaged file is named as damaged before anything is asked of the user
    state_dict = read_checkpoint(file, use_ema=use_ema and file.suffix != ".safetensors")
    if name and meta.get("model") and name != meta["model"]:
        raise CheckpointError(f"{path} was made by {meta['model']}, not {name}")
    name = name or meta.get("model")
    if not name:
        raise CheckpointError(f"{path} does not say which model it holds: pass the model name")
    args = dict(meta.get("model_args") or {})
    args.update(model_args)
    form = state_dict_form(state_dict)
    if form is not None and "attlip_form" not in args:  # the form the file's AttLip weights are (a
        args["attlip_form"] = form  # *_cert run's model_args need not name it, and its weights may be 'general')
    head = next((state_dict[k] for k in ("head.fc.weight", "head.weight") if k in state_dict), None)  # ours, released
    head = head if head is not None and head.dim() == 2 else None
    if "num_classes" not in args and head is not None:
        args["num_classes"] = head.shape[0]
    overlay = dict(meta.get("pretrained_cfg") or {})
    overlay.update(args.pop("pretrained_cfg_overlay", None) or {})  # a run's own (e.g. the certified configs' std 1)
    overlay.update(file=str(file), state_dict=state_dict, custom_load=False)
    if "num_classes" in args:
        overlay["num_classes"] = head.shape[0] if new_head and head is not None else args["num_classes"]
    stem = state_dict.get(f"{_registered_cfg(name).get('first_conv')}.weight")
    if stem is not None and stem.dim() == 4:  # the channels the file's first conv takes: what the weights declare
        args.setdefault("in_chans", stem.shape[1])
        size = overlay.get("input_size") or _registered_cfg(name)["input_size"]
        overlay["input_size"] = (stem.shape[1], *size[1:])
    model = _create(name, pretrained=True, pretrained_cfg_overlay=overlay, **args)
    model.pretrained_cfg.pop("state_dict", None)  # the weights are in the model; do not keep a second copy
    return model


def _registered_cfg(name: str) -> dict:
    """timm's pretrained config of ``name`` as a dict (empty for a name timm does not know)."""
    check_model_name(name)
    try:
        cfg = timm.models.get_pretrained_cfg(name)
    except RuntimeError:  # an unknown tag: the model's own config
        cfg = timm.models.get_pretrained_cfg(name.split(".", 1)[0])
    return cfg.to_dict() if cfg is not None else {}
