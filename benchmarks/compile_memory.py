"""A tool users run (docs/speed.md, compiled training memory): Compiled training memory against the partitioner's
activation memory budget (train.py's ``compile_memory_budget``), against timm's Swin eager and compiled.

    python benchmarks/compile_memory.py --budgets 1.0 0.8 --solver greedy
    python benchmarks/compile_memory.py [--model lipsformer_swin_t] [--budgets 1.0 0.8 0.5] [--batch 4] [--steps 3]
        [--solver greedy|dp|ilp] [--json out.json]

Each run is its own process: dynamo shares one compiled graph among same-shaped instances of a module class, so
a second model compiled in the same process with another budget would silently reuse the first one's graph. A run
builds the model, compiles it through ``lipsformer.engine.speed.compile_model`` (train.py's path), measures the
bytes autograd saves for backward in one training step (``throughput.train_memory``, the CPU measure of
``throughput.py``; the first step also compiles) and then times ``--steps`` training steps (SGD), median. The saved
activations grow with the batch, their ratios hardly (docs/speed.md); compiling one training graph of Swin-T takes
minutes on a CPU, so a run of this script is slow.
"""
import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import timm
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import lipsformer  # noqa: E402,F401  (registers the models)
from lipsformer.engine.speed import compile_model, prepare_model  # noqa: E402
from throughput import train_memory, train_time  # noqa: E402


def one_run(name: str, budget, compiled: bool, batch: int, steps: int, solver) -> dict:
    import torch._functorch.config as functorch_config
    if solver:
        functorch_config.activation_memory_budget_solver = solver
    torch.manual_seed(0)
    x = torch.randn(batch, 3, 224, 224)
    model = prepare_model(timm.create_model(name)).train()
    if compiled:
        compile_model(model, "default", budget)
    start = time.perf_counter()
    saved = train_memory(model, x, "cpu", "no")  # the first step compiles
    first = time.perf_counter() - start
    times = [train_time(model, x, "cpu", "no", 1) for _ in range(steps)]
    return dict(model=name, budget=budget, compiled=compiled, solver=functorch_config.activation_memory_budget_solver,
                saved_mb=saved, first_step_s=first, step_s=statistics.median(times))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="lipsformer_swin_t")
    parser.add_argument("--baseline", default="swin_tiny_patch4_window7_224")
    parser.add_argument("--budgets", type=float, nargs="+", default=[1.0, 0.8, 0.5])
    parser.add_argument("--solver", choices=("greedy", "dp", "ilp"), help="the partitioner's knapsack solver "
                        "(torch._functorch.config.activation_memory_budget_solver; default: torch's)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json")
    parser.add_argument("--one", nargs=3, metavar=("NAME", "BUDGET", "COMPILED"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        name, budget, compiled = args.one
        row = one_run(name, None if budget == "none" else float(budget), compiled == "1", args.batch, args.steps,
                      args.solver)
        print("RESULT " + json.dumps(row))
        return 0
    runs = [(args.baseline, "none", "0"), (args.baseline, "none", "1"), (args.model, "none", "0")]
    runs += [(args.model, str(b), "1") for b in args.budgets]
    rows = []
    for run in runs:
        cmd = [sys.executable, __file__, "--one", *run, "--batch", str(args.batch), "--steps", str(args.steps)]
        proc = subprocess.run(cmd + (["--solver", args.solver] if args.solver else []), capture_output=True,
                              text=True)
        if proc.returncode != 0:
            print(f"{run} failed (the runs before it are printed above):\n{proc.stderr[-3000:]}", file=sys.stderr)
            return proc.returncode
        row = json.loads([line for line in proc.stdout.splitlines() if line.startswith("RESULT ")][-1][7:])
        rows.append(row)
        print(f"{run}: {row['saved_mb']:.1f} MB saved, first step {row['first_step_s']:.0f} s, step "
              f"{row['step_s']:.2f} s", flush=True)
    base, compiled_base = rows[0], rows[1]
    print(f"\nCPU, {torch.get_num_threads()} threads, batch {args.batch}, 224 px, fp32, solver {rows[-1]['solver']}, "
          f"median of {args.steps} steps, one process per run")
    print(f"{'run':50s} {'saved MB':>9s} {'x eager':>8s} {'x compiled':>10s} {'step s':>7s} {'speed x':>8s}")
    for row in rows:
        label = f"{row['model']} " + (f"compiled, budget {row['budget'] or 1.0}" if row["compiled"] else "eager")
        row.update(mem_vs_baseline_eager=row["saved_mb"] / base["saved_mb"],
                   mem_vs_baseline_compiled=row["saved_mb"] / compiled_base["saved_mb"],
                   speed_vs_baseline_eager=base["step_s"] / row["step_s"])
        print(f"{label:50s} {row['saved_mb']:9.1f} {row['mem_vs_baseline_eager']:8.2f} "
              f"{row['mem_vs_baseline_compiled']:10.2f} {row['step_s']:7.2f} {row['speed_vs_baseline_eager']:8.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
