"""Triton kernels of CSwin's stripes (:mod:`lipsformer.layers.stripes`): the gather, with each branch's LePE, and the
merge, one pass each way, in float32 arithmetic whatever the tensors' dtypes (:mod:`lipsformer.layers.triton_kernels`'
conventions). Imported on the first CUDA call; tests run them on the CPU through Triton's interpreter.

A stripe is a window of ``wh`` x ``ww`` tokens of the (B, H, W) map; a branch's tensors are (windows, tokens, heads,
d), tokens row-major inside a window. LePE is a depth-wise 3x3 convolution of v inside each window (zero outside it):
``l[p] = b + sum_t w[t] v[p + t]`` over the nine offsets ``t``, so ``dv[p] = sum_t w[t] dl[p - t]`` and
``dw[t] = sum_p dl[p] v[p + t]``. The weight's and bias's gradients are summed per block of tokens into partial sums,
which a second launch adds, as the other reducing kernels do.

The kernels pick a branch's and a part's tensors by calling their helper once per case rather than selecting
pointers and sizes in an ``if`` and calling it once: Triton specialises an integer argument equal to 1 into a
constant (CSwin-T's first stripes are 1 wide), which such an ``if`` would have to merge with the other branch's
value; one call per case keeps each specialisation (and is untested on a GPU either way).
"""
import torch
import triton
import triton.language as tl

from .triton_kernels import ROWS, block_size, split_rows


