"""A tool users run (docs/speed.md, docs/gpu.md): what one training step and one inference batch move, counted op by
op on the CPU, against timm's Swin, with a roofline estimate for a named GPU.

    python benchmarks/step_cost.py [--models lipsformer_swin_t lipsformer_cswin_t]
        [--baseline swin_tiny_patch4_window7_224] [--img-size 224] [--gpu h100|a100]
        [--batches 64 256] [--compiled] [--json out.json] [--top 12]

For each model and the baseline, per training step (forward, cross-entropy, backward; no optimizer) and per
inference batch (forward under ``no_grad``), eager:

- **ops**: the kernels the step launches: every op the dispatcher runs below autograd, except views and allocations
  (a custom ``lipsformer::`` op is the kernels its CUDA implementation launches, ``LAUNCHES``;
  ``scaled_dot_product_attention`` is one op forward and one backward, plus the reduction of a broadcast mask's
  gradient, as CUDA's fused kernels run it; a convolution's backward one kernel for each gradient it computes);
- **bytes**: what the memory-bound ops read and write per image (every op but matrix products, dense convolutions
  and attention), each input counted by the elements it addresses, each output by its size;
- **FLOPs** per image (``torch.utils.flop_counter``'s formulas; a multiply-add is two);
- an **estimate** of img/s on the named GPU at each batch of ``--batches``: each op takes the longest of a launch,
  its FLOPs at the card's matrix rate and its bytes at the card's bandwidth (a step is bound by bytes at large
  batches and by launches at small ones).

The step runs on the meta device: shapes, strides and dtypes without data, in seconds, and every layer takes its
non-CPU route (no path written for CPU speed); a convolution's output keeps its input's channels-last layout, as
cuDNN's does (meta's own returns it contiguous). fp32, as the targets in docs/speed.md are stated; each op's bytes
and FLOPs are counted at two batch sizes and extended linearly to the batches estimated, so that what does not grow
with the batch (weights, their gradients) is not multiplied. With ``--compiled``, the training step and the inference
batch are also compiled (:func:`lipsformer.engine.speed.compile_model`) and run on the CPU, and the kernels inductor
generates are counted beside the library calls it makes, with the compile time. Deterministic: the same counts on
every run and machine (the estimate is arithmetic on them).
"""
import argparse
import sys
import time
from collections import Counter
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import timm
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import lipsformer  # noqa: E402,F401  (registers the models)
from lipsformer.layers.fused import LAUNCHES  # noqa: E402

aten = torch.ops.aten


@dataclass(frozen=True)
class GPU:
    """A card's rates as the estimate uses them: achieved (not peak) bandwidth and bf16 matrix rate, and the host's
    cost of one eager op (Python, dispatch, autograd and the launch: a GPU idles when its kernels are shorter).
    The achieved rates are those that make the estimate meet swin_tiny's measured bf16 img/s on one H100
    (docs/gpu.md) at batches 64 and 256, fitted to fp32 counts (so the bandwidth is an effective one); the H200's
    and A100's scale them by their datasheets."""
    name: str
    bandwidth: float  # bytes/s achieved by memory-bound kernels
    matmul: float  # FLOP/s achieved by matrix products and attention, bf16
    launch: float  # s per eager op
    peak_bandwidth: float
    peak_matmul: float


GPUS = {
    "h100": GPU("NVIDIA H100 80GB HBM3", bandwidth=2.2e12, matmul=400e12, launch=20e-6, peak_bandwidth=3.35e12,
                peak_matmul=989e12),
    "h200": GPU("NVIDIA H200", bandwidth=2.2e12 * 4.8 / 3.35, matmul=400e12, launch=20e-6, peak_bandwidth=4.8e12,
                peak_matmul=989e12),
    "a100": GPU("NVIDIA A100-SXM4-40GB", bandwidth=1.02e12, matmul=126e12, launch=20e-6, peak_bandwidth=1.555e12,
                peak_matmul=312e12),
}

