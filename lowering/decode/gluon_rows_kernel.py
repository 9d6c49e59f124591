"""Hopper MLA decode of a bf16 query at up to 32 query rows over an fp8 or a bf16 cache, in
Gluon: the "gluon" route's kernel for kv_cache_dtype="fp8", and for a bf16 cache up to 32
rows (launcher: gluon_decode.py).

At 16 heads (DeepSeek-V3 at tensor parallel 8, V2-Lite) a cache byte takes part in few
FLOPs, so a call is bound by how fast its tiles stream in. The Triton kernel widens each
fp8 tile from a load into registers, which cannot be issued ahead of use: DRAM stayed 22 %
busy (docs/notes/NOTES-decode-fp8.md); FlashMLA's bf16 kernel runs 64-row query tiles. Here:
  - a one-warp producer copies each tile of BN = 64 keys (9 TMA boxes of 64 columns) into
    a ring of STAGES buffers, ahead of the consumer;
  - both products run transposed, keys as the M side of the warpgroup MMA (whose M is at
    least 64; 16 query rows as M would waste three quarters of it):
        S^T [BN, NR]       = K [BN, 576] . q^T [576, NR]      (A: the ring slot)
        O^T [512, NR]     += V^T [512, BN] . P^T [BN, NR]     (A: the values, MN-major)
    q^T and P^T are the small B operands in shared memory; O^T is eight [64, NR]
    accumulators, one per 64 value columns;
  - bf16 cache: both MMAs read the ring slot, freed after the tile's P V; q and P in bf16;
  - FP8 cache: QK is an fp8 MMA over the ring slot itself, q held as two e4m3 terms per
    element (hi = e4m3(q s), lo = e4m3(q s - hi), s a power of two per row; B = [hi; lo],
    N = 2 NR, the two halves of S^T summed in registers). A widener partition (4 warps)
    turns the slot's eight value chunks into fp16 (exact for e4m3) for P V, into one of
    WBUF buffers (two at 16 rows): V^T is MN-major in the cache rows, which 16-bit MMAs
    read and fp8 ones do not. The slot is freed once QK and the widener have read it.
    The consumer is software-pipelined: tile i's QK, then tile i - 1's P V, and tile i's
    softmax while that P V runs (1.18x the single-warpgroup schedule per tile with the
    cache in the L2 on an H100, where the consumer's chain of ~700 instructions a tile,
    half of them the widening, bound it; BENCHMARKS.md). P is rounded to fp16. Hopper
    sums fp8 MMAs keeping ~14 bits per instruction, so a score carries ~0.2 % of the
    scores' spread in error (~15x below what the cache's own e4m3 rounding moves it);
  - the online softmax reduces along S^T's rows (keys): one max across the warpgroup per
    tile; the sums stay per key slot and are reduced once at the end.
The shared-memory indices of the MMA operands carry a runtime zero (z), as in
gluon_pair_kernel.py: with constant indices ptxas hoists every MMA descriptor out of the
loop and spills them. NR is the query rows (s_q * H, token-major) padded to 16 or 32;
padded rows are zero and never stored. Keys past a split's end in its last tile are
zeroed in the values' tile (unwritten rows may hold NaN, and 0 x NaN is NaN) and masked
in the scores. Output as the other stage-1 kernels: DIRECT -> out [B, ROWS, 512] bf16 +
lse [B, H, S_Q]; else fp32 partials (out / l) + lse for triton_merge_kernel.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier,
                                                              warpgroup_mma, warpgroup_mma_wait)

from lowering.decode.gluon_common import load_ring
from lowering.decode.gluon_rows_fp8 import WIDEN_REGS, store_q_terms, widen_tiles


@gluon.jit
def _zero_tail(sK, s, key0, end, BN: gl.constexpr, NCH: gl.constexpr):
    """A bf16 ring slot's rows at keys >= end to 0 (another split's keys, or whatever an
    unwritten page holds, must not reach P V as NaN x 0)."""
    z_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])       # [16, 64]
    keep = (key0 + gl.arange(0, BN, layout=gl.SliceLayout(1, z_l)) < end)[:, None]
    for c in gl.static_range(NCH):
        box = sK.index(s * NCH + c)
        x = box.load(z_l)
        box.store(gl.where(keep, x, gl.zeros_like(x)))


@gluon.jit
def _store_chunk(acc, inv, c: gl.constexpr, o_ptr, o_row0, ROWS: gl.constexpr,
                 NR: gl.constexpr, DIRECT: gl.constexpr):
    """Value columns [64 c, 64 c + 64) of the rows: acc [64, NR] (O^T) times inv [NR],
    stored from the accumulator's own layout: a warp's stores are runs of 8 columns of a
    row, and the transpose needs no trip through shared memory."""
    acc_l: gl.constexpr = acc.type.layout
    col = gl.arange(0, 64, layout=gl.SliceLayout(1, acc_l))
    r = gl.arange(0, NR, layout=gl.SliceLayout(0, acc_l))
    ptrs = o_ptr + (o_row0 + r)[None, :].to(gl.int64) * 512 + 64 * c + col[:, None]
    mask = (r[None, :] < ROWS) & (col[:, None] < 64)
    o = acc * inv[None, :]
    if DIRECT:
        gl.store(ptrs, o.to(gl.bfloat16), mask=mask)
    else:
        gl.store(ptrs, o, mask=mask)


@gluon.jit
def _softmax(sc, key0, end, limit, scale_log2, m_i, l_acc, BN: gl.constexpr):
    """One tile's online softmax along the keys (S^T's rows): raw scores sc [BN, NR] ->
    (p, alpha, m_i, l_acc); a row with nothing visible yet keeps m = -inf, and the sums
    stay per key slot (reduced once, at the end)."""
    keys = key0 + gl.arange(0, BN, layout=gl.SliceLayout(1, sc.type.layout))
    vis = (keys[:, None] < end) & (keys[:, None] < limit[None, :])
    sc = gl.where(vis, sc * scale_log2[None, :], float("-inf"))
    m_new = gl.maximum(m_i, gl.max(sc, axis=0))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_use)
    p = gl.exp2(sc - m_use[None, :])
    l_acc = l_acc * alpha[None, :] + p
    return p, alpha, m_new, l_acc


@gluon.jit
def _pv(sA, a0, sP, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, alpha):
    """O^T = alpha O^T + V^T P^T per 64 value columns: chunks a0 .. a0 + 7 of sA read
    MN-major (V^T), P^T from sP; the 8 MMAs are left in flight."""
    a = alpha[None, :]
    pt = sP.permute((1, 0))
    acc0 = warpgroup_mma(sA.index(a0 + 0).permute((1, 0)), pt, acc0 * a, is_async=True)
    acc1 = warpgroup_mma(sA.index(a0 + 1).permute((1, 0)), pt, acc1 * a, is_async=True)
    acc2 = warpgroup_mma(sA.index(a0 + 2).permute((1, 0)), pt, acc2 * a, is_async=True)
    acc3 = warpgroup_mma(sA.index(a0 + 3).permute((1, 0)), pt, acc3 * a, is_async=True)
    acc4 = warpgroup_mma(sA.index(a0 + 4).permute((1, 0)), pt, acc4 * a, is_async=True)
    acc5 = warpgroup_mma(sA.index(a0 + 5).permute((1, 0)), pt, acc5 * a, is_async=True)
    acc6 = warpgroup_mma(sA.index(a0 + 6).permute((1, 0)), pt, acc6 * a, is_async=True)
    acc7 = warpgroup_mma(sA.index(a0 + 7).permute((1, 0)), pt, acc7 * a, is_async=True)
    return acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7


@gluon.jit
def _qk8(sK, s, sQ, z, s2_l: gl.constexpr, BN: gl.constexpr, NR: gl.constexpr,
         NCH: gl.constexpr):
    """S^T [BN, 2 NR] = K8 [hi; lo]^T: 9 chained fp8 MMAs over ring slot s, in flight."""
    tok = warpgroup_mma(sK.index(s * NCH + z), sQ.index(z).permute((1, 0)),
                        gl.zeros([BN, 2 * NR], gl.float32, s2_l), is_async=True)
    for c in gl.static_range(1, NCH):
        tok = warpgroup_mma(sK.index(s * NCH + z + c), sQ.index(c + z).permute((1, 0)), tok,
                            is_async=True)
    return tok


@gluon.jit
def _hi_lo(s2, s_l: gl.constexpr, BN: gl.constexpr, NR: gl.constexpr):
    """The scores [BN, NR]: S^T's hi and lo halves summed."""
    hi, lo = gl.split(gl.permute(gl.reshape(s2, [BN, 2, NR]), [0, 2, 1]))
    return gl.convert_layout(hi + lo, s_l)