@triton.jit
def _map_offset(rows, H, W, wh, ww):
    """The map position (b * H + y) * W + x of each row of a (windows * tokens) row-major layout whose windows are
    ``wh`` x ``ww``, in raster order over a (B, H, W) map, tokens row-major inside."""
    n_w = W // ww
    per_image = (H // wh) * n_w
    N = wh * ww
    win, tok = rows // N, rows % N
    img, w_in = win // per_image, win % per_image
    y = (w_in // n_w) * wh + tok // ww
    x = (w_in % n_w) * ww + tok % ww
    return (img * H + y) * W + x


@triton.jit
def _neighbour(tokens, t, sign, wh, ww):
    """The token ``sign`` * (offset ``t`` of the 3x3) away from each of ``tokens`` (window * N + token) in its window,
    and whether it lies inside the window."""
    N = wh * ww
    win, tok = tokens // N, tokens % N
    y = tok // ww + sign * (t // 3 - 1)
    x = tok % ww + sign * (t % 3 - 1)
    inside = (y >= 0) & (y < wh) & (x >= 0) & (x < ww)
    return win * N + y * ww + x, inside


@triton.jit
def _sqkv_part(qkv, dst, r_ptr, pid, R, heads, d, C3, col0, H, W, wh, ww, scale, eps, NORM: tl.constexpr,
               ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Rows (window, token, head) ``pid * ROWS ..`` of one branch's q, k or v: read from the projection's channels
    ``col0 + head * d ..``, normalised (times ``scale``) where ``NORM``, written contiguous."""
    rows = (pid * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    row_ok, col_ok = rows < R, cols < d
    ok = row_ok[:, None] & col_ok[None, :]
    src = _map_offset(rows // heads, H, W, wh, ww) * C3 + col0 + (rows % heads) * d
    x = tl.load(qkv + src[:, None] + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    if NORM:
        r = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) + eps)
        x = x * (r * scale)[:, None]
        tl.store(r_ptr + rows, r.to(r_ptr.dtype.element_ty), mask=row_ok)
    tl.store(dst + rows[:, None] * d + cols[None, :], x.to(dst.dtype.element_ty), mask=ok)


@triton.jit
def _lepe_part(qkv, dst, w, b, pid, R, heads, d, C3, col0, H, W, wh, ww, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Rows (window, token, head) of one branch's LePE: its v's nine neighbours in the window, read from the
    projection, weighted per channel, plus the bias; written contiguous."""
    rows = (pid * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    row_ok, col_ok = rows < R, cols < d
    ok = row_ok[:, None] & col_ok[None, :]
    head = rows % heads
    channel = (head * d)[:, None] + cols[None, :]
    acc = tl.load(b + channel, mask=ok, other=0.0).to(tl.float32)
    for t in tl.static_range(9):
        near, inside = _neighbour(rows // heads, t, 1, wh, ww)
        src = _map_offset(near, H, W, wh, ww) * C3 + col0 + head * d
        v = tl.load(qkv + src[:, None] + cols[None, :], mask=ok & inside[:, None], other=0.0).to(tl.float32)
        acc += tl.load(w + channel * 9 + t, mask=ok, other=0.0).to(tl.float32) * v
    tl.store(dst + rows[:, None] * d + cols[None, :], acc.to(dst.dtype.element_ty), mask=ok)


@triton.jit
def _sqkv_fwd(qkv, q0, k0, v0, l0, w0, b0, q1, k1, v1, l1, w1, b1, r_ptr, R, heads, d, C, H, W, wh0, ww0, wh1, ww1,
              q_scale, eps, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    pid, part, branch = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    Cb = C // tl.num_programs(2)
    col0 = part * C + branch * Cb
    v_col0 = 2 * C + branch * Cb
    r_q = r_ptr + (branch * 2) * R
    if branch == 0:
        if part == 0:
            _sqkv_part(qkv, q0, r_q, pid, R, heads, d, 3 * C, col0, H, W, wh0, ww0, q_scale, eps, True, ROWS, BLOCK)
        elif part == 1:
            _sqkv_part(qkv, k0, r_q + R, pid, R, heads, d, 3 * C, col0, H, W, wh0, ww0, 1.0, eps, True, ROWS, BLOCK)
        elif part == 2:
            _sqkv_part(qkv, v0, r_q, pid, R, heads, d, 3 * C, col0, H, W, wh0, ww0, 1.0, eps, False, ROWS, BLOCK)
        else:
            _lepe_part(qkv, l0, w0, b0, pid, R, heads, d, 3 * C, v_col0, H, W, wh0, ww0, ROWS, BLOCK)
    else:
        if part == 0:
            _sqkv_part(qkv, q1, r_q, pid, R, heads, d, 3 * C, col0, H, W, wh1, ww1, q_scale, eps, True, ROWS, BLOCK)
        elif part == 1:
            _sqkv_part(qkv, k1, r_q + R, pid, R, heads, d, 3 * C, col0, H, W, wh1, ww1, 1.0, eps, True, ROWS, BLOCK)
        elif part == 2:
            _sqkv_part(qkv, v1, r_q, pid, R, heads, d, 3 * C, col0, H, W, wh1, ww1, 1.0, eps, False, ROWS, BLOCK)
        else:
            _lepe_part(qkv, l1, w1, b1, pid, R, heads, d, 3 * C, v_col0, H, W, wh1, ww1, ROWS, BLOCK)


@triton.jit
def _sqkv_bwd_part(g, gs0, gs1, gs2, gs3, out, r_ptr, gl, w, dst, pid, R, heads, d, C3, col0, H, W, wh, ww, scale,
                   NORM: tl.constexpr, LEPE: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """The projection's gradient at one branch's q, k or v: from ``g`` (windows, tokens, heads, d) of any strides,
    through the normalisation's derivative where ``NORM`` (the saved output and ``1 / norm``), plus at v (``LEPE``)
    the LePE's: its output's gradient ``gl`` (contiguous) at the nine neighbours, weighted; to the map."""
    rows = (pid * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    row_ok, col_ok = rows < R, cols < d
    ok = row_ok[:, None] & col_ok[None, :]
    N = wh * ww
    tokens = rows // heads
    head = rows % heads
    goff = (tokens // N) * gs0 + (tokens % N) * gs1 + head * gs2
    gx = tl.load(g + goff[:, None] + cols[None, :] * gs3, mask=ok, other=0.0).to(tl.float32)
    if NORM:
        o = tl.load(out + rows[:, None] * d + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        r = tl.load(r_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        dot = tl.sum(o * gx, axis=1)
        gx = (gx - o * (dot / (scale * scale))[:, None]) * (r * scale)[:, None]
    if LEPE:
        channel = (head * d)[:, None] + cols[None, :]
        for t in tl.static_range(9):
            near, inside = _neighbour(tokens, t, -1, wh, ww)
            gn = tl.load(gl + (near * heads + head)[:, None] * d + cols[None, :], mask=ok & inside[:, None],
                         other=0.0).to(tl.float32)
            gx += tl.load(w + channel * 9 + t, mask=ok, other=0.0).to(tl.float32) * gn
    dst_off = _map_offset(tokens, H, W, wh, ww) * C3 + col0 + head * d
    tl.store(dst + dst_off[:, None] + cols[None, :], gx.to(dst.dtype.element_ty), mask=ok)


@triton.jit
def _lepe_sums(gl, v, part_ptr, pid, T, Cb, wh, ww, tokens_per_program, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """One block of tokens' partial sums of one branch's LePE gradients: ``sum dl[p] v[p + t]`` for the nine offsets
    (the weight's, (Cb, 9) row-major) and ``sum dl[p]`` (the bias's), ``10 * Cb`` values at ``part_ptr``."""
    cols = tl.arange(0, BLOCK)
    col_ok = cols < Cb
    taps = tl.arange(0, 16)
    acc = tl.zeros([16, BLOCK], tl.float32)
    first = pid * tokens_per_program
    for start in range(first, first + tokens_per_program, ROWS):
        tokens = (start + tl.arange(0, ROWS)).to(tl.int64)
        ok = (tokens < T)[:, None] & col_ok[None, :]
        g = tl.load(gl + tokens[:, None] * Cb + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        acc += tl.where(taps[:, None] == 9, tl.sum(g, axis=0)[None, :], 0.0)
        for t in tl.static_range(9):
            near, inside = _neighbour(tokens, t, 1, wh, ww)
            x = tl.load(v + near[:, None] * Cb + cols[None, :], mask=ok & inside[:, None], other=0.0).to(tl.float32)
            acc += tl.where(taps[:, None] == t, tl.sum(g * x, axis=0)[None, :], 0.0)
    offs = tl.where(taps[:, None] < 9, cols[None, :] * 9 + taps[:, None], 9 * Cb + cols[None, :])
    tl.store(part_ptr + offs, acc, mask=(taps[:, None] < 10) & col_ok[None, :])


@triton.jit
def _sqkv_bwd(gq0, q0s0, q0s1, q0s2, q0s3, gk0, k0s0, k0s1, k0s2, k0s3, gv0, v0s0, v0s1, v0s2, v0s3, gl0,
              gq1, q1s0, q1s1, q1s2, q1s3, gk1, k1s0, k1s1, k1s2, k1s3, gv1, v1s0, v1s1, v1s2, v1s3, gl1,
              qn0, kn0, v0, w0, qn1, kn1, v1, w1, r_ptr, dst, parts, R, heads, d, C, H, W, wh0, ww0, wh1, ww1,
              q_scale, sum_programs, tokens_per_program, ROWS: tl.constexpr, BLOCK: tl.constexpr,
              SUM_BLOCK: tl.constexpr):
    pid, part, branch = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    Cb = C // tl.num_programs(2)
    col0 = part * C + branch * Cb
    r_q = r_ptr + (branch * 2) * R
    part_ptr = parts + (pid * tl.num_programs(2) + branch) * 10 * Cb
    if part == 3:  # the LePE's weight and bias: the first sum_programs programs
        if pid < sum_programs:
            if branch == 0:
                _lepe_sums(gl0, v0, part_ptr, pid, R // heads, Cb, wh0, ww0, tokens_per_program, ROWS, SUM_BLOCK)
            else:
                _lepe_sums(gl1, v1, part_ptr, pid, R // heads, Cb, wh1, ww1, tokens_per_program, ROWS, SUM_BLOCK)
    elif branch == 0:
        if part == 0:
            _sqkv_bwd_part(gq0, q0s0, q0s1, q0s2, q0s3, qn0, r_q, gl0, w0, dst, pid, R, heads, d, 3 * C, col0, H, W,
                           wh0, ww0, q_scale, True, False, ROWS, BLOCK)
        elif part == 1:
            _sqkv_bwd_part(gk0, k0s0, k0s1, k0s2, k0s3, kn0, r_q + R, gl0, w0, dst, pid, R, heads, d, 3 * C, col0, H,
                           W, wh0, ww0, 1.0, True, False, ROWS, BLOCK)
        else:
            _sqkv_bwd_part(gv0, v0s0, v0s1, v0s2, v0s3, qn0, r_q, gl0, w0, dst, pid, R, heads, d, 3 * C, col0, H, W,
                           wh0, ww0, 1.0, False, True, ROWS, BLOCK)
    else:
        if part == 0:
            _sqkv_bwd_part(gq1, q1s0, q1s1, q1s2, q1s3, qn1, r_q, gl1, w1, dst, pid, R, heads, d, 3 * C, col0, H, W,
                           wh1, ww1, q_scale, True, False, ROWS, BLOCK)
        elif part == 1:
            _sqkv_bwd_part(gk1, k1s0, k1s1, k1s2, k1s3, kn1, r_q + R, gl1, w1, dst, pid, R, heads, d, 3 * C, col0, H,
                           W, wh1, ww1, 1.0, True, False, ROWS, BLOCK)
        else:
            _sqkv_bwd_part(gv1, v1s0, v1s1, v1s2, v1s3, qn1, r_q, gl1, w1, dst, pid, R, heads, d, 3 * C, col0, H, W,
                           wh1, ww1, 1.0, False, True, ROWS, BLOCK)


@triton.jit
def _smerge_part(o, os0, os1, os2, os3, lepe, ls0, ls1, ls2, ls3, out, pid, R, d, Cb, C, col0, H, W, wh, ww,
                 ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Rows (window, token) of one branch: attention output (windows, heads, tokens, d) plus LePE (windows, C_b, wh,
    ww), both of any strides, into the map's channels ``col0 ..``."""
    rows = (pid * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    row_ok, col_ok = rows < R, cols < Cb
    ok = row_ok[:, None] & col_ok[None, :]
    N = wh * ww
    win, tok = rows // N, rows % N
    a = tl.load(o + (win * os0 + tok * os2)[:, None] + ((cols // d) * os1 + (cols % d) * os3)[None, :], mask=ok,
                other=0.0).to(tl.float32)
    b = tl.load(lepe + (win * ls0 + (tok // ww) * ls2 + (tok % ww) * ls3)[:, None] + (cols * ls1)[None, :], mask=ok,
                other=0.0).to(tl.float32)
    dst = _map_offset(rows, H, W, wh, ww) * C + col0
    tl.store(out + dst[:, None] + cols[None, :], (a + b).to(out.dtype.element_ty), mask=ok)


@triton.jit
def _smerge_fwd(o0, o0s0, o0s1, o0s2, o0s3, l0, l0s0, l0s1, l0s2, l0s3, o1, o1s0, o1s1, o1s2, o1s3,
                l1, l1s0, l1s1, l1s2, l1s3, out, R, d, Cb, H, W, wh0, ww0, wh1, ww1, ROWS: tl.constexpr,
                BLOCK: tl.constexpr):
    pid, branch = tl.program_id(0), tl.program_id(1)
    C = Cb * tl.num_programs(1)
    if branch == 0:
        _smerge_part(o0, o0s0, o0s1, o0s2, o0s3, l0, l0s0, l0s1, l0s2, l0s3, out, pid, R, d, Cb, C, 0, H, W, wh0, ww0,
                     ROWS, BLOCK)
    else:
        _smerge_part(o1, o1s0, o1s1, o1s2, o1s3, l1, l1s0, l1s1, l1s2, l1s3, out, pid, R, d, Cb, C, Cb, H, W, wh1,
                     ww1, ROWS, BLOCK)


@triton.jit
def _smerge_bwd_part(g, dst, pid, R, Cb, C, col0, H, W, wh, ww, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows = (pid * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    row_ok, col_ok = rows < R, cols < Cb
    ok = row_ok[:, None] & col_ok[None, :]
    src = _map_offset(rows, H, W, wh, ww) * C + col0
    x = tl.load(g + src[:, None] + cols[None, :], mask=ok, other=0.0)
    tl.store(dst + rows[:, None] * Cb + cols[None, :], x.to(dst.dtype.element_ty), mask=ok)


@triton.jit
def _smerge_bwd(g, g0, g1, R, Cb, H, W, wh0, ww0, wh1, ww1, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    pid, branch = tl.program_id(0), tl.program_id(1)
    C = Cb * tl.num_programs(1)
    if branch == 0:
        _smerge_bwd_part(g, g0, pid, R, Cb, C, 0, H, W, wh0, ww0, ROWS, BLOCK)
    else:
        _smerge_bwd_part(g, g1, pid, R, Cb, C, Cb, H, W, wh1, ww1, ROWS, BLOCK)


def _two(windows):
    """Two windows' sizes, the second repeating the first where there is one branch (never read)."""
    (wh0, ww0), (wh1, ww1) = windows[0], windows[-1]
    return wh0, ww0, wh1, ww1


def stripe_qkv(qkv, lepe_weights, windows, heads, q_scale, eps):
    B, H, W, C3 = qkv.shape
    nb, C = len(windows), C3 // 3
    d = C // (nb * heads)
    R = B * H * W * heads  # rows of each part: windows * tokens * heads
    outs = [qkv.new_empty(B * (H // wh) * (W // ww), wh * ww, heads, d) for wh, ww in windows for _ in range(4)]
    norms = qkv.new_empty(nb, 2, R)
    ptrs = outs + outs[:4] if nb == 1 else outs
    w = list(lepe_weights) * (2 if nb == 1 else 1)  # (weight, bias) per branch
    args = ptrs[:4] + w[:2] + ptrs[4:] + w[2:4]
    _sqkv_fwd[(triton.cdiv(R, ROWS), 4, nb)](qkv, *args, norms, R, heads, d, C, H, W, *_two(windows), q_scale, eps,
                                             ROWS=ROWS, BLOCK=block_size(d))
    outs += [qkv.new_empty(0) for _ in range(8 - len(outs))]
    return (*outs, norms)


def stripe_qkv_backward(grads, outs, weights, norms, windows, H, W, q_scale, sum_dtype):
    """The projection's gradient and the LePE weights' and biases' summed, (branches, 10 * C_b): from each branch's
    q, k, v and LePE output gradients (the LePE's contiguous), the saved q, k (normalised) and v, and the LePE
    weights."""
    nb = len(windows)
    qn0 = outs[0]
    heads, d = qn0.shape[2], qn0.shape[3]
    R = qn0.numel() // d
    C, Cb = nb * heads * d, heads * d
    dst = qn0.new_empty(R // (heads * H * W), H, W, 3 * C)
    programs, tokens_per_program = split_rows(R // heads, qn0.device)
    parts = qn0.new_empty(programs, nb, 10 * Cb, dtype=torch.float32)
    strided = []
    for b in list(range(nb)) * (2 if nb == 1 else 1):
        strided += [a for g in grads[4 * b:4 * b + 3] for a in (g, *g.stride())] + [grads[4 * b + 3]]
    saved = []
    for b in list(range(nb)) * (2 if nb == 1 else 1):
        saved += [outs[3 * b], outs[3 * b + 1], outs[3 * b + 2], weights[b]]
    _sqkv_bwd[(max(triton.cdiv(R, ROWS), programs), 4, nb)](
        *strided, *saved, norms, dst, parts, R, heads, d, C, H, W, *_two(windows), q_scale, programs,
        tokens_per_program, ROWS=ROWS, BLOCK=block_size(d), SUM_BLOCK=block_size(Cb))
    return dst, parts.sum(0).to(sum_dtype)


def stripe_merge(outs, lepes, windows, H, W):
    nb = len(windows)
    o0, l0 = outs[0], lepes[0]
    Bw, heads, N, d = o0.shape
    Cb = heads * d
    R = Bw * N  # rows of each branch: windows * tokens
    out = o0.new_empty(R // (H * W), H, W, nb * Cb, dtype=torch.promote_types(o0.dtype, l0.dtype))
    pairs = list(zip(outs, lepes)) * (2 if nb == 1 else 1)
    args = [a for o, lepe in pairs for a in (o, *o.stride(), lepe, *lepe.stride())]
    _smerge_fwd[(triton.cdiv(R, ROWS), nb)](*args, out, R, d, Cb, H, W, *_two(windows), ROWS=ROWS, BLOCK=block_size(Cb))
    return out


def stripe_merge_backward(grad, windows, heads):
    B, H, W, C = grad.shape
    nb = len(windows)
    Cb = C // nb
    R = B * H * W
    gs = [grad.new_empty(B * (H // wh) * (W // ww), wh * ww, heads, Cb // heads) for wh, ww in windows]
    g1 = gs[1] if nb > 1 else gs[0]
    _smerge_bwd[(triton.cdiv(R, ROWS), nb)](grad, gs[0], g1, R, Cb, H, W, *_two(windows), ROWS=ROWS,
                                            BLOCK=block_size(Cb))
    return gs[0], gs[1] if nb > 1 else grad.new_empty(0)
