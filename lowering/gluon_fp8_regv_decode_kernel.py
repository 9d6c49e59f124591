"""Experiment (not wired in): the fp8 pair kernel with the values as a register operand.

The fp8 pair kernel's schedule (blocks a = 2j / c = 2j + 1 scored at once by warpgroup 0 /
1, one reference max per pair, buffer halves refilled by the warpgroup that reads them
last), but P V computed transposed, O^T [256 columns, 64 heads] += V^T P^T, so that no
value transpose goes through shared memory: fp8 wgmma reads B K-major only, and V^T as
the A operand may come from registers. Each thread loads its rows of V^T as 8-byte rows of
the cache tile (the wgmma rows are permuted so that a thread's 8 rows are 8 consecutive
value columns, _values) and shuffles the bytes in registers; P goes to shared memory as
the B operand (warpgroup 0 stores its own P_a too). Value boxes and rope boxes live in
separate buffers so that a half's four value boxes are one [256, 64] view.
Scores = (q8 . k8) * q_scale * k_scale * softmax_scale; O = sum(P8 V8) * k_scale /
(P_SCALE * l). Outputs as the other kernels' stage 1 (cta_work).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier,
                                                              warpgroup_mma, warpgroup_mma_wait)

from .gluon_decode_kernel import _tma_load, cta_work

P_SCALE = gl.constexpr(256.0)      # P to e4m3 as p * P_SCALE


@gluon.jit
def _load_half(kv_desc, table_ptr, full, sKv, sKr, BUF: gl.constexpr, HALF: gl.constexpr, blk,
               n_tiles, b, start, stride_bt, num_blocks, PAGE: gl.constexpr):
    """Refill half HALF of buffer BUF (value boxes 4 HALF .. 4 HALF + 3, and the rope box
    where HALF is the buffer's scoring warpgroup) with block blk."""
    NB: gl.constexpr = 5 if HALF == BUF else 4
    ok = blk < n_tiles
    key = start + blk * 64
    page = gl.load(table_ptr + b * stride_bt + key // PAGE, mask=ok, other=0)
    page = gl.minimum(gl.maximum(page, 0), num_blocks - 1)
    row = page * PAGE + key % PAGE
    bar = full.index(BUF * 2 + HALF)
    mbarrier.expect(bar, NB * 64 * 64, pred=ok)
    for c in gl.static_range(4):
        _tma_load(kv_desc, [row, (4 * HALF + c) * 64], bar, sKv.index(BUF * 8 + 4 * HALF + c),
                  pred=ok)
    if HALF == BUF:
        _tma_load(kv_desc, [row, 512], bar, sKr.index(BUF), pred=ok)


@gluon.jit
def _qk(sQ, sKv, sKr, BUF: gl.constexpr, full, ph, more, z, s_l: gl.constexpr):
    """Issue S = q8 k8^T for the block in buffer BUF: the scoring warpgroup's half (4 value
    boxes + rope, 5 groups) first, then the other (4 groups). Waits skipped where more is
    false (a dummy QK whose scores go unused)."""
    C0: gl.constexpr = 4 * BUF
    C1: gl.constexpr = 4 - 4 * BUF
    mbarrier.wait(full.index(BUF * 3), ph, pred=more)          # BUF * 2 + BUF
    tok = warpgroup_mma(sQ.index(8 + z), sKr.index(BUF + z).permute((1, 0)),
                        gl.zeros([64, 64], gl.float32, s_l), is_async=True)
    for c in gl.static_range(4):
        tok = warpgroup_mma(sQ.index(C0 + c + z), sKv.index(BUF * 8 + C0 + c + z).permute((1, 0)),
                            tok, is_async=True)
    mbarrier.wait(full.index(BUF * 2 + 1 - BUF), ph, pred=more)
    for c in gl.static_range(4):
        tok = warpgroup_mma(sQ.index(C1 + c + z), sKv.index(BUF * 8 + C1 + c + z).permute((1, 0)),
                            tok, is_async=True)
    return tok


# The values of one block half, [64 keys, 256 dims] in 4 boxes, loaded as the A operand of
# O^T += V^T P^T: wgmma row m = 64 i + 16 w + 8 h + j is value column 64 w + 8 j + 2 i + h,
# so each thread's 8 rows are 8 consecutive columns of one box (warp w reads box w): 8-byte
# loads, then a byte shuffle in registers.
V_L = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [0, 4], [1, 0], [2, 0], [16, 0], [32, 0]],
    lane_bases=[[4, 0], [8, 0], [0, 8], [0, 16], [0, 32]],
    warp_bases=[[64, 0], [128, 0]], block_bases=[], shape=[256, 64]))
