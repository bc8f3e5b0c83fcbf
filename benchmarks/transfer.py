"""A demo users run (make finetune-demo; README.md, docs/training.md): Transfer demo: pretrain on digits 0-4,
fine-tune on digits 5-9 from a few labels per class.

    python benchmarks/transfer.py [--shots 10] [--pretrain-epochs 15] [--epochs 40] [--out output/transfer]

Every arm trains on the same few labelled digits 5-9 (``--shots`` per class) with the recipe of
configs/finetune_digits.yaml and is scored on all held-out digits 5-9:

- scratch: the same model and recipe, random initial weights;
- fine-tune: starting from the 0-4 pretraining (init_checkpoint), head re-created, layer-wise lr decay;
- linear probe: the pretrained backbone frozen (freeze: backbone), only the new head trains;
- the two 64 px arms: the 32 px pretrained weights fine-tuned at 64 px (CSwin: LePE is a convolution and split
  size 1 divides every stage, so every tensor carries over), against scratch at 64 px.

Accuracies are deterministic given the seeds. Writes ``transfer.json`` and prints a table; the folders under
``--out`` are replaced when the demo runs again.
"""
import argparse
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIG = ROOT / "configs" / "finetune_digits.yaml"


def subset(source: Path, dest: Path, digits, shots=None) -> Path:
    """``dest/train`` and ``dest/val`` linking to ``digits`` of the digits folder; ``shots`` training images per
    class (the first ones by name), all val images."""
    shutil.rmtree(dest, ignore_errors=True)
    for split in ("train", "val"):
        for d in digits:
            files = sorted((source / split / str(d)).glob("*.png"))
            if split == "train" and shots is not None:
                files = files[:shots]
            (dest / split / str(d)).mkdir(parents=True)
            for f in files:
                (dest / split / str(d) / f.name).symlink_to(f.resolve())
    return dest


def run(name: str, out: Path, overrides) -> dict:
    from accelerate.state import AcceleratorState, GradientState

    from lipsformer.config import load_config
    from lipsformer.run_folder import RunFolder
    from lipsformer.engine.train import train

    folder = out / name
    shutil.rmtree(folder, ignore_errors=True)
    cfg = load_config(CONFIG, [f"output_dir={folder}", *overrides])
    try:
        train(cfg)
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    rows = RunFolder(folder).read_metrics()
    last = [r for r in rows if r["kind"] == "epoch"][-1]
    init = next(r for r in rows if r["kind"] == "init")
    return dict(arm=name, img_size=cfg.img_size, train_images=last["train_samples"], top1=last["top1"],
                steps=last["step"], source=init["source"], reinitialised=init["reinitialised"], frozen=init["frozen"])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shots", type=int, default=10, help="labelled training images per digit 5-9")
    parser.add_argument("--pretrain-epochs", type=int, default=15)
    parser.add_argument("--epochs", type=int, default=40, help="fine-tuning epochs of every arm")
    parser.add_argument("--size", type=int, default=64, help="the resolution-transfer arms' input size")
    parser.add_argument("--data", default="output/digits")
    parser.add_argument("--out", default="output/transfer")
    args = parser.parse_args()

    from lipsformer.data.digits import write_digits_folder
    digits = Path(write_digits_folder(args.data, size=32))
    out = Path(args.out)
    pre_data = subset(digits, out / "digits0-4", range(5))
    few = subset(digits, out / "digits5-9_shots", range(5, 10), args.shots)
    epochs = [f"epochs={args.epochs}", f"eval_every_epochs={args.epochs}", f"data_dir={few}"]
    pretrain = out / "pretrain"

    results = [run("pretrain", out, [
        "init_checkpoint=null", "reset_head=false", "layer_decay=null", f"epochs={args.pretrain_epochs}",
        f"eval_every_epochs={args.pretrain_epochs}", "global_batch=64", "batch_size=64", "lr=2e-3",
        f"data_dir={pre_data}"])]
    arms = {
        "scratch": ["init_checkpoint=null", "reset_head=false", "layer_decay=null"],
        "fine-tune": [f"init_checkpoint={pretrain}"],
        "linear probe": [f"init_checkpoint={pretrain}", "freeze=backbone", "layer_decay=null", "lr=1e-2"],
        f"scratch {args.size}px": ["init_checkpoint=null", "reset_head=false", "layer_decay=null",
                                   f"img_size={args.size}"],
        f"fine-tune {args.size}px": [f"init_checkpoint={pretrain}", f"img_size={args.size}"],
    }
    for name, overrides in arms.items():
        results.append(run(name.replace(" ", "_"), out, epochs + overrides))
        results[-1]["arm"] = name

    (out / "transfer.json").write_text(json.dumps(dict(shots=args.shots, epochs=args.epochs,
                                                       pretrain_epochs=args.pretrain_epochs, results=results),
                                                  indent=2))
    print(f"\n{'arm':<16} {'size':>5} {'train imgs':>10} {'steps':>6} {'val top-1':>9}  "
          f"(held-out digits 5-9; the pretrain row: digits 0-4)")
    for r in results:
        print(f"{r['arm']:<16} {r['img_size']:>5} {r['train_images']:>10} {r['steps']:>6} {r['top1']:>8.2f}%")
    print(f"wrote {out / 'transfer.json'}")


if __name__ == "__main__":
    main()
