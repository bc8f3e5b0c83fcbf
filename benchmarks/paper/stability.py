"""A paper reproduction (docs/experiments.md): No-warmup stability: LipsFormer vs its standard-Transformer
counterpart at a deliberately high lr.

    python benchmarks/paper/stability.py --lr 1e-2 --epochs 10
    python benchmarks/paper/stability.py [--lr 1e-2] [--epochs 10] [--seeds 0 1 2] [--out output/stability]

Both models come from the same code and the same digits recipe (configs/demo_digits.yaml, no warmup);
the counterpart switches the Lipschitz choices off: norm=layer, attn=dot, init=trunc_normal, alpha_init=1.0.
Writes stability.json (per-run loss curves, final top-1, divergence) and stability.png, and prints a table.
Each run's folder under ``--out`` is replaced when the benchmark runs again.
"""
import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

VARIANTS = {
    "lipsformer": {},
    "standard": {"norm": "layer", "attn": "dot", "init": "trunc_normal", "alpha_init": 1.0},
}


def run(variant: str, seed: int, args) -> dict:
    from accelerate.state import AcceleratorState, GradientState

    from lipsformer.config import load_config
    from lipsformer.run_folder import RunFolder
    from lipsformer.engine.train import TrainingDiverged, train

    out = Path(args.out) / f"{variant}_seed{seed}"
    shutil.rmtree(out, ignore_errors=True)  # a fresh run, as make demo does
    cfg = load_config(ROOT / "configs" / "demo_digits.yaml", [
        f"seed={seed}", f"lr={args.lr}", f"epochs={args.epochs}", f"output_dir={out}", f"data_dir={args.data}",
        "log_every_steps=1", "checkpoint_every_steps=100000", "keep_last=1"])
    cfg.model_kwargs.update(VARIANTS[variant])
    row = dict(variant=variant, seed=seed, diverged=False, top1=None)
    try:
        row["top1"] = train(cfg)["best_top1"]
    except TrainingDiverged as e:
        row.update(diverged=True, reason=str(e))
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    metrics = RunFolder(out).read_metrics()
    row["loss"] = [(m["step"], m["loss"]) for m in metrics if m["kind"] == "train"]
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--data", default="output/digits")
    parser.add_argument("--out", default="output/stability")
    args = parser.parse_args()

    from lipsformer.data.digits import write_digits_folder
    write_digits_folder(args.data)
    rows = [run(v, s, args) for v in VARIANTS for s in args.seeds]
    out = Path(args.out)
    (out / "stability.json").write_text(json.dumps(dict(lr=args.lr, epochs=args.epochs, runs=rows), indent=1))

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in rows:
        if r["loss"]:
            ax.plot(*zip(*r["loss"]), color="C0" if r["variant"] == "lipsformer" else "C3", alpha=0.7,
                    label=f"{r['variant']} seed {r['seed']}")
    ax.set(xlabel="optimizer step", ylabel="train loss", yscale="log", title=f"digits, lr {args.lr:g}, no warmup")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "stability.png", dpi=100)

    print(f"lr {args.lr:g}, {args.epochs} epochs, no warmup")
    print(f"{'variant':<12}{'diverged':>10}{'mean top-1':>12}{'top-1 per seed':>30}")
    for variant in VARIANTS:
        mine = [r for r in rows if r["variant"] == variant]
        tops = [r["top1"] for r in mine if r["top1"] is not None]
        mean = sum(tops) / len(tops) if tops else float("nan")
        per = ", ".join("div" if r["diverged"] else f"{r['top1']:.1f}" for r in mine)
        print(f"{variant:<12}{sum(r['diverged'] for r in mine):>10}{mean:>12.2f}{per:>30}")


if __name__ == "__main__":
    main()
