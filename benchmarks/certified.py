"""Certified robustness on digits: certifiable LipsFormer-Swin and -CSwin against a 1-Lipschitz CNN (issue 17).

    python benchmarks/certified.py [--epochs 10] [--attack-images 120] [--out output/certified]
    python benchmarks/certified.py --seeds 0 1 2 --jobs 2      # three seeds each, two runs at a time

All three models are trained by the same loop (``lipsformer.engine.train``) on the same images (scikit-learn's
digits at 32x32, pixels in [0, 1]) for the same epochs with the same Lipschitz-margin loss: the LipsFormers from
configs/certified_digits.yaml and configs/certified_digits_cswin.yaml, the CNN from the Swin config with the model
swapped for :class:`LipschitzCNN` (registered with timm here; non-overlapping convolutions and a head whose
matrices are divided by their exact spectral norm in every forward, GroupSort: 1-Lipschitz by construction, so its
margin loss uses L = 1). Then, on the 360
held-out digits, in pixel space:

- the certified bound L, computed from the trained weights (``lipschitz_report`` for the LipsFormers, the product of
  the layers' exact operator norms for the CNN), the normalisation's 1/std included;
- clean accuracy; certified accuracy at eps 0.1 / 0.25 / 0.5 (correct with margin - 2 sqrt(2) D > sqrt(2) L eps,
  Tsuzuku et al., D the AttLip solver's defect: the LipsFormers certify through ``predict_certified``, as eval.py does,
  each AttLip block solved to its tolerance and checked; the CNN has no solver, D = 0);
- accuracy under an l2 PGD attack (``lipsformer.lipschitz.certify.pgd_l2``, on the certified solve) at the same eps on ``--attack-images``
  images spread over the classes (``--restarts`` random starts, ``--pgd-steps`` steps; an image counts as broken
  if any iterate of any run changes its prediction), beside
  the certified accuracy on the same images: certified <= attacked <= clean must hold;
- a measured lower bound of L: the largest difference quotient ||f(x + d) - f(x)|| / ||d|| found by projected gradient
  ascent (``lipsformer.lipschitz.maximize_difference_quotient``) from a few held-out images.

With several ``--seeds`` every model is trained once per seed and the table gives the mean and the standard
deviation over the seeds (one run's certified accuracy moves by about a point between seeds on 360 images).
Writes ``certified.json`` (every run) and prints a markdown table. Each run's folder under ``--out`` is replaced.
"""
import argparse
import functools
import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._jobs import add_jobs_argument, run_jobs  # noqa: E402  (--jobs: runs in processes, one thread each)

EPS = (0.1, 0.25, 0.5)


# -- the 1-Lipschitz CNN baseline ---------------------------------------------------------------------
class UnitLinear(nn.Module):
    """A linear map whose weight is divided by its exact largest singular value when that exceeds 1 (an SVD per
    forward, differentiable): spectral norm <= 1 at every step, and exactly what the certified bound reads."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        lin = nn.Linear(n_in, n_out)
        nn.init.orthogonal_(lin.weight)
        self.raw, self.bias = lin.weight, lin.bias

    @property
    def weight(self) -> torch.Tensor:
        return self.raw / torch.linalg.matrix_norm(self.raw, ord=2).clamp_min(1.0)

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class PatchConv(nn.Module):
    """A stride = kernel convolution whose reshaped kernel (out, in * k * k) is a :class:`UnitLinear`: the patches
    do not overlap, so the operator norm is exactly the kernel matrix's, at most 1."""

    def __init__(self, c_in: int, c_out: int, k: int):
        super().__init__()
        self.shape, self.k = (c_out, c_in, k, k), k
        self.lin = UnitLinear(c_in * k * k, c_out)

    def forward(self, x):
        return F.conv2d(x, self.lin.weight.view(self.shape), self.lin.bias, stride=self.k)