# ops that move no data on a GPU: views, allocations, metadata
FREE = {aten._unsafe_view.default, aten.detach.default, aten.alias.default, aten.lift_fresh.default,
        aten.empty.memory_format, aten.empty_like.default, aten.new_empty.default, aten.new_empty_strided.default,
        aten.empty_strided.default, aten._reshape_alias.default, aten.set_.source_Storage_storage_offset}
MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}
CONVOLUTIONS = {aten.convolution.default, aten.convolution_backward.default}
HOST_READS = {aten._local_scalar_dense.default, aten.item.default}


def addressed_bytes(t: torch.Tensor) -> int:
    """The bytes a kernel reads of ``t``: the elements its strides address (a broadcast dimension, stride 0, once)."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n * t.element_size()


def moved(inputs, outputs) -> int:
    """Bytes a kernel reads (each input by the elements it addresses) and writes (each output whole)."""
    return sum(addressed_bytes(t) for t in inputs) + sum(t.numel() * t.element_size() for t in outputs)


def _tensors(tree):
    leaves, _ = torch.utils._pytree.tree_flatten(tree)
    return [t for t in leaves if isinstance(t, torch.Tensor)]


def _channels_last(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(
        memory_format=torch.channels_last)


def cudnn_layout(func, args, out):
    """A meta convolution's outputs in the layout cuDNN gives them: channels-last when the input (or, backward, the
    output gradient) or the weight is, as ``cudnn_conv_suggest_memory_format`` decides; meta's are contiguous."""
    if func is aten.convolution.default:
        if out.device.type == "meta" and (_channels_last(args[0]) or _channels_last(args[1])):
            return torch.empty(out.shape, dtype=out.dtype, device="meta", memory_format=torch.channels_last)
        return out
    if out[0] is not None and out[0].device.type == "meta" and any(_channels_last(t) for t in args[:3]):
        grad_input = torch.empty(out[0].shape, dtype=out[0].dtype, device="meta", memory_format=torch.channels_last)
        return (grad_input, *out[1:])
    return out


def _groups(func, args) -> int:
    return args[8] if func is aten.convolution.default else args[9]


@dataclass
class Op:
    name: str
    bytes: int  # read and written
    flops: int  # of a compute-bound op (matrix products, dense convolutions, attention)
    compute: bool


@dataclass
class Tally:
    """The ops of one counted call, in order."""
    ops: list = field(default_factory=list)
    host_reads: int = 0

    def add(self, name: str, bytes_: int, flops: int = 0) -> None:
        self.ops.append(Op(name, bytes_, flops, flops > 0))


class Counting(TorchDispatchMode):
    """Counts each op the dispatcher runs below autograd (:class:`Tally`); ``paused`` stops counting while an op
    counted as one (fused attention) runs its CPU composition."""

    def __init__(self, tally: Tally):
        super().__init__()
        self.tally = tally
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in CONVOLUTIONS:
            out = cudnn_layout(func, args, out)
        if self.paused or func in FREE or func.is_view:
            return out
        if func in HOST_READS:
            self.tally.host_reads += 1
            return out
        packet = func._overloadpacket
        compute = func in MATMULS or (func in CONVOLUTIONS and _groups(func, args) == 1)
        flops = int(flop_registry[packet](*args, **kwargs, out_val=out)) if compute else 0
        self.tally.add(str(packet), moved(_tensors((args, kwargs)), _tensors(out)), flops)
        if func.namespace == "lipsformer":  # a fused op's further launches (a reduction of its partial sums)
            for _ in range(LAUNCHES.get(packet.__name__.split(".")[-1], 1) - 1):
                self.tally.add(f"{packet}.sum", 0)
        if func is aten.convolution_backward.default:  # cuDNN: one kernel for each gradient asked for
            for _ in range(sum(args[10]) - 1):
                self.tally.add(f"{packet}.more", 0)
        return out


