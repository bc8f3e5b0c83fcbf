"""What a certificate costs: certified inference and a training step of the certifiable models against the plain
LipsFormer of the same size, interleaved in one process (issue 26).

    python benchmarks/certified_speed.py [--pairs lipsformer_swin_t:lipsformer_swin_t_cert ...] [--batch 32]
        [--img-size 224] [--rounds 3] [--threads 2] [--json out.json]

For each pair (plain, certifiable), each round times, in this order:

- plain inference: ``model(images)`` under ``no_grad`` in eval mode;
- certified inference: :func:`lipsformer.lipschitz.certify.predict_certified` (the call ``eval.py --certify-eps``
  makes: a float32 forward with every AttLip solved to its tolerance and checked in float64, then the radii), with
  the Lipschitz bound computed once beforehand (it depends on the weights only; its time is printed apart);
- a training step of each: forward, cross-entropy, backward, AdamW step, in train mode (on copies of the two
  models, so that the inference models' weights, and the certifiable one's cached divisors, stay as at evaluation);
  the certifiable step also keeps the Lipschitz bound (``keep_bound`` at ``--lipschitz-target``, as train.py does
  after every step with ``configs/lipsformer_swin_t_cert.yaml``'s ``lipschitz_target``; its time is printed apart).
  The certifiable step is timed at each AttLip step count of ``--train-steps`` (default: the recipe's
  ``attlip_train_steps`` schedule, whose phases are equal spans of epochs), and the training ratio is the mean over
  the schedule's phases: what an epoch of the recipe costs on average. Each count's own ratio is printed too.

Each figure is the median over ``--rounds`` rounds (one warm-up call each first); the ratios are certifiable /
plain. Then one certified forward is profiled: the time inside the AttLip solves (split into the solve and its
float64 check), inside the normalised layers' divisors (cached at evaluation: computed once after a weight
change), and the rest; and the gradient evaluations each AttLip block
took (slowest window and mean over windows). Last, the multiply-adds of one image, as fvcore counts them (one per
multiply-add of a matrix product): the plain model's and, for the certifiable one, its AttLip solves and their
float64 checks as the solver counted them in that forward (:class:`~lipsformer.layers.attlip.SolveStats`) plus fvcore's
count of the rest of it (AttLip replaced by the identity): a floor under the inference ratio that no implementation
running both models equally fast could go below. Weights are random (no certified weights are published): solver
steps on trained weights may differ.
"""
import argparse
import copy
import json
import statistics
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import timm
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import lipsformer  # noqa: E402,F401  (registers the models)
from lipsformer.layers import attlip  # noqa: E402
from lipsformer.engine.config import load_config  # noqa: E402
from lipsformer.flops import count_flops  # noqa: E402
from lipsformer.layers.attlip import AttLip  # noqa: E402
from lipsformer.lipschitz.certify import pixel_lipschitz, predict_certified  # noqa: E402
from lipsformer.lipschitz.constraints import keep_bound  # noqa: E402

PAIRS = ("lipsformer_swin_t:lipsformer_swin_t_cert", "lipsformer_cswin_t:lipsformer_cswin_t_cert")
RECIPE = ROOT / "configs" / "lipsformer_swin_t_cert.yaml"  # its lipschitz_target and attlip_train_steps


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def train_step(model, opt, images, target):
    def step():
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(images), target).backward()
        opt.step()
    return step


@contextmanager
def attlip_as_identity():
    """Every AttLip returns its input (fvcore then counts the rest of the model)."""
    forward = AttLip.forward
    AttLip.forward = lambda self, x: x
    try:
        yield
    finally:
        AttLip.forward = forward


@contextmanager
def time_spent_in(spans: dict):
    """Accumulate wall time spent inside the AttLip certified solve, its float64 check, and the normalised layers'
    spectral divisors, by wrapping those functions for the duration."""
    normalized = lipsformer.layers.normalized
    originals = {("solve", "_bb_solve"): attlip, ("check", "prox_residual64"): attlip,
                 ("divisor", "top_singular_triple"): normalized}
    saved = {}
    for (key, name), module in originals.items():
        fn = getattr(module, name)
        saved[key, name] = fn

        def wrapper(*args, _fn=fn, _key=key, **kwargs):
            start = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                spans[_key] += time.perf_counter() - start
        setattr(module, name, wrapper)
    try:
        yield spans
    finally:
        for (key, name), module in originals.items():
            setattr(module, name, saved[key, name])


