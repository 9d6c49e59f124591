"""Experiment: the few-rows kernel over an fp8 cache at 16 query rows as two consumer
warpgroups on alternate tiles, P V's values as the MMA's register operand.

Warpgroup W takes tiles W, W + 2, ... of the CTA's split through two ring slots of its
own (2 W, 2 W + 1), which it refills itself: once tile j's QK and its values' loads have
read its slot, tile j + 2 of the warpgroup goes there, a chain ahead. No producer
warp, no widened copy of the values: chunk c's accumulator row r = 16 w + 8 h + g is
value column 128 w + 16 g + 2 c + h (V_L), so each thread's values are one 16-byte load
per key, widened in registers. Each warpgroup keeps its own online softmax and writes its
own fp32 partial (partial 2 split + W), which the merge adds. QK as gluon_rows_kernel.py
(the bf16 query as two e4m3 terms, written once by warpgroup 0).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier,
                                                              warpgroup_mma, warpgroup_mma_wait)

from lowering.decode.gluon_common import tma_load
from lowering.decode.gluon_rows_kernel import _amax, _q_terms

# a barrier of the calling partition's warps (renamed after triton 3.6)
_barrier = getattr(gl, "barrier", None) or gl.thread_barrier

V_L = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [1, 0], [8, 0], [16, 0], [32, 0]],
    lane_bases=[[2, 0], [4, 0], [0, 16], [0, 32], [64, 0]],
    warp_bases=[[128, 0], [256, 0]], block_bases=[], shape=[512, 64]))
ACC16_L = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                 instr_shape=[16, 16, 16]))
VT_L = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=ACC16_L, k_width=2))
SLOTS = gl.constexpr(4)  # two ring slots per warpgroup


@gluon.jit
def _values(sV, s, key0, end, BN: gl.constexpr):
    """Slot s's values as eight fp16 A operands [64 permuted columns, BN keys]; keys at or
    past end become 0 in a split's last tile."""
    v = sV.index(s).load(V_L).to(gl.float16)                       # [box * BN + key, 64]
    if key0 + BN > end:
        r = gl.arange(0, 8 * BN, layout=gl.SliceLayout(1, V_L))
        v = gl.where((key0 + r % BN < end)[:, None], v, gl.zeros_like(v))
    v = gl.reshape(v, [4, 2, BN, 4, 8, 2])                         # [w, g >> 2, key, g & 3, c, h]
    v = gl.permute(v, [0, 5, 1, 3, 2, 4])                          # [w, h, g >> 2, g & 3, key, c]
    v = gl.reshape(v, [64, BN, 2, 2, 2])                           # [row, key, c >> 2, .., c & 1]
    e, o = gl.split(v)
    e0, e1 = gl.split(e)
    o0, o1 = gl.split(o)
    v0, v4 = gl.split(e0)
    v2, v6 = gl.split(e1)
    v1, v5 = gl.split(o0)
    v3, v7 = gl.split(o1)
    return (gl.convert_layout(v0, VT_L), gl.convert_layout(v1, VT_L),
            gl.convert_layout(v2, VT_L), gl.convert_layout(v3, VT_L),
            gl.convert_layout(v4, VT_L), gl.convert_layout(v5, VT_L),
            gl.convert_layout(v6, VT_L), gl.convert_layout(v7, VT_L))


