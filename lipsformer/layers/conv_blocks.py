"""The convolution blocks that open every LipsFormer block (LipsFormer Fig. 1, Table 3)."""
from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .gelu import gelu_linear
from .groupsort import GroupSort
from .residual import Draw, create_residual

CONV_BLOCKS = ("A", "B", "C", "D")
ACTS = ("gelu", "groupsort")


def create_act(kind: str) -> nn.Module:
    """The blocks' activation by name: ``gelu`` (LipsFormer; largest slope 1.1289) or ``groupsort``
    (MaxMin, 1-Lipschitz; :class:`lipsformer.layers.groupsort.GroupSort`)."""
    if kind == "gelu":
        return nn.GELU()
    if kind == "groupsort":
        return GroupSort(2)
    raise ValueError(f"act must be one of {ACTS}, got {kind!r}")


def _nchw(x: torch.Tensor) -> torch.Tensor:
    """(B, H, W, C) -> (B, C, H, W) view; convolutions run on it in channels-last memory, no copy."""
    return x.permute(0, 3, 1, 2)


def _nhwc(x: torch.Tensor) -> torch.Tensor:
    return x.permute(0, 2, 3, 1)


# ``torch.library.define`` rather than ``custom_op``: it takes tags on every torch this package supports
torch.library.define("lipsformer::dw_grad_operands", "(Tensor x, Tensor grad, int pad) -> (Tensor, Tensor)",
                     tags=(torch.Tag.flexible_layout,))


