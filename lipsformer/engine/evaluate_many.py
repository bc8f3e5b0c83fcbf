"""Many evaluations in one call, as timm's validate.py scores a folder of checkpoints or a list of models: eval.py with
several ``--checkpoint`` values (weight files, run folders, exports; a pattern the shell did not expand is globbed), a
folder of runs, or several ``--model`` names (or timm patterns such as ``'lipsformer_*'``) with ``--pretrained``.

Every evaluation is checked and built before the first is scored (names, files, the fit check of
:mod:`lipsformer.weights`, the data's classes): a bad one ends the call in one line naming it, exit 2, with nothing
written. They are scored on the same data with the same settings into one table, sorted by top-1 (descending; ties
keep the order given; one that scored no image has no accuracy and comes last), one row each (:func:`row`).

**The data are read once where the preprocessing agrees.** Evaluations of the same resolved data config
(:attr:`~.evaluate.Prepared.preprocessing`: input size and channels, crop, interpolation, mean, std) form a group
whose models share one scan of the folder (those of the same classes) and one decoded pass: each batch is read once
and given to each model in turn (:func:`~.evaluate.evaluate_each`), so they score the very same tensors. A group of
another preprocessing reads the data again. A group's models are on the device together. A row's ``img_per_s`` counts
the model's own work (forward passes, top-k, gathers), not the reading its group shares; ``passes`` says each group's
whole pass.

**A folder of runs** is a folder that is neither a train.py run (it holds ``config.yaml``), an export (``config.json``)
nor a periodic checkpoint (``step_N``), and whose sub-folders, one level down, include runs or exports: each of those
is evaluated, in the natural order of their names; anything else in it is left. A run there without its weights yet
(``last.safetensors``, or ``last_ema.safetensors`` with ``--use-ema``: still training, or stopped before its end) is
skipped with a note, as validate.py scores the checkpoints that exist; every other defect of a run is refused.
"""
import contextlib
import dataclasses
import glob
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence

import timm
import torch
from accelerate import Accelerator
from timm.utils.misc import natural_key

from ..data import EvalDataset
from ..data.imagenet_eval import describe_samples
from ..errors import Mistake
from ..run_folder import RunFolder, checkpoint_step
from ..sources import resolve_checkpoint
from ..weights import ModelArgsError, weights_fit
from ..writer import EXPORT_CONFIG
from .evaluate import (DEFAULT_MAX_BAD_FRACTION, Prepared, check_request, check_source, describe, evaluate_each,
                       prepare, robustness, samples_for)
from .speed import compile_model, prepare_model

_PATTERN = re.compile(r"[*?\[]")
# the columns eval.py prints, in order: (heading, key, format)
COLUMNS = (("top-1", "top1", "{:.3f}"), ("top-5", "top5", "{:.3f}"), ("model", "model", "{}"),
           ("params", "params", "{:,}"), ("input", "input_size", "{}"), ("crop", "crop_pct", "{:g}"),
           ("interpolation", "interpolation", "{}"), ("images", "count", "{}"), ("img/s", "img_per_s", "{:.1f}"))
_logger = logging.getLogger(__name__)


class BadEntry(Mistake):
    """One of several evaluations cannot be made (a file, a name, the fit check, the data's classes): its line names
    it."""


@dataclass(frozen=True)
class Entry:
    """One evaluation asked for: a checkpoint (a file, a run, an export) built as ``model`` (or as it says), or the
    published weights of ``model``."""

    model: Optional[str]
    checkpoint: Optional[str] = None

    @property
    def name(self) -> str:
        return self.checkpoint if self.checkpoint is not None else str(self.model)


@dataclass
class Plan:
    """What a call evaluates, and the runs of a folder of runs it leaves (``source``, ``reason``)."""

    entries: List[Entry]
    skipped: List[Dict[str, str]]
    merged: List[str] = dataclasses.field(default_factory=list)  # a line for each source named more than once


