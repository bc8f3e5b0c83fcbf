"""A tool users run (README.md, docs/speed.md, docs/gpu.md): Inference and training-step throughput and memory of
LipsFormer models against a timm baseline, same process.

    python benchmarks/throughput.py --matrix --threads 1 2 --train-batches 8 32 --reps 3 --iters 1 --compiled none 0.8 \
        --compiled-batches 8
    python benchmarks/throughput.py [--models lipsformer_swin_t lipsformer_cswin_t]
        [--baseline swin_tiny_patch4_window7_224] [--device cpu|cuda] [--batch 16] [--train-batch 8]
        [--amp no|bf16|fp16] [--channels-last] [--compile] [--eager-baseline] [--reps 5] [--grad-checkpointing]
        [--json out.json] [--profile 15]
    python benchmarks/throughput.py --parts [--train-batch 8] [--reps 5]     # where a training step's blocks spend
    python benchmarks/throughput.py --matrix [--threads 1 2] [--train-batches 8 32] [--compiled none 0.8]
        [--compiled-batches 8] [--reps 3] [--iters 1] [--json out.json]

``--matrix`` is the training benchmark of docs/speed.md: for every thread count and batch, eager training and inference
of the models and the baseline interleaved, then, with ``--compiled``, the same compiled (``compile_model``, train.py's
path), one process per compiler setting (``none``: the compiler's default; a number: ``compile_memory_budget``).
Each row: img/s, the ratio to the baseline's and the per-FLOP ratio (ratio x GFLOPs / baseline GFLOPs), and the
bytes autograd saves for backward in one training step (every device; on CUDA also the peak allocated).

Models and baseline run interleaved (model, baseline, model, ...) for ``--reps`` rounds; each figure is the median.
Printed: img/s, the ratio to the baseline, the achieved GFLOP/s (img/s x fvcore GFLOPs per image) and its ratio
to the baseline's (speed per FLOP), and memory. Memory is
``torch.cuda.max_memory_allocated`` on CUDA; on CPU it is the bytes of the tensors autograd saves for the backward
pass during a training step (the activation memory, which is what gradient checkpointing trades for compute).
"""
import argparse
import json
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import timm
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import lipsformer  # noqa: E402,F401  (registers the models)
from lipsformer.engine.speed import COMPILE_MODES, compile_model, prepare_model  # noqa: E402
from lipsformer.flops import count_flops  # noqa: E402


# what the timings read: wall time, or (--clock cpu) the process's CPU time, which other processes on a shared
# machine disturb less (one thread: the same as wall time on an idle machine; more: the threads' sum)
CLOCK = [time.perf_counter]


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return float("nan")


def autocast(device: str, amp: str):
    if amp == "no":
        return nullcontext()
    return torch.autocast(device, dtype=torch.bfloat16 if amp == "bf16" else torch.float16)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def infer_time(model, x, device, amp, iters: int) -> float:
    with torch.no_grad(), autocast(device, amp):
        model(x)  # warm-up (and compilation)
        sync(device)
        start = CLOCK[0]()
        for _ in range(iters):
            model(x)
        sync(device)
    return (CLOCK[0]() - start) / iters


def train_time(model, x, device, amp, iters: int) -> float:
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    target = torch.zeros(x.shape[0], dtype=torch.long, device=device)

    def step():
        with autocast(device, amp):
            loss = torch.nn.functional.cross_entropy(model(x), target)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    sync(device)
    start = CLOCK[0]()
    for _ in range(iters):
        step()
    sync(device)
    return (CLOCK[0]() - start) / iters


