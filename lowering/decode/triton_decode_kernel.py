"""Stage 1 of MLA decode: attention of a block of query rows over one slice of the paged cache.

Absorbed MLA decode is multi-query attention with one shared KV head whose row is
[kv_c (L wide) | k_pe (R wide)]; the value is the first L columns of the same row.
Per request b the query rows are the s_q x H (token, head) pairs, folded into one
row axis r = t * H + h, so one program computes a [BLOCK_M, L] tile of output.

    grid = (cdiv(s_q * H, BLOCK_M) * V_PARTS, B, num_splits)

With V_PARTS = 2 each row block has two programs, each computing the scores (the same
ones) but P @ V and the output for its half of the L value columns only: the fp32
accumulator halves, so BLOCK_M = 128 rows fit in 8 warps with each warpgroup owning 64
whole rows (the row max and sum then never cross warpgroups). The scores are computed
twice, so this pays where they are cheap (fp8 dots) and the cross-warpgroup
synchronisation of a 64-row block is the bound.

Program (m, b, s) walks the key positions of split s of request b in BLOCK_N
steps. Each step:
  1. gathers the cache rows of BLOCK_N positions through the block table
     (any page size: position p lives in page block_table[b, p // PAGE], row p % PAGE),
  2. scores = q_nope @ kv_c^T + q_pe @ k_pe^T                 # [BLOCK_M, BLOCK_N]
  3. masks positions past each row's causal limit,
  4. online softmax in base 2 (the scale times log2(e) is folded into the scores),
  5. acc += p @ kv_c                                          # [BLOCK_M, L]
The same kv_c tile feeds both matrix products, so the cache is read once.

Where the split holds the whole sequence (DIRECT, one split) the program writes the
final output and lse itself; otherwise it writes an fp32 partial (out, lse) pair
that stage 2 (triton_merge_kernel.py) combines.

Split s of request b covers [s * chunk, (s + 1) * chunk) with
    chunk = FIXED_CHUNK                       if FIXED_CHUNK > 0 (batch-invariant mode)
    chunk = cdiv(cdiv(len_b, num_splits), BLOCK_N) * BLOCK_N   otherwise,
so each request's work spreads over all splits in proportion to its own length,
computed on the device (no host sync, safe under CUDA graphs).

Dtypes (KV_KIND):
  0: q and cache in the same dtype (bf16 or fp16); P is rounded to that dtype for P @ V.
  1: cache fp8 e4m3, q bf16/fp16: the dots run in fp16. Every e4m3 value is exact in
     fp16 and e4m3 -> fp16 is one instruction per pair on sm89+; q is scaled by 1/16
     (exact) before its one-time cast to fp16, so |q| up to 1e6 stays finite. The
     per-tensor k_scale is folded into the score scale and the output scale.
  2: q and cache fp8 e4m3 with q_scale and k_scale: fp8 tensor-core dots for the
     scores; P @ V in fp16 (V widened in registers, as for kind 1: fp8 P @ V needs V
     K-major, a transpose per tile that measured 5x slower on an H200).
"""
import triton
import triton.language as tl


@triton.jit
def _mma_operand(x, DOT_F32: tl.constexpr):
    # Triton's CPU interpreter mis-multiplies bf16/fp8 dots; it is given fp32 operands
    # (already rounded to the kernel's operand dtype) instead. On GPUs DOT_F32 is False.
    if DOT_F32:
        return x.to(tl.float32)
    else:
        return x


