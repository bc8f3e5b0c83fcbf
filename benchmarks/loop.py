"""A tool users run (README.md and docs/speed.md): train.py's loop against timm's own train.py: the same model, data
folder and recipe, run in turns.

    python benchmarks/loop.py --timm /work/timm-src                       # demo and swin_t, 3 rounds of 3 epochs
    python benchmarks/loop.py --timm /work/timm-src --settings demo --rounds 5 --threads 2 --json loop.json

``--timm``: a checkout of pytorch-image-models (docs/speed.md names the commit and how to get it). Only its
``train.py`` is used, run on the installed timm with ``import lipsformer`` first, so that the zoo's models are
registered; nothing of the checkout is imported. Settings:

- ``demo``: configs/demo_digits.yaml as shipped (its model, the digits folder ``--digits``, written there by
  ``lipsformer.data.digits`` when missing);
- ``swin_t``: configs/lipsformer_swin_t.yaml (the paper's recipe: RandAugment, random erasing, mixup and cutmix,
  label smoothing, the EMA, bf16, drop path 0.2) at 224 px with batch 8 on a folder of ``--images`` generated JPEGs
  (benchmarks/loader.py's), ``--workers`` loader workers.

The recipe is given to timm's train.py flag by flag from the same loaded config (:func:`timm_args`): model and
its arguments, optimizer (torch's fused AdamW on both sides: ``--opt-kwargs fused=True``), learning rate, betas,
eps, weight decay, the cosine schedule stepped per update without warmup, augmentation, mixup / cutmix, label
smoothing, EMA, precision, batch, accumulation, workers, log interval; both run ``--epochs`` epochs with
``--threads`` CPU threads (OMP_NUM_THREADS). What differs is each program's own: timm's prefetching loader (it
normalises on the device), its TF32 and cudnn.benchmark on CUDA (ours is given ``tf32: true`` there; ours has no
cudnn.benchmark), our per-sample seeded augmentation and checkpoints. Each round runs timm then ours, or ours then
timm in the next, each in a process of its own; a run's rate is its last epoch's images over that epoch's
``train_one_epoch`` time (evaluation and the epoch's checkpoint come after it in both). Printed per setting: the
median img/s of each and the median of the per-round ratios (ours / timm), and where each program's epoch went per
batch: waiting for the loader's next batch; for ours also the step (forward, backward, optimizer update), the
bookkeeping after it (schedule, EMA, logging, checkpoints), both timed through the run's ``phase`` hook, and the rest
of the loop. Times are the host's: on a GPU the step is what the host spends issuing it.
"""
import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SETTINGS = ("demo", "swin_t")


class TimedLoader:
    """A loader that counts the batches and samples it gives and the seconds spent waiting for them."""

    def __init__(self, loader):
        self.loader, self.wait, self.batches, self.samples = loader, 0.0, 0, 0

    def __len__(self):
        return len(self.loader)

    def __getattr__(self, name):
        return getattr(self.loader, name)

    def __iter__(self):
        batches = iter(self.loader)
        while True:
            start = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                return
            finally:
                self.wait += time.perf_counter() - start
            self.batches += 1
            self.samples += len(batch[1])
            yield batch


class Epochs:
    """Each epoch's seconds in ``train_one_epoch``, its batches and samples, and where the time went."""

    def __init__(self):
        self.rows, self.parts = [], dict(step=0.0, after=0.0)

    @contextlib.contextmanager
    def phase(self, part: str):
        """The training loop's ``phase`` hook: the block's time added to ``part`` of the epoch in progress."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.parts[part] += time.perf_counter() - start

    def measure(self, epoch, loader: TimedLoader):
        """Run ``epoch()``, which reads its batches from ``loader``, and record it."""
        self.parts = dict(step=0.0, after=0.0)
        start = time.perf_counter()
        try:
            return epoch()
        finally:
            self.rows.append(dict(seconds=time.perf_counter() - start, batches=loader.batches,
                                  samples=loader.samples, data=loader.wait, **self.parts))


def worker(args) -> None:
    """One run in this process, ours (train.py) or timm's train.py, on ``args.rest``; its epochs to ``args.result``."""
    import torch
    torch.set_num_threads(args.threads)
    import lipsformer  # noqa: F401  (registers the models with timm before timm's train.py builds one)
    epochs = Epochs()
    if args.worker == "ours":
        import lipsformer.engine.train as loop
        one_epoch = loop.train_one_epoch

        def train_one_epoch(run, epoch):
            loader = run.train_loader = TimedLoader(run.train_loader)
            run.phase = epochs.phase
            try:
                return epochs.measure(lambda: one_epoch(run, epoch), loader)
            finally:
                run.train_loader = loader.loader

        loop.train_one_epoch = train_one_epoch
        import importlib.util
        spec = importlib.util.spec_from_file_location("train_script", ROOT / "train.py")
        script = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(script)
        code = script.main(args.rest)
    else:
        import runpy

        from timm.data import auto_augment

        from lipsformer.data.augment import posterize
        # Pillow 13 refuses posterize at 0 bits, which RandAugment's magnitude noise draws: timm's ops get Pillow
        # < 13's result, as train.py's pipeline gives them (lipsformer.data.augment.portable)
        for name, op in list(auto_augment.NAME_TO_OP.items()):
            if op is auto_augment.posterize:
                auto_augment.NAME_TO_OP[name] = posterize
        scope = runpy.run_path(args.train_py, run_name="timm_train")["main"].__globals__  # main defined, not run
        one_epoch = scope["train_one_epoch"]

        def train_one_epoch(epoch, model, loader, *rest, **kwargs):
            loader = TimedLoader(loader)
            return epochs.measure(lambda: one_epoch(epoch, model, loader, *rest, **kwargs), loader)

        scope["train_one_epoch"] = train_one_epoch
        sys.argv = [args.train_py, *args.rest]
        scope["main"]()
        code = 0
    Path(args.result).write_text(json.dumps(dict(code=code, epochs=epochs.rows)))


