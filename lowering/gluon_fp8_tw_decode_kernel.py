"""Experiment: the fp8 Gluon decode kernel (gluon_fp8_decode_kernel.py) with its value
transposes moved to the partition that loads the tiles. Not a route of the library.

In the landed kernel each consumer warpgroup transposes its half of every tile's values
(fp8 wgmma reads B K-major only; cache rows are value-column-major) between its QK and
its P V. Here a 4-warp feeder loads q and the tiles (TMA) and does all the transposes:
per tile i, half h goes to buffer 2 h + (i % 2 == h) (warpgroup h's "own" buffer for its
own tiles, "other" for the other warpgroup's), keys past the split's end zeroed, then
vt_full; a consumer waits vt_full where it transposed before and releases the buffer
(vt_empty) after its P V. A ring stage is free after three releases (both consumers and
the feeder); the feeder refills tile i - LAG's stage after transposing tile i. The
consumers are the landed code otherwise. 12 warps: the launch gives 168 registers each,
and setmaxnreg moves them to the consumers (240 / 232) from the feeder (FEED_REGS). A
separate 1-warp loader would make 13 warps, counted as 16: 128 registers at launch,
which ptxas cannot fit the P V wgmma into.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier,
                                                              warpgroup_mma, warpgroup_mma_wait)

from .gluon_decode_kernel import _tma_load, cta_work, finish_rows
from .gluon_fp8_decode_kernel import P_SCALE, _other_pv, _qk, _softmax_publish


@gluon.jit
def _transpose_values(W: gl.constexpr, sK, s, vt, key0, end, BN: gl.constexpr,
                      NCH: gl.constexpr, vt_full, buf, i):
    """Wait until the transposer has written tile i's half W into vt (buffer buf)."""
    mbarrier.wait(vt_full.index(buf), (i // 2) & 1)


@gluon.jit
def _page(table_ptr, b, stride_bt, num_blocks, j, start, n_tiles, BN: gl.constexpr,
          PAGE: gl.constexpr):
    """Tile j's page id (bounded), 0 past the split."""
    page = gl.load(table_ptr + b * stride_bt + (start + j * BN) // PAGE, mask=j < n_tiles,
                   other=0)
    return gl.minimum(gl.maximum(page, 0), num_blocks - 1)


@gluon.jit
def _load_tile(kv_desc, kv_full, sK, page, j, start, BN: gl.constexpr, PAGE: gl.constexpr,
               STAGES: gl.constexpr, NCH: gl.constexpr):
    """TMA tile j (its page id known) into ring stage j % STAGES."""
    s = j % STAGES
    row = page * PAGE + (start + j * BN) % PAGE
    mbarrier.expect(kv_full.index(s), NCH * BN * 64)
    for c in gl.static_range(NCH):
        _tma_load(kv_desc, [row, c * 64], kv_full.index(s), sK.index(s * NCH + c))


@gluon.jit
def _feed(q_desc, kv_desc, table_ptr, q_bar, kv_full, kv_empty, vt_full, vt_empty, sQ, sK, sVT,
          q_row0, b, start, end, n_tiles, stride_bt, num_blocks, BN: gl.constexpr,
          PAGE: gl.constexpr, STAGES: gl.constexpr, NCH: gl.constexpr, LAG: gl.constexpr):
    """The 4-warp feeder: q and the first STAGES tiles in; then per tile i each half h of
    its values [BN, 256 h : 256 h + 256] -> buffer 2 h + (i % 2 == h) ([256, BN], keys
    contiguous; keys past end zeroed), vt_full, the stage's release, and the refill of
    tile i - LAG's stage with tile i - LAG + STAGES once the consumers released it."""
    tl_: gl.constexpr = gl.BlockedLayout([4, 4], [8, 4], [1, 4], [1, 0])        # [32, 64]
    mbarrier.expect(q_bar, NCH * 64 * 64)
    for c in gl.static_range(NCH):
        _tma_load(q_desc, [q_row0, c * 64], q_bar, sQ.index(c))
    for j in range(gl.minimum(n_tiles, STAGES)):
        page = _page(table_ptr, b, stride_bt, num_blocks, j, start, n_tiles, BN, PAGE)
        _load_tile(kv_desc, kv_full, sK, page, j, start, BN, PAGE, STAGES, NCH)
    nxt = _page(table_ptr, b, stride_bt, num_blocks, STAGES, start, n_tiles, BN, PAGE)
    for i in range(n_tiles):
        s = i % STAGES
        key0 = start + i * BN
        mbarrier.wait(kv_full.index(s), (i // STAGES) & 1)
        for h in gl.static_range(2):
            buf = 2 * h + (i % 2 == h).to(gl.int32)
            vt = sVT.index(buf)
            mbarrier.wait(vt_empty.index(buf), ((i // 2) & 1) ^ 1)
            if key0 + BN > end:
                keep = (key0 + gl.arange(0, BN, layout=gl.SliceLayout(1, tl_)) < end)[:, None]
                for c in gl.static_range(4):
                    x = sK.index(s * NCH + 4 * h + c).load(tl_)               # [BN, 64] fp8
                    x = gl.where(keep, x, gl.zeros_like(x))
                    vt.slice(64 * c, 64).store(gl.permute(x, [1, 0]))
            else:
                for c in gl.static_range(4):
                    x = sK.index(s * NCH + 4 * h + c).load(tl_)
                    vt.slice(64 * c, 64).store(gl.permute(x, [1, 0]))
            fence_async_shared()
            mbarrier.arrive(vt_full.index(buf), count=1)
        mbarrier.arrive(kv_empty.index(s), count=1)
        r = i - LAG + STAGES
        if i >= LAG and r < n_tiles:
            page = nxt
            nxt = _page(table_ptr, b, stride_bt, num_blocks, r + 1, start, n_tiles, BN, PAGE)
            mbarrier.wait(kv_empty.index(r % STAGES), ((r // STAGES) & 1) ^ 1)
            _load_tile(kv_desc, kv_full, sK, page, r, start, BN, PAGE, STAGES, NCH)


@gluon.jit
def _consumer(W: gl.constexpr, q_bar, kv_full, kv_empty, vt_full, vt_empty, p_full, p_empty,
              sQ, sK, sP, sVT,
              sStat, o_ptr, lse_ptr, qs_ptr, ks_ptr, o_row0, lse_row0, lse_stride, start, end,
              n_tiles, sm_scale_log2, BN: gl.constexpr, STAGES: gl.constexpr,
              NCH: gl.constexpr, DIRECT: gl.constexpr):
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                 instr_shape=[16, BN, 32])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                 instr_shape=[16, 256, 32])
    p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=4)
    row_s: gl.constexpr = gl.SliceLayout(1, s_l)
    row_o: gl.constexpr = gl.SliceLayout(1, o_l)
    k_scale = gl.load(ks_ptr)
    scale_log2 = sm_scale_log2 * gl.load(qs_ptr) * k_scale
    acc = gl.zeros([64, 256], gl.float32, o_l)                 # O[:, 256 W : 256 W + 256]
    m_prev = gl.full([64], float("-inf"), gl.float32, row_s)
    l_prev = gl.zeros([64], gl.float32, row_s)
    vt_other = sVT.index(2 * W)
    vt_own = sVT.index(2 * W + 1)
    mbarrier.wait(q_bar, 0)
    if W == 0:
        if n_tiles > 0:
            mbarrier.wait(kv_full.index(0), 0)
            tok = _qk(sQ, sK, 0, s_l, BN, NCH)
            sc = warpgroup_mma_wait(num_outstanding=0, deps=[tok])
            p8, m_prev, l_prev, alpha = _softmax_publish(W, sc, m_prev, l_prev, start, end,
                                                         scale_log2, 0, p_empty, p_full, sP,
                                                         sStat, s_l, BN)
            _transpose_values(W, sK, 0, vt_own, start, end, BN, NCH, vt_full, 2 * W + 1, 0)
            a_o = gl.convert_layout(alpha, row_o)[:, None]
            t = warpgroup_mma(gl.convert_layout(p8, p_l), vt_own.permute((1, 0)), acc * a_o,
                              is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=[t])
            mbarrier.arrive(vt_empty.index(2 * W + 1), count=1)
            mbarrier.arrive(kv_empty.index(0), count=1)
    for i in range(2 - W, n_tiles, 2):
        s = i % STAGES
        so = (i - 1) % STAGES
        mbarrier.wait(kv_full.index(s), (i // STAGES) & 1)
        tok = _qk(sQ, sK, s, s_l, BN, NCH)                             # 9 groups in flight
        # the other warpgroup's tile i - 1: its values transposed, then its P V
        mbarrier.wait(kv_full.index(so), ((i - 1) // STAGES) & 1)
        _transpose_values(W, sK, so, vt_other, start + (i - 1) * BN, end, BN, NCH, vt_full,
                          2 * W, i - 1)
        t, m_o, l_o = _other_pv(W, acc, sP, sStat, vt_other, p_full, i - 1, row_o)
        sc = warpgroup_mma_wait(num_outstanding=1, deps=[tok])
        p8, m_prev, l_prev, alpha = _softmax_publish(
            W, sc, gl.convert_layout(m_o, row_s), gl.convert_layout(l_o, row_s), start + i * BN,
            end, scale_log2, i // 2, p_empty, p_full, sP, sStat, s_l, BN)
        _transpose_values(W, sK, s, vt_own, start + i * BN, end, BN, NCH, vt_full, 2 * W + 1, i)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[t])
        mbarrier.arrive(vt_empty.index(2 * W), count=1)
        mbarrier.arrive(p_empty.index(1 - W), count=1)
        mbarrier.arrive(kv_empty.index(so), count=1)
        # this warpgroup's own P V, P from registers
        a_o = gl.convert_layout(alpha, row_o)[:, None]
        t = warpgroup_mma(gl.convert_layout(p8, p_l), vt_own.permute((1, 0)), acc * a_o,
                          is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[t])
        mbarrier.arrive(vt_empty.index(2 * W + 1), count=1)
        mbarrier.arrive(kv_empty.index(s), count=1)
    if n_tiles > 0 and (n_tiles - 1) % 2 != W:
        # the split's last tile is the other warpgroup's
        i = n_tiles - 1
        so = i % STAGES
        mbarrier.wait(kv_full.index(so), (i // STAGES) & 1)
        _transpose_values(W, sK, so, vt_other, start + i * BN, end, BN, NCH, vt_full, 2 * W, i)
        t, m_o, l_o = _other_pv(W, acc, sP, sStat, vt_other, p_full, i, row_o)
        m_prev = gl.convert_layout(m_o, row_s)
        l_prev = gl.convert_layout(l_o, row_s)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[t])
        mbarrier.arrive(vt_empty.index(2 * W), count=1)
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
        NCH: gl.constexpr, DIRECT: gl.constexpr, PAGE: gl.constexpr, LAG: gl.constexpr):
    (q_bar, kv_full, kv_empty, vt_full, vt_empty, p_full, p_empty, sQ, sK, sP, sVT, sStat, o_ptr,
     lse_ptr, qs_ptr, ks_ptr, o_row0, lse_row0, lse_stride, start, end, n_tiles,
     sm_scale_log2) = cargs
    _consumer(W, q_bar, kv_full, kv_empty, vt_full, vt_empty, p_full, p_empty, sQ, sK, sP, sVT,
              sStat, o_ptr,
              lse_ptr, qs_ptr, ks_ptr, o_row0, lse_row0, lse_stride, start, end, n_tiles,
              sm_scale_log2, BN, STAGES, NCH, DIRECT)


@gluon.jit
def _feeder(cargs, pargs, W: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
            NCH: gl.constexpr, DIRECT: gl.constexpr, PAGE: gl.constexpr, LAG: gl.constexpr):
    (q_desc, kv_desc, table_ptr, q_bar, kv_full, kv_empty, vt_full, vt_empty, sQ, sK, sVT,
     q_row0, b, start, end, n_tiles, stride_bt, num_blocks) = pargs
    _feed(q_desc, kv_desc, table_ptr, q_bar, kv_full, kv_empty, vt_full, vt_empty, sQ, sK, sVT,
          q_row0, b, start, end, n_tiles, stride_bt, num_blocks, BN, PAGE, STAGES, NCH, LAG)


@gluon.jit
def mla_decode_fp8_tw_kernel(q_desc, kv_desc, table_ptr, lens_ptr, qs_ptr, ks_ptr, o_ptr,
                             lse_ptr, sm_scale_log2, stride_bt, max_blocks, num_blocks,
                             num_splits, S_Q: gl.constexpr, H: gl.constexpr,
                             PAGE: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
                             DIRECT: gl.constexpr, CAUSAL: gl.constexpr, LAG: gl.constexpr,
                             FEED_REGS: gl.constexpr):
    NCH: gl.constexpr = 9                       # 576 = 8 value chunks of 64 + the rope chunk
    b, start, end, n_tiles, q_row0, o_row0, lse_row0, lse_stride = cta_work(
        lens_ptr, max_blocks, num_splits, S_Q, H, PAGE, BN, DIRECT, CAUSAL)

    f8: gl.constexpr = gl.float8e4nv
    sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 64], f8)
    slk: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, 64], f8)
    slp: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, BN], f8)
    slv: gl.constexpr = gl.NVMMASharedLayout.get_default_for([256, BN], f8)
    sQ = gl.allocate_shared_memory(f8, [NCH, 64, 64], sl)                 # q (rope chunk last)
    sK = gl.allocate_shared_memory(f8, [STAGES * NCH, BN, 64], slk)
    sP = gl.allocate_shared_memory(f8, [2, 64, BN], slp)
    sVT = gl.allocate_shared_memory(f8, [4, 256, BN], slv)                # per WG: other, own
    sStat = gl.allocate_shared_memory(gl.float32, [8 * 64],       # (m, l, alpha) x 2 slots
                                      gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    p_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    p_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):          # both consumers and the transposer release
        mbarrier.init(kv_full.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=3)
    for i in gl.static_range(2):
        mbarrier.init(p_full.index(i), count=1)
        mbarrier.init(p_empty.index(i), count=1)
    vt_full = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    vt_empty = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(4):
        mbarrier.init(vt_full.index(i), count=1)
        mbarrier.init(vt_empty.index(i), count=1)

    cargs = (q_bar, kv_full, kv_empty, vt_full, vt_empty, p_full, p_empty, sQ, sK, sP, sVT, sStat,
             o_ptr, lse_ptr, qs_ptr, ks_ptr, o_row0, lse_row0, lse_stride, start, end, n_tiles,
             sm_scale_log2)
    pargs = (q_desc, kv_desc, table_ptr, q_bar, kv_full, kv_empty, vt_full, vt_empty, sQ, sK,
             sVT, q_row0, b, start, end, n_tiles, stride_bt, num_blocks)
    gl.warp_specialize([(_wg, (cargs, pargs, 0, BN, STAGES, NCH, DIRECT, PAGE, LAG)),
                        (_wg, (cargs, pargs, 1, BN, STAGES, NCH, DIRECT, PAGE, LAG)),
                        (_feeder, (cargs, pargs, 2, BN, STAGES, NCH, DIRECT, PAGE, LAG))],
                       [4, 4], [240, FEED_REGS])