@gluon.jit
def _store_permuted(acc, inv, c: gl.constexpr, o_ptr, o_row0, ROWS: gl.constexpr,
                    NR: gl.constexpr):
    """fp32 chunk c: acc [64, NR] (row r is value column 128 (r >> 4) + 16 (r & 7) + 2 c +
    (r >> 3 & 1)) times inv [NR]."""
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, ACC16_L))
    n = gl.arange(0, NR, layout=gl.SliceLayout(0, ACC16_L))
    col = 128 * (r // 16) + 16 * (r % 8) + 2 * c + (r // 8) % 2
    ptrs = o_ptr + (o_row0 + n)[None, :].to(gl.int64) * 512 + col[:, None]
    gl.store(ptrs, acc * inv[None, :], mask=(n[None, :] < ROWS) & (col[:, None] < 512))


@gluon.jit
def _q_scale(q_ptr, b, ROWS: gl.constexpr, NR: gl.constexpr):
    """_q_terms' s [NR] alone (nothing stored)."""
    q_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])       # [16, 64]
    qr = gl.arange(0, NR, layout=gl.SliceLayout(1, q_l))
    qc = gl.arange(0, 64, layout=gl.SliceLayout(0, q_l))
    q_rows = q_ptr + (b * ROWS + qr)[:, None].to(gl.int64) * 576 + qc[None, :]
    q_mask = (qr[:, None] < ROWS) & (qc[None, :] < 64)
    amax = gl.zeros([NR], gl.float32, gl.SliceLayout(1, q_l))
    for c in gl.static_range(9):
        amax = gl.maximum(amax, _amax(gl.load(q_rows + 64 * c, mask=q_mask,
                                              other=0.0).to(gl.float32)))
    return gl.exp2(gl.floor(gl.log2(256.0 / gl.maximum(amax, 1e-30))))


