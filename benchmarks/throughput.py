"""Inference and training-step throughput and memory of LipsFormer models against a timm baseline, same process.

    python benchmarks/throughput.py [--models lipsformer_swin_t lipsformer_cswin_t] [--baseline swin_tiny_patch4_window7_224]
        [--device cpu|cuda] [--batch 16] [--train-batch 8] [--amp no|bf16|fp16] [--channels-last] [--compile]
        [--eager-baseline] [--reps 5] [--grad-checkpointing] [--json out.json] [--profile 15]

Models and baseline run interleaved (model, baseline, model, ...) for ``--reps`` rounds; each figure is the median.
Printed: img/s, the ratio to the baseline, the achieved GFLOP/s (img/s x fvcore GFLOPs per image) and its ratio
to the baseline's (speed per FLOP), and memory. Memory is
``torch.cuda.max_memory_allocated`` on CUDA; on CPU it is the bytes of the tensors autograd saves for the backward
pass during a training step (the activation memory, which is what gradient checkpointing trades for compute).
"""
import argparse
import json
import statistics
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
        start = time.perf_counter()
        for _ in range(iters):
            model(x)
        sync(device)
    return (time.perf_counter() - start) / iters


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
    start = time.perf_counter()
    for _ in range(iters):
        step()
    sync(device)
    return (time.perf_counter() - start) / iters


def profile_train_step(model, x, device, amp, top: int) -> str:
    """The ``top`` operators of one training step by their own time (where a model spends it)."""
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
    return prof.key_averages().table(sort_by=key, row_limit=top)


def train_memory(model, x, device, amp) -> float:
    """MB: peak allocated on CUDA; on CPU the bytes autograd saves for backward in one training step."""
    target = torch.zeros(x.shape[0], dtype=torch.long, device=device)
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        with autocast(device, amp):
            loss = torch.nn.functional.cross_entropy(model(x), target)
        loss.backward()
        model.zero_grad(set_to_none=True)
        return torch.cuda.max_memory_allocated() / 2 ** 20
    seen, total = set(), 0

    def pack(t):
        nonlocal total
        key = (t.untyped_storage().data_ptr(), t.dtype)
        if key not in seen and not isinstance(t, torch.nn.Parameter):
            seen.add(key)
            total += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast(device, amp):
        loss = torch.nn.functional.cross_entropy(model(x), target)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return total / 2 ** 20


def main() -> None:
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
                        help="with --compile, leave the baseline eager (issue 13's CPU target: a compiled LipsFormer "
                             "training step against swin_tiny eager)")
    parser.add_argument("--compile-mode", default="default", choices=COMPILE_MODES)
    parser.add_argument("--memory-budget", type=float, metavar="F",
                        help="with --compile: the partitioner's activation memory budget in (0, 1] (train.py's "
                             "compile_memory_budget)")
    parser.add_argument("--grad-checkpointing", action="store_true", help="for the LipsFormer models' training step")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--iters", type=int, default=2, help="timed iterations per repetition")
    parser.add_argument("--released", metavar="PATH",
                        help="a checkout of IDEA-Research/LipsFormer (see compare_released.py): also time the released "
                             "implementation of each model it has, named released:MODEL")
    parser.add_argument("--no-train", action="store_true")
    parser.add_argument("--json")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also print the N costliest operators of one training step of each model")
    args = parser.parse_args()
    torch.manual_seed(0)
    device = args.device
    names = [args.baseline] + [m for m in args.models if m != args.baseline]
    if args.released:
        from compare_released import RELEASED, build_released
        names += [f"released:{m}" for m in args.models if m in RELEASED]
    models, gflops = {}, {}
    for name in names:
        if name.startswith("released:"):
            model = build_released(args.released, name.split(":", 1)[1]).to(device)
        else:
            model = timm.create_model(name, img_size=args.img_size).to(device)
        gflops[name] = count_flops(model, (3, args.img_size, args.img_size)) / 1e9
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
    for name, model in models.items() if args.profile else ():
        print(f"\n{name}: one training step, batch {args.train_batch}")
        print(profile_train_step(model.train(), x_train, device, args.amp, args.profile))


if __name__ == "__main__":
    main()