def is_pattern(text: str) -> bool:
    return bool(_PATTERN.search(str(text)))


def runs_in(path) -> Optional[List[Path]]:
    """The runs and exports a folder of runs holds (see the module docstring), or None when ``path`` is not one."""
    path = Path(path)
    if not path.is_dir() or RunFolder(path).is_run() or (path / EXPORT_CONFIG).is_file() \
            or checkpoint_step(path) is not None:
        return None
    found = [p for p in path.iterdir() if p.is_dir() and not p.name.startswith(".")
             and (RunFolder(p).is_run() or (p / EXPORT_CONFIG).is_file())]
    return sorted(found, key=lambda p: natural_key(p.name)) or None


def _globbed(value: str) -> bool:
    return is_pattern(value) and not Path(value).exists()


def several(checkpoints: Optional[Sequence[str]], models: Optional[Sequence[str]]) -> bool:
    """Whether eval.py's sources name several evaluations, so that its results are a table: more than one value, a
    pattern, or a folder of runs (read from the file system, for the parser's table of ignored flags too)."""
    checkpoints, models = list(checkpoints or []), list(models or [])
    if checkpoints:
        return len(checkpoints) > 1 or any(_globbed(c) or runs_in(c) is not None for c in checkpoints)
    return len(models) > 1 or any(is_pattern(m) for m in models)


def plan(checkpoints: Optional[Sequence[str]], models: Optional[Sequence[str]], use_ema: bool = False) -> Plan:
    """The evaluations eval.py's sources name, each once, in the order given (a folder's runs and a pattern's matches
    in natural order). With checkpoints, ``models`` holds at most the one name each is built as."""
    entries: List[Entry] = []
    skipped: List[Dict[str, str]] = []
    if checkpoints:
        model = models[0] if models else None
        for value in checkpoints:
            paths = [value]
            if _globbed(value):
                paths = sorted(glob.glob(value), key=natural_key)
                if not paths:
                    raise BadEntry(f"--checkpoint {value} matches no file or folder")
            for path in paths:
                runs = runs_in(path)
                if runs is None:
                    entries.append(Entry(model, str(Path(path))))
                    continue
                for run in runs:
                    reason = _not_ready(run, use_ema)
                    if reason:
                        skipped.append(dict(source=str(run), reason=reason))
                    else:
                        entries.append(Entry(model, str(run)))
        if not entries:
            raise BadEntry(f"no run in {', '.join(map(str, checkpoints))} has its weights yet: "
                           f"{'; '.join(s['source'] + ': ' + s['reason'] for s in skipped[:3])}")
    else:
        for name in models or []:
            if not is_pattern(name):
                entries.append(Entry(name))
                continue
            found = timm.list_models(name, pretrained=True)
            if not found:
                raise ModelArgsError(f"--model {name} matches no model with published weights; "
                                     f"timm.list_models({name!r}, pretrained=True) lists them")
            entries += [Entry(n) for n in found]
    once: Dict[tuple, List[Entry]] = {}  # each source once (a file named twice, a run also in a folder given)
    for e in entries:
        once.setdefault((e.model, e.checkpoint and os.path.realpath(e.checkpoint)), []).append(e)
    merged = [f"{same[0].name} is named {len(same)} times"
              + (f" (as {', '.join(dict.fromkeys(e.name for e in same))})" if len({e.name for e in same}) > 1 else "")
              + ": evaluated once, one row" for same in once.values() if len(same) > 1]
    return Plan([same[0] for same in once.values()], skipped, merged)


def _not_ready(run: Path, use_ema: bool) -> str:
    """Why a run of a folder of runs is skipped (its weights are not written yet), or "" to evaluate it. A run whose
    weights can never be there (--use-ema on a run trained without an EMA) is a mistake and raises."""
    folder = RunFolder(run)
    weights = folder.weights(ema=use_ema)
    if not folder.is_run() or weights.is_file():
        return ""
    try:
        resolve_checkpoint(run, use_ema)  # raises for weights that will never be there
    except FileNotFoundError:  # not there yet
        pass
    steps = folder.finished_checkpoints()
    newest = f"; its newest checkpoint evaluates as --checkpoint {steps[-1]}" if steps and not use_ema else ""
    return f"no {weights.name} yet (still training, or stopped before its end){newest}"


