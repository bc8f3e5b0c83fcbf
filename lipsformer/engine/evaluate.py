"""Top-k predictions gathered across processes, and accuracy against label sets: every sample counted once."""
import csv
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import gather_object
from timm.data import infer_imagenet_subset
from torch.utils.data import DataLoader
from tqdm import tqdm

from ..build import PUBLISHED, WeightsUnavailable, build_model
from ..config import TrainConfig
from ..data import EvalDataset, collate_skip_failed, create_loader_transform, eval_data_config, eval_samples
from ..data.imagenet_eval import Sample, Samples, describe_samples, label_names
from ..errors import ConfigError, Stopped
from ..lipschitz.certify import certify_dataset
from ..sources import recorded_input_size, resolve_checkpoint
from ..weights import check_model_args, check_model_name, has_published_weights, weights_fit
from ..writer import replacing
from .speed import compile_model, prepare_model

TOPK = 5
DEFAULT_MAX_BAD_FRACTION = TrainConfig.max_bad_fraction  # one threshold for training and eval.py
_logger = logging.getLogger(__name__)


class TooManyBadSamples(Stopped, RuntimeError):
    """More of a pass's images failed to load than ``max_bad_fraction`` allows (training, validation, eval.py)."""


def check_unreadable(where: str, failed: int, total: int, max_fraction: float, examples: Sequence[str],
                     say: bool = True) -> None:
    """The one rule for unreadable images: warn when some failed, stop (naming them) above ``max_fraction``.
    ``failed``, ``total`` and ``examples`` are over all processes; ``say``: this process warns (the main one, so a
    multi-process run says it once)."""
    if failed and say:
        _logger.warning(f"{where}: {failed} of {total} images could not be read, e.g. {list(examples[:3])}")
    if failed > max_fraction * max(total, 1):
        raise TooManyBadSamples(f"{where}: {failed} of {total} images failed to load (more than {max_fraction:.0%}), "
                                f"e.g. {', '.join(examples[:5])}; fix or remove them")


@dataclass
class Predictions:
    """Top-k predictions of every readable sample, and what could not be read."""

    keys: torch.Tensor  # the batch's second item: a target in training, a sample index in eval.py
    classes: torch.Tensor  # (n, k) ranked classes
    probs: torch.Tensor  # (n, k) their softmax probabilities
    unreadable: int = 0  # samples that failed to load, over all processes
    failed: List[str] = field(default_factory=list)  # unreadable paths, of every process
    # (n,) cross-entropy of each readable sample (``losses=True``: keys are targets)
    loss: Optional[torch.Tensor] = None
    seconds: float = 0.0  # time in the model's own work: forward passes, top-k, gathers (not reading the data)


@torch.no_grad()
def predict(model, loader, accelerator, k: int = TOPK, desc: str = "evaluation",
            losses: bool = False) -> Predictions:
    """Top-``k`` predictions for every sample of ``loader`` across processes, in loader order, with a progress
    bar named ``desc`` on the main process when stderr is a terminal (tqdm's ``disable=None``).

    Batches are ``(images, keys, failed_paths)`` as :func:`~lipsformer.data.collate_skip_failed` makes them:
    the copies standing in for unreadable images are left out and counted, so an unreadable image is never
    scored as its neighbour. Accelerate's ``gather_for_metrics`` drops the samples repeated to even out the
    last batch. ``losses``: the keys are class targets, and each sample's cross-entropy is kept too.
    """
    return predict_each([model], loader, accelerator, k, desc, losses)[0]


