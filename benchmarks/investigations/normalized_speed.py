"""A finished investigation (docs/certified.md, the normalised layers' divisor, cites its figures): What the
normalised layers' divisor costs.

    python benchmarks/investigations/normalized_speed.py [--model lipsformer_swin_t] [--img 224] [--batch 4]
        [--threads 1] [--reps 7]

Interleaved in one process, medians: an eval forward with the cached divisor against one that recomputes it
(``forget_divisor`` before each forward), and a training step (forward, backward, SGD step) with the
power-iteration divisor (``linear=normalized_power``) against the exact one (``linear=normalized``), from the same
weights; and the two again with the certified bound computed after every step, as train.py's bound keeping does
(``lipschitz_target``): its eigendecompositions give the exact divisor of the next forward.

The model is the certifiable configuration without AttLip (``attn=l2``, ``linear=normalized``: every Linear and
non-overlapping convolution normalised), so that the divisor's share is not hidden behind AttLip's solver; a
``*_cert`` model name takes that model as registered (AttLip included), as the certified recipe trains it. (The l2
attention's bound reads its normalised projections' divided matrices, one more eigendecomposition each in exact
mode: there the rows with the bound favour power iteration more than with the ``*_cert`` models.)
"""
import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import timm
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import lipsformer  # noqa: E402,F401  (registers the models)
from lipsformer.layers.normalized import NormalizedConv2d, NormalizedLinear  # noqa: E402
from lipsformer.lipschitz.bounds import lipschitz_report  # noqa: E402


def build(name: str, img: int, linear: str = "normalized") -> torch.nn.Module:
    if name.endswith("_cert"):
        return timm.create_model(name, img_size=img, linear=linear)
    return timm.create_model(name, img_size=img, attn="l2", tied_qk=True, linear=linear, init="xavier",
                             norm="none", residual="convex", act="groupsort")


def forget(model: torch.nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, (NormalizedLinear, NormalizedConv2d)):
            m.forget_divisor()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="lipsformer_swin_t")
    p.add_argument("--img", type=int, default=224)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=7)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = build(args.model, args.img).eval()
    x = torch.randn(args.batch, 3, args.img, args.img)
    layers = sum(isinstance(m, (NormalizedLinear, NormalizedConv2d)) for m in model.modules())

    def eval_forward(cached: bool) -> float:
        if not cached:
            forget(model)  # this forward computes every divisor again
        t = time.perf_counter()
        with torch.no_grad():
            model(x)
        return time.perf_counter() - t

    eval_forward(True)  # warm-up, and fills the cache
    times = {True: [], False: []}
    for _ in range(args.reps):
        for cached in (False, True):
            times[cached].append(eval_forward(cached))
    fresh, cached = statistics.median(times[False]), statistics.median(times[True])
    print(f"{args.model} at {args.img}, batch {args.batch}, {args.threads} thread(s), {layers} normalised layers, "
          f"median of {args.reps}")
    print(f"eval forward: recomputed divisors {fresh * 1e3:.1f} ms, cached {cached * 1e3:.1f} ms, "
          f"speed-up {fresh / cached:.2f}x")

    power = build(args.model, args.img, "normalized_power")
    power.load_state_dict(model.state_dict())
    models = {"power": power.train(), "exact": model.train()}
    models.update({f"{k}+bound": copy.deepcopy(models[k]) for k in ("power", "exact")})
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}
    y = torch.zeros(args.batch, dtype=torch.long)

    def train_step(kind: str) -> float:
        t = time.perf_counter()
        torch.nn.functional.cross_entropy(models[kind](x), y).backward()
        opts[kind].step()
        opts[kind].zero_grad()
        if kind.endswith("+bound"):
            lipschitz_report(models[kind])  # what keep_bound computes after every step
        return time.perf_counter() - t

    for kind in models:  # warm-up; the power iteration's first vector is the exact one
        train_step(kind)
    steps = {k: [] for k in models}
    for _ in range(args.reps):
        for kind in models:
            steps[kind].append(train_step(kind))
    power, exact_s, power_b, exact_b = (statistics.median(steps[k])
                                        for k in ("power", "exact", "power+bound", "exact+bound"))
    print(f"training step: exact divisors {exact_s * 1e3:.1f} ms, power iteration {power * 1e3:.1f} ms, "
          f"speed-up {exact_s / power:.2f}x")
    print(f"training step with the certified bound after it (bound keeping): exact divisors {exact_b * 1e3:.1f} ms, "
          f"power iteration {power_b * 1e3:.1f} ms, speed-up {exact_b / power_b:.2f}x")


if __name__ == "__main__":
    main()
