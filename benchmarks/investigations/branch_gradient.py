"""A finished investigation (docs/certified.md, why the branches turn off, cites its result): Why the margin loss
turns the certifiable LipsFormer's residual branches off.

    python benchmarks/investigations/branch_gradient.py [--config configs/certified_digits.yaml]
        [--weights run/last.safetensors]

For the model of ``--config`` (at its initialisation, or with ``--weights``), on the training images without
augmentation, prints for every convex residual ``(1 - a) x + a f(x)``:

- ``dL/da`` of the Lipschitz-margin loss at margin_eps 0 (plain cross-entropy), 0.25 and 0.5, summed over the
  training set: positive means gradient descent lowers ``a`` (turns the branch off);
- the block's gain on differences between images of different classes, ``||F(x) - F(y)|| / ||x - y||`` over pairs of
  the block's inputs, at the current ``a`` and with ``a = 0`` (the skip alone, an isometry): with the bound fixed at 1,
  a branch that shrinks the differences between classes shrinks the margins the certificate divides by.
"""
import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "certified_digits.yaml"))
    parser.add_argument("--weights", help="a run's last.safetensors (default: the initialisation, seed 0)")
    parser.add_argument("--data", default="output/digits")
    parser.add_argument("--set", nargs="*", default=[])
    parser.add_argument("--images", type=int, default=512, help="training images used")
    args = parser.parse_args(argv)

    import lipsformer  # noqa: F401
    from lipsformer.data.digits import write_digits_folder
    from lipsformer.config import load_config
    from lipsformer.build import build_model
    from lipsformer.engine.margin import LipschitzMarginLoss
    from lipsformer.layers.residual import ConvexResidual
    from lipsformer.lipschitz.certify import normalization
    from benchmarks.paper.certified import load_images

    if "digits" in args.data:
        write_digits_folder(args.data)
    cfg = load_config(args.config, [f"data_dir={args.data}", *args.set])
    torch.manual_seed(0)
    model = build_model(cfg.model, **cfg.model_args()).model
    if args.weights:
        from safetensors.torch import load_file
        model.load_state_dict(load_file(args.weights))
    model.eval()  # no dropout / DropPath in these models; eval keeps the AttLip steps of evaluation
    mean, std = normalization(model)
    x, y = load_images(str(Path(args.data) / "train"), model, cfg)
    idx = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))[:args.images]
    x, y = (x[idx] - mean) / std, y[idx]
    residuals = [(n, m) for n, m in model.named_modules() if isinstance(m, ConvexResidual)]
    print("residual | a | dL/da at eps 0 / 0.25 / 0.5 | gain on class differences at a / at 0")
    grads = {}
    for eps in (0.0, 0.25, 0.5):
        model.zero_grad()
        loss = LipschitzMarginLoss(torch.nn.functional.cross_entropy, eps, 1.0)
        for xb, yb in zip(x.split(64), y.split(64)):
            (loss(model(xb), yb) * len(yb) / len(y)).backward()
        grads[eps] = [float(m.alpha.grad) for _, m in residuals]
    # block gains: the inputs each residual sees, through a hook
    inputs = {}
    hooks = [m.register_forward_hook(lambda mod, a, out, n=n: inputs.__setitem__(n, (a[0].detach(), a[1].detach())))
             for n, m in residuals]
    with torch.no_grad():
        model(x[:128])
    for h in hooks:
        h.remove()
    lab = y[:128]
    pairs = [(i, j) for i in range(128) for j in range(i + 1, 128) if lab[i] != lab[j]][:2000]
    i, j = (torch.tensor(p) for p in zip(*pairs))
    for k, (n, m) in enumerate(residuals):
        xin, fx = inputs[n]
        a = float(m.alpha.detach())
        out = torch.lerp(xin, fx, a)
        dx = (xin[i] - xin[j]).flatten(1).norm(dim=1)
        gain = float(((out[i] - out[j]).flatten(1).norm(dim=1) / dx).mean())
        full = float(((fx[i] - fx[j]).flatten(1).norm(dim=1) / dx).mean())
        print(f"{n} | {a:.3f} | {grads[0.0][k]:+.2e} / {grads[0.25][k]:+.2e} / {grads[0.5][k]:+.2e} | "
              f"{gain:.3f} (branch alone {full:.3f}) / 1.000")


if __name__ == "__main__":
    main()
