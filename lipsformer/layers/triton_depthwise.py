"""Triton kernels of the conv blocks' depth-wise convolution (:mod:`lipsformer.layers.conv_blocks`): stride 1, a
``k`` x ``k`` kernel (k odd) padded by ``k // 2``, on a (B, H, W, C) map, in float32 arithmetic whatever the tensors'
dtypes (:mod:`lipsformer.layers.triton_kernels`' conventions). Imported on the first CUDA call; tests run them on the
CPU through Triton's interpreter.

Forward ``u[p] = b + sum_t w[t] x[p + t]`` over the ``k * k`` offsets ``t``, with an epilogue: also ``GELU(u)``
(before a 1x1 convolution), or the conv block's residual ``x + m * alpha * GELU(u)``. Backward, one launch, both the
input's gradient ``skip[p] + sum_t w[t] dy[p - t]`` (``skip`` the gradient the residual's skip brings to the same
input, added here rather than in a pass of its own) and per block of positions the partial sums ``sum_p dy[p]
x[p + t]`` (the weight's) and ``sum_p dy[p]`` (the bias's), which a second launch adds, as the other reducing kernels
do.
"""
import torch
import triton
import triton.language as tl

from .triton_kernels import ROWS, gelu, gelu_residual_grad_parts, mask_args, row_factor, split_rows

CHANNELS = 64  # channels a program takes
TAPS = 64  # the weight's k * k offsets and the bias, a power of two at or above them (k <= 7)