class _Attention(torch.autograd.Function):
    """``scaled_dot_product_attention`` counted as CUDA's fused kernels run it: one op forward (q, k, v and the mask
    read, the output written) and one backward (q, k, v, the output and its gradient read, their gradients and the
    mask's, at the broadcast size, written), then the reduction of the mask's gradient to its own shape; FLOPs those
    of the attention's matrix products (backward: two and a half times the forward's, as flash attention's). The
    values and gradients are the CPU's, computed uncounted."""

    @staticmethod
    def forward(ctx, counting, q, k, v, mask, kwargs):
        ctx.counting, ctx.kwargs = counting, kwargs
        counting.paused += 1
        try:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kwargs)
        finally:
            counting.paused -= 1
        b, h, n, d = q.shape
        ctx.flops = 4 * b * h * n * k.shape[-2] * d
        counting.tally.add("attention", moved([q, k, v] + ([mask] if mask is not None else []), [out]), ctx.flops)
        ctx.save_for_backward(q, k, v, mask, out)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, mask, out = ctx.saved_tensors
        counting = ctx.counting
        counting.paused += 1
        try:
            with torch.enable_grad():
                leaves = [t.detach().requires_grad_(t.requires_grad) for t in (q, k, v, mask) if t is not None]
                mask_ = leaves[3] if mask is not None else None
                out = F.scaled_dot_product_attention(*leaves[:3], attn_mask=mask_, **ctx.kwargs)
                wanted = [t for t in leaves if t.requires_grad]
                grads = iter(torch.autograd.grad(out, wanted, grad))
                got = [next(grads) if t.requires_grad else None for t in leaves]
        finally:
            counting.paused -= 1
        read = [q, k, v, out, grad] + ([mask] if mask is not None else [])
        full = q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] * grad.element_size()  # the mask's, broadcast
        mask_grad = full if mask is not None and mask.requires_grad else 0
        counting.tally.add("attention_backward", moved(read, [q, k, v]) + mask_grad, int(2.5 * ctx.flops))
        if mask_grad:
            counting.tally.add("attention_mask_grad_sum", full + mask.numel() * mask.element_size())
        return (None, *got, *([None] if mask is None else []), None)


class FusedAttention(TorchFunctionMode):
    """Routes ``F.scaled_dot_product_attention`` through :class:`_Attention` (as CUDA runs it: fused)."""

    def __init__(self, counting: Counting):
        super().__init__()
        self.counting = counting

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and not self.counting.paused:
            q, k, v, *rest = args
            mask = kwargs.pop("attn_mask", rest[0] if rest else None)
            if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, mask)):
                return _Attention.apply(self.counting, q, k, v, mask, kwargs)
            with self.counting_paused():
                out = func(q, k, v, attn_mask=mask, **kwargs)
            b, h, n, d = q.shape
            self.counting.tally.add("attention", moved([q, k, v] + ([mask] if mask is not None else []), [out]),
                                    4 * b * h * n * k.shape[-2] * d)
            return out
        return func(*args, **kwargs)

    def counting_paused(self):
        counting = self.counting

        class _Paused:
            def __enter__(self):
                counting.paused += 1

            def __exit__(self, *exc):
                counting.paused -= 1
        return _Paused()


def count(model: torch.nn.Module, batch: int, img_size: int, train: bool) -> Tally:
    """The ops of one training step (``train``) or inference batch of ``model`` (on the meta device) at ``batch``
    images."""
    x = torch.empty(batch, 3, img_size, img_size, device="meta")
    target = torch.zeros(batch, dtype=torch.long, device="meta")
    tally = Tally()
    model.train(train)
    model.zero_grad(set_to_none=True)
    counting = Counting(tally)
    with FusedAttention(counting), counting:
        if train:
            F.cross_entropy(model(x), target).backward()
        else:
            with torch.no_grad():
                model(x)
    return tally


