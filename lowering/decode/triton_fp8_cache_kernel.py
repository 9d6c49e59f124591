"""Stage 1 of MLA decode over an fp8 cache, for the memory-bound shapes (few query rows).

Same contract as triton_decode_kernel.py (grid, split bounds, partial or direct outputs,
merged by merge_kernel.py); what differs is how the fp8 tiles reach the tensor cores.
At 16 heads a request has 16 query rows, so each cache byte takes part in few FLOPs
and the kernel is bound by bytes: the HBM bytes of the fp8 tiles, and each pass a tile
makes through shared memory (an H200 SM moves about 7 shared-memory bytes per HBM byte
it receives). So the key tile is the M side of both products:

    s^T  = kv_c @ q_nope^T + k_pe @ q_pe^T        # [BLOCK_N, BLOCK_M]: keys are the MMA rows
    o^T += kv_c^T @ p^T                           # [L, BLOCK_M]: value columns are the rows

With BLOCK_N >= 64 Hopper runs both as warpgroup MMAs whose A operand (the cache tile,
widened from e4m3 to fp16 in registers right before the dot: exact, no fp32 round trip)
comes from registers, and whose B operand (q^T, p^T: BLOCK_M = 16 columns) is small and
read from shared memory (at BLOCK_N = 32 the 32-row QK product runs as mma.sync instead,
each warp reloading q^T per tile); the softmax reduces over axis 0. The L value columns
are taken in four chunks of L / 4 (four dots and four accumulators o^T_j [L / 4,
BLOCK_M]), so a widened operand is L / 4 columns wide, not L: a whole [64, 512] fp16 A
operand is 128 registers per thread of a warpgroup, which spilled.

RELOAD_V = True reads the value chunks again for P V (from L2, just read) instead of
keeping the tile across the softmax. Each load then has one use, which lets the pipeliner
(num_stages) turn the tile's loads into asynchronous copies; compiled for SM90 with
triton 3.9, a chunk used by both products is loaded synchronously (only k_pe, used once,
is pipelined). The price: twice the L2 reads. (A register double buffer of the next tile
was tried too: it spilled 1-3 KB per thread at every tile size.)

Query (FP8_Q):
  False: q bf16/fp16, scaled by 1/16 (exact) before its one-time cast to fp16, so |q| up
         to 1e6 stays finite; the 16 is folded into the score scale.
  True:  q fp8 e4m3 with q_scale (value = stored * q_scale), widened to fp16 (exact).
The per-tensor k_scale (value = stored * k_scale) is folded into the score scale and the
output scale. p goes to fp16 for P V (better than bf16's 8 bits on [0, 1]).

    grid = (cdiv(s_q * H, BLOCK_M), B, num_splits)
"""
import triton
import triton.language as tl


@triton.jit
def _operand(x, DOT_F32: tl.constexpr):
    # Triton's CPU interpreter mis-multiplies 16-bit dots; it is given fp32 operands
    # (already rounded to fp16) instead. On GPUs DOT_F32 is False.
    if DOT_F32:
        return x.to(tl.float32)
    else:
        return x


@triton.jit
def _widen(x, DOT_F32: tl.constexpr):
    """An fp8 tile as a 16-bit MMA operand."""
    return _operand(x.to(tl.float16), DOT_F32)


