"""A paper reproduction (docs/experiments.md): LipsFormer Table 3 in miniature: the CSwin-T ablation (depths 1, 2,
21, 1), narrow, on the digits data.

    python benchmarks/paper/ablation.py --jobs 2
    python benchmarks/paper/ablation.py [--quick] [--epochs 12] [--embed-dim 16] [--lr 2e-3] [--out output/ablation]
    python benchmarks/paper/ablation.py --rows default norm=layer      # some rows only
    python benchmarks/paper/ablation.py --embed-dim 64 --batch 128      # wider, on a GPU (train() picks it up)
    python benchmarks/paper/ablation.py --jobs 2                        # two runs at a time, one thread each

One run per row of Table 3, every row a configuration of train.py (``lipsformer.engine.train.train`` with a
TrainConfig; every choice is a model constructor argument): no warmup unless the row says so, CenterNorm, SCSA,
spectral init, alpha 0.2 (the released CSwin value), conv blocks D, DropPath 0.2 (the CSwin-T recipe), one change
per row. Three seeds for the default and for the rows where the paper reports a failure (LayerNorm, dot product,
alpha 0.4), one elsewhere; ``--quick`` runs one seed of every row for fewer epochs. A run is ``diverged`` when
training stopped on a non-finite loss, ``not converged`` when its last epoch's mean training loss is not below
``--converge-loss`` (chance on 10 classes with label smoothing 0.1 is about 2.30), else its final top-1.
Writes ablation.json, ablation.png (the loss curves, one panel per Table 3 group) and prints a table beside the
paper's outcome. Each run's folder under ``--out`` is replaced when the benchmark runs again.
"""
import argparse
import json
import math
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# --jobs: runs in processes, one thread each
from benchmarks.paper._jobs import add_jobs_argument, run_jobs  # noqa: E402


@dataclass
class Row:
    """One row of Table 3: what changes from the default, and the paper's outcome for LipsFormer-CSwin-T."""

    group: str
    name: str
    model: Dict = field(default_factory=dict)  # model constructor arguments
    train: Dict = field(default_factory=dict)  # other TrainConfig keys
    paper: str = ""
    paper_fails: bool = False  # the paper reports a failure: three seeds
    warmup: float = 0.0  # warmup as a fraction of the epochs (the paper: 5 of 100)


DEFAULT_PAPER = "81.6"
ROWS: List[Row] = [
    Row("default", "default", paper=DEFAULT_PAPER),
    Row("warmup", "warmup=5%", paper="81.2", warmup=0.05),
    Row("norm", "norm=layer", dict(norm="layer"), paper="not converge", paper_fails=True),
    Row("norm", "norm=none", dict(norm="none"), paper="80.3"),
    Row("init", "init=trunc_normal", dict(init="trunc_normal"), paper="converges, below 81.6"),
    Row("init", "init=xavier", dict(init="xavier"), paper="81.6"),
    Row("attn", "attn=dot", dict(attn="dot"), paper="diverged", paper_fails=True),
    Row("attn", "attn=l2", dict(attn="l2"), paper="81.3"),
    Row("alpha", "alpha=0.1", dict(alpha_init=0.1), paper="81.4"),
    Row("alpha", "alpha=0.3", dict(alpha_init=0.3), paper="81.3"),
    Row("alpha", "alpha=0.4", dict(alpha_init=0.4), paper="diverged", paper_fails=True),
    Row("conv", "conv=A", dict(conv_blocks="A"), paper="80.7"),
    Row("conv", "conv=B", dict(conv_blocks="B"), paper="81.2"),
    Row("conv", "conv=C", dict(conv_blocks="C"), paper="81.6"),
    Row("droppath", "drop_path=0.0", train=dict(drop_path=0.0), paper="81.3"),
    Row("droppath", "drop_path=0.1", train=dict(drop_path=0.1), paper="81.6"),
]
# The default covers Table 3's warmup "No", CenterNorm, spectral, SCSA, alpha 0.2, conv D and p = 0.2 rows.
BY_NAME = {r.name: r for r in ROWS}


