"""A tool (docs/speed.md): what the host spends issuing a training step's ops, measured on the CPU. A GPU runs a step
no faster than its host issues the kernels, so at small batches the host's time per step bounds img/s; the step-cost
tool (benchmarks/step_cost.py) charges every op one launch cost alike, while a fused ``lipsformer::`` op is Python:
eager mode calls its implementation through a plain ``autograd.Function``, and where a dispatch mode is on it goes
through the dispatcher as a ``torch.library`` custom op (:mod:`lipsformer.layers.fused_op`).

    python benchmarks/host_cost.py [--models lipsformer_swin_t lipsformer_cswin_t]
        [--baseline swin_tiny_patch4_window7_224] [--chain 20] [--reps 7]

Measured in one process, interleaved, medians: a chain of ``--chain`` calls of one fused op (the residual's
CenterNorm with a DropPath mask, ``lipsformer::residual_center_norm``; its Triton kernels replaced by stubs that
return its outputs unwritten, so that the op takes its CUDA route on CPU tensors as a GPU's host runs it, less
Triton's launcher) forward and then backward, as eager mode calls it and through the dispatcher, against a chain of
as many aten ``mul`` (one op forward, two backward), on tiny tensors (the host's cost does not depend on their
size): microseconds per fused call (forward and backward) and per aten op. Then, per model, one training step's aten
ops and fused calls (step_cost's count, on the meta device) at eager mode's costs: the host's milliseconds per step
on this CPU, and their ratio to the baseline's; and the milliseconds with every fused call through the dispatcher.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import timm
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import lipsformer  # noqa: E402,F401  (registers the models)
import step_cost  # noqa: E402
from lipsformer.layers import fused, fused_op  # noqa: E402


class StubKernels:
    """The CenterNorm op's kernels as the op calls them (``lipsformer.layers.triton_kernels``), returning the outputs
    the op allocated for them, unwritten; ``calls`` counts them (the measurement took the op's CUDA route)."""
    calls = 0

    @classmethod
    def residual_center_norm(cls, *args):
        cls.calls += 1
        return args[-2], args[-1]

    @classmethod
    def residual_center_norm_backward(cls, *args):
        cls.calls += 1
        return args[-3:]


def _fused_chain(n: int):
    x = torch.randn(2, 4, 8, requires_grad=True)
    h, mask = torch.randn(2, 4, 8), torch.ones(2)
    weight, bias = torch.ones(8, requires_grad=True), torch.zeros(8, requires_grad=True)

    def step():
        y = x
        for _ in range(n):
            y = fused.residual_center_norm(y, h, mask, 0.9, weight, bias, 1.0)
        y.backward(torch.ones_like(y))
    return step


def _aten_chain(n: int):
    x, s = torch.randn(2, 4, 8, requires_grad=True), torch.randn(2, 4, 8, requires_grad=True)

    def step():
        y = x
        for _ in range(n):
            y = y * s
        y.backward(torch.ones_like(y))
    return step


def _dispatched(step):
    """``step`` with the fused ops called through the dispatcher, as under a dispatch mode."""
    def run():
        direct, fused_op.dispatched = fused_op.dispatched, lambda: True
        try:
            step()
        finally:
            fused_op.dispatched = direct
    return run


def per_call(chain: int, reps: int, number: int = 20) -> dict:
    """Median seconds per fused call (forward and backward) as eager mode calls it (``fused_call``) and through the
    dispatcher (``dispatched_call``), and per aten op, interleaved."""
    kernels, fused._kernels = fused._kernels, lambda t: StubKernels  # the op's CUDA route, on CPU tensors
    calls = StubKernels.calls
    fused_step, aten_step = _fused_chain(chain), _aten_chain(chain)
    runs = (("fused_call", fused_step, chain), ("dispatched_call", _dispatched(fused_step), chain),
            ("aten_op", aten_step, 3 * chain))
    times = {key: [] for key, _, _ in runs}
    try:
        for _ in range(reps):
            for key, step, per in runs:
                step()
                start = time.perf_counter()
                for _ in range(number):
                    step()
                times[key].append((time.perf_counter() - start) / (number * per))
    finally:
        fused._kernels = kernels
    if StubKernels.calls == calls:  # the timing would be the plain composition's
        raise RuntimeError("the fused op did not take its CUDA route (lipsformer.layers.fused.fusable refused it)")
    return {k: statistics.median(v) for k, v in times.items()}


def step_counts(name: str) -> dict:
    """One training step's ops as step_cost counts them (on the meta device, 224 px): the aten ops, the fused calls
    (forward and backward ops) and the kernels those launch."""
    tally = step_cost.count(timm.create_model(name).to("meta"), 2, 224, True)
    fused_calls = sum(op.name.startswith("lipsformer.") and not op.name.endswith(".sum") for op in tally.ops)
    launches = sum(op.name.startswith("lipsformer.") for op in tally.ops)
    return dict(aten_ops=len(tally.ops) - launches, fused_calls=fused_calls, fused_launches=launches)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["lipsformer_swin_t", "lipsformer_cswin_t"])
    parser.add_argument("--baseline", default="swin_tiny_patch4_window7_224")
    parser.add_argument("--chain", type=int, default=20)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args(argv)
    if args.chain < 1 or args.reps < 1:
        parser.error("--chain and --reps take positive counts")
    torch.set_num_threads(1)
    try:
        cost = per_call(args.chain, args.reps)
    except RuntimeError as e:
        parser.exit(1, f"error: {e}\n")
    aten = cost["aten_op"]
    print(f"host per fused call (forward and backward): {cost['fused_call'] * 1e6:.1f} us "
          f"({cost['fused_call'] / aten:.1f} aten ops), through the dispatcher {cost['dispatched_call'] * 1e6:.1f} us "
          f"({cost['dispatched_call'] / aten:.1f}); per aten op: {aten * 1e6:.1f} us, this CPU")
    base = None
    print(f"{'model':30} {'aten ops':>8} {'fused calls':>11} {'host ms':>8} {'ratio':>6} {'dispatched ms':>13}")
    for name in [args.baseline] + args.models:
        c = step_counts(name)
        ms, via = ((c["aten_ops"] * aten + c["fused_calls"] / 2 * cost[key]) * 1e3
                   for key in ("fused_call", "dispatched_call"))
        base = base or ms
        print(f"{name:30} {c['aten_ops']:8d} {c['fused_calls']:11d} {ms:8.1f} {ms / base:6.2f} {via:13.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