@gluon.jit
def _refill(kv_desc, table_ptr, kv_full, sV, sR, slot, i, n_tiles, b, start, stride_bt,
            num_blocks, BN: gl.constexpr, PAGE: gl.constexpr):
    """Tile i of the split, if there is one, into ring slot `slot` (8 value boxes, rope)."""
    ok = i < n_tiles
    key = start + i * BN
    page = gl.load(table_ptr + b * stride_bt + key // PAGE, mask=ok, other=0)
    page = gl.minimum(gl.maximum(page, 0), num_blocks - 1)
    row = page * PAGE + key % PAGE
    bar = kv_full.index(slot)
    mbarrier.expect(bar, 9 * BN * 64, pred=ok)
    for c in gl.static_range(8):
        tma_load(kv_desc, [row, c * 64], bar, sV.index(slot).slice(c * BN, BN), pred=ok)
    tma_load(kv_desc, [row, 512], bar, sR.index(slot), pred=ok)


@gluon.jit
def _pp_consumer(W: gl.constexpr, args, S_Q: gl.constexpr, H: gl.constexpr,
                 BN: gl.constexpr, NR: gl.constexpr, PAGE: gl.constexpr,
                 CAUSAL: gl.constexpr):
    (q_ptr, ks_ptr, o_ptr, lse_ptr, kv_desc, table_ptr, kv_full, q_bar, sV, sR, sQ, sP, b,
     split, seqlen, start, end, n_tiles, sm_scale_log2, num_splits, stride_bt,
     num_blocks) = args
    ROWS: gl.constexpr = S_Q * H
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                 instr_shape=[16, NR, 16])
    s2_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, 2 * NR, 32])
    row_l: gl.constexpr = gl.SliceLayout(0, s_l)
    key_l: gl.constexpr = gl.SliceLayout(1, s_l)
    # this warpgroup's first two tiles, W and W + 2, into its slots 2 W and 2 W + 1
    _refill(kv_desc, table_ptr, kv_full, sV, sR, 2 * W, W, n_tiles, b, start, stride_bt,
            num_blocks, BN, PAGE)
    _refill(kv_desc, table_ptr, kv_full, sV, sR, 2 * W + 1, W + 2, n_tiles, b, start,
            stride_bt, num_blocks, BN, PAGE)
    if W == 0:          # the query's terms, once for both warpgroups
        q_s = _q_terms(q_ptr, sQ, b, ROWS, NR)
        fence_async_shared()
        mbarrier.arrive(q_bar, count=1)
    else:
        q_s = _q_scale(q_ptr, b, ROWS, NR)
    mbarrier.wait(q_bar, 0)
    q_s = gl.convert_layout(q_s, row_l)
    k_scale = gl.load(ks_ptr)
    scale_log2 = (sm_scale_log2 * k_scale) / q_s                         # [NR]
    rows = gl.arange(0, NR, layout=row_l)
    if CAUSAL:
        limit = seqlen - S_Q + rows // H + 1
    else:
        limit = rows * 0 + seqlen
    m_i = gl.full([NR], float("-inf"), gl.float32, row_l)
    l_acc = gl.zeros([BN, NR], gl.float32, s_l)
    acc0 = gl.zeros([64, NR], gl.float32, s_l)
    acc1 = gl.zeros([64, NR], gl.float32, s_l)
    acc2 = gl.zeros([64, NR], gl.float32, s_l)
    acc3 = gl.zeros([64, NR], gl.float32, s_l)
    acc4 = gl.zeros([64, NR], gl.float32, s_l)
    acc5 = gl.zeros([64, NR], gl.float32, s_l)
    acc6 = gl.zeros([64, NR], gl.float32, s_l)
    acc7 = gl.zeros([64, NR], gl.float32, s_l)
    for j in range(gl.cdiv(gl.maximum(n_tiles - W, 0), 2)):
        i = 2 * j + W
        slot = 2 * W + j % 2
        key0 = start + i * BN
        mbarrier.wait(kv_full.index(slot), (j // 2) & 1)
        z = gl.minimum(key0, 0)
        tok = warpgroup_mma(sV.index(slot + z).slice(0, BN), sQ.index(z).permute((1, 0)),
                            gl.zeros([BN, 2 * NR], gl.float32, s2_l), is_async=True)
        for c in gl.static_range(1, 8):
            tok = warpgroup_mma(sV.index(slot + z).slice(c * BN, BN),
                                sQ.index(c + z).permute((1, 0)), tok, is_async=True)
        tok = warpgroup_mma(sR.index(slot + z), sQ.index(8 + z).permute((1, 0)), tok,
                            is_async=True)
        s2 = warpgroup_mma_wait(num_outstanding=0, deps=[tok])
        hi, lo = gl.split(gl.permute(gl.reshape(s2, [BN, 2, NR]), [0, 2, 1]))
        sc = gl.convert_layout(hi + lo, s_l)                                   # [BN, NR]
        keys = key0 + gl.arange(0, BN, layout=key_l)
        vis = (keys[:, None] < end) & (keys[:, None] < limit[None, :])
        sc = gl.where(vis, sc * scale_log2[None, :], float("-inf"))
        m_new = gl.maximum(m_i, gl.max(sc, axis=0))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(sc - m_use[None, :])
        l_acc = l_acc * alpha[None, :] + p
        m_i = m_new
        sPw = sP.index(W)
        sPw.store(gl.permute(p.to(gl.float16), [1, 0]))                        # P [NR, BN]
        fence_async_shared()
        # the values into registers (after the softmax, so that they are not live beside
        # it), then the slot is free: tile j + 2 of this warpgroup goes there
        v0, v1, v2, v3, v4, v5, v6, v7 = _values(sV, slot, key0, end, BN)
        _barrier()
        fence_async_shared()
        _refill(kv_desc, table_ptr, kv_full, sV, sR, slot, i + 4, n_tiles, b, start,
                stride_bt, num_blocks, BN, PAGE)
        a = alpha[None, :]
        pt = sPw.permute((1, 0))
        acc0 = warpgroup_mma(v0, pt, acc0 * a, is_async=True)
        acc1 = warpgroup_mma(v1, pt, acc1 * a, is_async=True)
        acc2 = warpgroup_mma(v2, pt, acc2 * a, is_async=True)
        acc3 = warpgroup_mma(v3, pt, acc3 * a, is_async=True)
        acc4 = warpgroup_mma(v4, pt, acc4 * a, is_async=True)
        acc5 = warpgroup_mma(v5, pt, acc5 * a, is_async=True)
        acc6 = warpgroup_mma(v6, pt, acc6 * a, is_async=True)
        acc7 = warpgroup_mma(v7, pt, acc7 * a, is_async=True)
        acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = warpgroup_mma_wait(
            num_outstanding=0, deps=[acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7])
    l_i = gl.sum(l_acc, axis=0)
    has = l_i > 0.0
    l_safe = gl.where(has, l_i, 1.0)
    lse = gl.where(has, (m_i + gl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    inv = k_scale / l_safe
    o_row0 = (b * 2 * num_splits + 2 * split + W) * ROWS
    gl.store(lse_ptr + o_row0 + rows, lse, mask=rows < ROWS)
    _store_permuted(acc0, inv, 0, o_ptr, o_row0, ROWS, NR)
    _store_permuted(acc1, inv, 1, o_ptr, o_row0, ROWS, NR)
    _store_permuted(acc2, inv, 2, o_ptr, o_row0, ROWS, NR)
    _store_permuted(acc3, inv, 3, o_ptr, o_row0, ROWS, NR)
    _store_permuted(acc4, inv, 4, o_ptr, o_row0, ROWS, NR)
    _store_permuted(acc5, inv, 5, o_ptr, o_row0, ROWS, NR)
    _store_permuted(acc6, inv, 6, o_ptr, o_row0, ROWS, NR)
    _store_permuted(acc7, inv, 7, o_ptr, o_row0, ROWS, NR)


@gluon.jit
def _pp_wg0(args, S_Q: gl.constexpr, H: gl.constexpr, BN: gl.constexpr, NR: gl.constexpr,
            PAGE: gl.constexpr, CAUSAL: gl.constexpr):
    _pp_consumer(0, args, S_Q, H, BN, NR, PAGE, CAUSAL)


@gluon.jit
def _pp_wg1(args, S_Q: gl.constexpr, H: gl.constexpr, BN: gl.constexpr, NR: gl.constexpr,
            PAGE: gl.constexpr, CAUSAL: gl.constexpr):
    _pp_consumer(1, args, S_Q, H, BN, NR, PAGE, CAUSAL)


@gluon.jit
def mla_decode_rows_pp_kernel(q_ptr, kv_desc, table_ptr, lens_ptr, ks_ptr, o_ptr, lse_ptr,
                              sm_scale_log2, stride_bt, max_blocks, num_blocks, num_splits,
                              S_Q: gl.constexpr, H: gl.constexpr, PAGE: gl.constexpr,
                              BN: gl.constexpr, NR: gl.constexpr, CAUSAL: gl.constexpr):
    """grid (B, num_splits); 8 warps (two consumer warpgroups). fp32 partials o [B, 2
    num_splits, ROWS, 512] and lse [B, 2 num_splits, ROWS] for the merge."""
    b = gl.program_id(0)
    split = gl.program_id(1)
    seqlen = gl.minimum(gl.maximum(gl.load(lens_ptr + b), 1), max_blocks * PAGE)
    chunk = gl.cdiv(gl.cdiv(seqlen, num_splits), BN) * BN
    start = split * chunk
    end = gl.minimum(start + chunk, seqlen)
    n_tiles = gl.maximum(gl.cdiv(end - start, BN), 0)
    kv: gl.constexpr = gl.float8e4nv
    lay: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, 64], kv)
    sV = gl.allocate_shared_memory(kv, [SLOTS, 8 * BN, 64], lay)       # the values
    sR = gl.allocate_shared_memory(kv, [SLOTS, BN, 64], lay)           # the rope boxes
    sQ = gl.allocate_shared_memory(kv, [9, 2 * NR, 64],
                                   gl.NVMMASharedLayout.get_default_for([2 * NR, 64], kv))
    sP = gl.allocate_shared_memory(gl.float16, [2, NR, BN],
                                   gl.NVMMASharedLayout.get_default_for([NR, BN], gl.float16))
    kv_full = gl.allocate_shared_memory(gl.int64, [SLOTS, 1], mbarrier.MBarrierLayout())
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(SLOTS):
        mbarrier.init(kv_full.index(i), count=1)
    mbarrier.init(q_bar, count=1)
    args = (q_ptr, ks_ptr, o_ptr, lse_ptr, kv_desc, table_ptr, kv_full, q_bar, sV, sR, sQ, sP,
            b, split, seqlen, start, end, n_tiles, sm_scale_log2, num_splits, stride_bt,
            num_blocks)
    gl.warp_specialize([(_pp_wg0, (args, S_Q, H, BN, NR, PAGE, CAUSAL)),
                        (_pp_wg1, (args, S_Q, H, BN, NR, PAGE, CAUSAL))], [4], [240])
