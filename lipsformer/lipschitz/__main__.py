"""How Lipschitz is a model? Certified bounds per stage and for the network, and measured lower bounds.

    python -m lipsformer.lipschitz --model lipsformer_swin_t --model-args '{"v_norm": true}'
    python -m lipsformer.lipschitz --model lipsformer_cswin_t --checkpoint run/ --measure network stages.2.blocks.0
"""
import math
import sys

import torch

from ..cli import ArgumentParser, command, json_value, path
from ..errors import UsageError, did_you_mean
from ..build import build_model
from ..weights import check_model_args, weights_fit
from ..writer import output_figure, output_file, save_figure, write_json
from .bounds import lipschitz_report
from .estimate import jacobian_norm


def _fmt(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.2f}"


def measure(model, names, input_size, iters: int = 20, seed: int = 0) -> dict:
    """Jacobian spectral norm (a lower bound on the Lipschitz constant) of ``network`` or of named submodules,
    at a random input (a submodule gets the activation it receives from that input)."""
    x = torch.randn(1, *input_size, generator=torch.Generator().manual_seed(seed), dtype=torch.double)
    model = model.double().eval()
    inputs = {}
    hooks = [model.get_submodule(n).register_forward_pre_hook(
        lambda m, args, n=n: inputs.setdefault(n, args[0].detach())) for n in names if n != "network"]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    out = {}
    for name in names:
        if name == "network":
            out[name] = jacobian_norm(lambda v: model(v.unsqueeze(0)).squeeze(0), x[0], iters)
        else:
            module, arg = model.get_submodule(name), inputs[name]
            out[name] = jacobian_norm(lambda v, m=module: m(v.unsqueeze(0)).squeeze(0), arg[0], iters)
    return out


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="python -m lipsformer.lipschitz", description=__doc__)
    parser.add_argument("--model", help="registered model name (optional with a checkpoint that names it)")
    parser.add_argument("--checkpoint", type=path, help="weight file, training run folder or exported folder")
    parser.add_argument("--input-size", type=int, nargs=3, metavar=("C", "H", "W"), help="default: the model's")
    parser.add_argument("--model-args", type=json_value, default={}, metavar="JSON",
                        help='e.g. \'{"v_norm": true}\' (SCSA with normalised v, inside Theorem 1)')
    parser.add_argument("--measure", nargs="+", default=[], metavar="NAME",
                        help="measure the Jacobian norm of 'network' or of submodules (e.g. stages.2.blocks.0)")
    parser.add_argument("--json", type=output_file,
                        help="write the table and bounds as JSON (a bound that is not finite is null, with a reason)")
    parser.add_argument("--plot", type=output_figure, help="write a PNG of every layer's bound")
    return parser


@command
def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.checkpoint and not args.model:
        parser.error("pass --model or --checkpoint")
    if args.input_size and min(args.input_size) < 1:
        parser.error(f"--input-size takes three positive numbers, C H W; got {' '.join(map(str, args.input_size))}")
    kwargs = dict(check_model_args(args.model_args))
    if args.input_size:
        kwargs.update(in_chans=args.input_size[0], img_size=tuple(args.input_size[1:]))
    if args.measure:
        kwargs["fused_attn"] = False  # forward-mode AD goes through the explicit softmax
    model, _ = build_model(args.model, args.checkpoint or None, **kwargs)
    known = dict(model.named_modules())
    unknown = [n for n in args.measure if n != "network" and n not in known]
    if unknown:
        raise UsageError(f"--measure: {model.pretrained_cfg.get('architecture', args.model)} has no module "
                         f"{unknown[0]!r}{did_you_mean(unknown[0], [n for n in known if n])}; give 'network' or a "
                         f"module name such as stages.0.blocks.0")
    report = lipschitz_report(model)  # a module type with no registered bound: a NoBoundError naming it
    name = model.pretrained_cfg.get("architecture", args.model)
    fit = weights_fit(model)
    for line in fit.lines():  # a bound for adapted weights is the adapted model's: said before it
        print(line)
    print(f"{name}: certified Lipschitz bounds (l2), as log10")
    print(f"{'part':<12} {'log10 bound':>12}")
    for part, bound in report.stages():
        print(f"{part:<12} {_fmt(bound):>12}")
    dominant = report.dominant()
    print(f"network bound (eq. 19, eval): 10^{_fmt(report.log10_bound)}")
    print(f"expected bound with DropPath (eq. 21, train): 10^{_fmt(report.log10_train_expected_bound)}")
    print(f"largest residual factor: {dominant.name} = {_fmt(dominant.lip)} ({dominant.note or 'conv / MLP'})")
    measured = {}
    if args.measure:
        size = (model.patch_embed.proj.in_channels, *model.patch_embed.img_size)
        measured = measure(model, args.measure, size)
        for n, value in measured.items():
            print(f"measured Jacobian norm of {n}: {value:.4g} (a lower bound)")
    if args.json:  # strict JSON: a bound that is not finite is null, with why (json's Infinity token is not JSON)
        unbounded = [r.name for r in report.rows if not math.isfinite(r.lip)]
        write_json(args.json, dict(model=name, adapted=fit.adapted, log10_bound=report.log10_bound,
                                   log10_train_expected_bound=report.log10_train_expected_bound,
                                   log10_stages=dict(report.stages()), measured=measured,
                                   rows=[vars(r) for r in report.rows]),
                   reason=f"no finite certified bound for {', '.join(unbounded)}" if unbounded else "")
    if args.plot:
        unbounded = _plot(report, args.plot, name)
        if unbounded:
            print(f"plot: {len(unbounded)} of {len(report.rows)} layers have no finite bound (red, marked inf): "
                  f"{', '.join(unbounded[:5])}{', ...' if len(unbounded) > 5 else ''}")
    return 0


def _plot(report, path, title) -> list:
    """A bar per layer (log10 of its bound); a layer without a finite bound is a red bar reaching above every
    finite one, marked inf. Returns those layers' names."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    finite = [math.log10(r.lip) for r in report.rows if math.isfinite(r.lip)]
    top = max(finite + [0.0]) * 1.2 + 0.5
    fig, ax = plt.subplots(figsize=(max(6, len(report.rows) * 0.15), 4))
    unbounded = []
    for i, r in enumerate(report.rows):
        if math.isfinite(r.lip):
            ax.bar(i, math.log10(r.lip), color="tab:blue")
        else:
            unbounded.append(r.name)
            ax.bar(i, top, color="tab:red", hatch="//", label="no finite bound" if len(unbounded) == 1 else None)
            ax.text(i, top, "inf", ha="center", va="bottom", color="tab:red", fontsize=7)
    if unbounded:
        ax.legend(loc="upper left")
    ax.set(xlabel="layer (input to output)", ylabel="log10 certified bound", title=title)
    fig.tight_layout()
    try:
        save_figure(fig, path)
    finally:
        plt.close(fig)
    return unbounded


if __name__ == "__main__":
    sys.exit(main())