@gluon.jit
def _tiles_fp8(kv_full, kv_empty, w_full, w_empty, sK, sW, sQ, sP, start, end, n_tiles, limit,
               scale_log2, m_i, l_acc, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7,
               s_l: gl.constexpr, s2_l: gl.constexpr, BN: gl.constexpr, NR: gl.constexpr,
               STAGES: gl.constexpr, NCH: gl.constexpr, WBUF: gl.constexpr):
    """The consumer's tiles over an fp8 cache (n_tiles >= 1), software-pipelined: tile i's
    QK goes out first, then tile i - 1's P V (its values widened by the widener partition);
    tile i's softmax runs while that P V may still run, and P(i) goes to sP once it has
    ended. Returns (m_i, l_acc, the eight O^T chunks)."""
    # tile 0: scores, softmax and P; its P V goes out after tile 1's QK
    mbarrier.wait(kv_full.index(0), 0)
    z = gl.minimum(start, 0)
    tok = _qk8(sK, 0, sQ, z, s2_l, BN, NR, NCH)
    s2 = warpgroup_mma_wait(num_outstanding=0, deps=[tok])
    mbarrier.arrive(kv_empty.index(0), count=1)
    p, alpha, m_i, l_acc = _softmax(_hi_lo(s2, s_l, BN, NR), start, end, limit, scale_log2,
                                    m_i, l_acc, BN)
    sP.store(gl.permute(p.to(gl.float16), [1, 0]))                          # P [NR, BN]
    fence_async_shared()
    for i in range(1, n_tiles):
        s = i % STAGES
        key0 = start + i * BN
        mbarrier.wait(kv_full.index(s), (i // STAGES) & 1)
        z = gl.minimum(key0, 0)
        tok = _qk8(sK, s, sQ, z, s2_l, BN, NR, NCH)
        j = i - 1                                   # the tile whose P V goes out now
        mbarrier.wait(w_full.index(j % WBUF), (j // WBUF) & 1)     # tile j's values widened
        acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _pv(
            sW, (j % WBUF) * (NCH - 1) + z, sP, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7,
            alpha)
        # QK(i) done (the MMAs end in order; P V(j)'s 8 may still run)
        s2 = warpgroup_mma_wait(num_outstanding=NCH - 1, deps=[tok])
        mbarrier.arrive(kv_empty.index(s), count=1)
        p, alpha, m_i, l_acc = _softmax(_hi_lo(s2, s_l, BN, NR), key0, end, limit, scale_log2,
                                        m_i, l_acc, BN)
        acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = warpgroup_mma_wait(
            num_outstanding=0, deps=[acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7])
        mbarrier.arrive(w_empty.index(j % WBUF), count=1)           # its buffer, to the widener
        sP.store(gl.permute(p.to(gl.float16), [1, 0]))                      # P V(j) has ended
        fence_async_shared()
    j = n_tiles - 1
    mbarrier.wait(w_full.index(j % WBUF), (j // WBUF) & 1)
    acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _pv(
        sW, (j % WBUF) * (NCH - 1) + z, sP, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, alpha)
    acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = warpgroup_mma_wait(
        num_outstanding=0, deps=[acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7])
    return m_i, l_acc, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7


@gluon.jit
def _consumer(q_ptr, ks_ptr, o_ptr, lse_ptr, kv_full, kv_empty, w_full, w_empty, sK, sW, sQ,
              sP, b, split, seqlen, start, end, n_tiles, sm_scale_log2, num_splits,
              S_Q: gl.constexpr, H: gl.constexpr, BN: gl.constexpr, NR: gl.constexpr,
              STAGES: gl.constexpr, NCH: gl.constexpr, DIRECT: gl.constexpr,
              CAUSAL: gl.constexpr, FP8: gl.constexpr, WBUF: gl.constexpr):
    ROWS: gl.constexpr = S_Q * H
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                 instr_shape=[16, NR, 16])
    row_l: gl.constexpr = gl.SliceLayout(0, s_l)             # [NR] query rows (S^T columns)

    rows = gl.arange(0, NR, layout=row_l)
    if FP8:
        # q [NR, 576] into sQ as two e4m3 terms (hi; lo) scaled by q_s [NR] per row: the
        # scores are fp8 MMAs over the ring slot itself, k_scale K q = K8 (hi + lo) k_scale / q_s
        s2_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, 2 * NR, 32])
        q_s = gl.convert_layout(store_q_terms(q_ptr, sQ, b, ROWS, NR), row_l)
        k_scale = gl.load(ks_ptr)
        scale_log2 = (sm_scale_log2 * k_scale) / q_s                     # [NR]
    else:
        # q [NR, 576] into sQ (9 chunks of 64 columns; padded rows 0)
        q_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])   # [16, 64]
        qr = gl.arange(0, NR, layout=gl.SliceLayout(1, q_l))
        qc = gl.arange(0, 64, layout=gl.SliceLayout(0, q_l))
        q_rows = q_ptr + (b * ROWS + qr)[:, None].to(gl.int64) * 576 + qc[None, :]
        q_mask = (qr[:, None] < ROWS) & (qc[None, :] < 64)
        for c in gl.static_range(NCH):
            sQ.index(c).store(gl.load(q_rows + 64 * c, mask=q_mask, other=0.0))
        k_scale = 1.0
        scale_log2 = gl.full([NR], sm_scale_log2, gl.float32, row_l)
    fence_async_shared()
    if CAUSAL:
        limit = seqlen - S_Q + rows // H + 1                 # keys visible to each row
    else:
        limit = rows * 0 + seqlen
    m_i = gl.full([NR], float("-inf"), gl.float32, row_l)   # running max (base 2)
    l_acc = gl.zeros([BN, NR], gl.float32, s_l)             # running sums of p, per key slot
    acc0 = gl.zeros([64, NR], gl.float32, s_l)              # O^T, value columns 0-63
    acc1 = gl.zeros([64, NR], gl.float32, s_l)
    acc2 = gl.zeros([64, NR], gl.float32, s_l)
    acc3 = gl.zeros([64, NR], gl.float32, s_l)
    acc4 = gl.zeros([64, NR], gl.float32, s_l)
    acc5 = gl.zeros([64, NR], gl.float32, s_l)
    acc6 = gl.zeros([64, NR], gl.float32, s_l)
    acc7 = gl.zeros([64, NR], gl.float32, s_l)              # value columns 448-511
    if FP8:
        if n_tiles > 0:
            m_i, l_acc, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _tiles_fp8(
                kv_full, kv_empty, w_full, w_empty, sK, sW, sQ, sP, start, end, n_tiles, limit,
                scale_log2, m_i, l_acc, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, s_l, s2_l,
                BN, NR, STAGES, NCH, WBUF)
    else:
        for i in range(n_tiles):
            s = i % STAGES
            key0 = start + i * BN
            mbarrier.wait(kv_full.index(s), (i // STAGES) & 1)
            z = gl.minimum(key0, 0)     # a runtime 0 in the MMA operands' indices (above)
            if key0 + BN > end:
                _zero_tail(sK, s, key0, end, BN, NCH)
            fence_async_shared()
            a0 = s * NCH + z                        # the MMAs' tile: the ring slot itself
            # S^T = K q^T: 9 chained MMAs over the 576 columns
            tok = warpgroup_mma(sK.index(a0), sQ.index(z).permute((1, 0)),
                                gl.zeros([BN, NR], gl.float32, s_l), is_async=True)
            for c in gl.static_range(1, NCH):
                tok = warpgroup_mma(sK.index(a0 + c), sQ.index(c + z).permute((1, 0)), tok,
                                    is_async=True)
            sc = warpgroup_mma_wait(num_outstanding=0, deps=[tok])         # [BN, NR]
            p, alpha, m_i, l_acc = _softmax(sc, key0, end, limit, scale_log2, m_i, l_acc, BN)
            sP.store(gl.permute(p.to(gl.bfloat16), [1, 0]))                 # P [NR, BN]
            fence_async_shared()
            acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _pv(
                sK, a0, sP, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, alpha)
            acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = warpgroup_mma_wait(
                num_outstanding=0, deps=[acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7])
            mbarrier.arrive(kv_empty.index(s), count=1)

    # ---- epilogue ---------------------------------------------------------------------
    l_i = gl.sum(l_acc, axis=0)
    has = l_i > 0.0
    l_safe = gl.where(has, l_i, 1.0)
    lse = gl.where(has, (m_i + gl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    inv = k_scale / l_safe
    if DIRECT:
        o_row0 = b * ROWS
        lse_off = b * ROWS + (rows % H) * S_Q + rows // H        # lse [B, H, S_Q]
    else:
        o_row0 = (b * num_splits + split) * ROWS
        lse_off = o_row0 + rows
    gl.store(lse_ptr + lse_off, lse, mask=rows < ROWS)
    _store_chunk(acc0, inv, 0, o_ptr, o_row0, ROWS, NR, DIRECT)
    _store_chunk(acc1, inv, 1, o_ptr, o_row0, ROWS, NR, DIRECT)
    _store_chunk(acc2, inv, 2, o_ptr, o_row0, ROWS, NR, DIRECT)
    _store_chunk(acc3, inv, 3, o_ptr, o_row0, ROWS, NR, DIRECT)
    _store_chunk(acc4, inv, 4, o_ptr, o_row0, ROWS, NR, DIRECT)
    _store_chunk(acc5, inv, 5, o_ptr, o_row0, ROWS, NR, DIRECT)
    _store_chunk(acc6, inv, 6, o_ptr, o_row0, ROWS, NR, DIRECT)
    _store_chunk(acc7, inv, 7, o_ptr, o_row0, ROWS, NR, DIRECT)


@gluon.jit
def _consume(cargs, pargs, BN: gl.constexpr, NR: gl.constexpr, STAGES: gl.constexpr,
             NCH: gl.constexpr, S_Q: gl.constexpr, H: gl.constexpr, PAGE: gl.constexpr,
             DIRECT: gl.constexpr, CAUSAL: gl.constexpr, FP8: gl.constexpr, WBUF: gl.constexpr):
    (q_ptr, ks_ptr, o_ptr, lse_ptr, kv_full, kv_empty, w_full, w_empty, sK, sW, sQ, sP, b, split,
     seqlen, start, end, n_tiles, sm_scale_log2, num_splits) = cargs
    _consumer(q_ptr, ks_ptr, o_ptr, lse_ptr, kv_full, kv_empty, w_full, w_empty, sK, sW, sQ, sP,
              b, split, seqlen, start, end, n_tiles, sm_scale_log2, num_splits, S_Q, H, BN, NR,
              STAGES, NCH, DIRECT, CAUSAL, FP8, WBUF)


@gluon.jit
def _load(pargs, BN: gl.constexpr, STAGES: gl.constexpr, NCH: gl.constexpr,
          PAGE: gl.constexpr, KV_BYTES: gl.constexpr):
    kv_desc, table_ptr, kv_full, kv_empty, sK, b, start, n_tiles, stride_bt, num_blocks = pargs
    load_ring(kv_desc, table_ptr, kv_full, kv_empty, sK, b, start, n_tiles, stride_bt,
              num_blocks, BN, PAGE, STAGES, NCH, KV_BYTES)


@gluon.jit
def mla_decode_rows_kernel(q_ptr, kv_desc, table_ptr, lens_ptr, ks_ptr, o_ptr, lse_ptr,
                           sm_scale_log2, stride_bt, max_blocks, num_blocks, num_splits,
                           S_Q: gl.constexpr, H: gl.constexpr, PAGE: gl.constexpr,
                           BN: gl.constexpr, NR: gl.constexpr, STAGES: gl.constexpr,
                           DIRECT: gl.constexpr, CAUSAL: gl.constexpr, FP8: gl.constexpr):
    """grid (B, num_splits); 4 warps (the consumer) plus the producer warp, and with FP8
    (an e4m3 cache) the 4-warp widener; else bf16 (the ring slots are the MMAs' tiles)."""
    NCH: gl.constexpr = 9                       # 576 = 8 value chunks of 64 + the rope chunk
    # FP8: widened-value buffers; two where shared memory holds them (16 rows: 220 KB)
    WBUF: gl.constexpr = 2 if NR == 16 else 1
    b = gl.program_id(0)
    split = gl.program_id(1)
    # lengths bounded here (CUDA-graph replays are not checked on the host)
    seqlen = gl.minimum(gl.maximum(gl.load(lens_ptr + b), 1), max_blocks * PAGE)
    chunk = gl.cdiv(gl.cdiv(seqlen, num_splits), BN) * BN
    start = split * chunk
    end = gl.minimum(start + chunk, seqlen)
    n_tiles = gl.maximum(gl.cdiv(end - start, BN), 0)

    if FP8:
        kv: gl.constexpr = gl.float8e4nv
        KV_BYTES: gl.constexpr = 1
        sW = gl.allocate_shared_memory(gl.float16, [WBUF * (NCH - 1), BN, 64],   # the values
                                       gl.NVMMASharedLayout.get_default_for([BN, 64],
                                                                            gl.float16))
        sQ = gl.allocate_shared_memory(kv, [NCH, 2 * NR, 64],                    # [hi; lo]
                                       gl.NVMMASharedLayout.get_default_for([2 * NR, 64], kv))
        sP = gl.allocate_shared_memory(gl.float16, [NR, BN],
                                       gl.NVMMASharedLayout.get_default_for([NR, BN],
                                                                            gl.float16))
    else:
        kv: gl.constexpr = gl.bfloat16
        KV_BYTES: gl.constexpr = 2
        sW = 0                                      # no widened copy: MMAs read the ring
        sQ = gl.allocate_shared_memory(kv, [NCH, NR, 64],
                                       gl.NVMMASharedLayout.get_default_for([NR, 64], kv))
        sP = gl.allocate_shared_memory(kv, [NR, BN],
                                       gl.NVMMASharedLayout.get_default_for([NR, BN], kv))
    sK = gl.allocate_shared_memory(kv, [STAGES * NCH, BN, 64],
                                   gl.NVMMASharedLayout.get_default_for([BN, 64], kv))
    kv_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    w_full = gl.allocate_shared_memory(gl.int64, [WBUF, 1], mbarrier.MBarrierLayout())
    w_empty = gl.allocate_shared_memory(gl.int64, [WBUF, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(kv_full.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=2 if FP8 else 1)   # FP8: QK and the widener
    for i in gl.static_range(WBUF):
        mbarrier.init(w_full.index(i), count=1)
        mbarrier.init(w_empty.index(i), count=1)

    cargs = (q_ptr, ks_ptr, o_ptr, lse_ptr, kv_full, kv_empty, w_full, w_empty, sK, sW, sQ, sP, b,
             split, seqlen, start, end, n_tiles, sm_scale_log2, num_splits)
    pargs = (kv_desc, table_ptr, kv_full, kv_empty, sK, b, start, n_tiles, stride_bt,
             num_blocks)
    if FP8:
        gl.warp_specialize([(_consume, (cargs, pargs, BN, NR, STAGES, NCH, S_Q, H, PAGE, DIRECT,
                                        CAUSAL, FP8, WBUF)),
                            (_load, (pargs, BN, STAGES, NCH, PAGE, KV_BYTES)),
                            (widen_tiles, (cargs, BN, STAGES, NCH, WBUF))],
                           [1, 4], [24, WIDEN_REGS])
    else:
        gl.warp_specialize([(_consume, (cargs, pargs, BN, NR, STAGES, NCH, S_Q, H, PAGE, DIRECT,
                                        CAUSAL, FP8, WBUF)),
                            (_load, (pargs, BN, STAGES, NCH, PAGE, KV_BYTES))],
                           [1], [24])
