"""The convolution blocks that open every LipsFormer block (LipsFormer Fig. 1, Table 3)."""
import enum
from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from . import fused  # fused._kernels looked up on the module, where the tests replace it
from .fused import autocast_dtype, defer_bias, fusable, math_backward, sum_dtype
from .fused_op import fused_op
from .gelu import gelu_linear, records_grad
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


def dw_conv(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
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
        return dw_conv(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:  # stride 1, padding k // 2: the transposed convolution is the flipped one
            grad_x = dw_conv(grad, weight.flip(2, 3))
        if ctx.needs_input_grad[1]:
            weight_grad = _dw_weight_grad if torch.compiler.is_compiling() else _dw_weight_grad_eager
            grad_w = weight_grad(x, grad, weight.shape[-1])
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad.sum((0, 1, 2))
        return grad_x, grad_w, grad_b


# -- the depth-wise convolution as fused ops: a Triton kernel each way on CUDA, the plain composition elsewhere -----
def _depthwise_kernels(t: torch.Tensor):
    """The depth-wise convolution's Triton kernels where the fused ops run theirs
    (:func:`lipsformer.layers.fused._kernels`)."""
    if fused._kernels(t) is None:
        return None
    from . import triton_depthwise
    return triton_depthwise


class Epilogue(enum.IntEnum):
    """What the fused depth-wise convolution writes with ``u = dw(x)``."""
    NONE = 0  # u
    GELU = 1  # u and GELU(u), for the 1x1 convolution after it
    RESIDUAL = 2  # the conv block's residual x + m * alpha * GELU(u), and u


@fused_op("lipsformer::depthwise_conv")
def _dwc(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, alpha: Optional[torch.Tensor],
         mask: Optional[torch.Tensor], keep: float, epilogue: int, out_dtype: torch.dtype
         ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(B, H, W, C) ``x`` convolved depth-wise (stride 1, padding ``k // 2``, a bias) into ``u``, in ``out_dtype``,
    with its :class:`Epilogue`: ``(u, empty)``, ``(u, GELU(u))`` or ``(x + m * alpha * GELU(u), u)`` (``m = mask /
    keep`` per sample, :func:`lipsformer.layers.fused.gelu_residual`), contiguous."""
    kernels = _depthwise_kernels(x)
    if kernels is not None:
        return kernels.depthwise_conv(x, weight, bias, alpha, mask, keep, epilogue, out_dtype,
                                      *_empty_dwc(x, alpha, epilogue, out_dtype))
    u = dw_conv(x.to(out_dtype), weight.to(out_dtype), bias.to(out_dtype)).contiguous()
    if epilogue == Epilogue.NONE:
        return u, u.new_empty(0)
    if epilogue == Epilogue.GELU:
        return u, F.gelu(u)
    return fused.gelu_residual_plain(x, u, alpha, mask, keep), u


def _empty_dwc(x, alpha, epilogue, out_dtype):
    """The outputs of :func:`_dwc`, uninitialised: their shapes and dtypes (those of the plain composition)."""
    u = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    if epilogue == Epilogue.NONE:
        return u, u.new_empty(0)
    if epilogue == Epilogue.GELU:
        return u, torch.empty_like(u)
    return fused.empty_gelu_residual(x, u, alpha), u


@_dwc.register_fake
def _(x, weight, bias, alpha, mask, keep, epilogue, out_dtype):
    return _empty_dwc(x, alpha, epilogue, out_dtype)


def dw_conv_grads(grad, x, weight, skip):
    """The gradients of :func:`dw_conv` from its output's (all (B, H, W, C)): the input's (plus ``skip``) and the
    weight's and bias's, flat (C * k * k, then C), in aten ops."""
    C, k = x.shape[-1], weight.shape[-1]
    dtype = grad.dtype
    gi, gw, gb = torch.ops.aten.convolution_backward(_nchw(grad), _nchw(x.to(dtype)), weight.to(dtype), [C], [1, 1],
                                                     [k // 2, k // 2], [1, 1], False, [0, 0], C, [True, True, True])
    gx = _nhwc(gi).to(x.dtype if skip is None else skip.dtype)
    return gx if skip is None else gx + skip, torch.cat((gw.flatten(), gb))


@fused_op("lipsformer::depthwise_conv_backward")
def _dwc_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, skip: Optional[torch.Tensor]
                  ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(the input's gradient plus ``skip`` where given, contiguous; the weight's and bias's gradients summed in
    float32 at least, flat: (C * k * k) then (C))."""
    kernels = _depthwise_kernels(grad)
    if kernels is not None:
        return kernels.depthwise_conv_backward(grad, x, weight, skip, sum_dtype(grad))
    gx, sums = dw_conv_grads(grad, x, weight, skip)
    return gx.contiguous(), sums.to(sum_dtype(grad))


@_dwc_backward.register_fake
def _(grad, x, weight, skip):
    C, k = x.shape[-1], weight.shape[-1]
    return (torch.empty(x.shape, dtype=x.dtype if skip is None else skip.dtype, device=x.device),
            x.new_empty(C * k * k + C, dtype=sum_dtype(grad)))


@fused_op("lipsformer::conv_residual_backward")
def _crb(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, u: torch.Tensor, alpha: torch.Tensor,
         mask: Optional[torch.Tensor], keep: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """A conv block's residual ``x + m * alpha * GELU(dw(x))`` backward, from its output's gradient and ``u =
    dw(x)``: (the input's gradient; alpha's, the weight's and the bias's summed in float32 at least, flat: C, C * k *
    k, C). On CUDA three kernels: the residual's, the convolution's with the skip's gradient added, and one adding
    both's partial sums."""
    kernels = _depthwise_kernels(grad)
    if kernels is not None:
        return kernels.conv_residual_backward(grad, x, weight, u, alpha, mask, keep, sum_dtype(grad))
    grad_u, grad_alpha = fused.gelu_residual_grads(grad, u, alpha, mask, keep)
    gx, sums = dw_conv_grads(grad_u, x, weight, grad)
    return gx.contiguous(), torch.cat((grad_alpha.to(sums.dtype), sums)).to(sum_dtype(grad))


@_crb.register_fake
def _(grad, x, weight, u, alpha, mask, keep):
    return torch.empty_like(x, dtype=grad.dtype), x.new_empty(2 * x.shape[-1] + weight.numel(), dtype=sum_dtype(grad))


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a convolution of ``x`` computes in: autocast's where it is on, else ``x``'s."""
    return autocast_dtype(x.device.type) or x.dtype


def _depthwise_grads(ctx, grad, skip):
    """The input's (plus ``skip``), weight's and bias's gradients of a fused depth-wise convolution, from its output's
    gradient: the fused backward op, or aten ops under ``create_graph``, which autograd differentiates again."""
    x, weight = ctx.saved_tensors[:2]
    if math_backward():
        gx, sums = dw_conv_grads(grad, x, weight, skip)
    else:
        gx, sums = _dwc_backward(grad.contiguous(), x, weight, None if skip is None else skip.contiguous())
    n = weight.numel()
    return gx, sums[:n].view(weight.shape).to(ctx.dtypes[0]), sums[n:].to(ctx.dtypes[1])


class _FusedDepthwise(torch.autograd.Function):
    """``(u, h, x)``: the depth-wise convolution ``u`` of (B, H, W, C) ``x`` by the fused ops, with ``h = GELU(u)``
    where ``gelu`` (not differentiable: the 1x1 convolution after it takes ``u``'s gradient), and ``x`` passed on to
    the residual's skip, as one autograd node (:func:`lipsformer.layers.gelu.skip_linear`'s pattern). One kernel
    forward (in autocast's dtype under autocast); backward one for the input's gradient with the skip's added and the
    weight's and bias's partial sums, and one adding those: where aten's backward is three kernels and an ``add``."""

    @staticmethod
    def forward(ctx, x, weight, bias, gelu):
        ctx.set_materialize_grads(False)  # no zeros for outputs nothing differentiates
        xc = x.contiguous()
        ctx.save_for_backward(xc, weight)
        ctx.dtypes = (weight.dtype, bias.dtype)
        u, h = _dwc(xc, weight, bias, None, None, 1.0, Epilogue.GELU if gelu else Epilogue.NONE, _compute_dtype(x))
        ctx.mark_non_differentiable(h)
        return u, h, x.view_as(x)

    @staticmethod
    def backward(ctx, grad, _grad_h, grad_skip):
        if grad is None:
            return grad_skip, None, None, None
        return (*_depthwise_grads(ctx, grad, grad_skip), None)


class _FusedConvResidual(torch.autograd.Function):
    """A conv block's residual ``x + m * alpha * GELU(dw(x))`` by the fused ops: one kernel forward (the convolution
    with the residual as its epilogue), keeping ``x`` and ``u = dw(x)``; backward one op (:func:`_crb`): the
    residual's kernel (``u``'s gradient), the convolution's, whose input gradient takes the skip's, ``grad``, in the
    same pass, and one launch adding alpha's, the weight's and the bias's partial sums."""

    @staticmethod
    def forward(ctx, x, weight, bias, alpha, mask, keep):
        xc = x.contiguous()
        y, u = _dwc(xc, weight, bias, alpha, mask, keep, Epilogue.RESIDUAL, _compute_dtype(x))
        ctx.save_for_backward(xc, weight, u, alpha, mask, bias)
        ctx.dtypes, ctx.keep = (weight.dtype, bias.dtype), keep
        return y

    @staticmethod
    def backward(ctx, grad):
        x, weight, u, alpha, mask, bias = ctx.saved_tensors
        if math_backward():  # u again from the saved inputs, so that a second derivative reaches them through it
            u = dw_conv(x.to(u.dtype), weight.to(u.dtype), bias.to(u.dtype))
            grad_u, grad_alpha = fused.gelu_residual_grads(grad, u, alpha, mask, ctx.keep)
            return (*_depthwise_grads(ctx, grad_u, grad), grad_alpha.to(alpha.dtype), None, None)
        gx, sums = _crb(grad.contiguous(), x, weight, u, alpha, mask, ctx.keep)
        C, n = alpha.shape[0], weight.numel()
        return (gx, sums[C:C + n].view(weight.shape).to(ctx.dtypes[0]), sums[C + n:].to(ctx.dtypes[1]),
                sums[:C].to(alpha.dtype), None, None)


def _float32_cpu(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """A float32 CPU convolution without autocast: where :class:`_DepthwiseConv` trains."""
    return x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32 and not torch.is_autocast_enabled("cpu")


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
        if self.pw is None:  # B
            return self._conv_residual(self.dw1, self.res1, x, draws[0])
        u, h, x = self._dw(self.dw1, x, gelu=True)  # x as the convolution passes it on to the skip
        # the 1x1 convolution as the matmul over channels it is, fused with its GELU (computed already where h is);
        # its bias added by the residual's fused op where that sums its gradient with alpha's (fused.defer_bias)
        bias = self.pw.bias if defer_bias(x) else None
        y = gelu_linear(u, self.pw.weight.flatten(1), None if bias is not None else self.pw.bias, h=h)
        x = self.res1(x, y, gelu=True, draw=draws[0], bias=bias)
        if self.dw2 is not None:
            x = self._conv_residual(self.dw2, self.res2, x, draws[1])
        return x

    def _conv_residual(self, conv: nn.Conv2d, res: nn.Module, x: torch.Tensor, draw: Optional[Draw]) -> torch.Tensor:
        """``res(x, GELU(conv(x)))``: one fused op each way (:class:`_FusedConvResidual`) where the fused depth-wise
        convolution runs."""
        if self._fused(conv, x):
            mask, keep = draw if draw is not None else res.drop_mask(x)
            return _FusedConvResidual.apply(x, conv.weight, conv.bias, res.alpha, mask, keep)
        u, _, x = self._dw(conv, x)
        return res(x, u, gelu=True, draw=draw)

    def _forward_act(self, x: torch.Tensor, draws: Sequence[Optional[Draw]]) -> torch.Tensor:
        """The same blocks with ``self.act`` and the residuals' own forward (no fused GELU)."""
        u, _, x = self._dw(self.dw1, x)
        y = self.act(u)
        if self.pw is not None:
            y = self.act(F.linear(y, self.pw.weight.flatten(1), self.pw.bias))
        x = self.res1(x, y, draw=draws[0])
        if self.dw2 is not None:
            u, _, x = self._dw(self.dw2, x)
            x = self.res2(x, self.act(u), draw=draws[1])
        return x

    def _dw(self, conv: nn.Conv2d, x: torch.Tensor, gelu: bool = False
            ) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
        """The depth-wise ``conv`` on (B, H, W, C) ``x``: ``(u, GELU(u) or None, x for the residual's skip)``. In a
        float32 CPU training step (eager or traced by ``torch.compile``) :class:`_DepthwiseConv` (oneDNN's forward, a
        faster weight gradient); in another training step where the fused ops run (a GPU's) :class:`_FusedDepthwise`,
        with ``GELU(u)`` where ``gelu`` asks for it and a backward that adds the skip's gradient to the input's;
        otherwise the module on a channels-last view, and ``x`` itself: evaluation (``torch.export`` and the ONNX
        exporter trace models in eval mode), torch.fx tracing, ``torch.func`` transforms, a frozen weight, an even
        kernel (the flipped-kernel input gradient needs an odd one), a subclass or a module with hooks."""
        if self._trainable(conv, x):
            weight = conv.weight
            if (torch.is_grad_enabled() and _float32_cpu(x, weight)
                    and not torch._C._are_functorch_transforms_active()):
                return _DepthwiseConv.apply(x, weight, conv.bias), None, x
            if self._fused(conv, x):
                u, h, x = _FusedDepthwise.apply(x, weight, conv.bias, gelu)
                return u, h if gelu else None, x
        return _nhwc(conv(_nchw(x))), None, x

    def _trainable(self, conv: nn.Conv2d, x: torch.Tensor) -> bool:
        """A training step's convolution that :meth:`_dw` may replace: not traced by torch.fx, ``nn.Conv2d``'s own
        forward, no hooks, an odd kernel, a weight that learns."""
        return (self.training and not isinstance(x, torch.fx.Proxy) and type(conv) is nn.Conv2d
                and conv.kernel_size[0] % 2 == 1 and conv.weight.requires_grad
                and not (conv._forward_hooks or conv._forward_pre_hooks))

    def _fused(self, conv: nn.Conv2d, x: torch.Tensor) -> bool:
        """Whether the fused depth-wise convolution runs: a training step where the fused ops run and the CPU's own
        convolution (:class:`_DepthwiseConv`) does not, a square kernel with a bias."""
        weight = conv.weight
        return (self._trainable(conv, x) and conv.bias is not None and conv.kernel_size[0] == conv.kernel_size[1]
                and records_grad(x, weight) and not _float32_cpu(x, weight) and fusable(x, weight, conv.bias))

    def extra_repr(self) -> str:
        return f"config={self.config!r}"