@triton.jit
def _near(pos, t, sign, H, W, K: tl.constexpr):
    """The position ``sign`` * (offset ``t`` of the k x k) away from each of ``pos`` (image * H * W + row * W +
    column), and whether it lies inside the map."""
    HW = H * W
    img, rest = pos // HW, pos % HW
    y = rest // W + sign * (t // K - K // 2)
    x = rest % W + sign * (t % K - K // 2)
    return img * HW + y * W + x, (y >= 0) & (y < H) & (x >= 0) & (x < W)


@triton.jit
def _dw_fwd(x, w, b, y, u_out, alpha, mask, P, H, W, C, inv_keep, EPILOGUE: tl.constexpr, HAS_MASK: tl.constexpr,
            K: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """The convolution ``u`` at ``ROWS`` positions and a block of channels, and what the epilogue makes of it: ``y =
    u`` (0); ``y = u`` and ``u_out = GELU(u)`` (1); ``u_out = u`` and ``y = x + m * alpha * GELU(u)`` (2), ``m`` the
    sample's DropPath factor."""
    pos = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    col_ok = cols < C
    row_ok = pos < P
    ok = row_ok[:, None] & col_ok[None, :]
    acc = tl.zeros([ROWS, BLOCK], tl.float32) + tl.load(b + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    for t in tl.static_range(K * K):
        near, inside = _near(pos, t, 1, H, W, K)
        v = tl.load(x + near[:, None] * C + cols[None, :], mask=ok & inside[:, None], other=0.0).to(tl.float32)
        acc += tl.load(w + cols * (K * K) + t, mask=col_ok, other=0.0).to(tl.float32)[None, :] * v
    offs = pos[:, None] * C + cols[None, :]
    if EPILOGUE == 2:
        tl.store(u_out + offs, acc.to(u_out.dtype.element_ty), mask=ok)
        a = tl.load(alpha + cols, mask=col_ok, other=0.0).to(tl.float32)
        f = row_factor(mask, pos, row_ok, H * W, inv_keep, HAS_MASK)
        acc = tl.load(x + offs, mask=ok, other=0.0).to(tl.float32) + f[:, None] * a[None, :] * gelu(acc)
    elif EPILOGUE == 1:
        tl.store(u_out + offs, gelu(acc).to(u_out.dtype.element_ty), mask=ok)
    tl.store(y + offs, acc.to(y.dtype.element_ty), mask=ok)


@triton.jit
def _dw_bwd(g, x, w, skip, gx, parts, part_stride, P, H, W, C, sum_programs, per_program, HAS_SKIP: tl.constexpr,
            K: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, TAPS: tl.constexpr):
    pid, part = tl.program_id(0), tl.program_id(2)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    col_ok = cols < C
    if part == 0:  # the input's gradient
        pos = (pid * ROWS + tl.arange(0, ROWS)).to(tl.int64)
        ok = (pos < P)[:, None] & col_ok[None, :]
        acc = tl.zeros([ROWS, BLOCK], tl.float32)
        if HAS_SKIP:
            acc += tl.load(skip + pos[:, None] * C + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        for t in tl.static_range(K * K):
            near, inside = _near(pos, t, -1, H, W, K)
            d = tl.load(g + near[:, None] * C + cols[None, :], mask=ok & inside[:, None], other=0.0).to(tl.float32)
            acc += tl.load(w + cols * (K * K) + t, mask=col_ok, other=0.0).to(tl.float32)[None, :] * d
        tl.store(gx + pos[:, None] * C + cols[None, :], acc.to(gx.dtype.element_ty), mask=ok)
    elif pid < sum_programs:  # the weight's and bias's partial sums over this program's positions
        taps = tl.arange(0, TAPS)
        sums = tl.zeros([TAPS, BLOCK], tl.float32)
        for start in range(pid * per_program, pid * per_program + per_program, ROWS):
            pos = (start + tl.arange(0, ROWS)).to(tl.int64)
            ok = (pos < P)[:, None] & col_ok[None, :]
            d = tl.load(g + pos[:, None] * C + cols[None, :], mask=ok, other=0.0).to(tl.float32)
            sums += tl.where(taps[:, None] == K * K, tl.sum(d, axis=0)[None, :], 0.0)
            for t in tl.static_range(K * K):
                near, inside = _near(pos, t, 1, H, W, K)
                v = tl.load(x + near[:, None] * C + cols[None, :], mask=ok & inside[:, None], other=0.0)
                sums += tl.where(taps[:, None] == t, tl.sum(d * v.to(tl.float32), axis=0)[None, :], 0.0)
        offs = tl.where(taps[:, None] < K * K, cols[None, :] * (K * K) + taps[:, None], K * K * C + cols[None, :])
        tl.store(parts + pid * part_stride + offs, sums, mask=(taps[:, None] <= K * K) & col_ok[None, :])


def depthwise_conv(x, weight, bias, alpha, mask, keep, epilogue, out_dtype, y, u):
    """Fills ``y`` and ``u`` (the op allocates them; ``u`` empty for epilogue 0) and returns them."""
    B, H, W, C = x.shape
    k = weight.shape[-1]
    P = B * H * W
    mask_ptr, inv_keep, has_mask = mask_args(mask, keep, x)
    _dw_fwd[(triton.cdiv(P, ROWS), triton.cdiv(C, CHANNELS))](
        x, weight, bias, y, u if u.numel() else y, alpha if alpha is not None else bias, mask_ptr, P, H, W, C,
        inv_keep, EPILOGUE=epilogue, HAS_MASK=has_mask, K=k, ROWS=ROWS, BLOCK=CHANNELS)
    return y, u


def depthwise_conv_backward(grad, x, weight, skip, sum_dtype):
    """The input's gradient (plus ``skip``'s, where it is not None) and the weight's and bias's, summed: (C * k * k
    + C), the weight's (C, k * k) row-major, then the bias's."""
    B, H, W, C = x.shape
    k = weight.shape[-1]
    parts = torch.empty((split_rows(B * H * W, x.device)[0], (k * k + 1) * C), dtype=torch.float32, device=x.device)
    return depthwise_conv_grad_parts(grad, x, weight, skip, parts), parts.sum(0).to(sum_dtype)


def depthwise_conv_grad_parts(grad, x, weight, skip, parts):
    """The input's gradient (plus ``skip``), returned, and the weight's and bias's partial sums, one row per program
    (:func:`split_rows` of the positions) written into ``parts`` (rows of any stride), for the caller to add."""
    B, H, W, C = x.shape
    k = weight.shape[-1]
    P = B * H * W
    gx = torch.empty(x.shape, dtype=x.dtype if skip is None else skip.dtype, device=x.device)
    programs, per_program = split_rows(P, x.device)
    _dw_bwd[(max(triton.cdiv(P, ROWS), programs), triton.cdiv(C, CHANNELS), 2)](
        grad, x, weight, grad if skip is None else skip, gx, parts, parts.stride(0), P, H, W, C, programs,
        per_program, HAS_SKIP=skip is not None, K=k, ROWS=ROWS, BLOCK=CHANNELS, TAPS=TAPS)
    return gx


def conv_residual_backward(grad, x, weight, u, alpha, mask, keep, sum_dtype):
    """A conv block's residual ``x + m * alpha * GELU(dw(x))`` backward: the input's gradient (``grad`` its skip's)
    and the gradients of alpha, the weight and the bias summed, (C + C * k * k + C), the two kernels' partial sums
    added in one launch."""
    B, H, W, C = x.shape
    k = weight.shape[-1]
    parts = torch.empty((split_rows(B * H * W, x.device)[0], (k * k + 2) * C), dtype=torch.float32, device=x.device)
    gu = gelu_residual_grad_parts(grad, u, alpha, mask, keep, parts[:, :C])
    gx = depthwise_conv_grad_parts(gu, x, weight, grad, parts[:, C:])
    return gx, parts.sum(0).to(sum_dtype)
