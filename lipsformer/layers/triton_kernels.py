"""Triton kernels of :mod:`lipsformer.layers.fused`: each op one pass over its rows (channels last), in float32
arithmetic whatever the tensors' dtypes, stored in the output's dtype. Imported on the first CUDA call; tests run
them on the CPU through Triton's interpreter (``TRITON_INTERPRET=1``).

The backward kernels that produce per-channel gradients (CenterNorm's weight and bias, a residual's alpha) sum their
block of rows in registers and write one row of partial sums per block; a second launch (``torch.sum``) adds those,
in a fixed order, so a step's gradients are the same on every run.
"""
import functools

import numpy as np
import torch
import triton
import triton.language as tl

ROWS = 16  # rows a program of the elementwise kernels takes


@triton.jit
def gelu(u):
    """GELU (the exact, erf form) in float32."""
    return 0.5 * u * (1.0 + tl.math.erf(u * 0.7071067811865476))


@triton.jit
def gelu_grad(u):
    """GELU's derivative in float32."""
    cdf = 0.5 * (1.0 + tl.math.erf(u * 0.7071067811865476))
    return cdf + u * 0.3989422804014327 * tl.exp(-0.5 * u * u)


@triton.jit
def row_factor(mask_ptr, rows, row_ok, per_sample, inv_keep, HAS_MASK: tl.constexpr):
    """The DropPath factor of each row: its sample's draw (0 or 1) times 1 / keep."""
    if HAS_MASK:
        return tl.load(mask_ptr + rows // per_sample, mask=row_ok, other=0.0).to(tl.float32) * inv_keep
    return tl.full(rows.shape, 1.0, tl.float32)


@triton.jit
def _tile(first, cols, col_ok, R, C, ROWS: tl.constexpr):
    """Rows ``first .. first + ROWS`` of a row-major (R, C) tensor at columns ``cols``: the rows, which of them exist,
    which elements exist, and their offsets."""
    rows = first + tl.arange(0, ROWS)
    row_ok = rows < R
    ok = row_ok[:, None] & col_ok[None, :]
    return rows, row_ok, ok, rows[:, None].to(tl.int64) * C + cols[None, :]


@triton.jit
def _rcn_fwd(x_ptr, h_ptr, hb_ptr, mask_ptr, w_ptr, b_ptr, y_ptr, z_ptr, R, C, per_sample, inv_keep, scale,
             HAS_H: tl.constexpr, HAS_HB: tl.constexpr, HAS_MASK: tl.constexpr, SAVE: tl.constexpr,
             ROWS: tl.constexpr, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    col_ok = cols < C
    rows, row_ok, ok, offs = _tile(tl.program_id(0) * ROWS, cols, col_ok, R, C, ROWS)
    s = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    if HAS_H:
        h = tl.load(h_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        if HAS_HB:
            h += tl.load(hb_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        s += h * row_factor(mask_ptr, rows, row_ok, per_sample, inv_keep, HAS_MASK)[:, None]
    mean = tl.sum(s, axis=1) / C
    z = tl.where(ok, s - mean[:, None], 0.0)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32) * scale
    b = tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, (z * w[None, :] + b[None, :]).to(y_ptr.dtype.element_ty), mask=ok)
    if SAVE:
        tl.store(z_ptr + offs, z.to(z_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rcn_bwd(g_ptr, z_ptr, mask_ptr, w_ptr, gs_ptr, gh_ptr, part_ptr, R, C, rows_per_program, per_sample,
             inv_keep, scale, HAS_MASK: tl.constexpr, N_SUMS: tl.constexpr, ROWS: tl.constexpr,
             BLOCK: tl.constexpr):
    """``N_SUMS`` partial sums per program: the weight's and bias's gradients, and with three the gradient of a bias
    added to ``h`` (``h``'s gradient summed)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    col_ok = cols < C
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32) * scale
    sum_w = tl.zeros([BLOCK], tl.float32)
    sum_b = tl.zeros([BLOCK], tl.float32)
    sum_hb = tl.zeros([BLOCK], tl.float32)
    first = pid * rows_per_program
    for start in range(first, first + rows_per_program, ROWS):
        rows, row_ok, ok, offs = _tile(start, cols, col_ok, R, C, ROWS)
        g = tl.load(g_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        gz = g * w[None, :]
        gs = tl.where(ok, gz - (tl.sum(gz, axis=1) / C)[:, None], 0.0)
        tl.store(gs_ptr + offs, gs.to(gs_ptr.dtype.element_ty), mask=ok)
        if HAS_MASK:
            f = row_factor(mask_ptr, rows, row_ok, per_sample, inv_keep, HAS_MASK)
            gh = gs * f[:, None]
            tl.store(gh_ptr + offs, gh.to(gh_ptr.dtype.element_ty), mask=ok)
        else:
            gh = gs
        sum_w += tl.sum(g * z, axis=0)
        sum_b += tl.sum(g, axis=0)
        if N_SUMS == 3:
            sum_hb += tl.sum(gh, axis=0)
    tl.store(part_ptr + pid * N_SUMS * C + cols, sum_w * scale, mask=col_ok)
    tl.store(part_ptr + pid * N_SUMS * C + C + cols, sum_b, mask=col_ok)
    if N_SUMS == 3:
        tl.store(part_ptr + pid * N_SUMS * C + 2 * C + cols, sum_hb, mask=col_ok)


@triton.jit
def _dropped(x_ptr, h_ptr, mask_ptr, y_ptr, R, C, per_sample, inv_keep, HAS_X: tl.constexpr, ROWS: tl.constexpr,
             BLOCK: tl.constexpr):
    """``y = x + m * h`` (``HAS_X``) or ``y = m * h``, ``m`` each row's DropPath factor."""
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    col_ok = cols < C
    rows, row_ok, ok, offs = _tile(tl.program_id(0) * ROWS, cols, col_ok, R, C, ROWS)
    y = tl.load(h_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    y = y * row_factor(mask_ptr, rows, row_ok, per_sample, inv_keep, True)[:, None]
    if HAS_X:
        y += tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _gr_fwd(x_ptr, u_ptr, ub_ptr, a_ptr, mask_ptr, y_ptr, R, C, per_sample, inv_keep, HAS_MASK: tl.constexpr,
            HAS_UB: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    col_ok = cols < C
    rows, row_ok, ok, offs = _tile(tl.program_id(0) * ROWS, cols, col_ok, R, C, ROWS)
    x = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    if HAS_UB:
        u += tl.load(ub_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    a = tl.load(a_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    f = row_factor(mask_ptr, rows, row_ok, per_sample, inv_keep, HAS_MASK)
    tl.store(y_ptr + offs, (x + gelu(u) * a[None, :] * f[:, None]).to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _gr_bwd(g_ptr, u_ptr, ub_ptr, a_ptr, mask_ptr, gu_ptr, part_ptr, part_stride, R, C, rows_per_program, per_sample,
            inv_keep, HAS_MASK: tl.constexpr, HAS_UB: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """``u``'s gradient, and partial sums per program: alpha's gradient, then with ``HAS_UB`` (``u + ub`` the GELU's
    input) ``ub``'s, ``C`` further along the row."""
    pid = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    col_ok = cols < C
    a = tl.load(a_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    if HAS_UB:
        ub = tl.load(ub_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    sum_a = tl.zeros([BLOCK], tl.float32)
    sum_ub = tl.zeros([BLOCK], tl.float32)
    first = pid * rows_per_program
    for start in range(first, first + rows_per_program, ROWS):
        rows, row_ok, ok, offs = _tile(start, cols, col_ok, R, C, ROWS)
        g = tl.load(g_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        if HAS_UB:
            u += ub[None, :]
        gf = g * row_factor(mask_ptr, rows, row_ok, per_sample, inv_keep, HAS_MASK)[:, None]
        gu = (gf * a[None, :] * gelu_grad(u)).to(gu_ptr.dtype.element_ty)
        tl.store(gu_ptr + offs, gu, mask=ok)
        sum_a += tl.sum(tl.where(ok, gf * gelu(u), 0.0), axis=0)
        if HAS_UB:
            sum_ub += tl.sum(tl.where(ok, gu.to(tl.float32), 0.0), axis=0)
    tl.store(part_ptr + pid * part_stride + cols, sum_a, mask=col_ok)
    if HAS_UB:
        tl.store(part_ptr + pid * part_stride + C + cols, sum_ub, mask=col_ok)


@triton.jit
def _gg(g_ptr, u_ptr, h_ptr, gu_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    u = tl.load(u_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(h_ptr + offs, gelu(u).to(h_ptr.dtype.element_ty), mask=ok)
    tl.store(gu_ptr + offs, (g * gelu_grad(u)).to(gu_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _l2_rows(src, s0, s1, s2, s3, d1, d2, dst, r_ptr, R, D, scale, eps, rows, ROWS: tl.constexpr,
             BLOCK: tl.constexpr):
    """Rows ``rows`` of a 4-d strided ``src`` (rows in (d0, d1, d2) order) normalised into contiguous ``dst``."""
    cols = tl.arange(0, BLOCK)
    row_ok, col_ok = rows < R, cols < D
    ok = row_ok[:, None] & col_ok[None, :]
    r64 = rows.to(tl.int64)
    base = (r64 // (d1 * d2)) * s0 + ((r64 // d2) % d1) * s1 + (r64 % d2) * s2
    x = tl.load(src + base[:, None] + cols[None, :] * s3, mask=ok, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) + eps)
    tl.store(dst + r64[:, None] * D + cols[None, :], (x * (r * scale)[:, None]).to(dst.dtype.element_ty), mask=ok)
    tl.store(r_ptr + rows, r.to(r_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _qkn_fwd(q, qs0, qs1, qs2, qs3, k, ks0, ks1, ks2, ks3, d1, d2, qn, kn, rq, rk, R, D, q_scale, eps,
             programs_q, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    if pid < programs_q:
        _l2_rows(q, qs0, qs1, qs2, qs3, d1, d2, qn, rq, R, D, q_scale, eps, pid * ROWS + tl.arange(0, ROWS),
                 ROWS, BLOCK)
    else:
        _l2_rows(k, ks0, ks1, ks2, ks3, d1, d2, kn, rk, R, D, 1.0, eps, (pid - programs_q) * ROWS
                 + tl.arange(0, ROWS), ROWS, BLOCK)


@triton.jit
def _l2_rows_bwd(g_ptr, out_ptr, r_ptr, gx_ptr, R, D, scale, rows, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    row_ok, col_ok = rows < R, cols < D
    ok = row_ok[:, None] & col_ok[None, :]
    offs = rows[:, None].to(tl.int64) * D + cols[None, :]
    g = tl.load(g_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    out = tl.load(out_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    dot = tl.sum(out * g, axis=1)
    gx = (g - out * (dot / (scale * scale))[:, None]) * (r * scale)[:, None]
    tl.store(gx_ptr + offs, gx.to(gx_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _qkn_bwd(gq, gk, qn, kn, rq, rk, gxq, gxk, R, D, q_scale, programs_q, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    if pid < programs_q:
        _l2_rows_bwd(gq, qn, rq, gxq, R, D, q_scale, pid * ROWS + tl.arange(0, ROWS), ROWS, BLOCK)
    else:
        _l2_rows_bwd(gk, kn, rk, gxk, R, D, 1.0, (pid - programs_q) * ROWS + tl.arange(0, ROWS), ROWS, BLOCK)


@triton.jit
def _sr_row(w_ptr, b_ptr, s_ptr, wo_ptr, bo_ptr, row, n_in, input_scale, HAS_B: tl.constexpr, BLOCK: tl.constexpr):
    s = tl.load(s_ptr + row).to(tl.float32)
    for start in range(0, n_in, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        ok = cols < n_in
        w = tl.load(w_ptr + row * n_in + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(wo_ptr + row * n_in + cols, (w * s * input_scale).to(wo_ptr.dtype.element_ty), mask=ok)
    if HAS_B:
        tl.store(bo_ptr + row, (tl.load(b_ptr + row).to(tl.float32) * s).to(bo_ptr.dtype.element_ty))


@triton.jit
def _sr_fwd(w0, b0, s0, wo0, bo0, n_out0, n_in0, c0, w1, b1, s1, wo1, bo1, n_in1, c1, HAS_B0: tl.constexpr,
            HAS_B1: tl.constexpr, BLOCK: tl.constexpr):
    """Two maps' rows (the second map's after the first's; one map: none of the second's)."""
    row = tl.program_id(0)
    if row < n_out0:
        _sr_row(w0, b0, s0, wo0, bo0, row, n_in0, c0, HAS_B0, BLOCK)
    else:
        _sr_row(w1, b1, s1, wo1, bo1, row - n_out0, n_in1, c1, HAS_B1, BLOCK)


@triton.jit
def _sr_row_bwd(gw_ptr, gb_ptr, w_ptr, b_ptr, s_ptr, gwo_ptr, gbo_ptr, gso_ptr, row, n_in, input_scale,
                HAS_B: tl.constexpr, BLOCK: tl.constexpr):
    s = tl.load(s_ptr + row).to(tl.float32)
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n_in, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        ok = cols < n_in
        gw = tl.load(gw_ptr + row * n_in + cols, mask=ok, other=0.0).to(tl.float32) * input_scale
        w = tl.load(w_ptr + row * n_in + cols, mask=ok, other=0.0).to(tl.float32)
        acc += gw * w
        tl.store(gwo_ptr + row * n_in + cols, (gw * s).to(gwo_ptr.dtype.element_ty), mask=ok)
    gs = tl.sum(acc, axis=0)
    if HAS_B:
        gb = tl.load(gb_ptr + row).to(tl.float32)
        gs += gb * tl.load(b_ptr + row).to(tl.float32)
        tl.store(gbo_ptr + row, (gb * s).to(gbo_ptr.dtype.element_ty))
    tl.store(gso_ptr + row, gs.to(gso_ptr.dtype.element_ty))


@triton.jit
def _sr_bwd(gw0, gb0, w0, b0, s0, gwo0, gbo0, gso0, n_out0, n_in0, c0, gw1, gb1, w1, b1, s1, gwo1, gbo1, gso1, n_in1,
            c1, HAS_B0: tl.constexpr, HAS_B1: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    if row < n_out0:
        _sr_row_bwd(gw0, gb0, w0, b0, s0, gwo0, gbo0, gso0, row, n_in0, c0, HAS_B0, BLOCK)
    else:
        _sr_row_bwd(gw1, gb1, w1, b1, s1, gwo1, gbo1, gso1, row - n_out0, n_in1, c1, HAS_B1, BLOCK)


# -- launchers: the ops' CUDA implementations (CPU tensors under the interpreter) -----------------------------------
def block_size(n: int) -> int:
    """The power of two at or above ``n``: a kernel's block of columns."""
    return triton.next_power_of_2(max(int(n), 1))


def split_rows(rows: int, device: torch.device) -> tuple:
    """Programs of a reducing backward kernel and the rows each takes (a multiple of ``ROWS``): enough programs to
    fill the device, few enough that their partial sums stay small."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    programs = max(1, min(triton.cdiv(rows, ROWS), 4 * sms))
    per_program = triton.cdiv(triton.cdiv(rows, programs), ROWS) * ROWS
    return triton.cdiv(rows, per_program), per_program


def mask_args(mask, keep: float, x: torch.Tensor):
    """A DropPath draw's kernel arguments: the mask's pointer, ``1 / keep`` and whether there is a mask."""
    if mask is None:
        return x, 1.0, False  # any pointer: never read
    return mask, _inv_keep(keep), True


@functools.lru_cache(maxsize=None)
def _inv_keep(keep: float) -> float:
    """``1 / keep`` rounded as float32 divides (numpy's float32 scalars: no torch op), once per rate."""
    return float(np.float32(1.0) / np.float32(keep))


def _per_sample(x: torch.Tensor) -> int:
    n = 1
    for d in x.shape[1:-1]:
        n *= d
    return max(n, 1)


def residual_center_norm(x, h, mask, keep, weight, bias, scale, h_bias, y, z):
    """Fills ``y`` and, unless it is empty, ``z`` (the op allocates them) and returns them."""
    C = x.shape[-1]
    R = x.numel() // C
    save = z.numel() > 0
    mask_ptr, inv_keep, has_mask = mask_args(mask, keep, x)
    has_hb = h is not None and h_bias is not None
    _rcn_fwd[(triton.cdiv(R, ROWS),)](x, h if h is not None else x, h_bias if has_hb else bias, mask_ptr, weight, bias,
                                      y, z if save else y, R, C, _per_sample(x), inv_keep, scale, HAS_H=h is not None,
                                      HAS_HB=has_hb, HAS_MASK=has_mask and h is not None, SAVE=save, ROWS=ROWS,
                                      BLOCK=block_size(C))
    return y, z


def residual_center_norm_backward(grad, z, mask, keep, weight, scale, gs, gh, sums):
    """Fills ``gs``, ``gh`` (where a mask scales ``h``) and ``sums`` (two rows, or three with the gradient of a
    bias added to ``h``) and returns them."""
    grad, C = grad.contiguous(), grad.shape[-1]
    R = grad.numel() // C
    P, per_program = split_rows(R, grad.device)
    parts = torch.empty((P, sums.shape[0], C), dtype=torch.float32, device=grad.device)
    mask_ptr, inv_keep, has_mask = mask_args(mask, keep, grad)
    _rcn_bwd[(P,)](grad, z, mask_ptr, weight, gs, gh if mask is not None else gs, parts, R, C, per_program,
                   _per_sample(grad), inv_keep, scale, HAS_MASK=has_mask, N_SUMS=sums.shape[0], ROWS=ROWS,
                   BLOCK=block_size(C))
    if sums.dtype == parts.dtype:
        torch.sum(parts, 0, out=sums)
    else:  # float64 gradients: sums wider than the kernel's float32 partials
        sums.copy_(parts.sum(0))
    return gs, gh, sums


def dropped(x, h, mask, keep, y):
    """Fills ``y`` with ``x + m * h`` (``x`` None: ``m * h``) and returns it."""
    C = h.shape[-1]
    R = h.numel() // C
    block = min(block_size(C), 128)
    _dropped[(triton.cdiv(R, ROWS), triton.cdiv(C, block))](h if x is None else x, h, mask, y, R, C, _per_sample(h),
                                                            mask_args(mask, keep, h)[1], HAS_X=x is not None,
                                                            ROWS=ROWS, BLOCK=block)
    return y


def gelu_residual(x, u, alpha, mask, keep, u_bias, y):
    """Fills ``y`` (the op allocates it) and returns it."""
    C = x.shape[-1]
    R = x.numel() // C
    mask_ptr, inv_keep, has_mask = mask_args(mask, keep, x)
    block = min(block_size(C), 128)
    _gr_fwd[(triton.cdiv(R, ROWS), triton.cdiv(C, block))](x, u, alpha if u_bias is None else u_bias, alpha, mask_ptr,
                                                           y, R, C, _per_sample(x), inv_keep, HAS_MASK=has_mask,
                                                           HAS_UB=u_bias is not None, ROWS=ROWS, BLOCK=block)
    return y


def gelu_residual_backward(grad, u, alpha, mask, keep, u_bias, sum_dtype):
    """``u``'s gradient and alpha's summed, (C), or with ``u_bias`` alpha's and ``u_bias``'s, (2, C)."""
    grad, C = grad.contiguous(), grad.shape[-1]
    n = 1 if u_bias is None else 2
    parts = torch.empty((split_rows(grad.numel() // C, grad.device)[0], n * C), dtype=torch.float32,
                        device=grad.device)
    gu = gelu_residual_grad_parts(grad, u, alpha, mask, keep, parts, u_bias)
    sums = parts.sum(0).to(sum_dtype)
    return gu, sums if u_bias is None else sums.view(2, C)


def gelu_residual_grad_parts(grad, u, alpha, mask, keep, parts, u_bias=None):
    """``u``'s gradient, returned, and alpha's partial sums (then ``u_bias``'s, where given), one row per program
    (:func:`split_rows` of the rows) written into ``parts`` (rows of any stride, columns contiguous), for the caller
    to add."""
    C = grad.shape[-1]
    R = grad.numel() // C
    gu = torch.empty(u.shape, dtype=u.dtype, device=u.device)
    P, per_program = split_rows(R, grad.device)
    block = min(block_size(C), 128)
    mask_ptr, inv_keep, has_mask = mask_args(mask, keep, grad)
    _gr_bwd[(P, triton.cdiv(C, block))](grad, u, alpha if u_bias is None else u_bias, alpha, mask_ptr, gu, parts,
                                         parts.stride(0), R, C, per_program, _per_sample(grad), inv_keep,
                                         HAS_MASK=has_mask, HAS_UB=u_bias is not None, ROWS=ROWS, BLOCK=block)
    return gu


def gelu_and_grad(grad_h, u):
    h, gu = torch.empty_like(u), torch.empty_like(u)
    n = u.numel()
    _gg[(triton.cdiv(n, 1024),)](grad_h, u, h, gu, n, BLOCK=1024)
    return h, gu


def qk_normalize(q, k, q_scale, eps):
    *lead, D = q.shape
    d0, d1, d2 = lead if len(lead) == 3 else (1, 1, max(1, q.numel() // D))
    if len(lead) != 3:
        q, k = q.reshape(1, 1, -1, D), k.reshape(1, 1, -1, D)
    R = d0 * d1 * d2
    qn = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    kn = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    rq = torch.empty(q.shape[:-1] + (1,), dtype=q.dtype, device=q.device)
    rk = torch.empty(k.shape[:-1] + (1,), dtype=k.dtype, device=k.device)
    programs_q = triton.cdiv(R, ROWS)
    _qkn_fwd[(2 * programs_q,)](q, *q.stride(), k, *k.stride(), d1, d2, qn, kn, rq, rk, R, D, q_scale, eps,
                                programs_q, ROWS=ROWS, BLOCK=block_size(D))
    shape = tuple(lead) + (D,)
    return qn.view(shape), kn.view(shape), rq.view(shape[:-1] + (1,)), rk.view(shape[:-1] + (1,))


def qk_normalize_backward(grad_q, grad_k, qn, kn, rq, rk, q_scale):
    D = qn.shape[-1]
    R = qn.numel() // D
    gq, gk = torch.empty_like(qn), torch.empty_like(kn)
    programs_q = triton.cdiv(R, ROWS)
    _qkn_bwd[(2 * programs_q,)](grad_q.contiguous(), grad_k.contiguous(), qn, kn, rq, rk, gq, gk, R, D, q_scale,
                                programs_q, ROWS=ROWS, BLOCK=block_size(D))
    return gq, gk


def _sr_launch(maps: list, weights: list) -> tuple:
    """The scale_rows kernels' launch: one program a row of every map, a block of columns for the widest, and the
    maps' arguments (one map's twice, where the op has one: the kernel never reaches the second)."""
    grid = (sum(w.shape[0] for w in weights),)
    return grid, min(block_size(max(w.shape[1] for w in weights)), 1024), maps if len(maps) == 2 else maps * 2


def scale_rows(weights, biases, scales, input_scales):
    maps, out = [], []
    for w, b, s, c in zip(weights, biases, scales, input_scales):
        w = w.contiguous()
        wo, bo = torch.empty_like(w), torch.empty_like(b)
        has_b = b.numel() > 0  # without one, any pointers: never read
        maps.append(((w, b if has_b else w, s, wo, bo if has_b else wo, w.shape[1], c), has_b))
        out += [wo, bo]
    grid, block, ((m0, has0), (m1, has1)) = _sr_launch(maps, weights)
    _sr_fwd[grid](*m0[:5], weights[0].shape[0], *m0[5:], *m1, HAS_B0=has0, HAS_B1=has1, BLOCK=block)
    return out


def scale_rows_backward(grads_w, grads_b, weights, biases, scales, input_scales):
    maps, out = [], []
    for gw, gb, w, b, s, c in zip(grads_w, grads_b, weights, biases, scales, input_scales):
        gw, w = gw.contiguous(), w.contiguous()
        gwo, gbo, gso = torch.empty_like(w), torch.empty_like(b), torch.empty_like(s)
        has_b = b.numel() > 0  # without one, any pointers: never read
        maps.append(((gw, gb if has_b else gw, w, b if has_b else w, s, gwo, gbo if has_b else gwo, gso,
                      w.shape[1], c), has_b))
        out += [gwo, gbo, gso]
    grid, block, ((m0, has0), (m1, has1)) = _sr_launch(maps, weights)
    _sr_bwd[grid](*m0[:8], weights[0].shape[0], *m0[8:], *m1, HAS_B0=has0, HAS_B1=has1, BLOCK=block)
    return out