def timm_args(cfg, data_dir: Path, output: Path, device: str) -> list:
    """timm's train.py flags for the recipe of ``cfg`` (a loaded TrainConfig)."""
    from lipsformer.engine.step import fused
    from timm.optim import get_optimizer_info

    def kwargs(values: dict) -> list:
        return [f"{k}={tuple(v) if isinstance(v, list) else v}" for k, v in values.items()]

    args = ["--data-dir", str(data_dir), "--train-split", cfg.train_split, "--val-split", cfg.val_split,
            "--model", cfg.model, "--num-classes", str(cfg.num_classes), "--img-size", str(cfg.img_size),
            "--model-kwargs", *kwargs(dict(img_size=cfg.img_size, **cfg.model_kwargs)),
            "--drop-path", str(cfg.drop_path), "--crop-pct", str(cfg.crop_pct),
            "--interpolation", cfg.interpolation, "--train-interpolation", cfg.interpolation,
            "-b", str(cfg.batch_size), "--grad-accum-steps", str(cfg.accumulation_steps(1)),
            "--opt", cfg.opt, "--lr", str(cfg.lr), "--weight-decay", str(cfg.weight_decay),
            "--opt-eps", str(cfg.eps), "--opt-betas", *map(str, cfg.betas),
            "--sched", cfg.sched, "--sched-on-updates", "--epochs", str(cfg.epochs), "--min-lr", str(cfg.min_lr),
            "--warmup-epochs", str(cfg.warmup_epochs), "--warmup-lr", str(cfg.min_lr), "--cooldown-epochs", "0",
            "--smoothing", str(cfg.label_smoothing), "--reprob", str(cfg.reprob), "--remode", "pixel",
            "--hflip", str(cfg.hflip), "--scale", *map(str, cfg.scale),
            "--mixup", str(cfg.mixup), "--cutmix", str(cfg.cutmix),
            "--workers", str(cfg.workers), "--log-interval", str(cfg.log_every_steps), "--seed", str(cfg.seed),
            "--checkpoint-hist", str(cfg.keep_last), "--output", str(output), "--experiment", "timm",
            "--device", device]
    opt_kwargs = fused(get_optimizer_info(cfg.opt.lower().split("_")[-1]).opt_class)
    if opt_kwargs:
        args += ["--opt-kwargs", *kwargs(opt_kwargs)]
    if cfg.aa:
        args += ["--aa", cfg.aa]
    if cfg.ema_decay:
        args += ["--model-ema", "--model-ema-decay", str(cfg.ema_decay)]
    if cfg.mixed_precision != "no":
        args += ["--amp", "--amp-dtype", dict(bf16="bfloat16", fp16="float16")[cfg.mixed_precision]]
    if cfg.clip_grad:
        args += ["--clip-grad", str(cfg.clip_grad)]
    if cfg.layer_decay:
        args += ["--layer-decay", str(cfg.layer_decay)]
    for key, flag in (("channels_last", "--channels-last"), ("grad_checkpointing", "--grad-checkpointing")):
        if getattr(cfg, key):
            args.append(flag)
    return args


