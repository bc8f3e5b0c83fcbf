"""A paper reproduction (docs/experiments.md): Kim et al. Figure 2: the measured lower bound of Lip-inf of L2
attention against Theorem 3.2's l-inf bound, by N.

    python benchmarks/paper/kim_tightness.py [--ns 100 200 400 1000] [--inits 16] [--top 5] [--steps 300]
                                       [--out output/kim_tightness]

As in Kim et al. Sec. 5.1 and Appendix H: L2-MHA with H = D = 1 and every weight 1 (so f(X)_i = sum_j P_ij x_j,
P_ij = softmax_j(-(x_i - x_j)^2)); the lower bound is the largest ||J_f(X)||_inf (largest absolute row sum)
found by Adam (lr 0.1) on X from ``--inits`` random starts X_ij ~ U[-c, c], c ~ U[0, 10], the top ``--top``
of which are reported; the upper bound is Theorem 3.2's 4 phi^-1(N - 1) + 1
(lipsformer.lipschitz.bounds.kim_l2_inf_bound). The Jacobian is computed in closed form (checked against autograd
on KimL2Attention in tests/test_paper_benchmarks.py):
J_ik = P_ik (1 + 2 (x_k - f_i)(x_i - x_k)) + [i = k] 2 sum_m P_im (x_m - f_i)(x_m - x_i).
Writes kim_tightness.json and kim_tightness.png and prints the table, with the slope of each curve against log N.
"""
import argparse
import json
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from lipsformer.layers.attention import KimL2Attention  # noqa: E402
from lipsformer.lipschitz.layer_bounds import kim_l2_inf_bound  # noqa: E402


def scalar_l2_jacobian(x: torch.Tensor) -> torch.Tensor:
    """J_f(x) of 1-d L2 attention with unit weights for a batch of token sequences x (R, N): (R, N, N)."""
    diff = x.unsqueeze(-1) - x.unsqueeze(-2)  # x_i - x_k
    p = (-diff.pow(2)).softmax(-1)
    f = p @ x.unsqueeze(-1)  # (R, N, 1)
    off = p * (1 + 2 * (x.unsqueeze(-2) - f) * diff)
    diag = 2 * (p * (x.unsqueeze(-2) - f) * (-diff)).sum(-1)
    return off + torch.diag_embed(diag)


def inf_norm(j: torch.Tensor) -> torch.Tensor:
    return j.abs().sum(-1).amax(-1)


def lower_bound(n: int, inits: int, steps: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    c = torch.rand(inits, 1, generator=g) * 10
    x = ((torch.rand(inits, n, generator=g) * 2 - 1) * c).double().requires_grad_(True)
    opt = torch.optim.Adam([x], lr=0.1)
    best = torch.zeros(inits, dtype=torch.double)
    for _ in range(steps):
        norms = inf_norm(scalar_l2_jacobian(x))
        best = torch.maximum(best, norms.detach())
        opt.zero_grad()
        (-norms.sum()).backward()
        opt.step()
    with torch.no_grad():
        best = torch.maximum(best, inf_norm(scalar_l2_jacobian(x)))
    return sorted(best.tolist(), reverse=True)


def upper_bound(n: int) -> float:
    attn = KimL2Attention(1, 1).double()
    for m in (attn.q, attn.v, attn.proj):
        torch.nn.init.ones_(m.weight)
    return kim_l2_inf_bound(attn, n)


def slope(ns, ys) -> float:
    """Least-squares slope of ys against ln N."""
    xs = [math.log(n) for n in ns]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((a - mx) * (b - my) for a, b in zip(xs, ys)) / sum((a - mx) ** 2 for a in xs)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ns", type=int, nargs="+", default=[100, 200, 400, 1000])
    parser.add_argument("--inits", type=int, default=16, help="random starts per N (the paper: 50)")
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300, help="Adam steps per start")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="output/kim_tightness")
    args = parser.parse_args(argv)
    rows = []
    for n in args.ns:
        found = lower_bound(n, args.inits, args.steps, args.seed)
        rows.append(dict(N=n, upper=upper_bound(n), lower_top=found[:args.top], lower=found[0]))
        print(f"  N={n}: lower {found[0]:.3f}, upper {rows[-1]['upper']:.3f}", flush=True)
    s_up, s_low = slope(args.ns, [r["upper"] for r in rows]), slope(args.ns, [r["lower"] for r in rows])
    print("Kim et al. Fig. 2, H = D = 1: Lip-inf of L2 attention")
    print(f"{'N':>6}{'lower (best)':>14}{'upper (Thm 3.2)':>17}{'ratio':>8}")
    for r in rows:
        print(f"{r['N']:>6}{r['lower']:>14.3f}{r['upper']:>17.3f}{r['upper'] / r['lower']:>8.2f}")
    print(f"slope against ln N: lower {s_low:.3f}, upper {s_up:.3f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = dict(settings=vars(args), rows=rows, slope_lower=s_low, slope_upper=s_up)
    (out / "kim_tightness.json").write_text(json.dumps(summary, indent=1))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(args.ns, [r["upper"] for r in rows], "o-", label="upper bound (Thm 3.2)")
    for k in range(min(args.top, args.inits)):
        ax.plot(args.ns, [r["lower_top"][k] for r in rows], "x", color="C1", label="lower bound (top starts)" if k == 0
                else None)
    ax.set(xscale="log", xlabel="N", ylabel="Lip-inf", title="L2 attention, H = D = 1")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "kim_tightness.png", dpi=100)
    return summary


if __name__ == "__main__":
    main()
