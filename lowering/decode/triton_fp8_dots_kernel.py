"""Stage 1 of MLA decode over an fp8 e4m3 cache with every product an fp8 tensor-core dot.

The stage-1 kernel (triton_decode_kernel.py, KV_KIND 1) widens each fp8 cache tile to
fp16 in registers before its dots. A load whose value goes through such a conversion is
not turned into an asynchronous copy by Triton's pipeliner, so at few query rows (16
heads: memory-bound) that kernel waits out the memory latency once per tile and reads
~1 TB/s, where the bf16 kernel, whose tiles feed its dots directly, reads ~3.3 TB/s.

Here the cache tile feeds only dots, in fp8, so it is copied like the bf16 tile:

    s = q . kv^T        q as fp8 terms:  q * 2^e = q_hi + q_lo       [BLOCK_M, BLOCK_N]
    o += p @ kv_c       p as fp8 terms:  p * 256 = p_hi + p_lo       [BLOCK_M, L]

A bf16 query row is scaled by a power of two e (exact) so that its largest element is
at most 256, then written as the sum of two e4m3 values per element: q_hi = e4m3(q),
q_lo = e4m3(q - q_hi). e4m3 keeps 4 significant bits, so the pair keeps ~8, about a
bf16's, down to e4m3's subnormal step (2^-9, i.e. 2^-17 of the row's largest element).
p (in [0, 1] after the running max) is split the same way after scaling by 256. Each
term is one dot with fp32 accumulation: a bf16 query is represented exactly (its 8 bits
fit two 4-bit terms), and P to about a bf16's rounding, as the stage-1 kernel rounds it; the softmax sum l adds the unsplit p. An fp8 query (Q_FP8) is one term with
its q_scale, as the stage-1 kernel's KV_KIND 2 but with P @ V in fp8 as well.

Everything else is the stage-1 kernel's: the folded (token, head) rows, the page
gather, the causal limit, the device-side split sizing, DIRECT or fp32 partials for the
merge kernel, bounded page ids and lengths.

    grid = (cdiv(s_q * H, BLOCK_M), B, num_splits)

fp8 dots need a reduction width of at least 32: R >= 32 and BLOCK_N >= 32 (the launcher
only gives this kernel such calls).
"""
import triton
import triton.language as tl


@triton.jit
def _operand(x, DOT_F32: tl.constexpr):
    # The CPU interpreter mis-multiplies fp8 dots; it gets the (exact) fp32 values instead.
    if DOT_F32:
        return x.to(tl.float32)
    else:
        return x


@triton.jit
def _top4(x):
    # x (fp32) rounded to its 4 leading significant bits, to nearest (ties away from zero),
    # on the bits: add half of the 20 dropped mantissa bits' weight, then clear them (a
    # carry into the exponent is the right rounding). The e4m3 cast after it is then exact
    # for normal e4m3 values. Rounding here rather than in the cast keeps the split the same
    # under the CPU interpreter, whose fp32 -> e4m3 cast rounds wrongly where rounding
    # carries; bit operations also cannot be contracted into FMAs as arithmetic tricks can.
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x80000) & -1048576          # -1048576 = 0xFFF00000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _fp8_pair(x):
    """x (fp32, |x| <= 256) as two e4m3 terms, hi + lo ~ x to ~8 significant bits."""
    hi = _top4(x)
    lo = _top4(x - hi)
    return hi.to(tl.float8e4nv), lo.to(tl.float8e4nv)