@torch.library.impl("lipsformer::dw_grad_operands", "default")
def _dw_grad_operands_impl(x: torch.Tensor, grad: torch.Tensor, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-major copies of a depth-wise convolution's input, zero-padded by ``pad`` on both sides of H and W, and of
    its output gradient, both (B, H, W, C). An operator the compiler cannot see into: its outputs fix the layout
    that the loops of :func:`_dw_weight_grad` read (inductor otherwise reads the activation in whatever layout it
    chose for it, channel by channel), and, taking the gradient, it stays in the backward graph. It takes its
    inputs in any layout (``flexible_layout``): a custom operator's default, the traced strides, made inductor
    store saved activations in another layout and copy them back."""
    return F.pad(x, (0, 0, pad, pad, pad, pad)).contiguous(), grad.clone(memory_format=torch.contiguous_format)


@torch.library.register_fake("lipsformer::dw_grad_operands")
def _(x: torch.Tensor, grad: torch.Tensor, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    b, h, w, c = x.shape
    return x.new_empty(b, h + 2 * pad, w + 2 * pad, c), torch.empty_like(grad, memory_format=torch.contiguous_format)


def _dw_weight_grad(x: torch.Tensor, grad: torch.Tensor, k: int) -> torch.Tensor:
    """The weight gradient of a stride-1 depth-wise ``k`` x ``k`` convolution padded by ``k // 2``, from its input
    and output gradient, both (B, H, W, C): first per image row (a sum over W whose operands stay in cache, one
    channel vector at a time), then over the rows, by a matrix product that also fixes the row sums' layout.
    Written for the compiler, which fuses the first sum into one loop over views of the padded input; run eagerly,
    the product would be materialised at k * k times the activation."""
    xp, grad = torch.ops.lipsformer.dw_grad_operands(x, grad, k // 2)
    windows = xp.unfold(1, k, 1).unfold(2, k, 1)  # (B, H, W, C, k, k), a view
    rows = (grad[:, :, None, None] * windows.permute(0, 1, 4, 5, 2, 3)).sum(4).flatten(0, 1).flatten(1)
    return (rows.new_ones(rows.shape[0]) @ rows).view(k, k, -1).permute(2, 0, 1).unsqueeze(1)  # (C, 1, k, k)


def _dw_conv(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """oneDNN's depth-wise convolution of (B, H, W, C) ``x`` (stride 1, padding ``k // 2``), on channels-last views."""
    return _nhwc(F.conv2d(_nchw(x), weight, bias, padding=weight.shape[-1] // 2, groups=weight.shape[0]))


# Elements of (x, grad) one convolution of :func:`_dw_weight_grad_eager` takes, per thread: a stage-1 image of
# Swin-T (56 x 56 x 96) alone, stage 3 four at a time. Larger groups leave the cache (at stage 1, batch 8, one
# image at a time is faster than all eight at once, which is still faster than oneDNN's weight gradient).
_DW_GRAD_CHUNK = 56 * 56 * 96


def _dw_weight_grad_eager(x: torch.Tensor, grad: torch.Tensor, k: int) -> torch.Tensor:
    """The weight gradient of a stride-1 depth-wise ``k`` x ``k`` convolution padded by ``k // 2`` from its input
    and output gradient, both (B, H, W, C), as oneDNN *forward* depth-wise convolutions with the roles swapped:
    ``grad_w[c, i, j] = sum_{b,h,w} x_pad[b, h+i, w+j, c] grad[b, h, w, c]`` is, for a group of images, the
    convolution of the input (images and channels as the channels of one map) with the output gradient as an
    H x W kernel per channel, a k x k output, summed over the group's images. oneDNN's own depth-wise weight
    gradient is slower at every stage of Swin-T."""
    B, H, W, C = x.shape
    step = max(1, _DW_GRAD_CHUNK * torch.get_num_threads() // (H * W * C))  # oneDNN splits the channels
    out = None
    for b in range(0, B, step):
        xs, gs = x[b:b + step], grad[b:b + step]
        n = xs.shape[0]
        maps = xs.permute(1, 2, 0, 3).reshape(1, H, W, n * C).permute(0, 3, 1, 2)  # (1, n*C, H, W) channels-last
        kernels = gs.permute(0, 3, 1, 2).reshape(n * C, 1, H, W)
        part = F.conv2d(maps, kernels, padding=k // 2, groups=n * C).view(n, C, k, k).sum(0)
        out = part if out is None else out + part
    return out.unsqueeze(1)  # (C, 1, k, k)


class _DepthwiseConv(torch.autograd.Function):
    """A depth-wise convolution (stride 1, padding ``k // 2``) on (B, H, W, C) for a float32 CPU training step,
    with the weight gradient computed by forward convolutions (:func:`_dw_weight_grad_eager`) or, under
    ``torch.compile``, by :func:`_dw_weight_grad` instead of oneDNN's depth-wise weight gradient, the slowest kernel
    of a LipsFormer training step on the CPU (README Speed). The forward pass and the input gradient (the
    convolution with the flipped kernel) are oneDNN's convolutions. It keeps what the module's autograd keeps: the
    input and the weight."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _dw_conv(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:  # stride 1, padding k // 2: the transposed convolution is the flipped one
            grad_x = _dw_conv(grad, weight.flip(2, 3))
        if ctx.needs_input_grad[1]:
            weight_grad = _dw_weight_grad if torch.compiler.is_compiling() else _dw_weight_grad_eager
            grad_w = weight_grad(x, grad, weight.shape[-1])
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad.sum((0, 1, 2))
        return grad_x, grad_w, grad_b


class ConvBlocks(nn.Module):
    r"""Depth-wise / point-wise convolution blocks with weighted residuals, on (B, H, W, C).

    Configurations of LipsFormer Table 3:

    - ``A``: none (identity);
    - ``B``: :math:`x + \mathrm{DP}(s_1 \odot \mathrm{GELU}(\mathrm{dw}_{7\times7}(x)))`;
    - ``C``:
     :math:`x + \mathrm{DP}(s_1 \odot \mathrm{GELU}(\mathrm{pw}_{1\times1}(\mathrm{GELU}(\mathrm{dw}_{7\times7}(x)))))`;
    - ``D`` (released default): ``C`` followed by
      :math:`x + \mathrm{DP}(s_2 \odot \mathrm{GELU}(\mathrm{dw}'_{7\times7}(x)))`.

    ``s1`` and ``s2`` are per-channel weights initialised to ``alpha_init``. The released code
    calls ``dw1``/``dw2`` ``dwconv_layers.0/1``, ``pw`` ``nin`` and ``res1/2.alpha`` ``scale_layers.0/1.scale``.
    ``act`` replaces GELU (``groupsort``) and ``residual="convex"`` the weighted residuals by
    :class:`lipsformer.layers.residual.ConvexResidual` (its weight kept in ``alpha_range``); the defaults run the
    fused GELU path.
    """

    def __init__(self, dim: int, config: str = "D", alpha_init: float = 0.1, drop_path: float = 0.0,
                 kernel_size: int = 7, act: str = "gelu", residual: str = "add",
                 alpha_range: Tuple[float, float] = (0.0, 1.0)):
        super().__init__()
        if config not in CONV_BLOCKS:
            raise ValueError(f"conv_blocks must be one of {CONV_BLOCKS}, got {config!r}")
        self.config = config
        self.act = None if act == "gelu" and residual == "add" else create_act(act)  # None: the fused GELU path

        def dw():
            return nn.Conv2d(dim, dim, kernel_size, padding=kernel_size // 2, groups=dim)

        self.dw1 = dw() if config != "A" else None
        self.pw = nn.Conv2d(dim, dim, 1) if config in ("C", "D") else None
        self.res1 = create_residual(residual, dim, alpha_init, drop_path, alpha_range) if config != "A" else None
        self.dw2 = dw() if config == "D" else None
        self.res2 = create_residual(residual, dim, alpha_init, drop_path, alpha_range) if config == "D" else None

    def forward(self, x: torch.Tensor, draws: Sequence[Optional[Draw]] = (None, None)) -> torch.Tensor:
        """``draws``: the residuals' DropPath draws made beforehand (a compiled block takes them as inputs), or None
        for each residual to draw its own."""
        if self.dw1 is None:
            return x
        if self.act is not None:
            return self._forward_act(x, draws)
        y = self._dw(self.dw1, x)
        if self.pw is not None:  # the 1x1 convolution as the matmul over channels it is, fused with its GELU
            y = gelu_linear(y, self.pw.weight.flatten(1), self.pw.bias)
        x = self.res1(x, y, gelu=True, draw=draws[0])
        if self.dw2 is not None:
            x = self.res2(x, self._dw(self.dw2, x), gelu=True, draw=draws[1])
        return x

    def _forward_act(self, x: torch.Tensor, draws: Sequence[Optional[Draw]]) -> torch.Tensor:
        """The same blocks with ``self.act`` and the residuals' own forward (no fused GELU)."""
        y = self.act(self._dw(self.dw1, x))
        if self.pw is not None:
            y = self.act(F.linear(y, self.pw.weight.flatten(1), self.pw.bias))
        x = self.res1(x, y, draw=draws[0])
        if self.dw2 is not None:
            x = self.res2(x, self.act(self._dw(self.dw2, x)), draw=draws[1])
        return x

    def _dw(self, conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
        """The depth-wise ``conv`` on (B, H, W, C) ``x``: the module on a channels-last view, or, in a float32 CPU
        training step (eager or traced by ``torch.compile``), :class:`_DepthwiseConv` (the same forward, a faster
        weight gradient). GPUs and autocast keep the module until measured, and so do evaluation (``torch.export``
        and the ONNX exporter trace models in eval mode), torch.fx tracing, ``torch.func`` transforms, a frozen
        weight, an even kernel (the flipped-kernel input gradient needs an odd one), a subclass or a module with
        hooks."""
        weight = conv.weight
        if (self.training and not isinstance(x, torch.fx.Proxy) and torch.is_grad_enabled() and weight.requires_grad
                and x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32
                and not torch.is_autocast_enabled("cpu") and not torch._C._are_functorch_transforms_active()
                and type(conv) is nn.Conv2d and conv.kernel_size[0] % 2 == 1
                and not (conv._forward_hooks or conv._forward_pre_hooks)):
            return _DepthwiseConv.apply(x, weight, conv.bias)
        return _nhwc(conv(_nchw(x)))

    def extra_repr(self) -> str:
        return f"config={self.config!r}"
