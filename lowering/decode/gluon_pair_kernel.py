"""Hopper MLA decode, stage 1, in Gluon: 64-key blocks taken in pairs, two buffers.

The "gluon" backend's bf16 kernel where the page is a multiple of 64 (launcher:
gluon_decode.py; the ring kernel in gluon_ring_kernel.py serves pages of 32), and with
FP8 (below) its kernel for a bf16 query over an fp8 cache there. SM90 only; bf16 query;
L = 512, R = 64; H a multiple of 64.

CTA = 64 query rows (one token's heads) x one split of one request's keys, 8 warps in two
warpgroups, no producer warp. Warpgroup W owns O[:, 256 W : 256 W + 256] and the blocks
of its parity: for pair j, block a = 2j sits in buffer 0 and is scored by warpgroup 0,
block c = 2j + 1 in buffer 1, scored by warpgroup 1, at the same time. A pair:
    WG0: softmax(a) from its running max; publish (m, alpha); O += P_a V_a[:, :256] (P in
         registers); refill boxes 0-3 of buffer 0 with block a + 2;
    WG1: softmax(c) against WG0's new max (so one reference max per pair); publish
         (m, s1); P_c into buffer 1's rope box; O = s O + P_c V_c[:, 256:] (registers);
    WG0: P_a x s1 into buffer 0's rope box (both P now share WG1's max);
         O = s1 O + P_c V_c[:, :256] (P from shared memory); refill boxes 0-3 + rope of
         buffer 1 with block c + 2; the next QK, boxes 0-3 first;
    WG1: O += P_a V_a[:, 256:] (shared memory); refill boxes 4-7 of buffer 1 and 4-7 +
         rope of buffer 0; the next QK, its own half first.
A buffer's 64-column TMA boxes are refilled by halves, each by the warpgroup that reads
it last (buffer 0: WG0 0-3, WG1 4-7 + rope; buffer 1: WG0 0-3 + rope, WG1 4-7; the rope
box holds the block's P after its QK), so a half is reloaded as soon as it is free and
no "empty" barriers are needed. Shared memory: q 72 KB + 2 x 72 KB.

The smem indices carry a runtime zero that changes per pair (`z`): with constant indices
ptxas hoists every wgmma descriptor out of the loop and spills them (~200 local loads per
pair, 1.65x slower on an H200).
Rows, causal limits and outputs as the ring kernel (cta_work); l is summed per warpgroup
and added in the epilogue.

FP8 (an e4m3 cache, bf16 query): the same schedule over bf16 tiles widened from the cache
(gluon_pair_widen.py). A refill stages the half's e4m3 boxes (half the bytes) inside its
own bf16 boxes on a "landed" barrier; a third partition (4 warps, few registers) widens
them in place to bf16 (exact for e4m3), zeroes keys past the split's end, and arrives on
the half's "full" barrier, which the warpgroups wait on as in bf16. Shared memory stays
what the bf16 kernel takes.
The cache's scale multiplies the scores (in scale_log2) and the output, never the
operands, so the products are those of the bf16 kernel over the dequantized cache.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier,
                                                              warpgroup_mma, warpgroup_mma_wait)

from lowering.decode.gluon_common import tma_load, cta_work, finish_rows, store_half
from lowering.decode.gluon_pair_widen import stage_half, widen_half

# S [64 rows, 64 keys] and each [64, 64] quarter of a warpgroup's O share this layout
S_L = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                             instr_shape=[16, 64, 16]))
P_L = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=S_L.value, k_width=2))
ROW_L = gl.constexpr(gl.SliceLayout(1, S_L.value))
# FP8: registers per thread of warpgroup 1 and of the widener (12 warps share 64 K)
CONSUMER_REGS = gl.constexpr(232)
WIDEN_REGS = gl.constexpr(32)


@gluon.jit
def _load_half(kv_desc, table_ptr, full, sK, sKr, BUF: gl.constexpr, HALF: gl.constexpr, blk,
               n_tiles, b, start, stride_bt, num_blocks, PAGE: gl.constexpr,
               FP8: gl.constexpr):
    """Refill half HALF (the boxes its warpgroup reads) of buffer BUF with block blk. FP8:
    the e4m3 boxes into the half's staging place (full is then the "landed" barriers)."""
    ROPE: gl.constexpr = (BUF == 0 and HALF == 1) or (BUF == 1 and HALF == 0)
    NB: gl.constexpr = 5 if ROPE else 4
    ok = blk < n_tiles
    key = start + blk * 64
    page = gl.load(table_ptr + b * stride_bt + key // PAGE, mask=ok, other=0)
    page = gl.minimum(gl.maximum(page, 0), num_blocks - 1)
    row = page * PAGE + key % PAGE
    bar = full.index(BUF * 2 + HALF)
    if FP8:
        stage_half(kv_desc, row, bar, sK, sKr, BUF, HALF, ok)
    else:
        mbarrier.expect(bar, NB * 64 * 64 * 2, pred=ok)
        for c in gl.static_range(4):
            tma_load(kv_desc, [row, (4 * HALF + c) * 64], bar,
                      sK.index(BUF * 8 + 4 * HALF + c), pred=ok)
        if ROPE:
            tma_load(kv_desc, [row, 512], bar, sKr.index(BUF), pred=ok)



@gluon.jit
def _qk_boxes(sQ, sK, BUF: gl.constexpr, C0: gl.constexpr, acc, z):
    """Chain S += q[:, box] k[:, box]^T over value boxes C0..C0+3 of buffer BUF."""
    for c in gl.static_range(4):
        acc = warpgroup_mma(sQ.index(C0 + c + z), sK.index(BUF * 8 + C0 + c + z).permute((1, 0)),
                            acc, is_async=True)
    return acc


@gluon.jit
def _qk(sQ, sQr, sK, sKr, BUF: gl.constexpr, FIRST: gl.constexpr, full, ph, more, z):
    """Issue S = q k^T for the block in buffer BUF, half FIRST's boxes first; waits each
    half's barrier (skipped where more is false: a dummy QK whose scores go unused)."""
    mbarrier.wait(full.index(BUF * 2 + FIRST), ph, pred=more)
    tok = _qk_boxes(sQ, sK, BUF, 4 * FIRST, gl.zeros([64, 64], gl.float32, S_L), z)
    mbarrier.wait(full.index(BUF * 2 + 1 - FIRST), ph, pred=more)
    tok = _qk_boxes(sQ, sK, BUF, 4 - 4 * FIRST, tok, z)
    return warpgroup_mma(sQr, sKr.index(BUF + z).permute((1, 0)), tok, is_async=True)


@gluon.jit
def _pv(p, sK, v0, acc0, acc1, acc2, acc3, z):
    """Issue O_half += P V over boxes v0..v0+3 (four async wgmma of [64, 64])."""
    t0 = warpgroup_mma(p, sK.index(v0 + 0 + z), acc0, is_async=True)
    t1 = warpgroup_mma(p, sK.index(v0 + 1 + z), acc1, is_async=True)
    t2 = warpgroup_mma(p, sK.index(v0 + 2 + z), acc2, is_async=True)
    t3 = warpgroup_mma(p, sK.index(v0 + 3 + z), acc3, is_async=True)
    return t0, t1, t2, t3


@gluon.jit
def _zero_tail(sK, v0, key0, end, FP8: gl.constexpr):
    """The split's last block: rows of boxes v0..v0+3 at keys >= end to zero (another
    split's keys, or whatever an unwritten page holds, must not reach P V as NaN x 0).
    FP8: the widener zeroed them."""
    if not FP8 and key0 + 64 > end:
        zl: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        keep = (key0 + gl.arange(0, 64, layout=gl.SliceLayout(1, zl)) < end)[:, None]
        for c in gl.static_range(4):
            box = sK.index(v0 + c)
            x = box.load(zl)
            box.store(gl.where(keep, x, gl.zeros_like(x)))
        fence_async_shared()


@gluon.jit
def _start(start):
    """A warpgroup's running state: O quarters, base-2 max, row sum of its own P, the key
    offsets of a block's columns, and the descriptor-index zero (z)."""
    acc0 = gl.zeros([64, 64], gl.float32, S_L)
    acc1 = gl.zeros([64, 64], gl.float32, S_L)
    acc2 = gl.zeros([64, 64], gl.float32, S_L)
    acc3 = gl.zeros([64, 64], gl.float32, S_L)
    m = gl.full([64], float("-inf"), gl.float32, ROW_L)
    l = gl.zeros([64], gl.float32, ROW_L)
    cols = gl.arange(0, 64, layout=gl.SliceLayout(0, S_L))
    return acc0, acc1, acc2, acc3, m, l, cols, gl.minimum(start, 0)


@gluon.jit
def _epilogue(W: gl.constexpr, acc0, acc1, acc2, acc3, m, l, sStat, bar_l, o_ptr, lse_ptr,
              o_row0, lse_row0, lse_stride, o_scale, DIRECT: gl.constexpr):
    """Add the two warpgroups' row sums; write this warpgroup's 256 columns (and the LSE)."""
    sStat.slice((4 + W) * 64, 64).store(l)
    mbarrier.arrive(bar_l.index(W), count=1)
    mbarrier.wait(bar_l.index(1 - W), 0)
    l = l + sStat.slice((5 - W) * 64, 64).load(ROW_L)
    l_safe = finish_rows(W, m, l, lse_ptr, lse_row0, lse_stride, ROW_L)
    store_half(W, acc0, acc1, acc2, acc3, o_scale / l_safe, o_ptr, o_row0, S_L, DIRECT)


@gluon.jit
def _wg0(args, PAGE: gl.constexpr, DIRECT: gl.constexpr, FP8: gl.constexpr):
    """Warpgroup 0: the even blocks' scores, O columns 0-255; loads q."""
    (q_desc, kv_desc, table_ptr, q_bar, full, loads, bars, bar_l, sQ, sQr, sK, sKr, sStat,
     o_ptr, lse_ptr, q_row0, b, o_row0, lse_row0, lse_stride, start, end, n_tiles, scale_log2,
     o_scale, stride_bt, num_blocks) = args
    acc0, acc1, acc2, acc3, m, l, cols, z = _start(start)       # O quarters of this WG's half
    if n_tiles > 0:
        mbarrier.expect(q_bar, 9 * 64 * 64 * 2)
        for c in gl.static_range(8):
            tma_load(q_desc, [q_row0, c * 64], q_bar, sQ.index(c))
        tma_load(q_desc, [q_row0, 512], q_bar, sQr)
        _load_half(kv_desc, table_ptr, loads, sK, sKr, 0, 0, 0, n_tiles, b, start, stride_bt,
                   num_blocks, PAGE, FP8)
        _load_half(kv_desc, table_ptr, loads, sK, sKr, 1, 0, 1, n_tiles, b, start, stride_bt,
                   num_blocks, PAGE, FP8)
        mbarrier.wait(q_bar, 0)
        tok = _qk(sQ, sQr, sK, sKr, 0, 0, full, 0, True, z)
        sc = warpgroup_mma_wait(num_outstanding=0, deps=[tok])   # [64, 64] scores of block 0
        for j in range(gl.cdiv(n_tiles, 2)):
            ph = j & 1
            a = 2 * j
            key_a = start + a * 64
            z = gl.minimum(key_a, 0)
            x = gl.where((key_a + cols < end)[None, :], sc * scale_log2, float("-inf"))
            m_new = gl.maximum(m, gl.max(x, axis=1))            # finite: a block has a key
            alpha = gl.exp2(m - m_new)
            p = gl.exp2(x - m_new[:, None])
            l = l * alpha + gl.sum(p, axis=1)
            sStat.slice(0, 64).store(m_new)
            sStat.slice(64, 64).store(alpha)
            mbarrier.arrive(bars.index(0), count=1)
            _zero_tail(sK, 0, key_a, end, FP8)
            a_o = alpha[:, None]
            t0, t1, t2, t3 = _pv(gl.convert_layout(p.to(gl.bfloat16), P_L), sK, 0, acc0 * a_o,
                                 acc1 * a_o, acc2 * a_o, acc3 * a_o, z)
            acc0, acc1, acc2, acc3 = warpgroup_mma_wait(num_outstanding=0,
                                                        deps=[t0, t1, t2, t3])
            _load_half(kv_desc, table_ptr, loads, sK, sKr, 0, 0, a + 2, n_tiles, b, start,
                       stride_bt, num_blocks, PAGE, FP8)
            mbarrier.wait(bars.index(1), ph)                    # WG1's max and factor
            m = sStat.slice(128, 64).load(ROW_L)
            s1 = sStat.slice(192, 64).load(ROW_L)
            l = l * s1
            sKr.index(0).store((p * s1[:, None]).to(gl.bfloat16))   # P_a at the pair's max
            fence_async_shared()
            mbarrier.arrive(bars.index(2), count=1)
            if a + 1 < n_tiles:
                _zero_tail(sK, 8, start + a * 64 + 64, end, FP8)
                mbarrier.wait(bars.index(3), ph)                # P_c in buffer 1's rope box
                s1_o = s1[:, None]
                u0, u1, u2, u3 = _pv(sKr.index(1 + z), sK, 8, acc0 * s1_o, acc1 * s1_o,
                                     acc2 * s1_o, acc3 * s1_o, z)
                more = a + 2 < n_tiles
                mbarrier.wait(full.index(0), ph ^ 1, pred=more)
                tok = _qk_boxes(sQ, sK, 0, 0, gl.zeros([64, 64], gl.float32, S_L), z)
                acc0, acc1, acc2, acc3 = warpgroup_mma_wait(num_outstanding=4,
                                                            deps=[u0, u1, u2, u3])
                _load_half(kv_desc, table_ptr, loads, sK, sKr, 1, 0, a + 3, n_tiles, b, start,
                           stride_bt, num_blocks, PAGE, FP8)
                mbarrier.wait(full.index(1), ph ^ 1, pred=more)
                tok = _qk_boxes(sQ, sK, 0, 4, tok, z)
                tok = warpgroup_mma(sQr, sKr.index(0 + z).permute((1, 0)), tok, is_async=True)
                sc = warpgroup_mma_wait(num_outstanding=0, deps=[tok])
    _epilogue(0, acc0, acc1, acc2, acc3, m, l, sStat, bar_l, o_ptr, lse_ptr, o_row0, lse_row0,
              lse_stride, o_scale, DIRECT)


@gluon.jit
def _wg1(args, PAGE: gl.constexpr, DIRECT: gl.constexpr, FP8: gl.constexpr):
    """Warpgroup 1: the odd blocks' scores, O columns 256-511."""
    (q_desc, kv_desc, table_ptr, q_bar, full, loads, bars, bar_l, sQ, sQr, sK, sKr, sStat,
     o_ptr, lse_ptr, q_row0, b, o_row0, lse_row0, lse_stride, start, end, n_tiles, scale_log2,
     o_scale, stride_bt, num_blocks) = args
    acc0, acc1, acc2, acc3, m, l, cols, z = _start(start)       # O quarters of this WG's half
    if n_tiles > 0:
        _load_half(kv_desc, table_ptr, loads, sK, sKr, 0, 1, 0, n_tiles, b, start, stride_bt,
                   num_blocks, PAGE, FP8)
        _load_half(kv_desc, table_ptr, loads, sK, sKr, 1, 1, 1, n_tiles, b, start, stride_bt,
                   num_blocks, PAGE, FP8)
        mbarrier.wait(q_bar, 0)
        tok = _qk(sQ, sQr, sK, sKr, 1, 1, full, 0, n_tiles > 1, z)
        sc = warpgroup_mma_wait(num_outstanding=0, deps=[tok])   # block 1's (unused if none)
        for j in range(gl.cdiv(n_tiles, 2)):
            ph = j & 1
            a = 2 * j
            key_c = start + a * 64 + 64
            z = gl.minimum(key_c, 0)
            has_c = a + 1 < n_tiles
            mbarrier.wait(bars.index(0), ph)                    # WG0's max and factor
            m0 = sStat.slice(0, 64).load(ROW_L)
            a0 = sStat.slice(64, 64).load(ROW_L)
            x = gl.where(((key_c + cols < end) & has_c)[None, :], sc * scale_log2,
                         float("-inf"))
            m = gl.maximum(m0, gl.max(x, axis=1))
            s1 = gl.exp2(m0 - m)
            p = gl.exp2(x - m[:, None])
            l = l * (a0 * s1) + gl.sum(p, axis=1)
            sStat.slice(128, 64).store(m)
            sStat.slice(192, 64).store(s1)
            mbarrier.arrive(bars.index(1), count=1)
            p16 = p.to(gl.bfloat16)
            o_s = (a0 * s1)[:, None]
            if has_c:
                sKr.index(1).store(p16)
                fence_async_shared()
                mbarrier.arrive(bars.index(3), count=1)
                _zero_tail(sK, 12, key_c, end, FP8)
                t0, t1, t2, t3 = _pv(gl.convert_layout(p16, P_L), sK, 12, acc0 * o_s,
                                     acc1 * o_s, acc2 * o_s, acc3 * o_s, z)
                mbarrier.wait(bars.index(2), ph)                # P_a in buffer 0's rope box
                u0, u1, u2, u3 = _pv(sKr.index(0 + z), sK, 4, t0, t1, t2, t3, z)
                # its own P V done (P_a V_a may still run): refill its half of buffer 1
                w0, w1, w2, w3 = warpgroup_mma_wait(num_outstanding=4, deps=[u0, u1, u2, u3])
                _load_half(kv_desc, table_ptr, loads, sK, sKr, 1, 1, a + 3, n_tiles, b, start,
                           stride_bt, num_blocks, PAGE, FP8)
                acc0, acc1, acc2, acc3 = warpgroup_mma_wait(num_outstanding=0,
                                                            deps=[w0, w1, w2, w3])
            else:
                _zero_tail(sK, 4, key_c - 64, end, FP8)
                mbarrier.wait(bars.index(2), ph)
                u0, u1, u2, u3 = _pv(sKr.index(0 + z), sK, 4, acc0 * o_s, acc1 * o_s,
                                     acc2 * o_s, acc3 * o_s, z)
                acc0, acc1, acc2, acc3 = warpgroup_mma_wait(num_outstanding=0,
                                                            deps=[u0, u1, u2, u3])
            _load_half(kv_desc, table_ptr, loads, sK, sKr, 0, 1, a + 2, n_tiles, b, start,
                       stride_bt, num_blocks, PAGE, FP8)
            tok = _qk(sQ, sQr, sK, sKr, 1, 1, full, ph ^ 1, a + 3 < n_tiles, z)
            sc = warpgroup_mma_wait(num_outstanding=0, deps=[tok])
    _epilogue(1, acc0, acc1, acc2, acc3, m, l, sStat, bar_l, o_ptr, lse_ptr, o_row0, lse_row0,
              lse_stride, o_scale, DIRECT)


@gluon.jit
def _widen_tiles(args, PAGE: gl.constexpr, DIRECT: gl.constexpr, FP8: gl.constexpr):
    """FP8: the widener partition. Each block's halves, in the order their warpgroup's QK
    waits for them (buffer 0: half 0 first; buffer 1: half 1 first)."""
    (q_desc, kv_desc, table_ptr, q_bar, full, loads, bars, bar_l, sQ, sQr, sK, sKr, sStat,
     o_ptr, lse_ptr, q_row0, b, o_row0, lse_row0, lse_stride, start, end, n_tiles, scale_log2,
     o_scale, stride_bt, num_blocks) = args
    for j in range(gl.cdiv(n_tiles, 2)):
        ph = j & 1
        key_a = start + j * 128
        widen_half(loads, full, sK, sKr, 0, 0, ph, key_a, end)
        widen_half(loads, full, sK, sKr, 0, 1, ph, key_a, end)
        if 2 * j + 1 < n_tiles:
            widen_half(loads, full, sK, sKr, 1, 1, ph, key_a + 64, end)
            widen_half(loads, full, sK, sKr, 1, 0, ph, key_a + 64, end)


@gluon.jit
def mla_decode_pair_kernel(q_desc, kv_desc, table_ptr, lens_ptr, ks_ptr, o_ptr, lse_ptr,
                           scale_log2, stride_bt, max_blocks, num_blocks, num_splits,
                           S_Q: gl.constexpr, H: gl.constexpr, PAGE: gl.constexpr,
                           BN: gl.constexpr, STAGES: gl.constexpr, DIRECT: gl.constexpr,
                           CAUSAL: gl.constexpr, FP8: gl.constexpr):
    """grid (64-row blocks, B, splits); 8 warps (two consumer warpgroups), and with FP8 (an
    e4m3 cache, its scale at ks_ptr) the 4-warp widener; else ks_ptr is unused."""
    gl.static_assert(BN == 64 and STAGES == 2, "blocks of 64 keys in two buffers")
    gl.static_assert(PAGE % 64 == 0, "a page holds whole 64-key blocks")
    b, start, end, n_tiles, q_row0, o_row0, lse_row0, lse_stride = cta_work(
        lens_ptr, max_blocks, num_splits, S_Q, H, PAGE, BN, DIRECT, CAUSAL)
    sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)
    sQ = gl.allocate_shared_memory(gl.bfloat16, [8, 64, 64], sl)      # q's 8 value boxes
    sQr = gl.allocate_shared_memory(gl.bfloat16, [64, 64], sl)        # q's rope box
    sK = gl.allocate_shared_memory(gl.bfloat16, [16, 64, 64], sl)     # buffer * 8 + value box
    sKr = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 64], sl)     # rope box, then P
    # (m, alpha) of WG0, (m, s1) of WG1, then each WG's row sums
    sStat = gl.allocate_shared_memory(gl.float32, [8 * 64],
                                      gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    full = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())  # buf * 2 + half
    # WG0 stats published, WG1 stats published, P_a in place, P_c in place
    bars = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    bar_l = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(4):
        mbarrier.init(full.index(i), count=1)
        mbarrier.init(bars.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(bar_l.index(i), count=1)
    if FP8:
        # a half's e4m3 boxes landed (TMA), before the widener makes it full
        loads = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(4):
            mbarrier.init(loads.index(i), count=1)
        ks = gl.load(ks_ptr)
        scale_log2 = scale_log2 * ks                # scores of the dequantized keys
        o_scale = ks                                # and their values
    else:
        loads = full
        o_scale = 1.0
    args = (q_desc, kv_desc, table_ptr, q_bar, full, loads, bars, bar_l, sQ, sQr, sK, sKr,
            sStat, o_ptr, lse_ptr, q_row0, b, o_row0, lse_row0, lse_stride, start, end,
            n_tiles, scale_log2, o_scale, stride_bt, num_blocks)
    if FP8:
        gl.warp_specialize([(_wg0, (args, PAGE, DIRECT, FP8)), (_wg1, (args, PAGE, DIRECT, FP8)),
                            (_widen_tiles, (args, PAGE, DIRECT, FP8))],
                           [4, 4], [CONSUMER_REGS, WIDEN_REGS])
    else:
        gl.warp_specialize([(_wg0, (args, PAGE, DIRECT, FP8)), (_wg1, (args, PAGE, DIRECT, FP8))],
                           [4], [240])
