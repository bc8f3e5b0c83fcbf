"""A paper reproduction (docs/experiments.md): Kim et al. Figure 3: numerical invertibility of g(x) = x + c f(x) for
L2 and dot-product multi-head attention.

    python benchmarks/paper/invertibility.py [--n 64] [--dim 64] [--heads 8] [--batch 128] [--iters 50] [--scale 10]
                                       [--out output/invertibility]

As in Kim et al. Sec. 5.2: 8 heads, N = 64, D = 64, randomly initialised weights (PyTorch's nn.Linear default), a
batch of 128 inputs with one token at 0 and the others uniform on [-scale, scale], y = g(x), then the fixed-point
iteration x <- y - c f(x) from x = y (lipsformer.lipschitz.invert's loop); c in {0.5, 0.7, 0.9}. Plotted: the largest
reconstruction error over the batch, max |x_k - x| (entries), against the iteration k. Rows:

- L2-MHA: Kim's tied L2 attention (KimL2Attention), f as initialised (the paper's left panel);
- DP-MHA: standard dot-product attention with its own q, k, v, output projections (the paper's right panel);
- Contractive-L2-MHA: L2-MHA divided by its Theorem 3.2 bound (l2), for which invert() certifies c Lip(f) = c < 1.

Writes invertibility.json and invertibility.png and prints the table of errors at a few iteration counts.
"""
import argparse
import json
import math
import sys
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from lipsformer.layers.attention import KimL2Attention, dot_attention  # noqa: E402
from lipsformer.lipschitz.invert import ContractiveL2Attention, InvertibleResidual, fixed_point_inverse  # noqa: E402
from lipsformer.lipschitz.invert import invert  # noqa: E402

CS = (0.5, 0.7, 0.9)
SHOWN = (1, 5, 10, 20, 50)


class DotMHA(nn.Module):
    """Standard multi-head dot-product self-attention on (B, N, D) (Vaswani et al.): not Lipschitz (Kim Thm 3.1)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(x).view(B, N, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        return self.proj(dot_attention(q, k, v).transpose(1, 2).reshape(B, N, C))


def inputs(batch: int, n: int, dim: int, scale: float, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = (torch.rand(batch, n, dim, generator=g, dtype=torch.double) * 2 - 1) * scale
    x[:, 0] = 0  # one token at 0: where dot-product attention's Jacobian grows with the others' variance
    return x


@torch.no_grad()
def curve(f, x: torch.Tensor, c: float, iters: int) -> list:
    y = x + c * f(x)
    errors = []
    fixed_point_inverse(lambda z: c * f(z), y, tol=0.0, max_iter=iters,
                        callback=lambda k, xk: errors.append(float((xk - x).abs().max())))
    # the loop ends early on an exact fixed point (kept from then on) or on a non-finite iterate (inf from then on)
    last = errors[-1] if math.isfinite(errors[-1]) else math.inf
    return errors + [last] * (iters - len(errors))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--scale", type=float, default=10.0, help="the other tokens are uniform on [-scale, scale]")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="output/invertibility")
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    layers = {
        "L2-MHA": KimL2Attention(args.dim, args.heads),
        "DP-MHA": DotMHA(args.dim, args.heads),
        "Contractive-L2-MHA": ContractiveL2Attention(args.dim, args.heads),
    }
    layers = {k: v.double().eval() for k, v in layers.items()}
    x = inputs(args.batch, args.n, args.dim, args.scale, args.seed)
    results = []
    for name, f in layers.items():
        for c in CS:
            errors = curve(f, x, c, args.iters)
            row = dict(layer=name, c=c, errors=errors)
            if name == "Contractive-L2-MHA":  # the certified path: invert() to 1e-10 (l2 per sample)
                block = InvertibleResidual(f, c)
                inv = invert(block, block(x), tol=1e-10, max_iter=10_000)
                row.update(certified_lip=block.lipschitz_branch(args.n), invert_iterations=inv.iterations,
                           invert_error_l2=float((inv.x - x).flatten(1).norm(dim=1).max()))
            results.append(row)

    print(f"largest reconstruction error max|x_k - x| over {args.batch} inputs (N={args.n}, D={args.dim}, "
          f"H={args.heads}, one token at 0, others U[-{args.scale:g}, {args.scale:g}])")
    shown = [k for k in SHOWN if k <= args.iters]
    print(f"{'layer':<20}{'c':>5}" + "".join(f"{f'k={k}':>11}" for k in shown))
    for r in results:
        print(f"{r['layer']:<20}{r['c']:>5}" + "".join(f"{r['errors'][k - 1]:>11.2e}" for k in shown))

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = dict(settings=vars(args), runs=results)
    (out / "invertibility.json").write_text(json.dumps(summary, indent=1))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(layers), figsize=(4.5 * len(layers), 3.5), sharey=True)
    for ax, name in zip(axes, layers):
        for r in (r for r in results if r["layer"] == name):
            errs = [e if math.isfinite(e) else float("nan") for e in r["errors"]]
            ax.plot(range(1, len(errs) + 1), errs, label=f"c = {r['c']}")
        ax.set(title=name, xlabel="fixed-point iterations", yscale="log")
        ax.legend()
    axes[0].set_ylabel("max reconstruction error")
    fig.tight_layout()
    fig.savefig(out / "invertibility.png", dpi=100)
    return summary


if __name__ == "__main__":
    main()