OT_L = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                              instr_shape=[16, 64, 32]))
VT_L = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=OT_L, k_width=4))
# O [64 heads, 256 columns] as the O^T accumulator holds it, each thread's 8 consecutive
# columns of a head first in its registers (vector stores)
STORE_L = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [0, 4], [1, 0], [8, 0], [16, 0], [32, 0]],
    lane_bases=[[2, 0], [4, 0], [0, 8], [0, 16], [0, 32]],
    warp_bases=[[0, 64], [0, 128]], block_bases=[], shape=[64, 256]))


@gluon.jit
def _values(sKv, v0: gl.constexpr, key0, end):
    """V^T of boxes v0..v0+3 as the wgmma A operand [256 (permuted columns), 64 keys];
    keys at or past end become 0 (the split's last block)."""
    v = sKv._reinterpret(gl.float8e4nv, [16 * 64, 64], sKv.layout).slice(v0 * 64, 256).load(V_L)
    if key0 + 64 > end:
        r = gl.arange(0, 256, layout=gl.SliceLayout(1, V_L))
        v = gl.where((key0 + r % 64 < end)[:, None], v, gl.zeros_like(v))
    v = gl.permute(gl.reshape(v, [4, 64, 64]), [0, 2, 1])         # [w, dim, key]
    v = gl.permute(gl.reshape(v, [4, 8, 4, 2, 64]), [2, 0, 3, 1, 4])   # [i, w, h, j, key]
    return gl.convert_layout(gl.reshape(v, [256, 64]), VT_L)


@gluon.jit
def _cols(x):
    """A per-head vector (rows of the scores) as a row vector of O^T [256, 64 heads]."""
    return gl.convert_layout(x, gl.SliceLayout(0, OT_L))[None, :]


@gluon.jit
def _epilogue(W: gl.constexpr, acc, m, l, k_scale, sStat, bar_l, o_ptr, lse_ptr, o_row0,
              lse_row0, lse_stride, s_l: gl.constexpr, DIRECT: gl.constexpr):
    """Add the two warpgroups' row sums; write this warpgroup's 256 columns (and the LSE)."""
    row_s: gl.constexpr = gl.SliceLayout(1, s_l)
    sStat.slice((4 + W) * 64, 64).store(l)
    mbarrier.arrive(bar_l.index(W), count=1)
    mbarrier.wait(bar_l.index(1 - W), 0)
    l = l + sStat.slice((5 - W) * 64, 64).load(row_s)
    has = l > 0.0
    l_safe = gl.where(has, l, 1.0)
    if W == 0:
        lse = gl.where(has, (m + gl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        gl.store(lse_ptr + lse_row0 + gl.arange(0, 64, layout=row_s) * lse_stride, lse)
    o = acc * _cols(k_scale / (P_SCALE * l_safe))                # O^T, rows permuted
    o = gl.permute(gl.reshape(o, [4, 4, 2, 8, 64]), [4, 1, 3, 0, 2])    # [head, w, j, i, h]
    o = gl.convert_layout(gl.reshape(o, [64, 256]), STORE_L)     # the same registers, in order
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, STORE_L))
    cols = gl.arange(0, 256, layout=gl.SliceLayout(0, STORE_L))
    ptrs = o_ptr + (o_row0 + rows)[:, None].to(gl.int64) * 512 + 256 * W + cols[None, :]
    if DIRECT:
        gl.store(ptrs, o.to(gl.bfloat16))
    else:
        gl.store(ptrs, o)