@torch.no_grad()
def predict_each(models: Sequence[torch.nn.Module], loader, accelerator, k: int = TOPK, desc: str = "evaluation",
                 losses: bool = False) -> List[Predictions]:
    """:func:`predict` of each of ``models`` over one pass of ``loader``: every batch is read once and given to each
    model in turn, so each model sees the very tensors the others see. Each one's ``seconds`` is the time its own
    work took (forward passes, top-k, gathers, the copy to the host), which reading the data does not enter."""
    for model in models:
        model.eval()
    keys, valid, failed = [], [], []
    classes, probs, nll = ([[] for _ in models] for _ in range(3))
    seconds = [0.0] * len(models)
    for batch in tqdm(loader, desc=desc, disable=None if accelerator.is_main_process else True, leave=False,
                      dynamic_ncols=True):
        images, key = batch[0], batch[1]
        bad = list(batch[2]) if len(batch) > 2 else []
        failed += bad
        if images is None:
            raise TooManyBadSamples(f"every image of a batch failed to load, e.g. {bad[:3]}")
        read = torch.arange(len(images), device=key.device) < len(images) - len(bad)  # stand-ins come last
        for i, model in enumerate(models):
            start = time.perf_counter()
            with accelerator.autocast():
                logits = model(images)
            p, c = logits.float().softmax(-1).topk(min(k, logits.shape[-1]), dim=-1)
            if losses:
                loss = F.cross_entropy(logits.float(), key, reduction="none")
                c, p, loss = accelerator.gather_for_metrics((c, p, loss))
                nll[i].append(loss.cpu())
            else:
                c, p = accelerator.gather_for_metrics((c, p))
            classes[i].append(c.cpu())
            probs[i].append(p.cpu())
            seconds[i] += time.perf_counter() - start
        key, read = accelerator.gather_for_metrics((key, read))
        keys.append(key.cpu())
        valid.append(read.cpu())
    if accelerator.num_processes > 1:  # every process's unreadable paths, for the one message about them
        failed = gather_object(failed)
    if not keys:
        return [Predictions(torch.zeros(0, dtype=torch.long), torch.zeros(0, k, dtype=torch.long), torch.zeros(0, k),
                            failed=failed) for _ in models]
    read = torch.cat(valid)
    return [Predictions(torch.cat(keys)[read], torch.cat(classes[i])[read], torch.cat(probs[i])[read],
                        unreadable=int((~read).sum()), failed=failed,
                        loss=torch.cat(nll[i])[read] if losses else None, seconds=seconds[i])
            for i in range(len(models))]


NOTHING_SCORED = "no image was scored: none had both a label and a readable file"


def score(classes: torch.Tensor, label_sets: Sequence[Sequence[int]]) -> dict:
    """Top-1 / top-5 (%) of ranked predictions against each sample's allowed labels.

    A prediction is right when it is in the sample's list; samples with an empty list are left out
    (ReaL). ``count`` is the number of samples scored. With none scored there is no accuracy: top-1 and top-5 are
    None (null) and ``top1_reason`` / ``top5_reason`` say why, never a 0% that ranks as a score.
    """
    correct1 = correct5 = count = 0
    for ranked, labels in zip(classes.tolist(), label_sets):
        if not labels:
            continue
        labels = set(labels)
        count += 1
        correct1 += ranked[0] in labels
        correct5 += any(c in labels for c in ranked[:TOPK])
    if not count:
        return dict(top1=None, top5=None, count=0, top1_reason=NOTHING_SCORED, top5_reason=NOTHING_SCORED)
    return dict(top1=100.0 * correct1 / count, top5=100.0 * correct5 / count, count=count)


def percent(value: Optional[float]) -> str:
    """An accuracy as eval.py prints it: ``82.700%``, or ``n/a`` where nothing was scored."""
    return "n/a" if value is None else f"{value:.3f}%"


def evaluate(model, loader, accelerator, max_bad_fraction: float = 1.0) -> dict:
    """Top-1 / top-5 and the mean cross-entropy (``loss``) of a ``(images, targets, failed)`` loader (training's
    validation) over its readable images; ``unreadable`` counts the others, under the same rule as training
    batches (:func:`check_unreadable`)."""
    pred = predict(model, loader, accelerator, desc="validation", losses=True)
    scored = {k: float("nan") if v is None else v  # nothing scored: NaN, null with a reason in metrics.jsonl
              for k, v in score(pred.classes, [[t] for t in pred.keys.tolist()]).items() if not k.endswith("_reason")}
    result = dict(scored,
                  loss=pred.loss.double().mean().item() if pred.loss is not None and pred.loss.numel()
                  else float("nan"))
    check_unreadable("validation", pred.unreadable, result["count"] + pred.unreadable, max_bad_fraction,
                     pred.failed, say=accelerator.is_main_process)
    return dict(result, unreadable=pred.unreadable)


