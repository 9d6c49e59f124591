"""Hopper MLA decode, stage 1, in Gluon: two consumer warpgroups in ping-pong.

The "gluon" backend's bf16 kernel for pages of 32 (launcher: gluon_decode.py; pages of
64 take gluon_pair_decode_kernel.py, 64-key blocks in pairs, faster). Gluon is
Triton's lower-level dialect: explicit layouts, async wgmma with explicit waits, TMA,
mbarriers and warp-specialized partitions, which tl.dot's single warpgroup pipeline
hides. SM90 only; bf16; L = 512, R = 64; H a multiple of 64; page a multiple of BN.

CTA = 64 query rows (the heads of one token) x one split of one request's keys.
  producer (1 warp):  q once (9 TMA boxes [64, 64]); each key tile of BN keys (a page
                      slice) as 9 boxes [BN, 64] into a STAGES-deep ring (kv_full/kv_empty),
                      its page id read one tile ahead.
  consumer warpgroup W (0, 1) owns O[:, 256 W : 256 W + 256] (four [64, 64] fp32
  accumulators) and the tiles i = W, W + 2, ... A step of tile i:
      issue S_i = q k_i^T (9 chained async wgmma: 8 value chunks + the rope chunk);
      wait the other warpgroup's P_{i-1} and row state (m, l, alpha) (p_full), issue
      O = alpha O + P_{i-1} V_{i-1} with P from shared memory;
      wait S_i; base-2 online softmax from tile i-1's state; publish P_i and the state
      in slot W (p_full[W]) for the other warpgroup;
      wait, release tile i-1 (p_empty, kv_empty); O = alpha O + P_i V_i, P from registers.
  So each warpgroup's QK runs while it waits on the other's softmax, and the softmaxes
  (a chain through the row state) alternate between the warpgroups.
Query rows r = t * H + h of the step's S_Q tokens (with CAUSAL, token t sees keys up
to seqlen - S_Q + t). Output as the Triton kernel's stage 1: DIRECT -> out [B, ROWS, 512]
bf16 + lse [B, H, S_Q] (natural log); else fp32 partials [B, splits, ROWS, 512]
(normalized) + lse [B, splits, ROWS] for triton_merge_kernel.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier,
                                                              warpgroup_mma, warpgroup_mma_wait)

from lowering.decode.gluon_common import (cta_work, finish_rows, ring_barriers, store_half,
                                           tma_load)


@gluon.jit
def _producer(q_desc, kv_desc, table_ptr, q_bar, kv_full, kv_empty, sQ, sQr, sK, sKr,
              q_row0, b, start, n_tiles, stride_bt, num_blocks,
              BN: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr, NCH: gl.constexpr):
    mbarrier.expect(q_bar, NCH * 64 * 64 * 2)
    for c in gl.static_range(NCH - 1):
        tma_load(q_desc, [q_row0, c * 64], q_bar, sQ.index(c))
    tma_load(q_desc, [q_row0, (NCH - 1) * 64], q_bar, sQr)
    nxt = gl.load(table_ptr + b * stride_bt + start // PAGE, mask=n_tiles > 0, other=0)
    for i in range(n_tiles):
        s = i % STAGES
        ph = (i // STAGES) & 1
        key = start + i * BN
        # this tile's page id was read a tile ago; read the next one before the wait, so
        # its latency is not on the refill's path
        page = nxt
        nxt = gl.load(table_ptr + b * stride_bt + (key + BN) // PAGE, mask=i + 1 < n_tiles,
                      other=0)
        mbarrier.wait(kv_empty.index(s), ph ^ 1)
        page = gl.minimum(gl.maximum(page, 0), num_blocks - 1)
        row = page * PAGE + key % PAGE
        mbarrier.expect(kv_full.index(s), NCH * BN * 64 * 2)
        for c in gl.static_range(NCH - 1):
            tma_load(kv_desc, [row, c * 64], kv_full.index(s), sK.index(s * (NCH - 1) + c))
        tma_load(kv_desc, [row, (NCH - 1) * 64], kv_full.index(s), sKr.index(s))


@gluon.jit
def _qk(sQ, sQr, sK, sKr, s, s_l: gl.constexpr, BN: gl.constexpr, NCH: gl.constexpr):
    """Issue S = q k^T for the tile in stage s: 9 chained async wgmma. [64, BN] fp32."""
    tok = warpgroup_mma(sQr, sKr.index(s).permute((1, 0)), gl.zeros([64, BN], gl.float32, s_l),
                        is_async=True)
    for c in gl.static_range(NCH - 1):
        tok = warpgroup_mma(sQ.index(c), sK.index(s * (NCH - 1) + c).permute((1, 0)), tok,
                            is_async=True)
    return tok


@gluon.jit
def _pv(p, sK, v0, acc0, acc1, acc2, acc3, a_o):
    """Issue O_half = alpha O_half + P V_half (four async wgmma of [64, 64])."""
    t0 = warpgroup_mma(p, sK.index(v0 + 0), acc0 * a_o, is_async=True)
    t1 = warpgroup_mma(p, sK.index(v0 + 1), acc1 * a_o, is_async=True)
    t2 = warpgroup_mma(p, sK.index(v0 + 2), acc2 * a_o, is_async=True)
    t3 = warpgroup_mma(p, sK.index(v0 + 3), acc3 * a_o, is_async=True)
    return t0, t1, t2, t3


@gluon.jit
def _softmax_publish(W: gl.constexpr, sc, m_prev, l_prev, key0, end, scale_log2, k, s,
                     p_empty, p_full, sP, sStat, sK, s_l: gl.constexpr, BN: gl.constexpr,
                     NCH: gl.constexpr):
    """Base-2 online softmax of this warpgroup's tile k (its k-th); P and (m, l, alpha)
    go to slot W for the other warpgroup. Returns (P bf16, m, l, alpha)."""
    cols = gl.arange(0, BN, layout=gl.SliceLayout(0, s_l))
    sc = gl.where((key0 + cols < end)[None, :], sc * scale_log2, float("-inf"))
    m_new = gl.maximum(m_prev, gl.max(sc, axis=1))     # finite: every tile has a key
    alpha = gl.exp2(m_prev - m_new)
    p = gl.exp2(sc - m_new[:, None])
    l_new = l_prev * alpha + gl.sum(p, axis=1)
    p16 = p.to(gl.bfloat16)
    mbarrier.wait(p_empty.index(W), (k & 1) ^ 1)
    sP.index(W).store(p16)
    sStat.slice((W * 3 + 0) * 64, 64).store(m_new)
    sStat.slice((W * 3 + 1) * 64, 64).store(l_new)
    sStat.slice((W * 3 + 2) * 64, 64).store(alpha)
    if key0 + BN > end:
        # the split's last tile: rows past its end (another split's keys, or whatever an
        # unwritten page holds) must not reach P @ V as NaN x 0
        zl: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        keep = (key0 + gl.arange(0, BN, layout=gl.SliceLayout(1, zl)) < end)[:, None]
        for c in gl.static_range(NCH - 1):
            buf = sK.index(s * (NCH - 1) + c)
            x = buf.load(zl)
            buf.store(gl.where(keep, x, gl.zeros_like(x)))
    fence_async_shared()
    mbarrier.arrive(p_full.index(W), count=1)
    return p16, m_new, l_new, alpha


@gluon.jit
def _consumer(W: gl.constexpr, q_bar, kv_full, kv_empty, p_full, p_empty, sQ, sQr, sK, sKr, sP,
              sStat, o_ptr, lse_ptr, o_row0, lse_row0, lse_stride, start, end, n_tiles, scale_log2,
              BN: gl.constexpr, STAGES: gl.constexpr, NCH: gl.constexpr, DIRECT: gl.constexpr):
    """Warpgroup W owns tiles i = W, W + 2, ... A step of tile i: issue its QK, then the
    other warpgroup's tile i - 1 (wait its P, issue P V from shared memory), then this
    tile's softmax (from the row state tile i - 1 left) and publication, then its own
    P V from registers. So QK_i runs while this warpgroup waits on the other's softmax."""
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                 instr_shape=[16, BN, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                 instr_shape=[16, 64, 16])
    p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_l)
    row_o: gl.constexpr = gl.SliceLayout(1, o_l)
    acc0 = gl.zeros([64, 64], gl.float32, o_l)
    acc1 = gl.zeros([64, 64], gl.float32, o_l)
    acc2 = gl.zeros([64, 64], gl.float32, o_l)
    acc3 = gl.zeros([64, 64], gl.float32, o_l)
    m_prev = gl.full([64], float("-inf"), gl.float32, row_s)
    l_prev = gl.zeros([64], gl.float32, row_s)
    mbarrier.wait(q_bar, 0)
    if W == 0:
        # tile 0 has no earlier tile to wait for
        if n_tiles > 0:
            mbarrier.wait(kv_full.index(0), 0)
            tok = _qk(sQ, sQr, sK, sKr, 0, s_l, BN, NCH)
            sc = warpgroup_mma_wait(num_outstanding=0, deps=[tok])
            p16, m_prev, l_prev, alpha = _softmax_publish(
                W, sc, m_prev, l_prev, start, end, scale_log2, 0, 0, p_empty, p_full, sP,
                sStat, sK, s_l, BN, NCH)
            a_o = gl.convert_layout(alpha, row_o)[:, None]
            t0, t1, t2, t3 = _pv(gl.convert_layout(p16, p_l), sK, 4 * W, acc0, acc1, acc2,
                                 acc3, a_o)
            acc0, acc1, acc2, acc3 = warpgroup_mma_wait(num_outstanding=0,
                                                        deps=[t0, t1, t2, t3])
            mbarrier.arrive(kv_empty.index(0), count=1)
    for i in range(2 - W, n_tiles, 2):
        s = i % STAGES
        so = (i - 1) % STAGES
        mbarrier.wait(kv_full.index(s), (i // STAGES) & 1)
        tok = _qk(sQ, sQr, sK, sKr, s, s_l, BN, NCH)                  # 9 groups in flight
        # the other warpgroup's tile i - 1: its P V runs while this tile's softmax does
        mbarrier.wait(kv_full.index(so), ((i - 1) // STAGES) & 1)
        mbarrier.wait(p_full.index(1 - W), ((i - 1) // 2) & 1)
        m_o = sStat.slice(((1 - W) * 3 + 0) * 64, 64).load(row_s)
        l_o = sStat.slice(((1 - W) * 3 + 1) * 64, 64).load(row_s)
        a_o = sStat.slice(((1 - W) * 3 + 2) * 64, 64).load(row_o)[:, None]
        t0, t1, t2, t3 = _pv(sP.index(1 - W), sK, so * (NCH - 1) + 4 * W, acc0, acc1, acc2,
                             acc3, a_o)
        sc = warpgroup_mma_wait(num_outstanding=4, deps=[tok])
        p16, m_prev, l_prev, alpha = _softmax_publish(
            W, sc, m_o, l_o, start + i * BN, end, scale_log2, i // 2, s, p_empty, p_full, sP,
            sStat, sK, s_l, BN, NCH)
        acc0, acc1, acc2, acc3 = warpgroup_mma_wait(num_outstanding=0, deps=[t0, t1, t2, t3])
        mbarrier.arrive(p_empty.index(1 - W), count=1)
        mbarrier.arrive(kv_empty.index(so), count=1)
        # this warpgroup's own P V, P from registers
        a_o = gl.convert_layout(alpha, row_o)[:, None]
        t0, t1, t2, t3 = _pv(gl.convert_layout(p16, p_l), sK, s * (NCH - 1) + 4 * W, acc0, acc1,
                             acc2, acc3, a_o)
        acc0, acc1, acc2, acc3 = warpgroup_mma_wait(num_outstanding=0, deps=[t0, t1, t2, t3])
        mbarrier.arrive(kv_empty.index(s), count=1)
    if n_tiles > 0 and (n_tiles - 1) % 2 != W:
        # the split's last tile is the other warpgroup's
        i = n_tiles - 1
        so = i % STAGES
        mbarrier.wait(kv_full.index(so), (i // STAGES) & 1)
        mbarrier.wait(p_full.index(1 - W), (i // 2) & 1)
        m_prev = sStat.slice(((1 - W) * 3 + 0) * 64, 64).load(row_s)
        l_prev = sStat.slice(((1 - W) * 3 + 1) * 64, 64).load(row_s)
        a_o = sStat.slice(((1 - W) * 3 + 2) * 64, 64).load(row_o)[:, None]
        t0, t1, t2, t3 = _pv(sP.index(1 - W), sK, so * (NCH - 1) + 4 * W, acc0, acc1, acc2,
                             acc3, a_o)
        acc0, acc1, acc2, acc3 = warpgroup_mma_wait(num_outstanding=0, deps=[t0, t1, t2, t3])
        mbarrier.arrive(p_empty.index(1 - W), count=1)
        mbarrier.arrive(kv_empty.index(so), count=1)

    # ---- epilogue: this warpgroup's 256 columns ------------------------------------------
    l_safe = finish_rows(W, m_prev, l_prev, lse_ptr, lse_row0, lse_stride, row_s)
    store_half(W, acc0, acc1, acc2, acc3, gl.convert_layout(1.0 / l_safe, row_o), o_ptr, o_row0,
               o_l, DIRECT)


@gluon.jit
def _wg(cargs, pargs, W: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
        NCH: gl.constexpr, DIRECT: gl.constexpr, PAGE: gl.constexpr):
    """Consumer warpgroup W (0: the default partition, 1: a worker)."""
    (q_bar, kv_full, kv_empty, p_full, p_empty, sQ, sQr, sK, sKr, sP, sStat, o_ptr, lse_ptr,
     o_row0, lse_row0, lse_stride, start, end, n_tiles, scale_log2) = cargs
    _consumer(W, q_bar, kv_full, kv_empty, p_full, p_empty, sQ, sQr, sK, sKr, sP, sStat, o_ptr,
              lse_ptr, o_row0, lse_row0, lse_stride, start, end, n_tiles, scale_log2, BN,
              STAGES, NCH, DIRECT)


@gluon.jit
def _load(cargs, pargs, W: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
          NCH: gl.constexpr, DIRECT: gl.constexpr, PAGE: gl.constexpr):
    (q_desc, kv_desc, table_ptr, q_bar, kv_full, kv_empty, sQ, sQr, sK, sKr, q_row0, b,
     start, n_tiles, stride_bt, num_blocks) = pargs
    _producer(q_desc, kv_desc, table_ptr, q_bar, kv_full, kv_empty, sQ, sQr, sK, sKr,
              q_row0, b, start, n_tiles, stride_bt, num_blocks, BN, PAGE, STAGES, NCH)


@gluon.jit
def mla_decode_gluon_kernel(q_desc, kv_desc, table_ptr, lens_ptr, o_ptr, lse_ptr, scale_log2,
                            stride_bt, max_blocks, num_blocks, num_splits,
                            S_Q: gl.constexpr, H: gl.constexpr, PAGE: gl.constexpr,
                            BN: gl.constexpr, STAGES: gl.constexpr, DIRECT: gl.constexpr,
                            CAUSAL: gl.constexpr):
    NCH: gl.constexpr = 9                       # 576 = 8 value chunks of 64 + the rope chunk
    b, start, end, n_tiles, q_row0, o_row0, lse_row0, lse_stride = cta_work(
        lens_ptr, max_blocks, num_splits, S_Q, H, PAGE, BN, DIRECT, CAUSAL)

    sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)
    slk: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, 64], gl.bfloat16)
    slp: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, BN], gl.bfloat16)
    sQ = gl.allocate_shared_memory(gl.bfloat16, [NCH - 1, 64, 64], sl)      # q's 8 value chunks
    sQr = gl.allocate_shared_memory(gl.bfloat16, [64, 64], sl)              # q's rope chunk
    sK = gl.allocate_shared_memory(gl.bfloat16, [STAGES * (NCH - 1), BN, 64], slk)
    sKr = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, 64], slk)
    sP = gl.allocate_shared_memory(gl.bfloat16, [2, 64, BN], slp)
    sStat = gl.allocate_shared_memory(gl.float32, [8 * 64],      # 6 used: (m, l, alpha) x 2
                                      gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    q_bar, kv_full, kv_empty, p_full, p_empty = ring_barriers(STAGES)

    cargs = (q_bar, kv_full, kv_empty, p_full, p_empty, sQ, sQr, sK, sKr, sP, sStat, o_ptr,
             lse_ptr, o_row0, lse_row0, lse_stride, start, end, n_tiles, scale_log2)
    pargs = (q_desc, kv_desc, table_ptr, q_bar, kv_full, kv_empty, sQ, sQr, sK, sKr, q_row0, b,
             start, n_tiles, stride_bt, num_blocks)
    # the workers share a signature (W is unused by the producer)
    gl.warp_specialize([(_wg, (cargs, pargs, 0, BN, STAGES, NCH, DIRECT, PAGE)),
                        (_wg, (cargs, pargs, 1, BN, STAGES, NCH, DIRECT, PAGE)),
                        (_load, (cargs, pargs, 1, BN, STAGES, NCH, DIRECT, PAGE))],
                       [4, 1], [240, 24])