@triton.jit
def mla_decode_fp8_dots_kernel(
    q_ptr,            # [B, s_q * H, L + R] rows contiguous; bf16/fp16, or e4m3 with Q_FP8
    kv_ptr,           # [num_blocks * PAGE, L + R] e4m3
    block_table_ptr,  # [B, max_blocks] int32
    seqlens_ptr,      # [B] int32
    q_scale_ptr,      # [1] fp32 (read when Q_FP8)
    k_scale_ptr,      # [1] fp32
    out_ptr,          # DIRECT: [B, s_q * H, L]; else [B, num_splits, s_q * H, L] fp32
    lse_ptr,          # DIRECT: [B, H, s_q] fp32; else [B, num_splits, s_q * H] fp32
    sm_scale,
    stride_qb, stride_bt, max_blocks, num_blocks,
    S_Q: tl.constexpr, H: tl.constexpr,
    L: tl.constexpr, R: tl.constexpr,
    PAGE: tl.constexpr,
    CAUSAL: tl.constexpr,
    num_splits,
    DIRECT: tl.constexpr,
    FIXED_CHUNK: tl.constexpr,
    Q_FP8: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    D: tl.constexpr = L + R
    ROWS: tl.constexpr = S_Q * H
    pid_m = tl.program_id(0)
    b = tl.program_id(1)
    split = tl.program_id(2)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)          # [BLOCK_M] folded (token, head)
    row_ok = rows < ROWS
    seqlen = tl.minimum(tl.maximum(tl.load(seqlens_ptr + b), 1), max_blocks * PAGE)
    if CAUSAL:
        limit = seqlen - S_Q + rows // H + 1
    else:
        limit = tl.zeros([BLOCK_M], dtype=tl.int32) + seqlen
    if FIXED_CHUNK > 0:
        chunk = FIXED_CHUNK
    else:
        chunk = tl.cdiv(tl.cdiv(seqlen, num_splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, seqlen)

    # ---- the query as fp8 terms, once --------------------------------------------------
    offs_l = tl.arange(0, L)
    offs_r = tl.arange(0, R)
    q_rows = q_ptr + b.to(tl.int64) * stride_qb + rows[:, None] * D
    q_nope = tl.load(q_rows + offs_l[None, :], mask=row_ok[:, None], other=0.0)      # [BLOCK_M, L]
    q_pe = tl.load(q_rows + L + offs_r[None, :], mask=row_ok[:, None], other=0.0)    # [BLOCK_M, R]
    qk_scale = tl.cast(sm_scale, tl.float32) * 1.4426950408889634 * tl.load(k_scale_ptr)
    k_scale = tl.load(k_scale_ptr)
    if Q_FP8:
        qk_scale = qk_scale * tl.load(q_scale_ptr)
        row_scale = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
        qn_hi = q_nope
        qp_hi = q_pe
        qn_lo = q_nope       # unused
        qp_lo = q_pe         # unused
    else:
        qn = q_nope.to(tl.float32)
        qp = q_pe.to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(qn), 1), tl.max(tl.abs(qp), 1))            # [BLOCK_M]
        amax = tl.where(amax > 0.0, amax, 1.0)
        e = tl.floor(tl.log2(256.0 / amax))                                          # 2^e * amax <= 256
        up = tl.exp2(e)
        row_scale = tl.exp2(-e)
        qn = qn * up[:, None]
        qp = qp * up[:, None]
        qn_hi, qn_lo = _fp8_pair(qn)
        qp_hi, qp_lo = _fp8_pair(qp)
    score_scale = qk_scale * row_scale                                               # [BLOCK_M]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, L], dtype=tl.float32)          # sum of (256 p) @ kv_c

    offs_n = tl.arange(0, BLOCK_N)
    bt_row = block_table_ptr + b.to(tl.int64) * stride_bt
    for n0 in tl.range(start, end, BLOCK_N):
        pos = n0 + offs_n
        in_range = pos < end
        page = tl.load(bt_row + pos // PAGE, mask=in_range, other=0)
        page = tl.minimum(tl.maximum(page, 0), num_blocks - 1)
        kv_row = (page.to(tl.int64) * PAGE + pos % PAGE) * D
        kv_c = tl.load(kv_ptr + kv_row[:, None] + offs_l[None, :],
                       mask=in_range[:, None], other=0.0)                         # [BLOCK_N, L] e4m3
        k_pe = tl.load(kv_ptr + kv_row[:, None] + L + offs_r[None, :],
                       mask=in_range[:, None], other=0.0)                         # [BLOCK_N, R] e4m3
        kc_t = tl.trans(_operand(kv_c, DOT_F32))
        kp_t = tl.trans(_operand(k_pe, DOT_F32))

        s = tl.dot(_operand(qn_hi, DOT_F32), kc_t)
        s = tl.dot(_operand(qp_hi, DOT_F32), kp_t, s)
        if not Q_FP8:
            s = tl.dot(_operand(qn_lo, DOT_F32), kc_t, s)
            s = tl.dot(_operand(qp_lo, DOT_F32), kp_t, s)                          # [BLOCK_M, BLOCK_N]
        s = s * score_scale[:, None]
        visible = in_range[None, :] & (pos[None, :] < limit[:, None])
        s = tl.where(visible, s, float("-inf"))

        m_tile = tl.max(s, 1)
        m_new = tl.maximum(m_i, m_tile)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])                     # [BLOCK_M, BLOCK_N] in [0, 1]
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        m_i = m_new

        p_hi, p_lo = _fp8_pair(p * 256.0)
        v = _operand(kv_c, DOT_F32)
        acc = tl.dot(_operand(p_hi, DOT_F32), v, acc)
        acc = tl.dot(_operand(p_lo, DOT_F32), v, acc)

    # ---- epilogue: normalise, write (out, lse) ---------------------------------------
    has_keys = l_i > 0.0
    l_safe = tl.where(has_keys, l_i, 1.0)
    o = acc * ((k_scale / 256.0) / l_safe)[:, None]         # [BLOCK_M, L]
    lse = tl.where(has_keys, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    if DIRECT:
        o_ptrs = out_ptr + (b.to(tl.int64) * ROWS + rows[:, None]) * L + offs_l[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        lse_off = b * ROWS + (rows % H) * S_Q + rows // H
        tl.store(lse_ptr + lse_off, lse, mask=row_ok)
    else:
        part = (b.to(tl.int64) * num_splits + split) * ROWS + rows
        tl.store(out_ptr + part[:, None] * L + offs_l[None, :], o, mask=row_ok[:, None])
        tl.store(lse_ptr + part, lse, mask=row_ok)