def evaluate_dataset(model, dataset, accelerator, batch_size: int, workers: int = 4,
                     max_bad_fraction: float = DEFAULT_MAX_BAD_FRACTION) -> dict:
    """Score an :class:`~lipsformer.data.EvalDataset`; the result also holds each image's ranked predictions
    (class -1 and probability 0 for an unreadable image) and the paths of the images that could not be read.
    ``seconds`` / ``img_per_s``: the whole pass, reading the data included.

    Unreadable images are skipped and counted as training counts them; more than ``max_bad_fraction`` of
    them stops the evaluation (TooManyBadSamples, naming them). Raises when the gathered predictions do
    not cover every readable image exactly once.
    """
    (result,), seconds = evaluate_each([model], dataset, accelerator, batch_size, workers, max_bad_fraction)
    return dict(result, seconds=seconds, img_per_s=len(dataset) / max(seconds, 1e-9))


def evaluate_each(models: Sequence[torch.nn.Module], dataset, accelerator, batch_size: int, workers: int = 4,
                  max_bad_fraction: float = DEFAULT_MAX_BAD_FRACTION,
                  labels: Optional[Sequence[Sequence[Sample]]] = None) -> Tuple[List[dict], float]:
    """:func:`evaluate_dataset` of each of ``models`` over one pass of ``dataset`` (:func:`predict_each`: each image
    read and decoded once); ``labels``: each model's samples, the dataset's paths labelled for its classes (default:
    the dataset's own). Returns the results, whose ``seconds`` / ``img_per_s`` count each model's own work, and the
    seconds of the whole pass."""
    labels = [dataset.samples] * len(models) if labels is None else labels
    loader = accelerator.prepare_data_loader(DataLoader(dataset, batch_size=batch_size, shuffle=False,
                                                        num_workers=workers, collate_fn=collate_skip_failed))
    start = time.perf_counter()
    preds = predict_each(models, loader, accelerator)
    seconds = time.perf_counter() - start
    pred = preds[0]
    missing = sorted(set(range(len(dataset))) - set(pred.keys.tolist()))
    unreadable = [dataset.samples[i][0] for i in missing]
    if len(missing) != pred.unreadable or pred.keys.numel() + len(missing) != len(dataset):
        raise RuntimeError(f"predictions cover {pred.keys.unique().numel()} distinct images in {pred.keys.numel()} "
                           f"rows with {pred.unreadable} unreadable, expected each of the {len(dataset)} images once")
    check_unreadable("evaluation", len(unreadable), len(dataset), max_bad_fraction, unreadable,
                     say=accelerator.is_main_process)
    read = torch.ones(len(dataset), dtype=torch.bool)
    read[missing] = False
    results = []
    for pred, samples in zip(preds, labels):
        classes = torch.full((len(dataset), pred.classes.shape[1]), -1, dtype=torch.long)  # -1: not read
        probs = torch.zeros(len(dataset), pred.probs.shape[1])
        classes[pred.keys], probs[pred.keys] = pred.classes, pred.probs
        result = score(classes, [s[1] if ok else [] for s, ok in zip(samples, read.tolist())])
        result.update(images=len(dataset), excluded=sum(1 for s, ok in zip(samples, read.tolist()) if ok and not s[1]),
                      unreadable=len(unreadable), unreadable_files=unreadable, seconds=pred.seconds,
                      img_per_s=len(dataset) / max(pred.seconds, 1e-9))
        results.append(dict(result, classes=classes, probs=probs))
    return results, seconds