@triton.jit
def _load_tile(kv_ptr, bt_row, n0, end, num_blocks, offs_n, offs_c, offs_r,
               L: tl.constexpr, R: tl.constexpr, PAGE: tl.constexpr):
    """The fp8 cache rows of key positions n0 + offs_n, zeros past `end`: the four
    L / 4-column chunks of kv_c [BLOCK_N, L / 4] each, k_pe [BLOCK_N, R], in_range."""
    LC: tl.constexpr = L // 4
    pos = n0 + offs_n                                                        # [BLOCK_N]
    in_range = pos < end
    page = tl.load(bt_row + pos // PAGE, mask=in_range, other=0)
    page = tl.minimum(tl.maximum(page, 0), num_blocks - 1)
    row = kv_ptr + ((page.to(tl.int64) * PAGE + pos % PAGE) * (L + R))[:, None]  # [BLOCK_N, 1]
    ok = in_range[:, None]
    c0 = tl.load(row + offs_c[None, :], mask=ok, other=0.0)                  # [BLOCK_N, LC] fp8
    c1 = tl.load(row + LC + offs_c[None, :], mask=ok, other=0.0)
    c2 = tl.load(row + 2 * LC + offs_c[None, :], mask=ok, other=0.0)
    c3 = tl.load(row + 3 * LC + offs_c[None, :], mask=ok, other=0.0)
    pe = tl.load(row + L + offs_r[None, :], mask=ok, other=0.0)              # [BLOCK_N, R] fp8
    return c0, c1, c2, c3, pe, in_range


@triton.jit
def _reload_chunk(kv_ptr, bt_row, n0, end, num_blocks, offs_n, offs_c, col0,
                  L: tl.constexpr, R: tl.constexpr, PAGE: tl.constexpr):
    """Columns col0 + offs_c of the tile's rows [BLOCK_N, L / 4] read again for P V: a
    load of its own (".ca" keeps the compiler from merging it with the first one)."""
    pos = n0 + offs_n
    in_range = pos < end
    page = tl.load(bt_row + pos // PAGE, mask=in_range, other=0)
    page = tl.minimum(tl.maximum(page, 0), num_blocks - 1)
    row = kv_ptr + ((page.to(tl.int64) * PAGE + pos % PAGE) * (L + R))[:, None]
    return tl.load(row + col0 + offs_c[None, :], mask=in_range[:, None], other=0.0,
                   cache_modifier=".ca")


@triton.jit
def _query_t(q_rows, row_ok, col0, offs, FP8_Q: tl.constexpr, DOT_F32: tl.constexpr):
    """Columns col0 + offs of the query rows, widened to fp16 and transposed:
    [len(offs), BLOCK_M] (a bf16/fp16 query is scaled by 1/16 first)."""
    x = tl.load(q_rows + col0 + offs[None, :], mask=row_ok[:, None], other=0.0)
    if FP8_Q:
        x = x.to(tl.float16)
    else:
        x = (x.to(tl.float32) * 0.0625).to(tl.float16)
    return tl.trans(_operand(x, DOT_F32))


@triton.jit
def _store_chunk(base, rows, row_ok, col0, offs_c, acc_t, o_scale, L: tl.constexpr):
    """Write o^T_j [LC, BLOCK_M] scaled per row as out[rows, col0 + offs_c]."""
    o = tl.trans(acc_t * o_scale[None, :])                                  # [BLOCK_M, LC]
    tl.store(base + rows[:, None] * L + col0 + offs_c[None, :],
             o.to(base.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def mla_decode_fp8_cache_kernel(
    q_ptr,            # [B, s_q * H, L + R] rows contiguous, bf16/fp16 or fp8 (FP8_Q)
    kv_ptr,           # [num_blocks * PAGE, L + R] fp8 e4m3, contiguous
    block_table_ptr,  # [B, max_blocks] int32
    seqlens_ptr,      # [B] int32
    q_scale_ptr,      # [1] fp32 (read when FP8_Q)
    k_scale_ptr,      # [1] fp32
    out_ptr,          # DIRECT: [B, s_q * H, L] out dtype; else [B, num_splits, s_q * H, L] fp32
    lse_ptr,          # DIRECT: [B, H, s_q] fp32;       else [B, num_splits, s_q * H] fp32
    sm_scale,         # softmax scale (float)
    stride_qb,        # q batch stride (elements)
    stride_bt,        # block_table row stride
    max_blocks,       # block_table width
    num_blocks,       # pages in the cache
    S_Q: tl.constexpr, H: tl.constexpr,
    L: tl.constexpr, R: tl.constexpr,
    PAGE: tl.constexpr,
    CAUSAL: tl.constexpr,
    num_splits,       # splits per request (grid axis 2)
    DIRECT: tl.constexpr,  # num_splits == 1: write the final (out, lse)
    FIXED_CHUNK: tl.constexpr,
    FP8_Q: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    RELOAD_V: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    D: tl.constexpr = L + R
    LC: tl.constexpr = L // 4
    ROWS: tl.constexpr = S_Q * H
    pid_m = tl.program_id(0)
    b = tl.program_id(1)
    split = tl.program_id(2)

    # ---- query rows and how far each may look (bounded as in triton_decode_kernel) ----
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)          # [BLOCK_M] folded (token, head)
    row_ok = rows < ROWS
    seqlen = tl.minimum(tl.maximum(tl.load(seqlens_ptr + b), 1), max_blocks * PAGE)
    if CAUSAL:
        limit = seqlen - S_Q + rows // H + 1                # [BLOCK_M]
    else:
        limit = tl.zeros([BLOCK_M], dtype=tl.int32) + seqlen
    if FIXED_CHUNK > 0:
        chunk = FIXED_CHUNK
    else:
        chunk = tl.cdiv(tl.cdiv(seqlen, num_splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, seqlen)

    # ---- the query, widened and transposed once: q^T chunks [LC, BLOCK_M], [R, BLOCK_M]
    offs_c = tl.arange(0, LC)
    offs_r = tl.arange(0, R)
    q_rows = q_ptr + b.to(tl.int64) * stride_qb + rows[:, None] * D
    qt0 = _query_t(q_rows, row_ok, 0, offs_c, FP8_Q, DOT_F32)
    qt1 = _query_t(q_rows, row_ok, LC, offs_c, FP8_Q, DOT_F32)
    qt2 = _query_t(q_rows, row_ok, 2 * LC, offs_c, FP8_Q, DOT_F32)
    qt3 = _query_t(q_rows, row_ok, 3 * LC, offs_c, FP8_Q, DOT_F32)
    qt_pe = _query_t(q_rows, row_ok, L, offs_r, FP8_Q, DOT_F32)
    k_scale = tl.load(k_scale_ptr)
    qk_scale = tl.cast(sm_scale, tl.float32) * 1.4426950408889634 * k_scale   # base 2
    if FP8_Q:
        qk_scale = qk_scale * tl.load(q_scale_ptr)
    else:
        qk_scale = qk_scale * 16.0

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)   # running max (base 2)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)                 # running sum of p
    acc0 = tl.zeros([LC, BLOCK_M], dtype=tl.float32)            # o^T by value-column chunk
    acc1 = tl.zeros([LC, BLOCK_M], dtype=tl.float32)
    acc2 = tl.zeros([LC, BLOCK_M], dtype=tl.float32)
    acc3 = tl.zeros([LC, BLOCK_M], dtype=tl.float32)

    offs_n = tl.arange(0, BLOCK_N)
    bt_row = block_table_ptr + b.to(tl.int64) * stride_bt
    for n0_pos in tl.range(start, end, BLOCK_N):
        c0, c1, c2, c3, pe, in_range = _load_tile(kv_ptr, bt_row, n0_pos, end, num_blocks,
                                                  offs_n, offs_c, offs_r, L, R, PAGE)
        # scores^T [BLOCK_N, BLOCK_M], keys down the rows
        s = tl.dot(_widen(c0, DOT_F32), qt0)
        s = tl.dot(_widen(c1, DOT_F32), qt1, s)
        s = tl.dot(_widen(c2, DOT_F32), qt2, s)
        s = tl.dot(_widen(c3, DOT_F32), qt3, s)
        s = tl.dot(_widen(pe, DOT_F32), qt_pe, s)
        s = s * qk_scale
        pos = n0_pos + offs_n
        visible = in_range[:, None] & (pos[:, None] < limit[None, :])
        s = tl.where(visible, s, float("-inf"))
        # online softmax over the keys (axis 0); a row with nothing visible keeps m = -inf
        m_new = tl.maximum(m_i, tl.max(s, 0))                # [BLOCK_M]
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[None, :])                      # [BLOCK_N, BLOCK_M]
        l_i = l_i * alpha + tl.sum(p, 0)
        m_i = m_new
        p_t = _operand(p.to(tl.float16), DOT_F32)
        # o^T_j += kv_c_j^T @ p^T
        if RELOAD_V:
            c0 = _reload_chunk(kv_ptr, bt_row, n0_pos, end, num_blocks, offs_n, offs_c, 0,
                               L, R, PAGE)
            c1 = _reload_chunk(kv_ptr, bt_row, n0_pos, end, num_blocks, offs_n, offs_c, LC,
                               L, R, PAGE)
            c2 = _reload_chunk(kv_ptr, bt_row, n0_pos, end, num_blocks, offs_n, offs_c, 2 * LC,
                               L, R, PAGE)
            c3 = _reload_chunk(kv_ptr, bt_row, n0_pos, end, num_blocks, offs_n, offs_c, 3 * LC,
                               L, R, PAGE)
        acc0 = tl.dot(tl.trans(_widen(c0, DOT_F32)), p_t, acc0 * alpha[None, :])
        acc1 = tl.dot(tl.trans(_widen(c1, DOT_F32)), p_t, acc1 * alpha[None, :])
        acc2 = tl.dot(tl.trans(_widen(c2, DOT_F32)), p_t, acc2 * alpha[None, :])
        acc3 = tl.dot(tl.trans(_widen(c3, DOT_F32)), p_t, acc3 * alpha[None, :])

    # ---- epilogue: normalise, write (out, lse) ---------------------------------------
    has_keys = l_i > 0.0
    l_safe = tl.where(has_keys, l_i, 1.0)
    o_scale = k_scale / l_safe                              # [BLOCK_M]
    lse = tl.where(has_keys, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    if DIRECT:
        base = out_ptr + b.to(tl.int64) * ROWS * L
        lse_off = b * ROWS + (rows % H) * S_Q + rows // H   # lse layout [B, H, s_q]
    else:
        base = out_ptr + (b.to(tl.int64) * num_splits + split) * ROWS * L
        lse_off = (b.to(tl.int64) * num_splits + split) * ROWS + rows
    _store_chunk(base, rows, row_ok, 0, offs_c, acc0, o_scale, L)
    _store_chunk(base, rows, row_ok, LC, offs_c, acc1, o_scale, L)
    _store_chunk(base, rows, row_ok, 2 * LC, offs_c, acc2, o_scale, L)
    _store_chunk(base, rows, row_ok, 3 * LC, offs_c, acc3, o_scale, L)
    tl.store(lse_ptr + lse_off, lse, mask=row_ok)