@contextlib.contextmanager
def naming(source: str) -> Iterator[None]:
    """Say which evaluation a mistake belongs to: a mistake whose line does not name ``source`` is raised again as a
    :class:`BadEntry` that does (the same exit code, 2)."""
    try:
        yield
    except (Mistake, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError) as e:
        text = f"{e.strerror}: {e.filename}" if isinstance(e, OSError) and e.strerror else str(e)
        if isinstance(e, BadEntry) or source in text:
            raise
        raise BadEntry(f"{source}: {text}") from None


def row(result: dict) -> dict:
    """One line of the table from an evaluation's result (:func:`~.evaluate.evaluate_model`'s keys): flat values
    only, so that JSON and CSV hold the same table. Sizes are ``CxHxW``; with a robustness pass, the Lipschitz bound,
    certified and attacked accuracy (%) at each radius, and why nothing certifies where nothing does."""
    size = "x".join(map(str, result["input_size"]))
    trained = result["trained_input_size"]
    out = dict(model=result["model"], source=result["source"], params=result["params"], input_size=size,
               crop_pct=result["crop_pct"], interpolation=result["interpolation"], top1=result["top1"],
               top5=result["top5"], count=result["count"], images=result["images"], img_per_s=result["img_per_s"],
               use_ema=result["use_ema"], trained_input_size="x".join(map(str, trained)) if trained else "",
               adapted="; ".join(result["adapted"]), excluded=result["excluded"], unreadable=result["unreadable"],
               seconds=result["seconds"])
    if result["top1"] is None:  # nothing scored: no accuracy, and why
        out["top1_reason"] = result["top1_reason"]
    r = result.get("robustness")
    if r is not None:
        out["lipschitz"] = r["lipschitz"]
        out.update({f"certified_{e:g}": a for e, a in r["certified"].items()})
        out.update({f"attacked_{e:g}": a for e, a in r["attacked"].items()})
        out["certified_reason"] = r["reason"]
    return out


def ranked(rows: Sequence[dict]) -> List[dict]:
    """Table rows sorted by top-1, highest first; ties keep their order, and a row that scored no image (top-1
    None: no accuracy) comes after every scored one, never ranked as a 0%."""
    return sorted(rows, key=lambda r: (r["top1"] is None, -(r["top1"] or 0.0)))