def write_predictions(path, samples, classes: torch.Tensor, probs: torch.Tensor, radius=None,
                      radius_global=None, names: Optional[Sequence[str]] = None) -> None:
    """One row per image: path, its allowed labels (space-separated), the top-5 classes and probabilities (empty for
    an image that could not be read), and with ``radius`` its certified l2 radius in pixel space
    (``certified_radius``: the pairwise rule, :mod:`lipsformer.lipschitz.certify`) and ``radius_global`` the global
    rule's (``certified_radius_global``). With ``names`` (each label's class name,
    :func:`~lipsformer.data.imagenet_eval.label_names`) each index column is followed by its names:
    ``target_names`` (``;``-separated) after ``targets``, ``topK_name`` after ``topK``."""
    k = classes.shape[1]
    named = names is not None
    header: List[str] = ["path", "targets"] + (["target_names"] if named else [])
    for i in range(1, k + 1):
        header += [f"top{i}"] + ([f"top{i}_name"] if named else []) + [f"prob{i}"]
    if radius is not None:
        header.append("certified_radius")
    if radius_global is not None:
        header.append("certified_radius_global")
    with replacing(path) as tmp, open(tmp, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        for n, ((image, labels), ranked, p) in enumerate(zip(samples, classes.tolist(), probs.tolist())):
            row = [image, " ".join(map(str, labels))]
            if named:
                row.append(";".join(names[c] for c in labels))
            for c, q in zip(ranked, p):
                if c < 0:  # an unreadable image: no prediction
                    row += [""] * (3 if named else 2)
                else:
                    row += [c, names[c], f"{q:.6f}"] if named else [c, f"{q:.6f}"]
            if radius is not None:
                row.append(f"{float(radius[n]):.6g}")
            if radius_global is not None:
                row.append(f"{float(radius_global[n]):.6g}")
            writer.writerow(row)


def check_eval_settings(img_size=None, crop_pct=None, attack_eps=(), attack_steps: int = 20,
                        attack_restarts: int = 3, batch_size: int = 1, workers: int = 0, model_args=None) -> None:
    """A ConfigError naming the setting unless the evaluation settings make sense (before any work starts)."""
    check_model_args(model_args or {})
    if batch_size < 1:
        raise ConfigError(f"--batch-size must be at least 1, got {batch_size}")
    if workers < 0:
        raise ConfigError(f"--workers must be 0 (load in the main process) or more, got {workers}")
    if img_size is not None and (not isinstance(img_size, int) or img_size < 1):
        raise ConfigError(f"--img-size must be a positive number of pixels, got {img_size}")
    if crop_pct is not None and not 0.0 < crop_pct <= 2.0:
        raise ConfigError(f"--crop-pct must be in (0, 2] (the crop's size over the resized image's: above 1 pads), "
                          f"got {crop_pct}")
    if attack_steps < 1:
        raise ConfigError(f"--attack-steps must be at least 1 (a PGD attack of {attack_steps} steps does not attack)")
    if attack_restarts < 1:
        raise ConfigError(f"--attack-restarts must be at least 1 (the number of PGD runs per image), got "
                          f"{attack_restarts}")


def check_request(data_dir, model_args=None, img_size=None, crop_pct=None, attack_eps=(), attack_steps: int = 20,
                  attack_restarts: int = 3, batch_size: int = 1, workers: int = 0, amp: str = "no",
                  pretrained: bool = False, use_ema: bool = False) -> dict:
    """The checks every evaluation of one call shares, before any model is built (a ConfigError naming the setting,
    a FileNotFoundError for the data folder); returns the model arguments, ``img_size`` among them when given."""
    check_eval_settings(img_size, crop_pct, attack_eps, attack_steps, attack_restarts, batch_size, workers, model_args)
    model_args = dict(model_args or {})
    if img_size is not None:
        if model_args.get("img_size", img_size) != img_size:
            raise ConfigError(f"--img-size {img_size} disagrees with --model-args img_size {model_args['img_size']}; "
                              f"pass one of them")
        model_args["img_size"] = img_size
    if pretrained and use_ema:
        raise ConfigError("--use-ema applies to --checkpoint; published weights hold one set")
    if not torch.cuda.is_available() and amp == "fp16":  # as training refuses it
        raise ConfigError("--amp fp16 needs a GPU: on CPU Accelerate would quietly run in fp32; use --amp bf16")
    if not Path(data_dir).is_dir():
        raise FileNotFoundError(f"no data folder {data_dir}")
    return model_args


SamplesFor = Callable[[torch.nn.Module], Samples]


def samples_for(dataset: str, data_dir, real_labels=None, shared: Optional[dict] = None) -> SamplesFor:
    """``model -> the data's samples labelled for its classes`` (:func:`~lipsformer.data.eval_samples`; data that do
    not fit the layout or the classes are a ConfigError). With ``shared`` (a dict kept across calls), models of the
    same classes (count, recorded names, ImageNet subset) share one scan of the folder."""
    def label(model) -> Samples:
        names = (getattr(model, "pretrained_cfg", None) or {}).get("label_names")
        key = (model.num_classes, tuple(names) if names else None, infer_imagenet_subset(model))
        if shared is not None and key in shared:
            return shared[key]
        try:  # labels for the model's classes: a folder's classes by name (data/classes.py)
            samples = eval_samples(dataset, data_dir, real_labels, model=model)
        except ValueError as e:  # the data do not fit the dataset's layout or the model's classes
            raise ConfigError(str(e)) from None
        if shared is not None:
            shared[key] = samples
        return samples
    return label


@dataclass
class Prepared:
    """One evaluation, checked and built before any is scored: the model with its weights (the fit check passed),
    the data's samples labelled for its classes, and its preprocessing."""

    model: torch.nn.Module
    source: str  # the checkpoint as given, or ``pretrained:TAG``
    checkpoint: Optional[str]
    trained: Optional[Tuple[int, ...]]  # the input size the weights record (recorded_input_size), or None
    samples: Samples
    transform: Callable
    data_cfg: dict

    @property
    def preprocessing(self) -> tuple:
        """What the transform is made of (input size and channels, crop, interpolation, mean, std): evaluations with
        the same one read the same tensors."""
        return tuple(sorted((k, tuple(v) if isinstance(v, (list, tuple)) else v) for k, v in self.data_cfg.items()))

    @property
    def size_warning(self) -> str:
        """Why the accuracy is not the trained model's when it is evaluated at another size than its weights record
        ("" otherwise)."""
        size = self.data_cfg["input_size"]
        if self.trained is None or tuple(self.trained[1:]) == tuple(size[1:]):
            return ""
        return (f"evaluating at {size[1]} px a model whose weights were made at {self.trained[1]} px (as they record): "
                f"its windows / stripes and position biases are resized (set_input_size), so this is not the "
                f"accuracy at the size it was trained for and is often much lower")


def check_source(model_name: Optional[str], checkpoint=None, use_ema: bool = False) -> None:
    """What can be told of an evaluation's source without building its model (nor downloading its weights): the
    model name, published weights where they are asked for, the checkpoint's files (:func:`resolve_checkpoint`)."""
    if model_name:
        check_model_name(model_name)
    if checkpoint is None and not has_published_weights(model_name):
        raise ConfigError(f"{model_name} has no published weights; evaluate a --checkpoint instead")
    if checkpoint is not None:
        resolve_checkpoint(checkpoint, use_ema)


def prepare(model_name: Optional[str], checkpoint, use_ema: bool, model_args: dict, label: SamplesFor,
            crop_pct=None, interpolation=None) -> Prepared:
    """Build the model of one evaluation (``checkpoint``, or timm's published weights of ``model_name`` when None)
    and label the data for it, raising what is wrong with it before any evaluation starts."""
    check_source(model_name, checkpoint, use_ema)
    try:  # the fit check refuses a num_classes other than the weights' classifier (eval scores it, not a new one)
        model, _ = build_model(model_name, PUBLISHED if checkpoint is None else checkpoint, use_ema=use_ema,
                               **model_args)
    except WeightsUnavailable as e:
        raise WeightsUnavailable(f"{e} (--checkpoint FILE)") from None
    trained = tuple(model.pretrained_cfg["input_size"]) if checkpoint is None else \
        recorded_input_size(checkpoint, use_ema)  # the size the weights were made at as they record it, or None
    samples = label(model)
    tag = model.pretrained_cfg.get("tag")
    source = str(checkpoint) if checkpoint is not None else f"pretrained:{tag}" if tag else "pretrained"
    return Prepared(model, source, None if checkpoint is None else str(checkpoint), trained, samples,
                    create_loader_transform(model, is_training=False, crop_pct=crop_pct, interpolation=interpolation),
                    eval_data_config(model, crop_pct, interpolation))


def describe(prepared: Prepared, dataset: str, accelerator, use_ema: bool, amp: str, compile: bool,
             channels_last: bool) -> dict:
    """What a result says of its evaluation beside the scores (eval.py's --output keys)."""
    model, cfg = prepared.model, prepared.data_cfg
    return dict(model=model.pretrained_cfg.get("architecture", type(model).__name__), dataset=dataset,
                checkpoint=prepared.checkpoint or "pretrained", source=prepared.source,
                params=sum(p.numel() for p in model.parameters()), use_ema=use_ema,
                amp=amp, processes=accelerator.num_processes, is_main_process=accelerator.is_main_process,
                input_size=list(cfg["input_size"]),
                trained_input_size=None if prepared.trained is None else list(prepared.trained),  # null: not recorded
                adapted=weights_fit(model).adapted,
                data=describe_samples(dataset, prepared.samples), crop_pct=cfg["crop_pct"],
                interpolation=cfg["interpolation"], compile=compile, channels_last=channels_last)


def robustness(prepared: Prepared, model, accelerator, batch_size: int, workers: int, certify_eps=(), attack_eps=(),
               attack_steps: int = 20, attack_restarts: int = 3) -> dict:
    """Certified and PGD-attacked accuracy of ``model`` (:func:`lipsformer.lipschitz.certify.certify_dataset`): a
    pass of its own over the data, in float32, with gradients for the attack."""
    loader = accelerator.prepare_data_loader(DataLoader(EvalDataset(prepared.samples, prepared.transform),
                                                        batch_size=batch_size, shuffle=False, num_workers=workers,
                                                        collate_fn=collate_skip_failed))
    return certify_dataset(model, loader, accelerator, [s[1] for s in prepared.samples], certify_eps, attack_eps,
                           attack_steps, attack_restarts)


def evaluate_model(model_name: str, data_dir, dataset: str = "imagenet", checkpoint=None, pretrained: bool = False,
                   real_labels=None, use_ema: bool = False, batch_size: int = 100, amp: str = "no",
                   workers: int = 4, model_args=None, max_bad_fraction: float = DEFAULT_MAX_BAD_FRACTION,
                   img_size=None, crop_pct=None, interpolation=None,
                   certify_eps=(), attack_eps=(), attack_steps: int = 20, attack_restarts: int = 3,
                   compile: bool = False, channels_last: bool = False):
    """eval.py's work: build the model (``checkpoint`` or timm's ``pretrained``; at ``img_size`` when given),
    preprocess as its pretrained config says at the size it is built for (``crop_pct`` / ``interpolation``
    override), score ``dataset`` on every process Accelerate launched. Returns ``(result, samples)``.

    With ``certify_eps`` / ``attack_eps`` the result also holds ``robustness``: certified accuracy at each radius
    and accuracy under an l2 PGD attack (:func:`lipsformer.lipschitz.certify.certify_dataset`), and ``radius``,
    each image's certified radius."""
    if (checkpoint is None) == (not pretrained):
        raise ConfigError("pass exactly one of --checkpoint PATH and --pretrained")
    model_args = check_request(data_dir, model_args, img_size, crop_pct, attack_eps, attack_steps, attack_restarts,
                               batch_size, workers, amp, pretrained, use_ema)
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), mixed_precision=amp)
    prepared = prepare(model_name, checkpoint, use_ema, model_args, samples_for(dataset, data_dir, real_labels),
                       crop_pct, interpolation)
    model, samples = prepared.model, prepared.samples
    for line in weights_fit(model).lines():  # what the weights did not bring as they are (adapted: ...)
        accelerator.print(line)
    if prepared.size_warning:
        _logger.warning(prepared.size_warning)
    if accelerator.is_main_process:  # after every check: a refused evaluation is one line
        for note in samples.notes:  # files that are not images, folders skipped, labels mapped by name
            _logger.warning(note)
    model = prepare_model(model.to(accelerator.device), channels_last=channels_last)
    if compile:
        compile_model(model)
    result = evaluate_dataset(model, EvalDataset(samples, prepared.transform), accelerator, batch_size, workers,
                              max_bad_fraction)
    result.update(label_names=label_names(dataset, samples, model))  # for --predictions; eval.py pops them
    result.update(describe(prepared, dataset, accelerator, use_ema, amp, compile, channels_last))
    if certify_eps or attack_eps:  # a second pass in float32, with gradients for the attack
        r = robustness(prepared, model, accelerator, batch_size, workers, certify_eps, attack_eps, attack_steps,
                       attack_restarts)
        result.update(radius=r.pop("radius"), radius_global=r.pop("radius_global"), robustness=r)
    return result, samples
