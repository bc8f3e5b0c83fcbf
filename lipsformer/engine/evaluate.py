"""Top-k predictions gathered across processes, and accuracy against label sets: every sample counted once."""
import csv
import time
from typing import List, Sequence

import timm
import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

from ..data import EvalDataset, create_loader_transform, eval_data_config, eval_samples
from ..weights import create_from_checkpoint

TOPK = 5


@torch.no_grad()
def predict(model, loader, accelerator, k: int = TOPK):
    """``(keys, classes, probs)`` for every sample of ``loader`` across processes, in loader order.

    ``keys`` is the batch's second item (a target in training, a sample index in eval.py); ``classes`` and
    ``probs`` are the top-``k`` softmax classes and probabilities. Accelerate's ``gather_for_metrics`` drops
    the samples repeated to even out the last batch.
    """
    model.eval()
    keys, classes, probs = [], [], []
    for batch in loader:
        images, key = batch[0], batch[1]
        if images is None:  # a training batch whose images all failed to load
            continue
        with accelerator.autocast():
            logits = model(images)
        p, c = logits.float().softmax(-1).topk(min(k, logits.shape[-1]), dim=-1)
        key, c, p = accelerator.gather_for_metrics((key, c, p))
        keys.append(key.cpu())
        classes.append(c.cpu())
        probs.append(p.cpu())
    if not keys:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, k, dtype=torch.long), torch.zeros(0, k)
    return torch.cat(keys), torch.cat(classes), torch.cat(probs)


def score(classes: torch.Tensor, label_sets: Sequence[Sequence[int]]) -> dict:
    """Top-1 / top-5 (%) of ranked predictions against each sample's allowed labels.

    A prediction is right when it is in the sample's list; samples with an empty list are left out
    (ReaL). ``count`` is the number of samples scored.
    """
    correct1 = correct5 = count = 0
    for ranked, labels in zip(classes.tolist(), label_sets):
        if not labels:
            continue
        labels = set(labels)
        count += 1
        correct1 += ranked[0] in labels
        correct5 += any(c in labels for c in ranked[:TOPK])
    return dict(top1=100.0 * correct1 / max(count, 1), top5=100.0 * correct5 / max(count, 1), count=count)


def evaluate(model, loader, accelerator) -> dict:
    """Top-1 / top-5 of a ``(images, targets, ...)`` loader (training's validation)."""
    targets, classes, _ = predict(model, loader, accelerator)
    return score(classes, [[t] for t in targets.tolist()])


def evaluate_dataset(model, dataset, accelerator, batch_size: int, workers: int = 4) -> dict:
    """Score an :class:`~lipsformer.data.EvalDataset`; the result also holds each image's ranked predictions.

    Raises when the gathered predictions do not cover every image exactly once.
    """
    loader = accelerator.prepare_data_loader(DataLoader(dataset, batch_size=batch_size, shuffle=False,
                                                        num_workers=workers))
    start = time.perf_counter()
    index, classes, probs = predict(model, loader, accelerator)
    seconds = time.perf_counter() - start
    order = index.argsort()
    index, classes, probs = index[order], classes[order], probs[order]
    if not torch.equal(index, torch.arange(len(dataset))):
        raise RuntimeError(f"predictions cover {index.unique().numel()} distinct images in {index.numel()} rows, "
                           f"expected each of the {len(dataset)} images once")
    labels = [s[1] for s in dataset.samples]
    result = score(classes, labels)
    result.update(images=len(dataset), excluded=sum(1 for s in labels if not s), seconds=seconds,
                  img_per_s=len(dataset) / max(seconds, 1e-9))
    return dict(result, classes=classes, probs=probs)


def write_predictions(path, samples, classes: torch.Tensor, probs: torch.Tensor) -> None:
    """One row per image: path, its allowed labels (space-separated), the top-5 classes and probabilities."""
    k = classes.shape[1]
    header: List[str] = ["path", "targets"]
    for i in range(1, k + 1):
        header += [f"top{i}", f"prob{i}"]
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        for (image, labels), ranked, p in zip(samples, classes.tolist(), probs.tolist()):
            row = [image, " ".join(map(str, labels))]
            for c, q in zip(ranked, p):
                row += [c, f"{q:.6f}"]
            writer.writerow(row)


def evaluate_model(model_name: str, data_dir, dataset: str = "imagenet", checkpoint=None, pretrained: bool = False,
                   real_labels=None, use_ema: bool = False, batch_size: int = 100, amp: str = "no",
                   workers: int = 4, model_args=None, img_size=None, crop_pct=None, interpolation=None):
    """eval.py's work: build the model (``checkpoint`` or timm's ``pretrained``; at ``img_size`` when given),
    preprocess as its pretrained config says at the size it is built for (``crop_pct`` / ``interpolation``
    override), score ``dataset`` on every process Accelerate launched. Returns ``(result, samples)``."""
    if (checkpoint is None) == (not pretrained):
        raise ValueError("pass exactly one of --checkpoint PATH and --pretrained")
    model_args = dict(model_args or {})
    if img_size is not None:
        if model_args.get("img_size", img_size) != img_size:
            raise ValueError(f"--img-size {img_size} disagrees with --model-args img_size {model_args['img_size']}; "
                             f"pass one of them")
        model_args["img_size"] = img_size
    if pretrained and use_ema:
        raise ValueError("--use-ema applies to --checkpoint; published weights hold one set")
    samples = eval_samples(dataset, data_dir, real_labels)
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), mixed_precision=amp)
    if checkpoint is not None:
        model = create_from_checkpoint(checkpoint, model_name, use_ema=use_ema, **model_args)
    else:
        model = timm.create_model(model_name, pretrained=True, **model_args)
    transform = create_loader_transform(model, is_training=False, crop_pct=crop_pct, interpolation=interpolation)
    data_cfg = eval_data_config(model, crop_pct, interpolation)
    result = evaluate_dataset(model.to(accelerator.device), EvalDataset(samples, transform), accelerator,
                              batch_size, workers)
    result.update(model=model.pretrained_cfg.get("architecture", model_name), dataset=dataset,
                  checkpoint=str(checkpoint) if checkpoint is not None else "pretrained", use_ema=use_ema,
                  amp=amp, processes=accelerator.num_processes, is_main_process=accelerator.is_main_process,
                  input_size=list(data_cfg["input_size"]), crop_pct=data_cfg["crop_pct"],
                  interpolation=data_cfg["interpolation"])
    return result, samples
