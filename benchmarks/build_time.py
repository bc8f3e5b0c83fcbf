"""A tool users run (docs/speed.md, Building): Time to build each LipsFormer model against timm's nearest Swin, and
to load weights, in one process.

    python benchmarks/build_time.py --reps 3
    python benchmarks/build_time.py [--models lipsformer_swin_t ...] [--reps 5] [--no-load] [--json out.json]

Each model and its baseline are created interleaved (model, baseline, model, ...) for ``--reps`` rounds; each
figure is the median, on CPU with the default (spectral) init. The target is a ratio of at most 2.
Loading: ``timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=...))`` of a saved
``.safetensors`` against building the model plus reading that file (target: ratio at most 1).
"""
import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import timm
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import lipsformer  # noqa: E402,F401  (registers the models)
from lipsformer.weights import read_checkpoint  # noqa: E402

# timm's Swin nearest in parameter count to each variant (Swin-L++, 527M, is nearer SwinV2-CR-H's 658M than
# Swin-L's 197M)
BASELINES = {
    "lipsformer_swin_t": "swin_tiny_patch4_window7_224",
    "lipsformer_swin_s": "swin_small_patch4_window7_224",
    "lipsformer_swin_b": "swin_base_patch4_window7_224",
    "lipsformer_swin_l": "swin_large_patch4_window7_224",
    "lipsformer_swin_lpp": "swinv2_cr_huge_224",
    "lipsformer_cswin_t": "swin_tiny_patch4_window7_224",
    "lipsformer_cswin_s": "swin_small_patch4_window7_224",
    "lipsformer_cswin_b": "swin_base_patch4_window7_224",
}


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def millions(name: str) -> float:
    with torch.device("meta"):
        return sum(p.numel() for p in timm.create_model(name).parameters()) / 1e6


def build_times(name: str, reps: int) -> dict:
    baseline = BASELINES[name]
    ours, theirs = [], []
    for _ in range(reps):
        ours.append(seconds(lambda: timm.create_model(name)))
        theirs.append(seconds(lambda: timm.create_model(baseline)))
    ours, theirs = statistics.median(ours), statistics.median(theirs)
    return dict(model=name, baseline=baseline, build_s=ours, baseline_s=theirs, ratio=ours / theirs,
                params_m=millions(name), baseline_params_m=millions(baseline))


def load_times(name: str, reps: int) -> dict:
    from safetensors.torch import save_file
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.safetensors"
        save_file(timm.create_model(name).state_dict(), str(path))
        load, build_read = [], []
        for _ in range(reps):
            load.append(seconds(lambda: timm.create_model(
                name, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)))))
            build_read.append(seconds(lambda: (timm.create_model(name), read_checkpoint(path))))
    load, build_read = statistics.median(load), statistics.median(build_read)
    return dict(model=name, load_s=load, build_read_s=build_read, ratio=load / build_read)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=sorted(BASELINES), choices=sorted(BASELINES))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--no-load", action="store_true", help="skip the pretrained-loading comparison")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    builds = [build_times(name, args.reps) for name in args.models]
    print(f"build (median of {args.reps}, interleaved; {torch.get_num_threads()} threads)")
    print(f"{'model':22s} {'M':>5s} {'s':>7s} {'baseline':32s} {'M':>5s} {'s':>7s} {'ratio':>6s}")
    for r in builds:
        print(f"{r['model']:22s} {r['params_m']:5.0f} {r['build_s']:7.2f} {r['baseline']:32s} "
              f"{r['baseline_params_m']:5.0f} {r['baseline_s']:7.2f} {r['ratio']:6.2f}")
    loads = []
    if not args.no_load:
        loads = [load_times(name, args.reps) for name in args.models]
        print(f"\npretrained load vs build + read (median of {args.reps})")
        print(f"{'model':22s} {'load s':>7s} {'build+read s':>12s} {'ratio':>6s}")
        for r in loads:
            print(f"{r['model']:22s} {r['load_s']:7.2f} {r['build_read_s']:12.2f} {r['ratio']:6.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(build=builds, load=loads), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