# operator families of a training step, for the profile's summary (first match; the rest is "other")
OP_FAMILIES = (
    ("matrix products", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")),
    ("attention (softmax, fused SDPA)", ("softmax", "scaled_dot_product")),
    ("convolutions", ("convolution",)),
    ("GELU", ("gelu",)),
    ("LayerNorm", ("layer_norm",)),
    ("copies (copy_, cat, clone, index)", ("aten::copy_", "aten::cat", "aten::clone", "aten::index", "aten::roll",
                                          "aten::stack", "aten::constant_pad_nd")),
    ("elementwise and reductions", ("aten::mul", "aten::add", "aten::sub", "aten::div", "aten::addcmul", "aten::sum",
                                    "aten::mean", "aten::pow", "aten::rsqrt", "aten::neg", "aten::where",
                                    "aten::fill_", "aten::bernoulli_", "aten::all", "aten::isneginf")),
)


def profile_train_step(model, x, device, amp, top: int) -> tuple:
    """The ``top`` operators of one training step by their own time (where a model spends it), and the own time
    (ms) of each operator family (:data:`OP_FAMILIES`)."""
    from torch.profiler import ProfilerActivity, profile
    target = torch.zeros(x.shape[0], dtype=torch.long, device=device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        with autocast(device, amp):
            loss = torch.nn.functional.cross_entropy(model(x), target)
        loss.backward()
        sync(device)
    model.zero_grad(set_to_none=True)
    key = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    families = dict.fromkeys([f for f, _ in OP_FAMILIES] + ["other"], 0.0)
    for event in prof.key_averages():
        if event.key.startswith("aten::"):
            family = next((f for f, keys in OP_FAMILIES if any(k in event.key for k in keys)), "other")
            families[family] += getattr(event, key) / 1e3
    return prof.key_averages().table(sort_by=key, row_limit=top), families


def block_parts(model, x) -> list:
    """``(block, parts, input)`` for every block: ``parts`` is ``[(name, fn)]`` in the block's order, LipsFormer's
    conv blocks and its attention and MLP residuals (each with the norm after it), or timm Swin's attention and MLP
    residuals (each with the norm before it), so that chained they give the block's output; ``input`` is the
    block's input in a forward pass of ``x``. Every block is listed (timm's alternate shifted windows)."""
    from timm.models.swin_transformer import SwinTransformer, SwinTransformerBlock
    from lipsformer.layers import LipsBlock
    from lipsformer.models._base import LipsFormerBase
    if isinstance(model, LipsFormerBase):
        blocks = [b for s in model.stages for b in s.blocks]
    elif isinstance(model, SwinTransformer):
        blocks = [b for s in model.layers for b in s.blocks]
    else:
        raise SystemExit(f"--parts knows LipsFormer and timm's Swin blocks, not {type(model).__name__}")
    inputs = {}

    def keep(module, args):
        inputs[module] = args[0].detach()

    hooks = [b.register_forward_pre_hook(keep) for b in blocks]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    out = []
    for b in blocks:
        if isinstance(b, LipsBlock):
            parts = [("convs", b.convs), ("attention", lambda t, b=b: b._residual(b.res_attn, b.attn, b.norm1, t)),
                     ("mlp", lambda t, b=b: b._residual(b.res_mlp, b.mlp, b.norm2, t))]
        elif isinstance(b, SwinTransformerBlock):
            parts = [("attention", lambda t, b=b: t + b.drop_path1(b._attn(b.norm1(t)))),
                     ("mlp", lambda t, b=b: t + b.drop_path2(b.mlp(b.norm2(t))))]
        else:
            raise SystemExit(f"--parts knows LipsFormer and timm's Swin blocks, not {type(b).__name__}")
        out.append((b, parts, inputs[b]))
    return out


def time_parts(models, x, reps: int) -> dict:
    """Median seconds of forward + backward (gradient of ones) of every block part of each model
    (:func:`block_parts`), interleaved over ``reps`` rounds after a warm-up round, summed over the blocks:
    ``{model: {part: ms per training step}}``."""
    jobs = [(name, model, part, fn, inp) for name, model in models.items()
            for _, parts, inp in block_parts(model.train(), x) for part, fn in parts]
    times = [[] for _ in jobs]
    for _ in range(reps + 1):
        for j, (_, model, _, fn, inp) in enumerate(jobs):
            model.zero_grad(set_to_none=True)
            t = inp.clone().requires_grad_()
            sync(t.device.type)
            start = CLOCK[0]()
            out = fn(t)
            out.backward(torch.ones_like(out))
            sync(t.device.type)
            times[j].append(CLOCK[0]() - start)
    result = {name: {} for name in models}
    for (name, _, part, _, _), t in zip(jobs, times):
        result[name][part] = result[name].get(part, 0.0) + statistics.median(t[1:]) * 1e3
    return result


def print_against_baseline(label: str, rows: list, table: dict, baseline: str, widths=(12, 28)) -> None:
    """``table`` ({model: {row: ms}}) as one line per row of ``rows`` and a total, a column per model, each model's
    difference to ``baseline`` in brackets (a row a model lacks counts 0)."""
    print(f"{label:<{widths[0]}}" + "".join(f" {n[:widths[1]]:>{widths[1]}}" for n in table))
    for row in [*rows, "total"]:
        cells = []
        for name, values in table.items():
            value, ref = (sum(v.values()) if row == "total" else v.get(row, 0.0) for v in (values, table[baseline]))
            cells.append(f"{value:>9.0f}" + (f" ({value - ref:+7.0f})" if name != baseline else " " * 10))
        print(f"{row:<{widths[0]}}" + "".join(f" {c:>{widths[1]}}" for c in cells))


def print_parts(parts: dict, baseline: str, batch: int) -> None:
    print(f"blocks by part, forward + backward (every block), ms per training step at batch {batch}, "
          f"{torch.get_num_threads()} threads; each model's difference to {baseline} in brackets")
    print_against_baseline("part", ["convs", "attention", "mlp"], parts, baseline)


def train_memory(model, x, device, amp) -> float:
    """MB: peak allocated on CUDA; elsewhere the bytes autograd saves for backward in one training step
    (:func:`saved_bytes`)."""
    if device != "cuda":
        return saved_bytes(model, x, device, amp) / 2 ** 20
    target = torch.zeros(x.shape[0], dtype=torch.long, device=device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    with autocast(device, amp):
        loss = torch.nn.functional.cross_entropy(model(x), target)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return torch.cuda.max_memory_allocated() / 2 ** 20


def saved_bytes(model, x, device, amp) -> int:
    """Bytes of the tensors autograd saves for backward in one training step (each storage once, parameters left
    out): the activation memory, on any device. They are all saved by the forward pass, which is all this runs."""
    target = torch.zeros(x.shape[0], dtype=torch.long, device=device)
    seen, total = set(), 0

    def pack(t):
        nonlocal total
        key = (t.untyped_storage().data_ptr(), t.device, t.dtype)
        if key not in seen and not isinstance(t, torch.nn.Parameter):
            seen.add(key)
            total += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast(device, amp):
        torch.nn.functional.cross_entropy(model(x), target)
    return total


TARGETS = dict(train_ratio=0.9, train_per_flop=1.0, saved_ratio=1.1, infer_per_flop=1.0)  # docs/speed.md's targets


def build(names, args) -> tuple:
    """Each model on the device (baseline first), and its fvcore GFLOPs per image (counted on the CPU)."""
    models, gflops = {}, {}
    for name in names:
        if name.startswith("released:"):
            from compare_released import build_released
            model = build_released(args.released, name.split(":", 1)[1])
        else:
            model = timm.create_model(name, img_size=args.img_size)
        gflops[name] = count_flops(model, (3, args.img_size, args.img_size)) / 1e9
        models[name] = prepare_model(model.to(args.device), channels_last=args.channels_last)
    return models, gflops


def matrix_rows(models, gflops, args, mode: str) -> list:
    """Interleaved rounds (every model at one thread count and batch, inference then a training step, each after a
    warm-up call) for each thread count and batch, then the bytes saved in one step; rows with ratios to the first
    model's."""
    device, rows, saved = args.device, [], {}
    threads = args.threads if device == "cpu" else [torch.get_num_threads()]
    fmt = dict(memory_format=torch.channels_last) if args.channels_last else {}
    for n_threads in threads:
        torch.set_num_threads(n_threads)
        for batch in args.train_batches:
            x = torch.randn(batch, 3, args.img_size, args.img_size, device=device).contiguous(**fmt)
            t = {name: dict(infer=[], train=[]) for name in models}
            for _ in range(args.reps):  # each timing warms up (and compiles) first
                for name, model in models.items():
                    t[name]["infer"].append(infer_time(model.eval(), x, device, args.amp, args.iters))
                    t[name]["train"].append(train_time(model.train(), x, device, args.amp, args.iters))
            group = []
            for name, model in models.items():
                infer, train = (batch / statistics.median(t[name][k]) for k in ("infer", "train"))
                if (name, batch) not in saved:  # the same at every thread count
                    saved[name, batch] = saved_bytes(model.train(), x, device, args.amp) / 2 ** 20
                row = dict(mode=mode, threads=n_threads, batch=batch, model=name, gflops=gflops[name],
                           infer_img_s=infer, train_img_s=train, saved_mb=saved[name, batch])
                if device == "cuda":
                    row["train_memory_mb"] = train_memory(model, x, device, args.amp)  # peak allocated
                base = group[0] if group else row
                flops = gflops[name] / base["gflops"]
                row.update(infer_ratio=infer / base["infer_img_s"], train_ratio=train / base["train_img_s"],
                           saved_ratio=row["saved_mb"] / base["saved_mb"])
                row.update(infer_per_flop=row["infer_ratio"] * flops, train_per_flop=row["train_ratio"] * flops)
                row["missed"] = [k for k, v in TARGETS.items()
                                 if group and (row[k] > v if k == "saved_ratio" else row[k] < v)]
                group.append(row)
                print(f"{mode:<14} {n_threads:>3} {batch:>5}  " + _matrix_line(row), flush=True)
            rows += group
    return rows


def _matrix_line(r: dict) -> str:
    return (f"{r['model']:<30} {r['gflops']:>6.2f} {r['infer_img_s']:>8.1f} {r['infer_ratio']:>6.2f} "
            f"{r['infer_per_flop']:>6.2f} {r['train_img_s']:>8.2f} {r['train_ratio']:>6.2f} "
            f"{r['train_per_flop']:>6.2f} "
            f"{r['saved_mb']:>8.0f} {r['saved_ratio']:>6.2f}  {' '.join(r['missed']) or '-'}")


MATRIX_HEADER = (f"{'mode':<14} {'thr':>3} {'batch':>5}  {'model':<30} {'GFLOPs':>6} {'inf/s':>8} {'ratio':>6} "
                 f"{'/FLOP':>6} {'train/s':>8} {'ratio':>6} {'/FLOP':>6} {'saved MB':>8} {'ratio':>6}  missed targets")


def run_matrix(args, names) -> list:
    """Eager rows here, compiled rows from one process per compiler setting (dynamo would share one compiled graph
    among same-shaped instances of a module class, so two settings cannot share a process)."""
    print(f"training benchmark: {args.device}, amp={args.amp}, {args.img_size} px, channels_last={args.channels_last}, "
          f"{args.reps} interleaved rounds x {args.iters} iteration(s), each timing after a warm-up call, medians of "
          f"{'wall' if args.clock == 'wall' else 'CPU'} time; "
          f"targets: train ratio >= {TARGETS['train_ratio']}, train /FLOP >= {TARGETS['train_per_flop']}, saved "
          f"ratio <= {TARGETS['saved_ratio']}, inference /FLOP >= {TARGETS['infer_per_flop']}")
    print(MATRIX_HEADER, flush=True)
    models, gflops = build(names, args)
    rows = matrix_rows(models, gflops, args, "eager")
    del models
    for budget in args.compiled or ():
        cmd = [sys.executable, __file__, "--matrix-compiled", budget, "--models", *args.models, "--baseline",
               args.baseline, "--device", args.device, "--amp", args.amp, "--img-size", str(args.img_size),
               "--reps", str(args.reps), "--iters", str(args.iters), "--clock", args.clock,
               "--threads", *map(str, args.threads),
               "--train-batches", *map(str, args.compiled_batches or args.train_batches)] \
            + (["--channels-last"] if args.channels_last else []) \
            + (["--released", args.released] if args.released else [])
        result = None
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) as proc:
            for line in proc.stdout:  # its rows as they come, then them all as one RESULT line
                if line.startswith("RESULT "):
                    result = json.loads(line[len("RESULT "):])
                else:
                    print(line, end="", flush=True)
        if proc.returncode != 0 or result is None:
            print(f"compiled ({budget}): failed with exit code {proc.returncode}; the rows before it stand",
                  file=sys.stderr)
            continue
        rows += result
    return rows


def compiled_matrix(args, names) -> None:
    """One compiler setting (``--matrix-compiled``), in its own process: rows printed as one RESULT line."""
    budget = None if args.matrix_compiled == "none" else float(args.matrix_compiled)
    models, gflops = build(names, args)
    for model in models.values():
        compile_model(model, "default", budget)
    rows = matrix_rows(models, gflops, args, f"compiled {args.matrix_compiled}")
    print("RESULT " + json.dumps(rows))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["lipsformer_swin_t", "lipsformer_cswin_t"])
    parser.add_argument("--baseline", default="swin_tiny_patch4_window7_224")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=16, help="inference batch")
    parser.add_argument("--train-batch", type=int, default=8)
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--amp", default="no", choices=("no", "bf16", "fp16"))
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument("--compile", action="store_true", help="torch.compile every model")
    parser.add_argument("--eager-baseline", action="store_true",
                        help="with --compile, leave the baseline eager (the CPU target: a compiled LipsFormer "
                             "training step against swin_tiny eager)")
    parser.add_argument("--compile-mode", default="default", choices=COMPILE_MODES)
    parser.add_argument("--memory-budget", type=float, metavar="F",
                        help="with --compile: the partitioner's activation memory budget in (0, 1] (train.py's "
                             "compile_memory_budget)")
    parser.add_argument("--grad-checkpointing", action="store_true", help="for the LipsFormer models' training step")
    parser.add_argument("--reps", type=int, help="interleaved rounds (default 5; --matrix: 3)")
    parser.add_argument("--iters", type=int, help="timed iterations per round (default 2; --matrix: 1)")
    parser.add_argument("--matrix", action="store_true", help="the training benchmark of docs/speed.md (see the top)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="--matrix: CPU thread counts")
    parser.add_argument("--train-batches", type=int, nargs="+", default=[8, 32], help="--matrix: batches")
    parser.add_argument("--compiled-batches", type=int, nargs="+",
                        help="--matrix: the batches of the compiled runs (default: --train-batches)")
    parser.add_argument("--compiled", nargs="*", metavar="BUDGET",
                        help="--matrix: also compiled, once per setting: none (the compiler's default) or a "
                             "compile_memory_budget in (0, 1]")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="time by the wall clock or by the process's CPU time (a shared machine; CPU only)")
    parser.add_argument("--matrix-compiled", help=argparse.SUPPRESS)
    parser.add_argument("--released", metavar="PATH",
                        help="a checkout of IDEA-Research/LipsFormer (see compare_released.py): also time the released "
                             "implementation of each model it has, named released:MODEL")
    parser.add_argument("--no-train", action="store_true")
    parser.add_argument("--json")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also print the N costliest operators of one training step of each model")
    parser.add_argument("--parts", action="store_true",
                        help="only time each model's block parts (conv blocks, attention, MLP), forward + backward, "
                             "at --train-batch, and print them against the baseline's")
    args = parser.parse_args(argv)
    if args.clock == "cpu" and args.device != "cpu":
        parser.error("--clock cpu times CPU work: use it with --device cpu")
    if args.parts and (args.matrix or args.matrix_compiled is not None or args.compile or args.released
                       or args.amp != "no" or args.channels_last or args.grad_checkpointing or args.profile):
        parser.error("--parts times the eager fp32 blocks of timm-registered models: use it without --matrix, "
                     "--compile, --released, --amp, --channels-last, --grad-checkpointing and --profile")
    CLOCK[0] = time.process_time if args.clock == "cpu" else time.perf_counter
    matrix = args.matrix or args.matrix_compiled is not None
    args.reps = args.reps or (3 if matrix else 5)
    args.iters = args.iters or (1 if matrix else 2)
    for budget in args.compiled or ():
        if budget != "none" and not 0.0 < _float(budget) <= 1.0:
            parser.error(f"--compiled takes none or budgets in (0, 1], got {budget}")
    torch.manual_seed(0)
    device = args.device
    names = [args.baseline] + [m for m in args.models if m != args.baseline]
    if args.released:
        from compare_released import RELEASED, build_released
        names += [f"released:{m}" for m in args.models if m in RELEASED]
    if args.parts:
        models = {name: timm.create_model(name, img_size=args.img_size).to(device) for name in names}
        x = torch.randn(args.train_batch, 3, args.img_size, args.img_size, device=device)
        parts = time_parts(models, x, args.reps)
        print_parts(parts, args.baseline, args.train_batch)
        if args.json:
            Path(args.json).write_text(json.dumps(dict(setup=f"--parts, batch {args.train_batch}", parts=parts)))
        return
    if matrix:
        if args.matrix_compiled is not None:
            return compiled_matrix(args, names)
        rows = run_matrix(args, names)
        if args.json:
            setup = f"training benchmark (--matrix), {device}, {args.clock} clock, amp={args.amp}"
            Path(args.json).write_text(json.dumps(dict(setup=setup, rows=rows), indent=2))
        return
    models, gflops = {}, {}
    for name in names:
        if name.startswith("released:"):
            model = build_released(args.released, name.split(":", 1)[1]).to(device)
        else:
            model = timm.create_model(name, img_size=args.img_size)
        gflops[name] = count_flops(model.cpu(), (3, args.img_size, args.img_size)) / 1e9  # fvcore's input: CPU
        model = model.to(device)
        model = prepare_model(model, channels_last=args.channels_last,
                              grad_checkpointing=args.grad_checkpointing and name != args.baseline)
        # static shapes, as in training with a fixed batch: each (batch, grad mode) pair gets its own graph, where
        # automatic dynamic shapes would turn the batch symbolic once inference (16) and training (8) both ran
        compiled = args.compile and not (args.eager_baseline and name == args.baseline)
        models[name] = compile_model(model, args.compile_mode, args.memory_budget) if compiled else model
    fmt = dict(memory_format=torch.channels_last) if args.channels_last else {}
    x_inf = torch.randn(args.batch, 3, args.img_size, args.img_size, device=device).contiguous(**fmt)
    x_train = torch.randn(args.train_batch, 3, args.img_size, args.img_size, device=device).contiguous(**fmt)
    times = {n: dict(infer=[], train=[]) for n in names}
    for _ in range(args.reps):  # interleaved: slow drifts of the machine hit every model alike
        for name, model in models.items():
            model.eval()
            times[name]["infer"].append(infer_time(model, x_inf, device, args.amp, args.iters))
            if not args.no_train:
                model.train()
                times[name]["train"].append(train_time(model, x_train, device, args.amp, args.iters))
    rows = []
    base = times[args.baseline]
    for name in names:
        t = times[name]
        infer = args.batch / statistics.median(t["infer"])
        row = dict(model=name, gflops=gflops[name], infer_img_s=infer,
                   infer_ratio=statistics.median(base["infer"]) / statistics.median(t["infer"]),
                   infer_gflop_s=infer * gflops[name])
        if not args.no_train:
            model = models[name]
            model.train()
            row.update(train_img_s=args.train_batch / statistics.median(t["train"]),
                       train_ratio=statistics.median(base["train"]) / statistics.median(t["train"]),
                       train_memory_mb=train_memory(model, x_inf, device, args.amp))
        rows.append(row)
    base_row = rows[0]
    desc = (f"{device}, {torch.get_num_threads()} threads, amp={args.amp}, batch {args.batch} (train step "
            f"{args.train_batch}; training memory at {args.batch}), "
            f"{args.img_size}px, channels_last={args.channels_last}, compile={args.compile}"
            + (f" ({args.compile_mode}, memory budget {args.memory_budget}"
               + (", baseline eager" if args.eager_baseline else "") + ")" if args.compile else "") + ", "
            f"grad_checkpointing={args.grad_checkpointing}, {args.reps} reps x {args.iters} iters, medians")
    print(desc)
    print(f"{'model':<30} {'GFLOPs':>7} {'img/s':>8} {'ratio':>6} {'GFLOP/s':>8} {'per-FLOP':>9}"
          + ("" if args.no_train else f" {'train img/s':>11} {'ratio':>6} {'mem MB':>8} {'mem ratio':>9}"))
    for r in rows:
        line = (f"{r['model']:<30} {r['gflops']:>7.2f} {r['infer_img_s']:>8.1f} {r['infer_ratio']:>6.2f} "
                f"{r['infer_gflop_s']:>8.1f} "
                f"{r['infer_gflop_s'] / base_row['infer_gflop_s']:>9.2f}")
        if not args.no_train:
            line += (f" {r['train_img_s']:>11.1f} {r['train_ratio']:>6.2f} {r['train_memory_mb']:>8.0f} "
                     f"{r['train_memory_mb'] / base_row['train_memory_mb']:>9.2f}")
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(setup=desc, rows=rows), indent=2))
    families = {}
    for name, model in models.items() if args.profile else ():
        print(f"\n{name}: one training step, batch {args.train_batch}")
        table, families[name] = profile_train_step(model.train(), x_train, device, args.amp, args.profile)
        print(table)
    if families:  # where each model's step differs from the baseline's, by operator family
        print(f"\nown time (ms) by operator family, one training step, batch {args.train_batch}; each model's "
              f"difference to {args.baseline} in brackets")
        print_against_baseline("family", list(families[args.baseline]), families, args.baseline, widths=(36, 24))


if __name__ == "__main__":
    main()