@gluon.jit
def _wg0(args, PAGE: gl.constexpr, DIRECT: gl.constexpr):
    """Warpgroup 0: the even blocks' scores, O columns 0-255; loads q."""
    (q_desc, kv_desc, table_ptr, q_bar, full, bars, bar_l, sQ, sKv, sKr, sP, sStat, o_ptr,
     lse_ptr, qs_ptr, ks_ptr, q_row0, b, o_row0, lse_row0, lse_stride, start, end, n_tiles,
     sm_scale_log2, stride_bt, num_blocks) = args
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                 instr_shape=[16, 64, 32])
    row_s: gl.constexpr = gl.SliceLayout(1, s_l)
    k_scale = gl.load(ks_ptr)
    scale_log2 = sm_scale_log2 * gl.load(qs_ptr) * k_scale
    acc = gl.zeros([256, 64], gl.float32, OT_L)                  # O[:, 0:256]^T
    m = gl.full([64], float("-inf"), gl.float32, row_s)          # base-2, the pair's max
    l = gl.zeros([64], gl.float32, row_s)                         # sum of this WG's P
    cols = gl.arange(0, 64, layout=gl.SliceLayout(0, s_l))
    z = gl.minimum(start, 0)
    if n_tiles > 0:
        mbarrier.expect(q_bar, 9 * 64 * 64)
        for c in gl.static_range(9):
            _tma_load(q_desc, [q_row0, c * 64], q_bar, sQ.index(c))
        _load_half(kv_desc, table_ptr, full, sKv, sKr, 0, 0, 0, n_tiles, b, start, stride_bt,
                   num_blocks, PAGE)
        _load_half(kv_desc, table_ptr, full, sKv, sKr, 1, 0, 1, n_tiles, b, start, stride_bt,
                   num_blocks, PAGE)
        mbarrier.wait(q_bar, 0)
        tok = _qk(sQ, sKv, sKr, 0, full, 0, True, z, s_l)
        sc = warpgroup_mma_wait(num_outstanding=0, deps=[tok])    # [64, 64] scores of block 0
        for j in range(gl.cdiv(n_tiles, 2)):
            ph = j & 1
            a = 2 * j
            key_a = start + a * 64
            z = gl.minimum(key_a, 0)
            x = gl.where((key_a + cols < end)[None, :], sc * scale_log2, float("-inf"))
            m_new = gl.maximum(m, gl.max(x, axis=1))             # finite: a block has a key
            alpha = gl.exp2(m - m_new)
            p = gl.exp2(x - m_new[:, None])
            l = l * alpha + gl.sum(p, axis=1)
            sStat.slice(0, 64).store(m_new)
            sStat.slice(64, 64).store(alpha)
            mbarrier.arrive(bars.index(0), count=1)
            va = _values(sKv, 0, key_a, end)                     # V_a[:, 0:256]^T
            _load_half(kv_desc, table_ptr, full, sKv, sKr, 0, 0, a + 2, n_tiles, b, start,
                       stride_bt, num_blocks, PAGE)
            sP.index(2).store((p * P_SCALE).to(gl.float8e4nv))   # P_a, this WG's own
            fence_async_shared()
            gl.thread_barrier()
            t = warpgroup_mma(va, sP.index(2 + z).permute((1, 0)), acc * _cols(alpha),
                              is_async=True)
            mbarrier.wait(bars.index(1), ph)                     # WG1's max and factor
            m = sStat.slice(128, 64).load(row_s)
            s1 = sStat.slice(192, 64).load(row_s)
            l = l * s1
            sP.index(0).store((p * (s1 * P_SCALE)[:, None]).to(gl.float8e4nv))
            fence_async_shared()
            mbarrier.arrive(bars.index(2), count=1)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=[t])
            if a + 1 < n_tiles:
                vc = _values(sKv, 8, key_a + 64, end)            # V_c[:, 0:256]^T
                _load_half(kv_desc, table_ptr, full, sKv, sKr, 1, 0, a + 3, n_tiles, b, start,
                           stride_bt, num_blocks, PAGE)
                mbarrier.wait(bars.index(3), ph)                 # P_c
                u = warpgroup_mma(vc, sP.index(1 + z).permute((1, 0)), acc * _cols(s1),
                                  is_async=True)
                more = a + 2 < n_tiles
                mbarrier.wait(full.index(0), ph ^ 1, pred=more)
                tok = warpgroup_mma(sQ.index(8 + z), sKr.index(0 + z).permute((1, 0)),
                                    gl.zeros([64, 64], gl.float32, s_l), is_async=True)
                for c in gl.static_range(4):
                    tok = warpgroup_mma(sQ.index(c + z), sKv.index(c + z).permute((1, 0)), tok,
                                        is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=5, deps=[u])
                mbarrier.wait(full.index(1), ph ^ 1, pred=more)
                for c in gl.static_range(4):
                    tok = warpgroup_mma(sQ.index(4 + c + z), sKv.index(4 + c + z).permute((1, 0)),
                                        tok, is_async=True)
                sc = warpgroup_mma_wait(num_outstanding=0, deps=[tok])
    _epilogue(0, acc, m, l, gl.load(ks_ptr), sStat, bar_l, o_ptr, lse_ptr, o_row0, lse_row0,
              lse_stride, s_l, DIRECT)