class LipschitzCNN(nn.Module):
    """Patchify 4x4, then 2x2 stride-2 convs (orthogonal at initialisation, spectral norm <= 1 always), MaxMin
    GroupSort after each, flatten, a unit-norm head: every layer's l2 operator norm is at most 1, GroupSort is
    1-Lipschitz, flattening is an isometry."""

    def __init__(self, num_classes: int = 10, in_chans: int = 3, img_size: int = 32, widths=(64, 128, 256), **_):
        super().__init__()
        self.pretrained_cfg = dict(input_size=(in_chans, img_size, img_size), mean=(0.5,) * 3, std=(1.0,) * 3,
                                   crop_pct=1.0, interpolation="bicubic")
        layers, c = [], in_chans
        for i, w in enumerate(widths):
            layers.append(PatchConv(c, w, 4 if i == 0 else 2))
            c = w
        self.convs = nn.ModuleList(layers)
        side = img_size // (4 * 2 ** (len(widths) - 1))
        self.head = UnitLinear(c * side * side, num_classes)

    def forward(self, x):
        from lipsformer.layers import group_sort
        for conv in self.convs:
            x = group_sort(conv(x).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return self.head(x.flatten(1))

    @torch.no_grad()
    def lipschitz_bound(self) -> float:
        """The product of the layers' exact norms, from the weights (GroupSort and flatten: 1)."""
        from lipsformer.lipschitz import matrix_norm
        out = matrix_norm(self.head.weight)
        for conv in self.convs:
            out *= matrix_norm(conv.lin.weight)
        return out


def register_cnn() -> None:
    """``timm.create_model("lipschitz_cnn")``, so the training loop builds the baseline as it builds ours."""
    import timm
    from timm.models import register_model

    if timm.is_model("lipschitz_cnn"):
        return

    @register_model
    def lipschitz_cnn(pretrained=False, **kwargs):
        kwargs.pop("drop_path_rate", None)
        return LipschitzCNN(**kwargs)


# -- the model on pixels ------------------------------------------------------------------------------
class PixelModel(nn.Module):
    """The model on pixels in [0, 1]: the input normalisation inside, so perturbations are in pixel space."""

    def __init__(self, model, mean, std):
        super().__init__()
        self.model = model
        self.register_buffer("mean", torch.tensor(mean).view(1, -1, 1, 1))
        self.register_buffer("std", torch.tensor(std).view(1, -1, 1, 1))

    def forward(self, x):
        return self.model((x - self.mean) / self.std)


@functools.lru_cache(maxsize=1)  # read once per process, not once per run
def load_images(folder: str):
    from PIL import Image
    folder = Path(folder)
    xs, ys = [], []
    classes = sorted(p.name for p in folder.iterdir() if p.is_dir())
    for c, name in enumerate(classes):
        for f in sorted((folder / name).iterdir()):
            xs.append(np.asarray(Image.open(f).convert("RGB"), dtype=np.float32) / 255.0)
            ys.append(c)
    return torch.from_numpy(np.stack(xs)).permute(0, 3, 1, 2).contiguous(), torch.tensor(ys)


# -- runs ---------------------------------------------------------------------------------------------
RUNS = {
    "LipsFormer-Swin (certifiable)": ("certified_digits.yaml", []),
    "LipsFormer-CSwin (certifiable)": ("certified_digits_cswin.yaml", []),
    "1-Lipschitz CNN": ("certified_digits.yaml", ["model=lipschitz_cnn", "model_kwargs={}", "lipschitz_target=null",
                                                 "lipschitz_weight_max=null", "lipschitz_conv_max=null",
                                                 "margin_bound=1.0"]),
}


def train_run(name: str, seed: int, args):
    from accelerate.state import AcceleratorState, GradientState
    from safetensors.torch import load_file

    from lipsformer.engine.config import load_config
    from lipsformer.engine.train import build_model, train

    config, extra = RUNS[name]
    out = Path(args.out) / (config.replace(".yaml", "") if "CNN" not in name else "cnn")
    if len(args.seeds) > 1:
        out = out.with_name(f"{out.name}_seed{seed}")
    shutil.rmtree(out, ignore_errors=True)
    cfg = load_config(ROOT / "configs" / config, [f"epochs={args.epochs}", f"output_dir={out}", f"seed={seed}",
                                                  f"data_dir={args.data}", f"eval_every_epochs={args.epochs}",
                                                  *extra, *args.set])
    try:
        summary = train(cfg)
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    model = build_model(cfg)
    model.load_state_dict(load_file(str(out / "last.safetensors")))
    return model.eval(), cfg, summary


def pixel_bound(model):
    """L in pixel space, from the weights: ``lipschitz.certify.pixel_lipschitz`` (the report's bound times the
    normalisation's 1/std, with the AttLip solver's defect D) for the LipsFormers, the product of the layers' exact
    norms over min(std) for the CNN (no solver: a float)."""
    from lipsformer.lipschitz.certify import normalization, pixel_lipschitz
    if isinstance(model, LipschitzCNN):
        return model.lipschitz_bound() / float(normalization(model)[1].min())
    return pixel_lipschitz(model)


def branches_in_use(model) -> list:
    """[residual branches whose weight alpha is not all zero, residual branches]: a branch at alpha 0 (keep_bound
    clamps the convex residuals' alphas to [0, 1]) adds nothing to the function, so a LipsFormer with none in use is
    its patch embedding, stage activations, downsamplings and head alone; the CNN has none."""
    from lipsformer.layers.residual import ConvexResidual, WeightedResidual
    residuals = [m for m in model.modules() if isinstance(m, (ConvexResidual, WeightedResidual))]
    return [sum(bool(m.alpha.detach().any()) for m in residuals), len(residuals)]


def evaluate_run(name: str, model, args, xv, yv) -> dict:
    """Certificates on every held-out image, ``lipschitz.certify.pgd_l2`` on the attack subset, and a measured
    lower bound of L. The LipsFormers certify through ``predict_certified`` (what ``eval.py --certify-eps`` does:
    AttLip solved to its tolerance and checked, the solver defect off each margin) and are attacked with that same
    solve; the CNN through ``certified_radius`` with its own bound."""
    from lipsformer.layers.attlip import AttLip, solve_to_tolerance
    from lipsformer.lipschitz import maximize_difference_quotient
    from lipsformer.lipschitz.certify import certified_accuracy, certified_radius, normalization, pgd_l2, \
        predict_certified

    mean, std = normalization(model)
    f = PixelModel(model, mean.flatten().tolist(), std.flatten().tolist()).eval()
    bound = pixel_bound(model)  # pixel space: the normalisation's 1/std counts
    solved = [m for m in model.modules() if isinstance(m, AttLip)]
    steps = 0
    if isinstance(bound, float):
        with torch.no_grad():
            logits = torch.cat([f(x) for x in xv.split(120)])
        radius = certified_radius(logits, bound).float()  # margin / (sqrt(2) L) (Tsuzuku et al. 2018)
        row = dict(model=name, bound=bound, defect=0.0)
    else:
        parts = []
        for x in xv.split(120):
            parts.append(predict_certified(model, (x - mean) / std, bound))
            steps = max([steps] + [m.last_solve.steps for m in solved])
        logits, radius = torch.cat([p[0] for p in parts]), torch.cat([p[2] for p in parts]).float()
        row = dict(model=name, bound=bound.bound, defect=bound.defect)
    row["solver_steps"] = steps  # the most gradient evaluations an AttLip block's certified solve took
    row["branches_in_use"] = branches_in_use(model)
    correct = logits.argmax(1) == yv
    row.update(clean=100 * correct.float().mean().item(),
               median_radius_correct=float(radius[correct].median()) if correct.any() else 0.0)
    sub = torch.linspace(0, len(yv) - 1, args.attack_images).round().long()  # spread over every class
    row["clean_subset"] = 100 * correct[sub].float().mean().item()
    certified, certified_sub = certified_accuracy(radius, correct, EPS), certified_accuracy(radius[sub], correct[sub], EPS)
    for eps in EPS:
        row[f"certified@{eps}"] = certified[eps]
        with solve_to_tolerance(model):  # the function the certificate is for (a no-op for the CNN)
            broken = pgd_l2(model, xv[sub], yv[sub], eps, mean, std, args.pgd_steps, args.restarts)
        row[f"attacked@{eps}"] = 100 * (correct[sub] & ~broken).float().mean().item()
        row[f"certified_subset@{eps}"] = certified_sub[eps]
        # soundness: a certified image must never be broken
        row[f"certified_but_broken@{eps}"] = int((correct[sub] & (radius[sub] > eps) & broken).sum())
    lower = 0.0
    for i in range(args.quotient_images):
        r = maximize_difference_quotient(lambda x: f(x[None])[0], xv[int(sub[i])], radius=0.5, steps=args.quotient_steps,
                                         lr=0.1, seed=i)
        lower = max(lower, r["lower_bound"])
    row["measured_lower"] = lower
    row["bound_over_lower"] = row["bound"] / lower if lower > 0 else math.inf
    return row


def run_one(name: str, seed: int, args) -> dict:
    """Train one model with one seed and evaluate it (a whole job: ``--jobs`` runs several in processes)."""
    register_cnn()
    xv, yv = load_images(str(Path(args.data) / "val"))
    model, _, _ = train_run(name, seed, args)
    return dict(evaluate_run(name, model, args, xv, yv), seed=seed)


COLUMNS = ["clean", *(f"certified@{e}" for e in EPS), *(f"attacked@{e}" for e in EPS)]


def table(rows) -> str:
    """One line per model: each accuracy as the mean over its seeds (with the standard deviation when there are
    several), the bound and the lower bound of the first seed's run, and each seed's residual branches in use."""
    head = ("| model | seeds | clean | " + " | ".join(f"cert. {e}" for e in EPS) + " | "
            + " | ".join(f"PGD {e}" for e in EPS) + " | bound L | measured lower | L / lower | branches in use |")
    lines = [head, "|" + " --- |" * (7 + 2 * len(EPS))]
    for name in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == name]
        cells = []
        for c in COLUMNS:
            values = np.array([r[c] for r in mine])
            cells.append(f"{values.mean():.1f}" + (f" ± {values.std(ddof=1):.1f}" if len(values) > 1 else ""))
        first = mine[0]
        lines.append(f"| {name} | {len(mine)} | " + " | ".join(cells)
                     + f" | {first['bound']:.4f} | {first['measured_lower']:.4f} | {first['bound_over_lower']:.2f} | "
                     + ", ".join(f"{a}/{b}" for a, b in (r["branches_in_use"] for r in mine)) + " |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--data", default="output/digits")
    parser.add_argument("--out", default="output/certified")
    parser.add_argument("--models", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--attack-images", type=int, default=60)
    parser.add_argument("--pgd-steps", type=int, default=10)
    parser.add_argument("--restarts", type=int, default=2, help="PGD runs from random starts in the ball")
    parser.add_argument("--quotient-images", type=int, default=2)
    parser.add_argument("--quotient-steps", type=int, default=20)
    parser.add_argument("--set", nargs="*", default=[], help="config overrides for every run (key=value)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="train every model once per seed")
    add_jobs_argument(parser)
    args = parser.parse_args(argv)
    if any(item.split("=", 1)[0].strip() == "seed" for item in args.set):
        parser.error("--set seed=... would give every run the same seed; use --seeds")
    args.seeds = list(dict.fromkeys(args.seeds))  # a seed named twice would share (and remove) one run folder

    from lipsformer.data.digits import write_digits_folder
    write_digits_folder(args.data)

    def report(row: dict) -> dict:
        print(json.dumps(row), flush=True)
        return row

    rows = run_jobs(run_one, [(name, seed, args) for name in args.models for seed in args.seeds], args.jobs, report)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "certified.json").write_text(json.dumps(dict(args=vars(args), rows=rows), indent=1))
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
