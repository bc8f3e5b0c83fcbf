"""What a run reports about itself: ``metrics.jsonl`` rows (and Accelerate's trackers), ``summary.csv`` derived from
them, the running sums of an epoch's training batches, the per-stage |alpha| statistics, and ``curves.png`` drawn
from the rows."""
import csv
import io
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List

import torch
from accelerate.utils import gather_object

from ..layers.residual import WeightedResidual
from ..models._base import LipsFormerBase
from ..run_folder import RunFolder, read_metrics
from ..writer import append_text, save_figure, to_json, write_text
from .ema import full_tensor_of


class MetricsLog:
    """Metrics to the run folder's ``metrics.jsonl`` (main process) and to Accelerate's trackers (``log_with``: every
    number of every row, as ``KIND/KEY`` at the row's step). Each row is strict JSON (a non-finite value is null with
    a ``KEY_reason``) appended whole: a failed append is cut back, leaving no partial row
    (:func:`lipsformer.writer.append_text`). After each epoch row ``summary.csv`` is rewritten from the file's rows
    (:func:`summary_csv`), so a resumed run's summary is the uninterrupted one's."""

    def __init__(self, accelerator, folder: RunFolder):
        self.accelerator, self.folder = accelerator, folder

    def __call__(self, kind: str, step: int, **values):
        if self.accelerator.is_main_process:
            append_text(self.folder.metrics, to_json(dict(kind=kind, step=step, **values)) + "\n")
            if kind == "epoch":
                write_text(self.folder.summary, summary_csv(read_metrics(self.folder.metrics)))
        self.accelerator.log({f"{kind}/{k}": v for k, v in values.items() if isinstance(v, (int, float))}, step=step)


# summary.csv's columns and the epoch row's key of each: timm's (timm.utils.summary.update_summary: epoch, train_*,
# eval_*, lr), always there, then ours, where an epoch row has them (the EMA's figures, the kept Lipschitz bound,
# and which of model / EMA became best.safetensors that epoch).
SUMMARY_COLUMNS = (("epoch", "epoch"), ("train_loss", "train_loss"), ("eval_loss", "val_loss"),
                   ("eval_top1", "top1"), ("eval_top5", "top5"), ("lr", "lr"))
SUMMARY_OURS = (("ema_eval_loss", "ema_val_loss"), ("ema_eval_top1", "ema_top1"), ("ema_eval_top5", "ema_top5"),
                ("lipschitz_bound", "lipschitz_bound"), ("best", "best"))


def summary_csv(rows: List[dict]) -> str:
    """``summary.csv`` of ``metrics.jsonl`` rows: a header, then one row per epoch row, in order; a figure the epoch
    did not have (not evaluated that epoch) or that was not finite (null) is empty."""
    epochs = [r for r in rows if r["kind"] == "epoch"]
    columns = [*SUMMARY_COLUMNS, *(c for c in SUMMARY_OURS if any(c[1] in r for r in epochs))]
    text = io.StringIO()
    out = csv.writer(text, lineterminator="\n")
    out.writerow([name for name, _ in columns])
    out.writerows([["" if r.get(key) is None else r[key] for _, key in columns] for r in epochs])
    return text.getvalue()


def logged_lr(optimizer) -> float:
    """The learning rate a run logs: the mean over the optimizer's parameter groups, as timm's train.py logs it (with
    ``layer_decay`` each group's lr is the schedule's times its layer's scale)."""
    lrs = [group["lr"] for group in optimizer.param_groups]
    return sum(lrs) / len(lrs)


NO_FINITE_LOSS = "no finite batch loss in the epoch so far"


@dataclass
class EpochMeter:
    """The running sums of one epoch's training batches; ``carried`` holds the sums of the batches before a
    mid-epoch resume (checkpointed as ``TrainState.epoch_sums``), so a resumed epoch's row counts the whole epoch.
    Counts the host knows (samples, unreadable images) are kept here; the losses are summed on the device by
    ``tally`` (step.py's StepTally) and copied here at each read step, summed over every process there, so the loss
    a run logs is the whole run's, as timm's train.py reduces it at its log steps."""

    failed: List[str] = field(default_factory=list)  # paths of images that could not be read
    seen: int = 0  # samples in this process's batches
    loss_sum: float = 0.0  # every process's finite batch losses, as of the last read
    loss_n: int = 0
    images: int = 0  # over all processes, for the speed shown
    t0: float = field(default_factory=time.time)
    carried: Dict[str, Any] = field(default_factory=dict)  # :meth:`totals` at the checkpoint resumed from
    tally: Any = None  # the steps' device-side record (step.py)

    @property
    def loss(self) -> float:  # the mean finite batch loss of every process over the epoch so far; NaN: none finite
        n = self.carried.get("loss_n", 0) + self.loss_n
        return (self.carried.get("loss_sum", 0.0) + self.loss_sum) / n if n else math.nan

    def loss_figures(self, key: str) -> Dict[str, Any]:
        """:attr:`loss` as a row's ``key``; with no finite batch loss in the epoch so far it is NaN (null in
        ``metrics.jsonl``, an empty ``summary.csv`` cell) and ``KEY_reason`` says why."""
        if math.isfinite(self.loss):
            return {key: self.loss}
        return {key: self.loss, f"{key}_reason": NO_FINITE_LOSS}

    def loss_text(self) -> str:
        """:attr:`loss` as the console shows it: four decimals, or ``n/a`` when no batch loss was finite."""
        return f"{self.loss:.4f}" if math.isfinite(self.loss) else "n/a"

    def read(self, accelerator, cause: bool = False):
        """At a read step: ``tally``'s record (step.py's ``StepTally.read``), its loss sums copied here."""
        got = self.tally.read(accelerator, cause)
        self.loss_sum, self.loss_n = got.loss_sum, got.loss_n
        return got

    def totals(self, accelerator) -> Dict[str, Any]:
        """The epoch so far, carried part included: samples and unreadable ones over all processes (a collective
        call), every process's loss sums (as of the last read), wall seconds, and a few unreadable paths of any
        process for messages."""
        counts = accelerator.reduce(torch.tensor([float(len(self.failed)), float(self.seen)],
                                                 device=accelerator.device), "sum")
        c = self.carried
        failed = gather_object(self.failed[:5]) if accelerator.num_processes > 1 else self.failed
        return dict(failed=c.get("failed", 0) + int(counts[0]), seen=c.get("seen", 0) + int(counts[1]),
                    loss_sum=c.get("loss_sum", 0.0) + self.loss_sum, loss_n=c.get("loss_n", 0) + self.loss_n,
                    seconds=c.get("seconds", 0.0) + time.time() - self.t0,
                    failed_paths=(list(c.get("failed_paths", [])) + list(failed))[:5])


@torch.no_grad()
def alpha_statistics(model: torch.nn.Module) -> Dict[str, float]:
    """Per-stage mean and standard deviation of |alpha| over every WeightedResidual alpha of the stage (all
    channels pooled; population std), as ``alpha_mean_s{i}`` / ``alpha_std_s{i}``: LipsFormer Figure 5's
    curves. Empty for a model that is not a LipsFormer."""
    if not isinstance(model, LipsFormerBase):
        return {}
    stats = {}
    for i, stage in enumerate(model.stages):
        alphas = [full_tensor_of(m.alpha).detach().float().abs().flatten() for m in stage.modules()
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
    ax1.plot([r["step"] for r in train], [math.nan if r["loss"] is None else r["loss"] for r in train],
             label="train loss (epoch running mean)")
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
    try:
        save_figure(fig, png_path)
    finally:
        plt.close(fig)