def setting(name: str, args, work: Path):
    """(config path, train.py overrides, data folder) of a setting."""
    if name == "demo":
        data = Path(args.digits)
        if not (data / "train").is_dir():
            from lipsformer.data.digits import write_digits_folder
            write_digits_folder(data)
        return ROOT / "configs" / "demo_digits.yaml", [], data
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from loader import CLASSES, make_jpegs  # benchmarks/loader.py's photo-like JPEGs
    data = work / "jpegs"
    if not data.is_dir():
        make_jpegs(data, args.images, (256, 256))
    return ROOT / "configs" / "lipsformer_swin_t.yaml", ["batch_size=8", "global_batch=8", f"num_classes={CLASSES}",
                                                          f"workers={args.workers}"], data


def run(args, program: str, cfg_path: Path, overrides: list, data: Path, out: Path) -> dict:
    """One run of ``program`` ("ours" or "timm") in a process of its own; its epochs' times."""
    import torch
    from lipsformer.config import load_config
    device = "cuda" if torch.cuda.is_available() else "cpu"
    overrides = [*overrides, *args.set, f"epochs={args.epochs}", f"data_dir={data}", f"output_dir={out}"]
    if device == "cuda":
        overrides.append("tf32=true")  # timm's train.py turns TF32 on
    if program == "ours":
        rest = ["--config", str(cfg_path), "--set", *overrides]
    else:
        rest = timm_args(load_config(str(cfg_path), overrides), data, out, device)
    result = out.parent / f"{out.name}.json"
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    proc = subprocess.run([sys.executable, __file__, "--worker", program, "--result", str(result),
                           "--threads", str(args.threads), "--train-py", str(Path(args.timm) / "train.py"),
                           "--", *rest], cwd=out.parent, env=env, capture_output=True, text=True)
    if proc.returncode != 0 or not result.is_file():
        raise SystemExit(f"{program} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    shutil.rmtree(out, ignore_errors=True)
    return json.loads(result.read_text())


def rate(epoch: dict) -> float:
    return epoch["samples"] / epoch["seconds"]


def per_batch(epoch: dict) -> dict:
    """Milliseconds per batch of where an epoch's time went."""
    n = max(epoch["batches"], 1)
    parts = dict(data=epoch["data"], step=epoch["step"], after=epoch["after"])
    parts["rest"] = epoch["seconds"] - sum(parts.values())
    return {k: 1e3 * v / n for k, v in parts.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timm", help="a pytorch-image-models checkout (its train.py is run)")
    parser.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS))
    parser.add_argument("--rounds", type=int, default=3, help="runs of each program per setting, in turns")
    parser.add_argument("--epochs", type=int, default=3, help="epochs per run; the last one is timed")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads of each run (OMP_NUM_THREADS)")
    parser.add_argument("--digits", default=str(ROOT / "output" / "digits"), help="demo: the digits folder")
    parser.add_argument("--images", type=int, default=256, help="swin_t: training images to generate")
    parser.add_argument("--workers", type=int, default=1, help="swin_t: loader workers of both")
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                        help="config overrides for both programs (train.py's --set), e.g. a smaller model")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--worker", choices=("ours", "timm"), help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--train-py", help=argparse.SUPPRESS)
    parser.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    if args.worker:
        return worker(args)
    if not args.timm or not (Path(args.timm) / "train.py").is_file():
        parser.error("--timm must name a pytorch-image-models checkout with its train.py (docs/speed.md)")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name in args.settings:
            cfg_path, overrides, data = setting(name, args, work)
            rows = dict(ours=[], timm=[])
            for r in range(args.rounds):
                for program in ("timm", "ours") if r % 2 == 0 else ("ours", "timm"):
                    got = run(args, program, cfg_path, overrides, data, work / f"{name}_{program}_{r}")
                    rows[program].append(got["epochs"][-1])
                    print(f"{name} round {r + 1}: {program} {rate(got['epochs'][-1]):.1f} img/s", flush=True)
            results[name] = rows
    print(f"\n{'setting':<8} {'ours img/s':>10} {'timm img/s':>10} {'ratio':>6}   per batch, ms: ours data / step / "
          f"bookkeeping / rest; timm data / the rest")
    summary = {}
    for name, rows in results.items():
        ours, timm = ([rate(e) for e in rows[p]] for p in ("ours", "timm"))
        ratio = statistics.median(o / t for o, t in zip(ours, timm))
        parts = {p: {k: statistics.median(per_batch(e)[k] for e in rows[p]) for k in ("data", "step", "after", "rest")}
                 for p in rows}
        o, t = parts["ours"], parts["timm"]
        print(f"{name:<8} {statistics.median(ours):>10.1f} {statistics.median(timm):>10.1f} {ratio:>5.2f}x   "
              f"{o['data']:.1f} / {o['step']:.1f} / {o['after']:.2f} / {o['rest']:.2f}; "
              f"{t['data']:.1f} / {t['rest']:.1f}")
        summary[name] = dict(ours=ours, timm=timm, ratio=ratio, ms_per_batch=parts, epochs=rows)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
