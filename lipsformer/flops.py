"""Parameters and fvcore GFLOPs of every registered LipsFormer model beside the paper's figures.

    python -m lipsformer.flops [--models lipsformer_swin_t ...] [--json out.json]

fvcore counts one multiply-add as one FLOP. ``scaled_dot_product_attention`` is counted as the
two matmuls it replaces (q k^T and attn v), so fused and unfused attention give the same count.
"""
import logging
import sys
import warnings
from typing import Callable, Dict, Optional

import torch

from .cli import ArgumentParser, command
from .build import build_model
from .weights import check_model_name
from .writer import output_file, write_json

with warnings.catch_warnings():  # fvcore.nn's focal_loss module calls torch.jit.script on import (deprecated)
    warnings.filterwarnings("ignore", message=r"`torch\.jit\.script` is deprecated", category=FutureWarning)
    from fvcore.nn import FlopCountAnalysis
    from fvcore.nn.jit_handles import get_shape

# Paper Table 2 / DESIGN.md: params (M), GFLOPs at 224x224, ImageNet-1k top-1 (None where not given).
PAPER: Dict[str, dict] = {
    "lipsformer_swin_t": dict(params_m=31, gflops=5.0, top1=82.7),
    "lipsformer_swin_s": dict(params_m=54, gflops=9.7, top1=83.5),
    "lipsformer_swin_b": dict(params_m=96, gflops=17.0, top1=84.0),
    "lipsformer_swin_l": dict(params_m=214, gflops=37.7, top1=83.5),
    "lipsformer_swin_lpp": dict(params_m=526, gflops=None, top1=None),
    "lipsformer_cswin_t": dict(params_m=24, gflops=4.7, top1=83.5),
    "lipsformer_cswin_s": dict(params_m=38, gflops=7.6, top1=83.8),
    "lipsformer_cswin_b": dict(params_m=83, gflops=16.3, top1=84.6),
}


def _sdpa_flop_jit(inputs, outputs) -> int:
    """aten::scaled_dot_product_attention as q k^T plus attn v: B*H*N*M*(d + dv) multiply-adds."""
    q, k, v = (get_shape(t) for t in inputs[:3])
    *batch, n, d = q
    m, dv = k[-2], v[-1]
    count = n * m * (d + dv)
    for b in batch:
        count *= b
    return count


def count_params(name: str, **kwargs) -> int:
    """Parameter count, built on the meta device (no memory, no init)."""
    with torch.device("meta"):
        model, _ = build_model(name, **kwargs)
    return sum(p.numel() for p in model.parameters())


def count_flops(model: torch.nn.Module, input_size=(3, 224, 224)) -> int:
    """fvcore FLOPs (multiply-adds) of one forward pass at batch 1."""
    model = model.eval()
    x = torch.zeros(1, *input_size)
    logging.getLogger("fvcore").setLevel(logging.ERROR)
    analysis = FlopCountAnalysis(model, x).set_op_handle("aten::scaled_dot_product_attention", _sdpa_flop_jit)
    analysis.unsupported_ops_warnings(False).uncalled_modules_warnings(False)
    with torch.no_grad():
        return int(analysis.total())


def _cpu_attention(query, key, value, *args, out_shape=None, **kwargs) -> int:
    from torch.utils.flop_counter import sdpa_flop_count
    return sdpa_flop_count(query, key, value)


def _cpu_attention_backward(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    from torch.utils.flop_counter import sdpa_backward_flop_count
    return sdpa_backward_flop_count(grad_out, query, key, value)


def _conv_backward(grad_out, x, w, bias, stride, padding, dilation, transposed, output_padding, groups,
                   output_mask, out_shape=None) -> int:
    """The input and weight gradients of a convolution, each as many multiply-adds as its forward (torch's own
    formula ignores ``groups``: a depth-wise 7x7 conv's backward would count 9x its forward)."""
    from torch.utils.flop_counter import conv_flop_count
    return conv_flop_count(x, w, grad_out, transposed) * (int(output_mask[0]) + int(output_mask[1]))


def count_multiply_adds(fn: Callable[[], object]) -> int:
    """Multiply-adds of every matrix product and convolution ``fn()`` runs, forward and backward, however many
    the data decides (a solver's iterations): torch's ``FlopCounterMode`` (two FLOPs per multiply-add, halved
    here), with the CPU's fused attention counted as q k^T plus attn v (and its backward), as ``count_flops``
    counts it, and grouped convolutions' backward counted by their groups. On a forward it gives fvcore's count;
    elementwise passes are not counted by either."""
    from torch.utils.flop_counter import FlopCounterMode
    custom = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention,
              torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward,
              torch.ops.aten.convolution_backward: _conv_backward}
    with FlopCounterMode(display=False, custom_mapping=custom) as counter:
        fn()
    return counter.get_total_flops() // 2


def measure(name: str, flops: bool = True) -> dict:
    """Params (M) and GFLOPs at the model's default input size, beside the paper's figures."""
    row = dict(model=name, params_m=count_params(name) / 1e6)
    if flops:
        model, _ = build_model(name, init="xavier")  # the init does not change the count; skip the SVDs
        row["gflops"] = count_flops(model, model.pretrained_cfg["input_size"]) / 1e9
    paper = PAPER.get(name, {})
    row.update({f"paper_{k}": v for k, v in paper.items()})
    return row


def _fmt(v: Optional[float], spec: str) -> str:
    return "-" if v is None else format(v, spec)


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="python -m lipsformer.flops", description=__doc__)
    parser.add_argument("--models", nargs="+", default=list(PAPER), help="model names (default: all of the paper's)")
    parser.add_argument("--no-flops", action="store_true", help="parameters only (fast)")
    parser.add_argument("--json", type=output_file, help="also write the rows to this JSON file")
    return parser


@command
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    for name in args.models:  # every name before the first row
        check_model_name(name)
    rows = []
    print(f"{'model':<22}{'params (M)':>12}{'paper':>8}{'GFLOPs':>9}{'paper':>8}{'top-1 (paper)':>15}")
    for name in args.models:
        row = measure(name, flops=not args.no_flops)
        rows.append(row)
        print(f"{name:<22}{row['params_m']:>12.2f}{_fmt(row.get('paper_params_m'), 'g'):>8}"
              f"{_fmt(row.get('gflops'), '.2f'):>9}{_fmt(row.get('paper_gflops'), 'g'):>8}"
              f"{_fmt(row.get('paper_top1'), 'g'):>15}", flush=True)
    if args.json:
        write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