@gluon.jit
def _wg1(args, PAGE: gl.constexpr, DIRECT: gl.constexpr):
    """Warpgroup 1: the odd blocks' scores, O columns 256-511."""
    (q_desc, kv_desc, table_ptr, q_bar, full, bars, bar_l, sQ, sKv, sKr, sP, sStat, o_ptr,
     lse_ptr, qs_ptr, ks_ptr, q_row0, b, o_row0, lse_row0, lse_stride, start, end, n_tiles,
     sm_scale_log2, stride_bt, num_blocks) = args
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                 instr_shape=[16, 64, 32])
    row_s: gl.constexpr = gl.SliceLayout(1, s_l)
    k_scale = gl.load(ks_ptr)
    scale_log2 = sm_scale_log2 * gl.load(qs_ptr) * k_scale
    acc = gl.zeros([256, 64], gl.float32, OT_L)                  # O[:, 256:512]^T
    m = gl.full([64], float("-inf"), gl.float32, row_s)
    l = gl.zeros([64], gl.float32, row_s)
    cols = gl.arange(0, 64, layout=gl.SliceLayout(0, s_l))
    z = gl.minimum(start, 0)
    if n_tiles > 0:
        _load_half(kv_desc, table_ptr, full, sKv, sKr, 0, 1, 0, n_tiles, b, start, stride_bt,
                   num_blocks, PAGE)
        _load_half(kv_desc, table_ptr, full, sKv, sKr, 1, 1, 1, n_tiles, b, start, stride_bt,
                   num_blocks, PAGE)
        mbarrier.wait(q_bar, 0)
        tok = _qk(sQ, sKv, sKr, 1, full, 0, n_tiles > 1, z, s_l)
        sc = warpgroup_mma_wait(num_outstanding=0, deps=[tok])    # block 1's (unused if none)
        for j in range(gl.cdiv(n_tiles, 2)):
            ph = j & 1
            a = 2 * j
            key_a = start + a * 64
            key_c = key_a + 64
            z = gl.minimum(key_c, 0)
            has_c = a + 1 < n_tiles
            mbarrier.wait(bars.index(0), ph)                     # WG0's max and factor
            m0 = sStat.slice(0, 64).load(row_s)
            a0 = sStat.slice(64, 64).load(row_s)
            x = gl.where(((key_c + cols < end) & has_c)[None, :], sc * scale_log2,
                         float("-inf"))
            m = gl.maximum(m0, gl.max(x, axis=1))
            s1 = gl.exp2(m0 - m)
            p = gl.exp2(x - m[:, None])
            l = l * (a0 * s1) + gl.sum(p, axis=1)
            sStat.slice(128, 64).store(m)
            sStat.slice(192, 64).store(s1)
            mbarrier.arrive(bars.index(1), count=1)
            o_s = _cols(a0 * s1)
            if has_c:
                sP.index(1).store((p * P_SCALE).to(gl.float8e4nv))
                fence_async_shared()
                gl.thread_barrier()
                mbarrier.arrive(bars.index(3), count=1)
                vc = _values(sKv, 12, key_c, end)                # V_c[:, 256:512]^T
                _load_half(kv_desc, table_ptr, full, sKv, sKr, 1, 1, a + 3, n_tiles, b, start,
                           stride_bt, num_blocks, PAGE)
                t = warpgroup_mma(vc, sP.index(1 + z).permute((1, 0)), acc * o_s,
                                  is_async=True)
                va = _values(sKv, 4, key_a, end)                 # V_a[:, 256:512]^T
                _load_half(kv_desc, table_ptr, full, sKv, sKr, 0, 1, a + 2, n_tiles, b, start,
                           stride_bt, num_blocks, PAGE)
                mbarrier.wait(bars.index(2), ph)                 # P_a at the pair's max
                u = warpgroup_mma(va, sP.index(0 + z).permute((1, 0)), t, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=[u])
            else:
                va = _values(sKv, 4, key_a, end)
                mbarrier.wait(bars.index(2), ph)
                u = warpgroup_mma(va, sP.index(0 + z).permute((1, 0)), acc * o_s,
                                  is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=[u])
            tok = _qk(sQ, sKv, sKr, 1, full, ph ^ 1, a + 3 < n_tiles, z, s_l)
            sc = warpgroup_mma_wait(num_outstanding=0, deps=[tok])
    _epilogue(1, acc, m, l, gl.load(ks_ptr), sStat, bar_l, o_ptr, lse_ptr, o_row0, lse_row0,
              lse_stride, s_l, DIRECT)