def measure_pair(plain_name: str, cert_name: str, batch: int, img_size: int, rounds: int,
                 lipschitz_target: float, train_steps: list) -> dict:
    torch.manual_seed(0)
    plain = timm.create_model(plain_name, img_size=img_size)
    cert = timm.create_model(cert_name, img_size=img_size)
    images = torch.randn(batch, 3, img_size, img_size)
    target = torch.randint(0, plain.num_classes, (batch,))
    bound_s = timed(lambda: pixel_lipschitz(cert))
    L = pixel_lipschitz(cert)
    # the training steps change weights: they run on copies, so the inference models keep theirs (and the
    # certifiable one its cached divisors, as at evaluation)
    trained = dict(plain=copy.deepcopy(plain), cert=copy.deepcopy(cert))
    steps = {name: train_step(m, torch.optim.AdamW(m.parameters(), lr=1e-6), images, target)
             for name, m in trained.items()}

    def plain_infer():
        plain.eval()
        with torch.no_grad():
            plain(images)

    def cert_infer():
        predict_certified(cert, images, L)

    def plain_train():
        trained["plain"].train()
        steps["plain"]()

    def keep():
        keep_bound(trained["cert"], lipschitz_target)

    def cert_train(k: int):
        def run():
            trained["cert"].train()
            for m in trained["cert"].modules():
                if isinstance(m, AttLip):
                    m.train_steps = k
            steps["cert"]()
            times["keep_bound"].append(timed(keep))
        return run

    counts = sorted(set(train_steps))
    runs = dict(plain_infer=plain_infer, cert_infer=cert_infer, plain_train=plain_train,
                **{f"cert_train_{k}": cert_train(k) for k in counts})
    times = defaultdict(list)
    for fn in runs.values():  # warm-up
        fn()
    times.clear()
    for r in range(rounds):
        for key, fn in runs.items():
            times[key].append(timed(fn))
        print(f"  {cert_name} round {r + 1}/{rounds}: " + "  ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items()),
              flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    cert_train_s = {k: med[f"cert_train_{k}"] for k in counts}
    schedule_s = statistics.mean(cert_train_s[k] for k in train_steps)  # equal phases

    spans = defaultdict(float)
    with time_spent_in(spans):
        total = timed(cert_infer)
    blocks = [(name, m.last_solve) for name, m in cert.named_modules() if isinstance(m, AttLip)]
    size = (3, img_size, img_size)
    with attlip_as_identity():
        rest = count_flops(cert, size)
    macs = dict(plain=count_flops(plain, size) / 1e9, solve=sum(s.multiply_adds for _, s in blocks) / batch / 1e9,
                check=sum(s.check_multiply_adds for _, s in blocks) / batch / 1e9, rest=rest / 1e9)
    macs["cert"] = macs["solve"] + macs["check"] + macs["rest"]
    profile = dict(total_s=total, attlip_solve_s=spans["solve"], attlip_float64_check_s=spans["check"],
                   normalized_divisor_s=spans["divisor"],
                   rest_s=total - spans["solve"] - spans["check"] - spans["divisor"])
    return dict(plain=plain_name, cert=cert_name, batch=batch, img_size=img_size, rounds=rounds,
                threads=torch.get_num_threads(), lipschitz_target=lipschitz_target, bound_once_s=bound_s, defect=L.defect, lipschitz=L.bound,
                radius_cost=2 * L.defect / L.bound, plain_infer_s=med["plain_infer"], cert_infer_s=med["cert_infer"],
                plain_train_s=med["plain_train"], train_steps=list(train_steps), cert_train_s=schedule_s,
                cert_train_by_steps_s={str(k): v for k, v in cert_train_s.items()}, keep_bound_s=med["keep_bound"],
                infer_ratio=med["cert_infer"] / med["plain_infer"], train_ratio=schedule_s / med["plain_train"],
                train_ratio_by_steps={str(k): v / med["plain_train"] for k, v in cert_train_s.items()},
                profile=profile, gmacs_per_image=macs, macs_ratio=macs["cert"] / macs["plain"],
                solver_steps=[dict(block=n, steps=s.steps, mean_steps=round(s.mean_steps, 2),
                                   float64_windows=s.float64_windows) for n, s in blocks])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", nargs="+", default=list(PAIRS), metavar="PLAIN:CERT")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--rounds", type=int, default=3)
    recipe = load_config(RECIPE)
    parser.add_argument("--lipschitz-target", type=float, default=recipe.lipschitz_target,
                        help="keep_bound's target in the certifiable training step (default: the recipe's "
                             "lipschitz_target)")
    parser.add_argument("--train-steps", type=int, nargs="+", default=recipe.attlip_train_steps,
                        metavar="K", help="AttLip steps in the certifiable training step, one phase each of the "
                                          "schedule the training ratio averages (default: the recipe's "
                                          "attlip_train_steps)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, all cores)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if min(args.train_steps) < 1:
        parser.error(f"--train-steps takes AttLip step counts >= 1, got {args.train_steps}")
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for pair in args.pairs:
        plain_name, sep, cert_name = pair.partition(":")
        if not sep or not timm.is_model(plain_name) or not timm.is_model(cert_name):
            parser.error(f"--pairs takes PLAIN:CERT of registered models, got {pair!r}")
        rows.append(measure_pair(plain_name, cert_name, args.batch, args.img_size, args.rounds,
                                 args.lipschitz_target, args.train_steps))
    print(f"\nbatch {args.batch} at {args.img_size}px, {torch.get_num_threads()} threads, medians of {args.rounds} "
          f"interleaved rounds (certifiable / plain); the certifiable train step averaged over AttLip step phases "
          f"{args.train_steps}\n")
    print("| certifiable | plain | certified inference | ratio | train step | ratio | D (solver defect) | "
          "radius cost 2D/L |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['cert']} | {r['plain']} | {r['cert_infer_s']:.2f} s vs {r['plain_infer_s']:.2f} s | "
              f"**{r['infer_ratio']:.2f}x** | {r['cert_train_s']:.2f} s vs {r['plain_train_s']:.2f} s | "
              f"**{r['train_ratio']:.2f}x** | {r['defect']:.2e} | {r['radius_cost']:.2e} |")
    for r in rows:
        p = r["profile"]
        print(f"\n{r['cert']}: one certified forward {p['total_s']:.2f} s = AttLip solve {p['attlip_solve_s']:.2f} s"
              f" + its float64 check {p['attlip_float64_check_s']:.2f} s + normalised divisors "
              f"{p['normalized_divisor_s']:.2f} s + the rest {p['rest_s']:.2f} s; the bound, once: "
              f"{r['bound_once_s']:.2f} s; keep_bound in each training step {r['keep_bound_s']:.2f} s")
        print("  train step by AttLip steps: " + ", ".join(
            f"{k}: {r['cert_train_by_steps_s'][k]:.2f} s ({r['train_ratio_by_steps'][k]:.2f}x)"
            for k in r["cert_train_by_steps_s"]))
        m = r["gmacs_per_image"]
        print(f"  multiply-adds per image: {m['cert']:.2f} G = AttLip solves {m['solve']:.2f} G + their float64 "
              f"checks {m['check']:.2f} G + the rest {m['rest']:.2f} G, vs {m['plain']:.2f} G plain: "
              f"{r['macs_ratio']:.2f}x")
        print("  gradient evaluations per AttLip block (slowest window / mean): " + ", ".join(
            f"{s['steps']}/{s['mean_steps']:g}" + (f" ({s['float64_windows']} in float64)" if s["float64_windows"]
                                                   else "") for s in r["solver_steps"]))
    if args.json:
        args.json.write_text(json.dumps(dict(rows=rows), indent=2))
    return rows


if __name__ == "__main__":
    main()