def base_overrides(args) -> List[str]:
    """The default row as TrainConfig overrides on configs/demo_digits.yaml: CSwin-T depths, narrow
    (head width 8 in stages 1-3, 16 in stage 4; stripes of 1, 2, 2 rows on the 8, 4, 2 token grids of 32 px)."""
    e = args.embed_dim
    heads = [max(2, e // 8), max(2, e // 4), max(2, e // 2), max(1, e // 2)]
    return [
        "model=lipsformer_cswin_t",
        f"model_kwargs={{embed_dim: {e}, depths: {list(args.depths)}, num_heads: {heads}, split_size: [1, 2, 2, 2]}}",
        "drop_path=0.2", f"lr={args.lr}", f"epochs={args.epochs}", f"batch_size={args.batch}",
        f"global_batch={args.batch}", f"data_dir={args.data}", "log_every_steps=1",
        "checkpoint_every_steps=1000000", "keep_last=1", "warmup_epochs=0",
    ]


def converged_or_not(train_loss: Optional[float], threshold: float) -> bool:
    return train_loss is not None and math.isfinite(train_loss) and train_loss < threshold


def run(row: Row, seed: int, args) -> dict:
    from accelerate.state import AcceleratorState, GradientState

    from lipsformer.config import load_config
    from lipsformer.run_folder import RunFolder
    from lipsformer.engine.train import TrainingDiverged, train

    out = Path(args.out) / f"{row.name.replace('=', '_')}_seed{seed}"
    shutil.rmtree(out, ignore_errors=True)
    train_keys = dict(row.train)
    if row.warmup:
        train_keys["warmup_epochs"] = max(1, round(row.warmup * args.epochs))
    row_keys = [f"{k}={v}" for k, v in train_keys.items()]  # a row's key replaces the base's: each is given once
    overrides = [o for o in base_overrides(args) if o.split("=", 1)[0] not in train_keys]
    overrides += [f"seed={seed}", f"output_dir={out}"] + row_keys
    cfg = load_config(ROOT / "configs" / "demo_digits.yaml", overrides)
    cfg.model_kwargs.update(row.model)
    result = dict(row=row.name, group=row.group, seed=seed, paper=row.paper, status=None, top1=None,
                  final_train_loss=None, train=train_keys, model=row.model)
    t0 = time.time()
    try:
        train(cfg)
    except TrainingDiverged as e:
        result.update(status="diverged", reason=str(e).splitlines()[0])
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    result["seconds"] = round(time.time() - t0, 1)
    metrics = RunFolder(out).read_metrics()
    result["loss"] = [(m["step"], m["loss"]) for m in metrics if m["kind"] == "train"]
    epochs = [m for m in metrics if m["kind"] == "epoch"]
    if epochs:
        result["final_train_loss"] = epochs[-1]["train_loss"]
        result["top1"] = epochs[-1].get("top1")
    if result["status"] is None:
        ok = converged_or_not(result["final_train_loss"], args.converge_loss)
        result["status"] = "ok" if ok else "not converged"
    return result


def outcome(r: dict) -> str:
    return f"{r['top1']:.1f}" if r["status"] == "ok" else r["status"]


def table(results: List[dict]) -> List[str]:
    lines = ["| row | paper (CSwin-T, ImageNet, 100 ep) | ours: outcome per seed | mean top-1 |",
             "| --- | --- | --- | --- |"]
    for name in dict.fromkeys(r["row"] for r in results):
        mine = [r for r in results if r["row"] == name]
        tops = [r["top1"] for r in mine if r["status"] == "ok"]
        mean = f"{sum(tops) / len(tops):.1f}" if tops else "-"
        lines.append(f"| {name} | {mine[0]['paper']} | {', '.join(outcome(r) for r in mine)} | {mean} |")
    return lines


def plot(results: List[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys(r["group"] for r in results if r["group"] != "default"))
    cols = 4
    fig, axes = plt.subplots(math.ceil(len(groups) / cols), cols, figsize=(4 * cols, 3 * math.ceil(len(groups) / cols)),
                             squeeze=False)
    for ax, group in zip(axes.flat, groups):
        shown = [r for r in results if r["group"] in ("default", group)]
        names = list(dict.fromkeys(r["row"] for r in shown))
        for r in shown:
            if r["loss"]:
                steps, loss = zip(*r["loss"])
                ax.plot(steps, loss, color=f"C{names.index(r['row'])}", alpha=0.8, lw=0.8,
                        label=f"{r['row']} s{r['seed']} ({outcome(r)})")
        ax.set(title=group, xlabel="optimizer step", ylabel="train loss", yscale="log")
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(groups):]:
        ax.axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one seed per row, --quick-epochs epochs")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--quick-epochs", type=int, default=2)
    parser.add_argument("--depths", type=int, nargs=4, default=[1, 2, 21, 1], help="blocks per stage (CSwin-T)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds for the default and the paper's failure rows")
    parser.add_argument("--embed-dim", type=int, default=16, help="stage-1 width (CSwin-T: 64)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--converge-loss", type=float, default=1.5,
                        help="a run has converged when its last epoch's mean train loss is below this")
    parser.add_argument("--rows", nargs="+", default=None, choices=list(BY_NAME), metavar="ROW",
                        help=f"run these rows only ({', '.join(BY_NAME)})")
    parser.add_argument("--data", default="output/digits")
    parser.add_argument("--out", default="output/ablation")
    add_jobs_argument(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.epochs, args.seeds = args.quick_epochs, 1

    if not (Path(args.data) / "train").is_dir():  # any train/ + val/ folder of 10 classes; digits by default
        from lipsformer.data.digits import write_digits_folder
        write_digits_folder(args.data)
    rows = [BY_NAME[n] for n in args.rows] if args.rows else ROWS
    jobs = [(row, seed, args) for row in rows
            for seed in range(args.seeds if (row.paper_fails or row.name == "default") else 1)]

    def report(r: dict) -> dict:
        print(f"{r['row']:<18} seed {r['seed']}: {outcome(r):<14} loss {r['final_train_loss']}  ({r['seconds']:.0f} s)",
              flush=True)
        return r

    results = run_jobs(run, jobs, args.jobs, report)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = dict(epochs=args.epochs, embed_dim=args.embed_dim, batch=args.batch, lr=args.lr,
                    converge_loss=args.converge_loss, depths=args.depths, quick=args.quick, jobs=args.jobs)
    summary = dict(settings=settings, runs=results)
    (out / "ablation.json").write_text(json.dumps(summary, indent=1))
    plot(results, out / "ablation.png", f"Table 3 in miniature: CSwin depths {'-'.join(map(str, args.depths))}, "
                                        f"width {args.embed_dim}, digits, {args.epochs} epochs, lr {args.lr:g}")
    print("\n".join(table(results)))
    return summary


if __name__ == "__main__":
    main()