@gluon.jit
def mla_decode_fp8_pair_kernel(q_desc, kv_desc, table_ptr, lens_ptr, qs_ptr, ks_ptr, o_ptr,
                               lse_ptr, sm_scale_log2, stride_bt, max_blocks, num_blocks,
                               num_splits, S_Q: gl.constexpr, H: gl.constexpr,
                               PAGE: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
                               DIRECT: gl.constexpr, CAUSAL: gl.constexpr):
    gl.static_assert(BN == 64 and STAGES == 2, "blocks of 64 keys in two buffers")
    gl.static_assert(PAGE % 64 == 0, "a page holds whole 64-key blocks")
    b, start, end, n_tiles, q_row0, o_row0, lse_row0, lse_stride = cta_work(
        lens_ptr, max_blocks, num_splits, S_Q, H, PAGE, BN, DIRECT, CAUSAL)
    f8: gl.constexpr = gl.float8e4nv
    sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 64], f8)
    sQ = gl.allocate_shared_memory(f8, [9, 64, 64], sl)           # q (rope box last)
    sKv = gl.allocate_shared_memory(f8, [16, 64, 64], sl)         # values: buffer * 8 + box
    sKr = gl.allocate_shared_memory(f8, [2, 64, 64], sl)          # rope: buffer
    sP = gl.allocate_shared_memory(f8, [3, 64, 64], sl)           # P_a rescaled, P_c, P_a
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
    args = (q_desc, kv_desc, table_ptr, q_bar, full, bars, bar_l, sQ, sKv, sKr, sP, sStat, o_ptr,
            lse_ptr, qs_ptr, ks_ptr, q_row0, b, o_row0, lse_row0, lse_stride, start, end,
            n_tiles, sm_scale_log2, stride_bt, num_blocks)
    gl.warp_specialize([(_wg0, (args, PAGE, DIRECT)), (_wg1, (args, PAGE, DIRECT))], [4], [240])
