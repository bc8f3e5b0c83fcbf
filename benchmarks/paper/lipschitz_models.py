"""A paper reproduction (docs/lipschitz.md): Reproduction (c) of the Lipschitz toolkit: the certified network bound
of every registered model at initialisation, and how DropPath and alpha change it (LipsFormer Theorem 2, Appendix
J).

    python benchmarks/paper/lipschitz_models.py [--out output/lipschitz]

Models are built with ``v_norm=True`` (the released unnormalised-v SCSA has no finite bound). For each: the
bound at the default alpha (eq. 19), the expected bound with the config's DropPath rate under the paper's
eq. 21 (no rescaling) and under timm's DropPath (kept branches divided by 1-p), and the bound with alpha
halved. Writes lipschitz_models.json and prints the table (log10 of each bound).
"""
import argparse
import json
import math
import sys
import time
from pathlib import Path

import timm
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import lipsformer  # noqa: E402,F401
from lipsformer.lipschitz import lipschitz_report  # noqa: E402


def fmt(log10: float) -> str:
    return "inf" if math.isinf(log10) else f"{log10:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="output/lipschitz")
    parser.add_argument("--models", nargs="+", default=sorted(timm.list_models("lipsformer_*")))
    args = parser.parse_args()
    rows = []
    print(f"{'model':<22} {'eq.19':>7} {'eq.21 paper':>12} {'eq.21 timm':>11} {'alpha/2':>8} {'released':>9}  seconds")
    for name in args.models:
        t0 = time.time()
        torch.manual_seed(0)
        model = timm.create_model(name, v_norm=True)
        report = lipschitz_report(model)
        timm_train = report.log10_train_expected_bound
        for r in report.rows:
            r.scale_by_keep = False
        paper_train = report.log10_train_expected_bound
        with torch.no_grad():
            for m in model.modules():
                if hasattr(m, "alpha"):
                    m.alpha.mul_(0.5)
        half = lipschitz_report(model).log10_bound
        released = lipschitz_report(timm.create_model(name, pretrained=False)).log10_bound
        row = dict(model=name, log10_bound=report.log10_bound, log10_train_paper=paper_train,
                   log10_train_timm=timm_train, log10_half_alpha=half, log10_released=released,
                   dominant=report.dominant().name, seconds=time.time() - t0)
        rows.append(row)
        print(f"{name:<22} {fmt(row['log10_bound']):>7} {fmt(paper_train):>12} {fmt(timm_train):>11} "
              f"{fmt(half):>8} {fmt(released):>9}  {row['seconds']:.0f}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "lipschitz_models.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
