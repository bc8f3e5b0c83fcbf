"""A tool users run (README.md and docs/certified.md, what a certificate costs): What a certificate costs: certified
inference, the plain evaluation forward and a training step of the certifiable models against the plain LipsFormer
of the same size, interleaved in one process.

    python benchmarks/certified_speed.py --batch 8 32 --threads 2 --rounds 5
    python benchmarks/certified_speed.py [--pairs lipsformer_swin_t:lipsformer_swin_t_cert ...] [--batch 8 32]
        [--img-size 224] [--rounds 3] [--threads 2] [--attlip-form orthogonal|general] [--json out.json]

For each pair (plain, certifiable) and each batch size, each round times, in this order:

- plain inference: ``model(images)`` under ``no_grad`` in eval mode;
- certified inference: :func:`lipsformer.lipschitz.certify.predict_certified` (the call ``eval.py --certify-eps``
  makes: a float32 forward with every AttLip solved to its tolerance and its residual checked, then the radii),
  with the Lipschitz bound computed once beforehand (it depends on the weights only; its time is printed apart);
- the certifiable model's plain evaluation forward: ``model(images)`` under ``no_grad`` in eval mode (what
  ``train.py``'s validation and ``eval.py`` without ``--certify-eps`` run: the certified solve's first pass);
- a training step of each: forward, cross-entropy, backward, AdamW step, in train mode (on copies of the two
  models, so that the inference models' weights, and the certifiable one's cached divisors, stay as at evaluation);
  the certifiable step also keeps the Lipschitz bound (``keep_bound`` at ``--lipschitz-target``, as train.py does
  with ``configs/lipsformer_swin_t_cert.yaml``'s ``lipschitz_target``; its time is printed apart), counted at
  ``1 / --lipschitz-every-steps`` of its time per step (the recipe's ``lipschitz_every_steps``: train.py keeps it
  after every k-th step). With k > 1 the normalised layers' cached divisors are dropped after it, so that each
  timed step computes its divisors as a step after which the bound was not kept does (the step of the projection
  then counts one estimate too many: conservative).
  The certifiable step is timed at each AttLip step count of ``--train-steps`` (default: the recipe's
  ``attlip_train_steps`` schedule, whose phases are equal spans of epochs), and the training ratio is the mean over
  the schedule's phases: what an epoch of the recipe costs on average. Each count's own ratio is printed too.

The images are random pixels in [0, 1], each model given them through its own normalisation (ImageNet's for the
plain models, mean 0.5 and std 1 for the certifiable ones). Each figure is the median over ``--rounds`` rounds (one
warm-up call each first); the ratios are certifiable / plain. Beside each ratio, its **multiply-add floor**: the
multiply-adds of the two calls timed (every matrix product and convolution they run, forward and backward, as many as
the data decides: torch's FlopCounterMode, :func:`lipsformer.flops.count_multiply_adds`, which gives fvcore's count on a
forward), certifiable / plain: a ratio no implementation running both models equally fast per multiply-add could go
below. Then one certified forward is profiled: the time inside the AttLip solves, inside their residual checks (float32
with the rounding bound, and float64 where that does not settle a window), in the rest of AttLip (the orthogonal form's
rotations, the layout of its per-head problems), inside the normalised layers' divisors (cached at evaluation: computed
once after a weight change), and the rest; the multiply-adds of one image split the same way (the solves and checks as
the solver counts them, :class:`~lipsformer.layers.attlip.SolveStats`); and the gradient evaluations each AttLip block
took (slowest window and mean over windows, and how many windows needed a float64 check). Weights are random (no
certified weights are published): solver steps on trained weights may differ.
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

import lipsformer  # noqa: E402  (registers the models)
from lipsformer.layers import attlip_solver  # noqa: E402
from lipsformer.config import load_config  # noqa: E402
from lipsformer.flops import count_multiply_adds  # noqa: E402
from lipsformer.layers.attlip import FORMS, AttLip  # noqa: E402
from lipsformer.layers.normalized import NormalizedConv2d, NormalizedLinear  # noqa: E402
from lipsformer.lipschitz.certify import normalization, pixel_lipschitz, predict_certified  # noqa: E402
from lipsformer.lipschitz.constraints import keep_bound  # noqa: E402

PAIRS = ("lipsformer_swin_t:lipsformer_swin_t_cert", "lipsformer_cswin_t:lipsformer_cswin_t_cert")
RECIPE = ROOT / "configs" / "lipsformer_swin_t_cert.yaml"  # its lipschitz_target and attlip_train_steps


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measured(fn) -> float:
    """The seconds ``fn`` says it counts (a training step with its share of the bound keeping), or its wall time."""
    start = time.perf_counter()
    counted = fn()
    return time.perf_counter() - start if counted is None else counted


def train_step(model, opt, images, target):
    def step():
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(images), target).backward()
        opt.step()
    return step


@contextmanager
def time_spent_in(spans: dict):
    """Accumulate wall time spent inside AttLip's forward, its certified solve, its residual checks (float32 with
    the rounding bound, float64), and the normalised layers' spectral divisors, by wrapping those functions for
    the duration."""
    normalized = lipsformer.layers.normalized
    originals = {("attlip", "forward"): AttLip, ("solve", "_bb_solve"): attlip_solver,
                 ("check", "prox_residual64"): attlip_solver, ("check", "prox_residual32"): attlip_solver,
                 ("divisor", "top_singular_triple"): normalized}
    saved = {}
    for (key, name), owner in originals.items():
        fn = getattr(owner, name)
        saved[key, name] = fn

        def wrapper(*args, _fn=fn, _key=key, **kwargs):
            start = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                spans[_key] += time.perf_counter() - start
        setattr(owner, name, wrapper)
    try:
        yield spans
    finally:
        for (key, name), owner in originals.items():
            setattr(owner, name, saved[key, name])


def measure_pair(plain_name: str, cert_name: str, batch: int, img_size: int, rounds: int,
                 lipschitz_target: float, train_steps: list, form=None, every: int = 1) -> dict:
    torch.manual_seed(0)
    plain = timm.create_model(plain_name, img_size=img_size)
    cert = timm.create_model(cert_name, img_size=img_size, **({} if form is None else dict(attlip_form=form)))
    forms = sorted({m.form for m in cert.modules() if isinstance(m, AttLip)})
    # random pixels in [0, 1], each model given them through its own normalisation (the certifiable models' std is
    # 1: a std-1 Gaussian would be 3.5 times the spread any image gives them, and their solves depend on it)
    pixels = torch.rand(batch, 3, img_size, img_size)
    plain_images, images = ((pixels - mean) / std for mean, std in (normalization(plain), normalization(cert)))
    target = torch.randint(0, plain.num_classes, (batch,))
    bound_s = timed(lambda: pixel_lipschitz(cert))
    L = pixel_lipschitz(cert)
    # the training steps change weights: they run on copies, so the inference models keep theirs (and the
    # certifiable one its cached divisors, as at evaluation)
    trained = dict(plain=copy.deepcopy(plain), cert=copy.deepcopy(cert))
    steps = {name: train_step(m, torch.optim.AdamW(m.parameters(), lr=1e-6), x, target)
             for (name, m), x in zip(trained.items(), (plain_images, images))}

    def plain_infer():
        plain.eval()
        with torch.no_grad():
            plain(plain_images)

    def cert_infer():
        predict_certified(cert, images, L)

    def cert_eval():
        cert.eval()
        with torch.no_grad():
            cert(images)

    def plain_train():
        trained["plain"].train()
        steps["plain"]()

    def keep():
        keep_bound(trained["cert"], lipschitz_target)

    def cert_step(k: int):
        def run():
            trained["cert"].train()
            for m in trained["cert"].modules():
                if isinstance(m, AttLip):
                    m.train_steps = k
            steps["cert"]()
        return run

    def cert_train(k: int):
        def run():
            t = timed(cert_step(k))
            kept = timed(keep)
            if every > 1:
                for m in trained["cert"].modules():
                    if isinstance(m, (NormalizedLinear, NormalizedConv2d)):
                        m.forget_divisor()
            times["keep_bound"].append(kept)
            return t + kept / every
        return run

    counts = sorted(set(train_steps))
    runs = dict(plain_infer=plain_infer, cert_infer=cert_infer, cert_eval=cert_eval, plain_train=plain_train,
                **{f"cert_train_{k}": cert_train(k) for k in counts})
    times = defaultdict(list)
    for fn in runs.values():  # warm-up
        fn()
    times.clear()
    for r in range(rounds):
        for key, fn in runs.items():
            times[key].append(measured(fn))
        print(f"  {cert_name} batch {batch} round {r + 1}/{rounds}: "
              + "  ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items()), flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    cert_train_s = {k: med[f"cert_train_{k}"] for k in counts}
    schedule_s = statistics.mean(cert_train_s[k] for k in train_steps)  # equal phases

    # the multiply-adds of each timed call (per image), once, outside the timing
    # (keep_bound's counted at the share of it the time counts)
    macs = {key: count_multiply_adds(fn) / batch / 1e9 for key, fn in
            dict(plain_infer=plain_infer, cert_infer=cert_infer, cert_eval=cert_eval, plain_train=plain_train,
                 keep_bound=keep, **{f"cert_train_{k}": cert_step(k) for k in counts}).items()}
    for k in counts:
        macs[f"cert_train_{k}"] += macs["keep_bound"] / every
    macs["cert_train"] = statistics.mean(macs[f"cert_train_{k}"] for k in train_steps)

    spans = defaultdict(float)
    with time_spent_in(spans):
        total = timed(cert_infer)
    blocks = [(name, m.last_solve) for name, m in cert.named_modules() if isinstance(m, AttLip)]
    split = dict(solve=sum(s.multiply_adds for _, s in blocks) / batch / 1e9,
                 check=sum(s.check_multiply_adds for _, s in blocks) / batch / 1e9)
    split["rest"] = macs["cert_infer"] - split["solve"] - split["check"]
    profile = dict(total_s=total, attlip_solve_s=spans["solve"], attlip_check_s=spans["check"],
                   attlip_other_s=spans["attlip"] - spans["solve"] - spans["check"],
                   normalized_divisor_s=spans["divisor"],
                   rest_s=total - spans["attlip"] - spans["divisor"])
    floor = dict(infer=macs["cert_infer"] / macs["plain_infer"], eval=macs["cert_eval"] / macs["plain_infer"],
                 train=macs["cert_train"] / macs["plain_train"])
    return dict(plain=plain_name, cert=cert_name, attlip_form=forms, batch=batch, img_size=img_size, rounds=rounds,
                threads=torch.get_num_threads(), lipschitz_target=lipschitz_target, lipschitz_every_steps=every,
                bound_once_s=bound_s,
                defect=L.defect, lipschitz=L.bound, radius_cost=2 * L.defect / L.bound,
                plain_infer_s=med["plain_infer"], cert_infer_s=med["cert_infer"], cert_eval_s=med["cert_eval"],
                plain_train_s=med["plain_train"], train_steps=list(train_steps), cert_train_s=schedule_s,
                cert_train_by_steps_s={str(k): v for k, v in cert_train_s.items()}, keep_bound_s=med["keep_bound"],
                infer_ratio=med["cert_infer"] / med["plain_infer"], eval_ratio=med["cert_eval"] / med["plain_infer"],
                train_ratio=schedule_s / med["plain_train"],
                train_ratio_by_steps={str(k): v / med["plain_train"] for k, v in cert_train_s.items()},
                gmacs_per_image=macs, floor=floor, cert_infer_split=split, profile=profile,
                solver_steps=[dict(block=n, steps=s.steps, mean_steps=round(s.mean_steps, 2),
                                   float64_windows=s.float64_windows, float64_checks=s.float64_checks)
                              for n, s in blocks])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", nargs="+", default=list(PAIRS), metavar="PLAIN:CERT")
    parser.add_argument("--batch", type=int, nargs="+", default=[32])
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--rounds", type=int, default=3)
    recipe = load_config(RECIPE)
    parser.add_argument("--lipschitz-target", type=float, default=recipe.lipschitz_target,
                        help="keep_bound's target in the certifiable training step (default: the recipe's "
                             "lipschitz_target)")
    parser.add_argument("--lipschitz-every-steps", type=int, default=recipe.lipschitz_every_steps, metavar="K",
                        help="keep_bound counted at 1/K of its time per training step (default: the recipe's "
                             "lipschitz_every_steps)")
    parser.add_argument("--train-steps", type=int, nargs="+", default=recipe.attlip_train_steps,
                        metavar="K", help="AttLip steps in the certifiable training step, one phase each of the "
                                          "schedule the training ratio averages (default: the recipe's "
                                          "attlip_train_steps)")
    parser.add_argument("--attlip-form", choices=list(FORMS), default=None,
                        help="the certifiable model's AttLip form (default: the model's own)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, all cores)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if min(args.train_steps) < 1:
        parser.error(f"--train-steps takes AttLip step counts >= 1, got {args.train_steps}")
    if args.lipschitz_every_steps < 1:
        parser.error(f"--lipschitz-every-steps takes a number of steps >= 1, got {args.lipschitz_every_steps}")
    if args.threads:
        torch.set_num_threads(args.threads)
    pairs = []
    for pair in args.pairs:
        plain_name, sep, cert_name = pair.partition(":")
        if not sep or not timm.is_model(plain_name) or not timm.is_model(cert_name):
            parser.error(f"--pairs takes PLAIN:CERT of registered models, got {pair!r}")
        pairs.append((plain_name, cert_name))
    start = time.perf_counter()
    rows = [measure_pair(plain_name, cert_name, batch, args.img_size, args.rounds, args.lipschitz_target,
                         args.train_steps, args.attlip_form, args.lipschitz_every_steps)
            for batch in args.batch for plain_name, cert_name in pairs]
    print(f"\n{args.img_size}px, {torch.get_num_threads()} threads, medians of {args.rounds} interleaved rounds "
          f"(certifiable / plain, each ratio beside its multiply-add floor); the certifiable train step averaged over "
          f"AttLip step phases {args.train_steps}; {time.perf_counter() - start:.0f} s in all\n")
    print("| certifiable (AttLip form) | batch | certified inference | ratio (floor) | plain eval forward | "
          "ratio (floor) | train step | ratio (floor) | D (solver defect) | radius cost 2D/L |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        f = r["floor"]
        print(f"| {r['cert']} ({', '.join(r['attlip_form'])}) vs {r['plain']} | {r['batch']} | "
              f"{r['cert_infer_s']:.2f} s vs {r['plain_infer_s']:.2f} s | **{r['infer_ratio']:.2f}x** "
              f"({f['infer']:.2f}x) | {r['cert_eval_s']:.2f} s | **{r['eval_ratio']:.2f}x** ({f['eval']:.2f}x) | "
              f"{r['cert_train_s']:.2f} s vs {r['plain_train_s']:.2f} s | **{r['train_ratio']:.2f}x** "
              f"({f['train']:.2f}x) | {r['defect']:.2e} | {r['radius_cost']:.2e} |")
    for r in rows:
        p, m, s = r["profile"], r["gmacs_per_image"], r["cert_infer_split"]
        print(f"\n{r['cert']} batch {r['batch']}: one certified forward {p['total_s']:.2f} s = AttLip solve "
              f"{p['attlip_solve_s']:.2f} s + its residual checks {p['attlip_check_s']:.2f} s + the rest of AttLip "
              f"{p['attlip_other_s']:.2f} s + normalised divisors {p['normalized_divisor_s']:.2f} s + the rest "
              f"{p['rest_s']:.2f} s; the bound, once: {r['bound_once_s']:.2f} s; keep_bound {r['keep_bound_s']:.2f} s, "
              f"after every {r['lipschitz_every_steps']} training step(s)")
        print("  train step by AttLip steps: " + ", ".join(
            f"{k}: {r['cert_train_by_steps_s'][k]:.2f} s ({r['train_ratio_by_steps'][k]:.2f}x)"
            for k in r["cert_train_by_steps_s"]))
        print(f"  multiply-adds per image: certified inference {m['cert_infer']:.2f} G = AttLip solves "
              f"{s['solve']:.2f} G + their checks {s['check']:.2f} G + the rest {s['rest']:.2f} G, plain eval forward "
              f"{m['cert_eval']:.2f} G, vs {m['plain_infer']:.2f} G plain; training step {m['cert_train']:.2f} G vs "
              f"{m['plain_train']:.2f} G")
        print("  gradient evaluations per AttLip block (slowest window / mean; windows checked in float64): "
              + ", ".join(f"{b['steps']}/{b['mean_steps']:g}"
                          + (f" ({b['float64_checks']})" if b["float64_checks"] else "")
                          + (f" ({b['float64_windows']} finished in float64)" if b["float64_windows"] else "")
                          for b in r["solver_steps"]))
    if args.json:
        args.json.write_text(json.dumps(dict(rows=rows), indent=2))
    return rows


if __name__ == "__main__":
    main()
