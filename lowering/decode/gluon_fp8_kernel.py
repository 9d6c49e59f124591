"""Hopper MLA decode over an fp8 cache, in Gluon: stage 1 of the "gluon" route of
lowering.mla_decode_fp8q (an fp8 query), and in its BF16Q mode of lowering.mla_decode's
"gluon" route over an fp8 cache past 32 query rows (launcher: gluon_decode.py).

The bf16 kernel's design (gluon_decode_kernel.py: two consumer warpgroups in ping-pong,
a one-warp TMA producer, tiles of BN keys) with e4m3 operands:
  - QK^T is an fp8 wgmma (k = 32 per instruction): half the shared-memory bytes per FLOP
    of the bf16 kernel's N = 32 scores;
  - tiles are half the size, so the ring holds 8 tiles of 32 keys or 3 of 64 (the bf16
    kernel fits 4 of 32 beside q); the launcher picks by split length (fp8_config);
  - P V is one fp8 wgmma of N = 256 per warpgroup and tile (its half of O). fp8 wgmma
    reads B K-major only and the cache rows are value-column-major, so each warpgroup
    transposes its half of a tile's values through registers into its own buffer, and
    zeroes keys past the split's end there (no NaN x 0 from unwritten rows);
  - P goes to e4m3 scaled by P_SCALE (p in [0, 1] -> [0, 256]), as the Triton fp8 path;
    the row sums use the unrounded p.
Scores = (q8 . k8) * q_scale * k_scale * softmax_scale; O = sum(P8 V8) * k_scale /
(P_SCALE * l). Output as the bf16 kernel's stage 1: DIRECT -> out [B, ROWS, 512] bf16 +
lse [B, H, S_Q]; else fp32 partials + lse for triton_merge_kernel.

BF16Q (a bf16 query over an fp8 cache, kv_cache_dtype="fp8" past 32 query rows): q
comes as two e4m3 terms per element, hi and lo, with s [rows] a power of two per row
(q_terms_kernel.py: q = (hi + lo) / s, a bf16's precision kept). q_desc covers [2 N, 576],
hi rows then lo rows; the producer copies both (18 boxes); QK chains 9 MMAs over lo, then
9 over hi, into one accumulator (_qk); qs_ptr holds s and the scale becomes per row,
k_scale * softmax_scale / s. The terms take 72 KB of shared memory, so the ring is
shorter (BF16Q_CONFIG in gluon_decode.py: 6 tiles of 32 keys).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier,
                                                              warpgroup_mma, warpgroup_mma_wait)

from lowering.decode.gluon_common import (tma_load, cta_work, finish_rows, load_ring,
                                          ring_barriers)

NCH = gl.constexpr(9)              # 576 = 8 value chunks of 64 + the rope chunk

P_SCALE = gl.constexpr(256.0)      # P to e4m3 as p * P_SCALE


@gluon.jit
def _producer(q_desc, kv_desc, table_ptr, q_bar, kv_full, kv_empty, sQ, sK, q_row0, lo_row0,
              b, start, n_tiles, stride_bt, num_blocks, BN: gl.constexpr, PAGE: gl.constexpr,
              STAGES: gl.constexpr, NCH: gl.constexpr, BF16Q: gl.constexpr):
    if BF16Q:
        # q's hi rows at q_row0, its lo rows at lo_row0 (B x ROWS rows further down)
        mbarrier.expect(q_bar, 2 * NCH * 64 * 64)
        for c in gl.static_range(NCH):
            tma_load(q_desc, [q_row0, c * 64], q_bar, sQ.index(c))
            tma_load(q_desc, [lo_row0, c * 64], q_bar, sQ.index(NCH + c))
    else:
        mbarrier.expect(q_bar, NCH * 64 * 64)
        for c in gl.static_range(NCH):
            tma_load(q_desc, [q_row0, c * 64], q_bar, sQ.index(c))
    load_ring(kv_desc, table_ptr, kv_full, kv_empty, sK, b, start, n_tiles, stride_bt,
              num_blocks, BN, PAGE, STAGES, NCH)


@gluon.jit
def _qk(sQ, sK, s, z, s_l: gl.constexpr, BN: gl.constexpr, NCH: gl.constexpr,
        BF16Q: gl.constexpr):
    """Issue S = q8 k8^T for the tile in stage s (9 chained fp8 wgmma). [64, BN] fp32.

    BF16Q: 9 over q's lo term, then 9 over its hi term, into the same accumulator. Hopper
    adds each fp8 MMA into the accumulator keeping ~14 bits relative to the largest addend,
    so the small lo products go first, while the sum is still small: after the hi ones
    they would be summed at the scores' magnitude, doubling the scores' rounding. z is a
    runtime 0 (min(key0, 0)) in the lo terms' indices: with constant ones ptxas hoists the
    18 descriptors out of the loop and spills them (at BN = 64, 184-208 bytes of stack
    against 56-88 with z; at BF16Q's BN = 32, 0-16 with z under triton 3.6-3.9)."""
    acc = gl.zeros([64, BN], gl.float32, s_l)
    if BF16Q:
        for c in gl.static_range(NCH):
            acc = warpgroup_mma(sQ.index(NCH + c + z),
                                sK.index(s * NCH + c + z).permute((1, 0)), acc, is_async=True)
    tok = warpgroup_mma(sQ.index(NCH - 1), sK.index(s * NCH + NCH - 1).permute((1, 0)), acc,
                        is_async=True)
    for c in gl.static_range(NCH - 1):
        tok = warpgroup_mma(sQ.index(c), sK.index(s * NCH + c).permute((1, 0)), tok,
                            is_async=True)
    return tok


@gluon.jit
def _transpose_values(W: gl.constexpr, sK, s, vt, key0, end, BN: gl.constexpr,
                      NCH: gl.constexpr):
    """This warpgroup's half of the tile's values, [BN keys, 256] -> vt [256, BN] (keys
    contiguous, as fp8 wgmma reads B); in the split's last tile, keys at or past end
    become 0. Each thread moves 4 x 4-byte blocks (ldmatrix in, 32-bit stores out)."""
    tl_: gl.constexpr = gl.BlockedLayout([4, 4], [8, 4], [1, 4], [1, 0])        # [32, 64]
    if key0 + BN > end:
        keep = (key0 + gl.arange(0, BN, layout=gl.SliceLayout(1, tl_)) < end)[:, None]
        for c in gl.static_range(4):
            x = sK.index(s * NCH + 4 * W + c).load(tl_)                      # [BN, 64] fp8
            x = gl.where(keep, x, gl.zeros_like(x))
            vt.slice(64 * c, 64).store(gl.permute(x, [1, 0]))                 # [64, BN]
    else:
        for c in gl.static_range(4):
            x = sK.index(s * NCH + 4 * W + c).load(tl_)
            vt.slice(64 * c, 64).store(gl.permute(x, [1, 0]))
    fence_async_shared()


@gluon.jit
def _softmax_publish(W: gl.constexpr, sc, m_prev, l_prev, key0, end, scale_log2, k, p_empty,
                     p_full, sP, sStat, s_l: gl.constexpr, BN: gl.constexpr):
    """Base-2 online softmax of this warpgroup's k-th tile (scale_log2 [64], per row); P
    (e4m3, x P_SCALE) and (m, l, alpha) go to slot W. Returns (P fp8, m, l, alpha)."""
    cols = gl.arange(0, BN, layout=gl.SliceLayout(0, s_l))
    sc = gl.where((key0 + cols < end)[None, :], sc * scale_log2[:, None], float("-inf"))
    m_new = gl.maximum(m_prev, gl.max(sc, axis=1))
    alpha = gl.exp2(m_prev - m_new)
    p = gl.exp2(sc - m_new[:, None])
    l_new = l_prev * alpha + gl.sum(p, axis=1)
    p8 = (p * P_SCALE).to(gl.float8e4nv)
    mbarrier.wait(p_empty.index(W), (k & 1) ^ 1)
    sP.index(W).store(p8)
    sStat.slice((W * 3 + 0) * 64, 64).store(m_new)
    sStat.slice((W * 3 + 1) * 64, 64).store(l_new)
    sStat.slice((W * 3 + 2) * 64, 64).store(alpha)
    fence_async_shared()
    mbarrier.arrive(p_full.index(W), count=1)
    return p8, m_new, l_new, alpha


@gluon.jit
def _other_pv(W: gl.constexpr, acc, sP, sStat, vt, p_full, i, row_o: gl.constexpr):
    """Wait the other warpgroup's P of tile i and issue acc = alpha acc + P V (1 group).
    Returns (token, m, l) of that tile's row state."""
    mbarrier.wait(p_full.index(1 - W), (i // 2) & 1)
    row_s: gl.constexpr = row_o
    m_o = sStat.slice(((1 - W) * 3 + 0) * 64, 64).load(row_s)
    l_o = sStat.slice(((1 - W) * 3 + 1) * 64, 64).load(row_s)
    a_o = sStat.slice(((1 - W) * 3 + 2) * 64, 64).load(row_o)[:, None]
    tok = warpgroup_mma(sP.index(1 - W), vt.permute((1, 0)), acc * a_o, is_async=True)
    return tok, m_o, l_o


@gluon.jit
def _consumer(W: gl.constexpr, q_bar, kv_full, kv_empty, p_full, p_empty, sQ, sK, sP, sVT,
              sStat, o_ptr, lse_ptr, qs_ptr, ks_ptr, q_row0, o_row0, lse_row0,
              lse_stride, start, end, n_tiles, sm_scale_log2, BN: gl.constexpr,
              STAGES: gl.constexpr, NCH: gl.constexpr, DIRECT: gl.constexpr,
              BF16Q: gl.constexpr):
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                 instr_shape=[16, BN, 32])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                 instr_shape=[16, 256, 32])
    p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=4)
    row_s: gl.constexpr = gl.SliceLayout(1, s_l)
    row_o: gl.constexpr = gl.SliceLayout(1, o_l)
    k_scale = gl.load(ks_ptr)
    if BF16Q:
        q_s = gl.load(qs_ptr + q_row0 + gl.arange(0, 64, layout=row_s))        # [64] per row
        scale_log2 = (sm_scale_log2 * k_scale) / q_s
    else:
        scale_log2 = gl.full([64], sm_scale_log2 * gl.load(qs_ptr) * k_scale, gl.float32,
                             row_s)
    acc = gl.zeros([64, 256], gl.float32, o_l)                 # O[:, 256 W : 256 W + 256]
    m_prev = gl.full([64], float("-inf"), gl.float32, row_s)
    l_prev = gl.zeros([64], gl.float32, row_s)
    vt_other = sVT.index(2 * W)
    vt_own = sVT.index(2 * W + 1)
    mbarrier.wait(q_bar, 0)
    if W == 0:
        if n_tiles > 0:
            mbarrier.wait(kv_full.index(0), 0)
            tok = _qk(sQ, sK, 0, gl.minimum(start, 0), s_l, BN, NCH, BF16Q)
            sc = warpgroup_mma_wait(num_outstanding=0, deps=[tok])
            p8, m_prev, l_prev, alpha = _softmax_publish(W, sc, m_prev, l_prev, start, end,
                                                         scale_log2, 0, p_empty, p_full, sP,
                                                         sStat, s_l, BN)
            _transpose_values(W, sK, 0, vt_own, start, end, BN, NCH)
            a_o = gl.convert_layout(alpha, row_o)[:, None]
            t = warpgroup_mma(gl.convert_layout(p8, p_l), vt_own.permute((1, 0)), acc * a_o,
                              is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=[t])
            mbarrier.arrive(kv_empty.index(0), count=1)
    for i in range(2 - W, n_tiles, 2):
        s = i % STAGES
        so = (i - 1) % STAGES
        mbarrier.wait(kv_full.index(s), (i // STAGES) & 1)
        tok = _qk(sQ, sK, s, gl.minimum(start + i * BN, 0), s_l, BN, NCH, BF16Q)  # 9 (18)
        # the other warpgroup's tile i - 1: its values transposed, then its P V
        mbarrier.wait(kv_full.index(so), ((i - 1) // STAGES) & 1)
        _transpose_values(W, sK, so, vt_other, start + (i - 1) * BN, end, BN, NCH)
        t, m_o, l_o = _other_pv(W, acc, sP, sStat, vt_other, p_full, i - 1, row_o)
        sc = warpgroup_mma_wait(num_outstanding=1, deps=[tok])
        p8, m_prev, l_prev, alpha = _softmax_publish(
            W, sc, gl.convert_layout(m_o, row_s), gl.convert_layout(l_o, row_s), start + i * BN,
            end, scale_log2, i // 2, p_empty, p_full, sP, sStat, s_l, BN)
        _transpose_values(W, sK, s, vt_own, start + i * BN, end, BN, NCH)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[t])
        mbarrier.arrive(p_empty.index(1 - W), count=1)
        mbarrier.arrive(kv_empty.index(so), count=1)
        # this warpgroup's own P V, P from registers
        a_o = gl.convert_layout(alpha, row_o)[:, None]
        t = warpgroup_mma(gl.convert_layout(p8, p_l), vt_own.permute((1, 0)), acc * a_o,
                          is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[t])
        mbarrier.arrive(kv_empty.index(s), count=1)
    if n_tiles > 0 and (n_tiles - 1) % 2 != W:
        # the split's last tile is the other warpgroup's
        i = n_tiles - 1
        so = i % STAGES
        mbarrier.wait(kv_full.index(so), (i // STAGES) & 1)
        _transpose_values(W, sK, so, vt_other, start + i * BN, end, BN, NCH)
        t, m_o, l_o = _other_pv(W, acc, sP, sStat, vt_other, p_full, i, row_o)
        m_prev = gl.convert_layout(m_o, row_s)
        l_prev = gl.convert_layout(l_o, row_s)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[t])
        mbarrier.arrive(p_empty.index(1 - W), count=1)
        mbarrier.arrive(kv_empty.index(so), count=1)

    # ---- epilogue: this warpgroup's 256 columns ------------------------------------------
    l_safe = finish_rows(W, m_prev, l_prev, lse_ptr, lse_row0, lse_stride, row_s)
    inv = gl.convert_layout(k_scale / (P_SCALE * l_safe), row_o)[:, None]
    rows = gl.arange(0, 64, layout=row_o)
    cols = gl.arange(0, 256, layout=gl.SliceLayout(0, o_l))
    ptrs = o_ptr + (o_row0 + rows)[:, None].to(gl.int64) * 512 + 256 * W + cols[None, :]
    if DIRECT:
        gl.store(ptrs, (acc * inv).to(gl.bfloat16))
    else:
        gl.store(ptrs, acc * inv)


@gluon.jit
def _wg(cargs, pargs, W: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
        DIRECT: gl.constexpr, PAGE: gl.constexpr, BF16Q: gl.constexpr):
    (q_bar, kv_full, kv_empty, p_full, p_empty, sQ, sK, sP, sVT, sStat, o_ptr, lse_ptr,
     qs_ptr, ks_ptr, q_row0, o_row0, lse_row0, lse_stride, start, end, n_tiles,
     sm_scale_log2) = cargs
    _consumer(W, q_bar, kv_full, kv_empty, p_full, p_empty, sQ, sK, sP, sVT, sStat, o_ptr,
              lse_ptr, qs_ptr, ks_ptr, q_row0, o_row0, lse_row0, lse_stride, start, end,
              n_tiles, sm_scale_log2, BN, STAGES, NCH, DIRECT, BF16Q)


@gluon.jit
def _load(cargs, pargs, W: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
          DIRECT: gl.constexpr, PAGE: gl.constexpr, BF16Q: gl.constexpr):
    (q_desc, kv_desc, table_ptr, q_bar, kv_full, kv_empty, sQ, sK, q_row0, lo_row0, b, start,
     n_tiles, stride_bt, num_blocks) = pargs
    _producer(q_desc, kv_desc, table_ptr, q_bar, kv_full, kv_empty, sQ, sK, q_row0, lo_row0, b,
              start, n_tiles, stride_bt, num_blocks, BN, PAGE, STAGES, NCH, BF16Q)


@gluon.jit
def mla_decode_fp8_kernel(q_desc, kv_desc, table_ptr, lens_ptr, qs_ptr, ks_ptr, o_ptr, lse_ptr,
                          sm_scale_log2, stride_bt, max_blocks, num_blocks, num_splits,
                          S_Q: gl.constexpr, H: gl.constexpr, PAGE: gl.constexpr,
                          BN: gl.constexpr, STAGES: gl.constexpr, DIRECT: gl.constexpr,
                          CAUSAL: gl.constexpr, BF16Q: gl.constexpr):
    """grid (ROWS / 64, B, num_splits). q_desc: fp8 q [B x ROWS, 576] with its per-tensor
    scale at qs_ptr, or BF16Q: q's terms [2 B x ROWS, 576] with s [B x ROWS] at qs_ptr."""
    b, start, end, n_tiles, q_row0, o_row0, lse_row0, lse_stride = cta_work(
        lens_ptr, max_blocks, num_splits, S_Q, H, PAGE, BN, DIRECT, CAUSAL)

    f8: gl.constexpr = gl.float8e4nv
    sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 64], f8)
    slk: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, 64], f8)
    slp: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, BN], f8)
    slv: gl.constexpr = gl.NVMMASharedLayout.get_default_for([256, BN], f8)
    if BF16Q:
        sQ = gl.allocate_shared_memory(f8, [2 * NCH, 64, 64], sl)         # q's hi, then lo
    else:
        sQ = gl.allocate_shared_memory(f8, [NCH, 64, 64], sl)             # q (rope chunk last)
    sK = gl.allocate_shared_memory(f8, [STAGES * NCH, BN, 64], slk)
    sP = gl.allocate_shared_memory(f8, [2, 64, BN], slp)
    sVT = gl.allocate_shared_memory(f8, [4, 256, BN], slv)                # per WG: other, own
    sStat = gl.allocate_shared_memory(gl.float32, [8 * 64],       # (m, l, alpha) x 2 slots
                                      gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    q_bar, kv_full, kv_empty, p_full, p_empty = ring_barriers(STAGES)

    cargs = (q_bar, kv_full, kv_empty, p_full, p_empty, sQ, sK, sP, sVT, sStat, o_ptr, lse_ptr,
             qs_ptr, ks_ptr, q_row0, o_row0, lse_row0, lse_stride, start, end, n_tiles,
             sm_scale_log2)
    lo_row0 = q_row0 + gl.num_programs(1) * (S_Q * H)       # BF16Q: q's lo term (grid: B)
    pargs = (q_desc, kv_desc, table_ptr, q_bar, kv_full, kv_empty, sQ, sK, q_row0, lo_row0, b,
             start, n_tiles, stride_bt, num_blocks)
    gl.warp_specialize([(_wg, (cargs, pargs, 0, BN, STAGES, DIRECT, PAGE, BF16Q)),
                        (_wg, (cargs, pargs, 1, BN, STAGES, DIRECT, PAGE, BF16Q)),
                        (_load, (cargs, pargs, 1, BN, STAGES, DIRECT, PAGE, BF16Q))],
                       [4, 1], [240, 24])