@dataclass
class Cost:
    """A call's ops, each extended to any batch (bytes and FLOPs as ``a + b * batch``)."""
    ops: int
    host_reads: int
    per_op: list  # [(name, compute-bound, bytes a, bytes b, flops a, flops b)]: a + b * batch

    def bytes_per_image(self, batch: int) -> float:
        """Bytes the memory-bound ops move per image at ``batch`` (what does not grow with it shared out)."""
        return sum(ba + bb * batch for _, compute, ba, bb, _, _ in self.per_op if not compute) / batch

    def flops_per_image(self, batch: int) -> float:
        return sum(fa + fb * batch for _, _, _, _, fa, fb in self.per_op) / batch

    def estimate(self, gpu: GPU, batch: int) -> dict:
        """Seconds per call and img/s at ``batch`` on ``gpu``, and what bounds the ops (launch, bytes, FLOPs)."""
        total, bound = 0.0, Counter()
        for _, _, ba, bb, fa, fb in self.per_op:
            times = {"launch": gpu.launch, "bytes": (ba + bb * batch) / gpu.bandwidth,
                     "flops": (fa + fb * batch) / gpu.matmul}
            kind = max(times, key=times.get)
            total += times[kind]
            bound[kind] += times[kind]
        return dict(seconds=total, img_s=batch / total, bound_s={k: bound[k] for k in ("launch", "bytes", "flops")})


def measure(model: torch.nn.Module, img_size: int, train: bool, batches=(2, 4)) -> Cost:
    """Counts at two batch sizes (two: at one, some copies of the last stage become views); each op's bytes and
    FLOPs as a constant and a per-image part."""
    lo, hi = (count(model, b, img_size, train) for b in batches)
    if [o.name for o in lo.ops] != [o.name for o in hi.ops]:
        raise RuntimeError(f"{type(model).__name__}: the ops differ between batch {batches[0]} and {batches[1]}; "
                           f"the step cannot be extended to other batches")
    per_op = []
    for a, b in zip(lo.ops, hi.ops):
        slope_b = (b.bytes - a.bytes) / (batches[1] - batches[0])
        slope_f = (b.flops - a.flops) / (batches[1] - batches[0])
        per_op.append((a.name, a.compute, a.bytes - slope_b * batches[0], slope_b, a.flops - slope_f * batches[0],
                       slope_f))
    return Cost(ops=len(hi.ops), host_reads=hi.host_reads, per_op=per_op)


def top_ops(cost: Cost, batch: int, top: int) -> list:
    """The memory-bound ops that move the most bytes at ``batch``, grouped by name: (name, count, MB per image)."""
    by = Counter()
    counts = Counter()
    for name, compute, ba, bb, _, _ in cost.per_op:
        if compute:
            continue
        by[name] += (ba + bb * batch) / batch
        counts[name] += 1
    return [(name, counts[name], round(b / 1e6, 2)) for name, b in by.most_common(top)]


def compiled_kernels(model: torch.nn.Module, img_size: int, train: bool) -> dict:
    """A compiled step of ``model`` on the CPU (:func:`lipsformer.engine.speed.compile_model`, by region): the
    kernels inductor generated that one step launches (counted by the profiler: inductor's kernel profile names each
    call ``graph_N_cpp_fused_*``), the graphs compiled, and the seconds the first, compiling, step took."""
    from torch._dynamo.utils import counters
    from torch.profiler import profile

    from lipsformer.engine.speed import compile_model
    torch._dynamo.reset()
    counters.clear()
    x, target = torch.randn(2, 3, img_size, img_size), torch.zeros(2, dtype=torch.long)
    model.train(train)

    def step():
        with nullcontext() if train else torch.no_grad():
            out = model(x)
            if train:
                F.cross_entropy(out, target).backward()

    with torch._inductor.config.patch({"cpp.enable_kernel_profile": True, "fx_graph_cache": False}):
        compile_model(model)
        start = time.perf_counter()
        step()
        seconds = time.perf_counter() - start
        with profile() as prof:
            step()
    kernels = sum(1 for e in prof.events() if "cpp_fused" in e.name or e.name.startswith("triton_"))
    result = dict(generated=kernels, graphs=counters["stats"]["unique_graphs"], compile_s=round(seconds, 1))
    torch._dynamo.reset()
    return result