@triton.jit
def mla_decode_stage1_kernel(
    q_ptr,            # [B, s_q * H, L + R] rows contiguous
    kv_ptr,           # [num_blocks * PAGE, L + R] contiguous
    block_table_ptr,  # [B, max_blocks] int32
    seqlens_ptr,      # [B] int32
    q_scale_ptr,      # [1] fp32 (read when KV_KIND == 2)
    k_scale_ptr,      # [1] fp32 (read when KV_KIND >= 1)
    out_ptr,          # DIRECT: [B, s_q * H, L] q.dtype / out dtype; else [B, num_splits, s_q * H, L] fp32
    lse_ptr,          # DIRECT: [B, H, s_q] fp32;                  else [B, num_splits, s_q * H] fp32
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
    KV_KIND: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    V_PARTS: tl.constexpr,       # 1, or 2: this program computes half of the L columns
    DOT_F32: tl.constexpr,
):
    D: tl.constexpr = L + R
    ROWS: tl.constexpr = S_Q * H
    LV: tl.constexpr = L // V_PARTS
    pid_m = tl.program_id(0) // V_PARTS
    pid_v = tl.program_id(0) % V_PARTS
    b = tl.program_id(1)
    split = tl.program_id(2)

    # ---- which query rows, and how far each may look --------------------------------
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)          # [BLOCK_M] folded (token, head)
    row_ok = rows < ROWS
    # Lengths and page ids are bounded here (a no-op for the checked inputs of an
    # eager call): under CUDA-graph capture nothing checked them, and a bad value must
    # give wrong rows, never an out-of-bounds read.
    seqlen = tl.minimum(tl.maximum(tl.load(seqlens_ptr + b), 1), max_blocks * PAGE)
    if CAUSAL:
        limit = seqlen - S_Q + rows // H + 1                # [BLOCK_M] keys visible to each row
    else:
        limit = tl.zeros([BLOCK_M], dtype=tl.int32) + seqlen

    # ---- this program's slice of key positions --------------------------------------
    if FIXED_CHUNK > 0:
        chunk = FIXED_CHUNK
    else:
        chunk = tl.cdiv(tl.cdiv(seqlen, num_splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, seqlen)

    # ---- the query tile, loaded once ------------------------------------------------
    offs_l = tl.arange(0, L)                                # [L]
    offs_r = tl.arange(0, R)                                # [R]
    offs_v = pid_v * LV + tl.arange(0, LV)                  # [LV] this program's value columns
    q_rows = q_ptr + b.to(tl.int64) * stride_qb + rows[:, None] * D
    q_nope = tl.load(q_rows + offs_l[None, :], mask=row_ok[:, None], other=0.0)      # [BLOCK_M, L]
    q_pe = tl.load(q_rows + L + offs_r[None, :], mask=row_ok[:, None], other=0.0)    # [BLOCK_M, R]

    # Scores are kept in base 2: s2 = (q . k) * scale * log2(e).
    qk_scale = tl.cast(sm_scale, tl.float32) * 1.4426950408889634  # Inductor passes fp64
    out_scale = 1.0
    if KV_KIND == 1:
        q_nope = (q_nope.to(tl.float32) * 0.0625).to(tl.float16)
        q_pe = (q_pe.to(tl.float32) * 0.0625).to(tl.float16)
        qk_scale = qk_scale * 16.0
    if KV_KIND >= 1:
        k_scale = tl.load(k_scale_ptr)
        qk_scale = qk_scale * k_scale
        out_scale = k_scale
    if KV_KIND == 2:
        qk_scale = qk_scale * tl.load(q_scale_ptr)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)   # running max (base 2)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)                 # running sum of p
    acc = tl.zeros([BLOCK_M, LV], dtype=tl.float32)             # running sum of p @ v

    offs_n = tl.arange(0, BLOCK_N)
    bt_row = block_table_ptr + b.to(tl.int64) * stride_bt
    for n0 in tl.range(start, end, BLOCK_N):
        pos = n0 + offs_n                                   # [BLOCK_N] key positions
        in_range = pos < end
        page = tl.load(bt_row + pos // PAGE, mask=in_range, other=0)
        page = tl.minimum(tl.maximum(page, 0), num_blocks - 1)
        kv_row = (page.to(tl.int64) * PAGE + pos % PAGE) * D                     # [BLOCK_N]
        kv_c = tl.load(kv_ptr + kv_row[:, None] + offs_l[None, :],
                       mask=in_range[:, None], other=0.0)                         # [BLOCK_N, L]
        k_pe = tl.load(kv_ptr + kv_row[:, None] + L + offs_r[None, :],
                       mask=in_range[:, None], other=0.0)                         # [BLOCK_N, R]
        if KV_KIND == 1:
            kv_c = kv_c.to(tl.float16)
            k_pe = k_pe.to(tl.float16)

        # 2. scores
        s = tl.dot(_mma_operand(q_nope, DOT_F32), tl.trans(_mma_operand(kv_c, DOT_F32)))
        s += tl.dot(_mma_operand(q_pe, DOT_F32), tl.trans(_mma_operand(k_pe, DOT_F32)))  # [BLOCK_M, BLOCK_N] fp32
        s = s * qk_scale
        # 3. mask: past this split's end or past the row's causal limit
        visible = in_range[None, :] & (pos[None, :] < limit[:, None])
        s = tl.where(visible, s, float("-inf"))

        # 4. online softmax; a row with nothing visible yet keeps m = -inf, p = 0
        m_tile = tl.max(s, 1)                               # [BLOCK_M]
        m_new = tl.maximum(m_i, m_tile)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)                        # [BLOCK_M]
        p = tl.exp2(s - m_use[:, None])                     # [BLOCK_M, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        m_i = m_new

        # 5. acc += p @ v   (v is the kv_c tile already loaded, or its half of columns)
        if V_PARTS == 1:
            v = kv_c
        else:
            v = tl.load(kv_ptr + kv_row[:, None] + offs_v[None, :],
                        mask=in_range[:, None], other=0.0)                        # [BLOCK_N, LV]
            if KV_KIND == 1:
                v = v.to(tl.float16)
        if KV_KIND == 2:
            p_op = p.to(tl.float16)
            v_op = v.to(tl.float16)
        else:
            p_op = p.to(v.dtype)
            v_op = v
        acc = tl.dot(_mma_operand(p_op, DOT_F32), _mma_operand(v_op, DOT_F32), acc)

    # ---- epilogue: normalise, write (out, lse) ---------------------------------------
    has_keys = l_i > 0.0
    l_safe = tl.where(has_keys, l_i, 1.0)
    o = acc * (out_scale / l_safe)[:, None]                 # [BLOCK_M, LV]
    lse = tl.where(has_keys, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    lse_ok = row_ok & ((rows * 0 + pid_v) == 0)             # one writer per row: part 0

    if DIRECT:
        o_ptrs = out_ptr + (b.to(tl.int64) * ROWS + rows[:, None]) * L + offs_v[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        # lse layout [B, H, s_q]: row r = t * H + h goes to h * s_q + t
        lse_off = b * ROWS + (rows % H) * S_Q + rows // H
        tl.store(lse_ptr + lse_off, lse, mask=lse_ok)
    else:
        part = (b.to(tl.int64) * num_splits + split) * ROWS + rows      # [BLOCK_M]
        tl.store(out_ptr + part[:, None] * L + offs_v[None, :], o, mask=row_ok[:, None])
        tl.store(lse_ptr + part, lse, mask=lse_ok)