def format_table(rows: Sequence[dict]) -> str:
    """The rows as eval.py prints them: aligned columns (:data:`COLUMNS`, then certified / attacked accuracy where
    asked), the source last."""
    extra = [(k.replace("certified_", "cert@").replace("attacked_", "pgd@"), k, "{:.3f}") for k in (rows[0] if rows
             else {}) if k.startswith(("certified_", "attacked_")) and k != "certified_reason"]
    columns = [*COLUMNS, *extra, ("source", "source", "{}")]
    cells = [[heading for heading, _, _ in columns]]
    cells += [[fmt.format(r[key]) if r[key] is not None else "-" for _, key, fmt in columns] for r in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    numeric = [fmt != "{}" for _, _, fmt in columns]
    return "\n".join("  ".join(c.rjust(w) if n else c.ljust(w) for c, w, n in zip(line, widths, numeric)).rstrip()
                     for line in cells)


def evaluate_many(checkpoints, models, data_dir, dataset: str = "imagenet", real_labels=None, use_ema: bool = False,
                  batch_size: int = 100, amp: str = "no", workers: int = 4, model_args=None,
                  max_bad_fraction: float = DEFAULT_MAX_BAD_FRACTION, img_size=None, crop_pct=None,
                  interpolation=None, certify_eps=(), attack_eps=(), attack_steps: int = 20, attack_restarts: int = 3,
                  compile: bool = False, channels_last: bool = False) -> dict:
    """eval.py's work for several evaluations (see the module docstring): every one checked and built, then each
    group of one preprocessing scored in one pass. Returns ``results`` (:func:`row` of each, sorted by top-1),
    ``skipped`` (runs without weights yet), what the rows share (``data_dir``, ``dataset``, ``data``, ``amp``,
    ``processes``), ``passes`` (each group: its preprocessing, sources and seconds) and ``is_main_process``."""
    todo = plan(checkpoints, models, use_ema)
    model_args = check_request(data_dir, model_args, img_size, crop_pct, attack_eps, attack_steps, attack_restarts,
                               batch_size, workers, amp, not checkpoints, use_ema)
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), mixed_precision=amp)
    label = samples_for(dataset, data_dir, real_labels, shared={})
    for entry in todo.entries:  # names and files first: nothing is built (or downloaded) for a call that fails
        with naming(entry.name):
            check_source(entry.model, entry.checkpoint, use_ema)
    prepared: List[Prepared] = []
    for entry in todo.entries:  # every one before the first is scored
        with naming(entry.name):
            prepared.append(prepare(entry.model, entry.checkpoint, use_ema, model_args, label, crop_pct,
                                    interpolation))
    if accelerator.is_main_process:  # after every check: a refused call is one line
        for skip in todo.skipped:
            _logger.warning(f"skipped {skip['source']}: {skip['reason']}")
        for line in todo.merged:
            _logger.warning(line)
        for p in prepared:
            for line in weights_fit(p.model).lines():  # what the weights did not bring as they are (adapted: ...)
                accelerator.print(f"{p.source}: {line}")
            if p.size_warning:
                _logger.warning(f"{p.source}: {p.size_warning}")
        for note in dict.fromkeys(n for p in prepared for n in p.samples.notes):
            _logger.warning(note)
    groups: Dict[tuple, List[Prepared]] = {}
    for p in prepared:
        groups.setdefault(p.preprocessing, []).append(p)
    given = {id(p): i for i, p in enumerate(prepared)}
    rows, passes, described = [], [], describe_samples(dataset, prepared[0].samples)
    for group in groups.values():
        nets = [prepare_model(p.model.to(accelerator.device), channels_last=channels_last) for p in group]
        if compile:
            for net in nets:
                compile_model(net)
        data = EvalDataset(group[0].samples, group[0].transform)
        if any([s[0] for s in p.samples] != [s[0] for s in data.samples] for p in group):
            raise RuntimeError("the models of one group were given different images")  # one scanner: never
        results, seconds = evaluate_each(nets, data, accelerator, batch_size, workers, max_bad_fraction,
                                         labels=[p.samples for p in group])
        for p, net, result in zip(group, nets, results):
            result.update(describe(p, dataset, accelerator, use_ema, amp, compile, channels_last))
            if certify_eps or attack_eps:  # a pass of its own, in float32, with gradients for the attack
                r = robustness(p, net, accelerator, batch_size, workers, certify_eps, attack_eps, attack_steps,
                               attack_restarts)
                result["robustness"] = {k: v for k, v in r.items() if k not in ("radius", "radius_global")}
            rows.append((given[id(p)], row(result)))
            p.model = None  # off the device once its group is scored
        cfg = group[0].data_cfg
        passes.append(dict(input_size=list(cfg["input_size"]), crop_pct=cfg["crop_pct"],
                           interpolation=cfg["interpolation"], mean=list(cfg["mean"]), std=list(cfg["std"]),
                           sources=[p.source for p in group], seconds=seconds))
        del nets
    rows.sort(key=lambda r: r[0])  # the order given, which ties keep
    return dict(results=ranked([r for _, r in rows]), skipped=todo.skipped, data_dir=str(data_dir), dataset=dataset,
                data=described, amp=amp, processes=accelerator.num_processes, passes=passes,
                is_main_process=accelerator.is_main_process)