def run(names, baseline: str, img_size: int, gpu: GPU, batches, compiled: bool, top: int) -> list:
    rows = []
    for name in [baseline, *names]:
        kwargs = dict(img_size=img_size) if img_size != 224 else {}
        with torch.device("meta"):
            model = timm.create_model(name, **kwargs)
        for mode in ("train", "infer"):
            cost = measure(model, img_size, mode == "train")
            at = batches[-1]
            row = dict(model=name, mode=mode, ops=cost.ops, mb_per_image=round(cost.bytes_per_image(at) / 1e6, 1),
                       gflops_per_image=round(cost.flops_per_image(at) / 1e9, 2), host_reads=cost.host_reads,
                       estimate={b: cost.estimate(gpu, b) for b in batches}, top=top_ops(cost, batches[-1], top))
            if compiled:
                row["compiled"] = compiled_kernels(timm.create_model(name, **kwargs), img_size, mode == "train")
            rows.append(row)
    for row in rows:
        base = next(r for r in rows if r["model"] == baseline and r["mode"] == row["mode"])
        row["ops_ratio"] = round(row["ops"] / base["ops"], 2)
        row["bytes_ratio"] = round(row["mb_per_image"] / base["mb_per_image"], 2)
        row["img_s_ratio"] = {b: round(row["estimate"][b]["img_s"] / base["estimate"][b]["img_s"], 2)
                              for b in batches}
        if compiled:
            row["compiled"]["generated_ratio"] = round(row["compiled"]["generated"] / base["compiled"]["generated"],
                                                       2)
    return rows


def print_rows(rows: list, gpu: GPU, batches) -> None:
    print(f"per image at batch {batches[-1]}, fp32; estimate for {gpu.name} (achieved {gpu.bandwidth / 1e12:.2f} TB/s, "
          f"{gpu.matmul / 1e12:.0f} TFLOP/s, {gpu.launch * 1e6:.0f} us an op)")
    head = f"{'model':30} {'mode':5} {'ops':>6} {'ratio':>6} {'MB':>8} {'ratio':>6} {'GFLOP':>7}"
    head += "".join(f" {'img/s@' + str(b):>11} {'ratio':>6}" for b in batches)
    print(head)
    for r in rows:
        line = (f"{r['model']:30} {r['mode']:5} {r['ops']:>6} {r['ops_ratio']:>6.2f} {r['mb_per_image']:>8.1f} "
                f"{r['bytes_ratio']:>6.2f} {r['gflops_per_image']:>7.2f}")
        line += "".join(f" {r['estimate'][b]['img_s']:>11.0f} {r['img_s_ratio'][b]:>6.2f}" for b in batches)
        if "compiled" in r:
            c = r["compiled"]
            line += f"  compiled: {c['generated']} kernels ({c['generated_ratio']:.2f}), {c['compile_s']} s"
        print(line)
    for r in rows:
        if r["mode"] == "train":
            print(f"{r['model']} train, the most bytes at batch {batches[-1]} (op, count, MB per image): "
                  + ", ".join(f"{n} {c} {mb}" for n, c, mb in r["top"]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["lipsformer_swin_t", "lipsformer_cswin_t"])
    parser.add_argument("--baseline", default="swin_tiny_patch4_window7_224")
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--gpu", choices=sorted(GPUS), default="h100")
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--compiled", action="store_true", help="also count the kernels of the compiled step")
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if any(b < 1 for b in args.batches):
        parser.error("--batches takes positive batch sizes")
    gpu = GPUS[args.gpu]
    rows = run(args.models, args.baseline, args.img_size, gpu, args.batches, args.compiled, args.top)
    print_rows(rows, gpu, args.batches)
    if args.json:
        from lipsformer.writer import write_json
        write_json(args.json, dict(gpu=asdict(gpu), img_size=args.img_size, rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
