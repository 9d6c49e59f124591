"""Hopper MLA decode for an fp8 query and an fp8 cache, 64-key blocks taken in pairs:
stage 1 of the "gluon" route of lowering.mla_decode_fp8q where a page holds whole 64-key
blocks (launcher: gluon_decode.py).

The bf16 pair kernel's schedule (gluon_pair_decode_kernel.py: blocks a = 2j / c = 2j + 1
scored at once by warpgroup 0 / 1, one reference max per pair, no producer warp, buffer
halves refilled by the warpgroup that reads them last) with the fp8 ring kernel's
operands (gluon_fp8_decode_kernel.py: e4m3 QK, P as e4m3 x P_SCALE, P V of N = 256 on
values transposed to K-major, since fp8 wgmma reads B K-major only):
  - each warpgroup transposes its half of a block's values (boxes 0-3 or 4-7) into a
    buffer of its own, zeroing keys past the split's end there; once transposed (and
    scored) the half is free, so it is refilled at once, before the P V that reads the
    transposed copy;
  - the rope box goes with the scoring warpgroup's half (buffer 0: WG0 0-3 + rope, WG1
    4-7; buffer 1: WG0 0-3, WG1 4-7 + rope); P of each block has a slot of its own.
Shared memory: q 36 KB + 2 blocks x 36 KB + 4 transposed halves x 16 KB + P 8 KB.
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
def _load_half(kv_desc, table_ptr, full, sK, BUF: gl.constexpr, HALF: gl.constexpr, blk,
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
        _tma_load(kv_desc, [row, (4 * HALF + c) * 64], bar, sK.index(BUF * 9 + 4 * HALF + c),
                  pred=ok)
    if HALF == BUF:
        _tma_load(kv_desc, [row, 512], bar, sK.index(BUF * 9 + 8), pred=ok)


@gluon.jit
def _qk(sQ, sK, BUF: gl.constexpr, full, ph, more, z, s_l: gl.constexpr):
    """Issue S = q8 k8^T for the block in buffer BUF: the scoring warpgroup's half (4 value
    boxes + rope, 5 groups) first, then the other (4 groups). Waits skipped where more is
    false (a dummy QK whose scores go unused)."""
    C0: gl.constexpr = 4 * BUF
    C1: gl.constexpr = 4 - 4 * BUF
    mbarrier.wait(full.index(BUF * 3), ph, pred=more)          # BUF * 2 + BUF
    tok = warpgroup_mma(sQ.index(8 + z), sK.index(BUF * 9 + 8 + z).permute((1, 0)),
                        gl.zeros([64, 64], gl.float32, s_l), is_async=True)
    for c in gl.static_range(4):
        tok = warpgroup_mma(sQ.index(C0 + c + z), sK.index(BUF * 9 + C0 + c + z).permute((1, 0)),
                            tok, is_async=True)
    mbarrier.wait(full.index(BUF * 2 + 1 - BUF), ph, pred=more)
    for c in gl.static_range(4):
        tok = warpgroup_mma(sQ.index(C1 + c + z), sK.index(BUF * 9 + C1 + c + z).permute((1, 0)),
                            tok, is_async=True)
    return tok


@gluon.jit
def _transpose(sK, v0, vt, key0, end):
    """Value boxes v0..v0+3 ([64 keys, 64] each) -> vt [256, 64 keys] (keys contiguous, as
    fp8 wgmma reads B); keys at or past end become 0 (the split's last block)."""
    tl_: gl.constexpr = gl.BlockedLayout([4, 4], [8, 4], [1, 4], [1, 0])
    if key0 + 64 > end:
        keep = (key0 + gl.arange(0, 64, layout=gl.SliceLayout(1, tl_)) < end)[:, None]
        for c in gl.static_range(4):
            x = sK.index(v0 + c).load(tl_)
            x = gl.where(keep, x, gl.zeros_like(x))
            vt.slice(64 * c, 64).store(gl.permute(x, [1, 0]))
    else:
        for c in gl.static_range(4):
            x = sK.index(v0 + c).load(tl_)
            vt.slice(64 * c, 64).store(gl.permute(x, [1, 0]))
    fence_async_shared()


@gluon.jit
def _epilogue(W: gl.constexpr, acc, m, l, k_scale, sStat, bar_l, o_ptr, lse_ptr, o_row0,
              lse_row0, lse_stride, s_l: gl.constexpr, o_l: gl.constexpr, DIRECT: gl.constexpr):
    """Add the two warpgroups' row sums; write this warpgroup's 256 columns (and the LSE)."""
    row_s: gl.constexpr = gl.SliceLayout(1, s_l)
    row_o: gl.constexpr = gl.SliceLayout(1, o_l)
    sStat.slice((4 + W) * 64, 64).store(l)
    mbarrier.arrive(bar_l.index(W), count=1)
    mbarrier.wait(bar_l.index(1 - W), 0)
    l = l + sStat.slice((5 - W) * 64, 64).load(row_s)
    has = l > 0.0
    l_safe = gl.where(has, l, 1.0)
    if W == 0:
        lse = gl.where(has, (m + gl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        gl.store(lse_ptr + lse_row0 + gl.arange(0, 64, layout=row_s) * lse_stride, lse)
    inv = gl.convert_layout(k_scale / (P_SCALE * l_safe), row_o)[:, None]
    rows = gl.arange(0, 64, layout=row_o)
    cols = gl.arange(0, 256, layout=gl.SliceLayout(0, o_l))
    ptrs = o_ptr + (o_row0 + rows)[:, None].to(gl.int64) * 512 + 256 * W + cols[None, :]
    if DIRECT:
        gl.store(ptrs, (acc * inv).to(gl.bfloat16))
    else:
        gl.store(ptrs, acc * inv)


@gluon.jit
def _wg0(args, PAGE: gl.constexpr, DIRECT: gl.constexpr):
    """Warpgroup 0: the even blocks' scores, O columns 0-255; loads q."""
    (q_desc, kv_desc, table_ptr, q_bar, full, bars, bar_l, sQ, sK, sP, sVT, sStat, o_ptr,
     lse_ptr, qs_ptr, ks_ptr, q_row0, b, o_row0, lse_row0, lse_stride, start, end, n_tiles,
     sm_scale_log2, stride_bt, num_blocks) = args
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                 instr_shape=[16, 64, 32])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                 instr_shape=[16, 256, 32])
    p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=4)
    row_s: gl.constexpr = gl.SliceLayout(1, s_l)
    row_o: gl.constexpr = gl.SliceLayout(1, o_l)
    k_scale = gl.load(ks_ptr)
    scale_log2 = sm_scale_log2 * gl.load(qs_ptr) * k_scale
    acc = gl.zeros([64, 256], gl.float32, o_l)                   # O[:, 0:256]
    m = gl.full([64], float("-inf"), gl.float32, row_s)          # base-2, the pair's max
    l = gl.zeros([64], gl.float32, row_s)                         # sum of this WG's P
    cols = gl.arange(0, 64, layout=gl.SliceLayout(0, s_l))
    z = gl.minimum(start, 0)
    if n_tiles > 0:
        mbarrier.expect(q_bar, 9 * 64 * 64)
        for c in gl.static_range(9):
            _tma_load(q_desc, [q_row0, c * 64], q_bar, sQ.index(c))
        _load_half(kv_desc, table_ptr, full, sK, 0, 0, 0, n_tiles, b, start, stride_bt,
                   num_blocks, PAGE)
        _load_half(kv_desc, table_ptr, full, sK, 1, 0, 1, n_tiles, b, start, stride_bt,
                   num_blocks, PAGE)
        mbarrier.wait(q_bar, 0)
        tok = _qk(sQ, sK, 0, full, 0, True, z, s_l)
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
            _transpose(sK, 0, sVT.index(0), key_a, end)          # V_a[:, 0:256]
            _load_half(kv_desc, table_ptr, full, sK, 0, 0, a + 2, n_tiles, b, start,
                       stride_bt, num_blocks, PAGE)
            a_o = gl.convert_layout(alpha, row_o)[:, None]
            t = warpgroup_mma(gl.convert_layout((p * P_SCALE).to(gl.float8e4nv), p_l),
                              sVT.index(0 + z).permute((1, 0)), acc * a_o, is_async=True)
            mbarrier.wait(bars.index(1), ph)                     # WG1's max and factor
            m = sStat.slice(128, 64).load(row_s)
            s1 = sStat.slice(192, 64).load(row_s)
            l = l * s1
            sP.index(0).store((p * (s1 * P_SCALE)[:, None]).to(gl.float8e4nv))
            fence_async_shared()
            mbarrier.arrive(bars.index(2), count=1)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=[t])
            if a + 1 < n_tiles:
                _transpose(sK, 9, sVT.index(1), key_a + 64, end)  # V_c[:, 0:256]
                _load_half(kv_desc, table_ptr, full, sK, 1, 0, a + 3, n_tiles, b, start,
                           stride_bt, num_blocks, PAGE)
                mbarrier.wait(bars.index(3), ph)                 # P_c
                s1_o = gl.convert_layout(s1, row_o)[:, None]
                u = warpgroup_mma(sP.index(1 + z), sVT.index(1 + z).permute((1, 0)), acc * s1_o,
                                  is_async=True)
                more = a + 2 < n_tiles
                mbarrier.wait(full.index(0), ph ^ 1, pred=more)
                tok = warpgroup_mma(sQ.index(8 + z), sK.index(8 + z).permute((1, 0)),
                                    gl.zeros([64, 64], gl.float32, s_l), is_async=True)
                for c in gl.static_range(4):
                    tok = warpgroup_mma(sQ.index(c + z), sK.index(c + z).permute((1, 0)), tok,
                                        is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=5, deps=[u])
                mbarrier.wait(full.index(1), ph ^ 1, pred=more)
                for c in gl.static_range(4):
                    tok = warpgroup_mma(sQ.index(4 + c + z), sK.index(4 + c + z).permute((1, 0)),
                                        tok, is_async=True)
                sc = warpgroup_mma_wait(num_outstanding=0, deps=[tok])
    _epilogue(0, acc, m, l, gl.load(ks_ptr), sStat, bar_l, o_ptr, lse_ptr, o_row0, lse_row0,
              lse_stride, s_l, o_l, DIRECT)


@gluon.jit
def _wg1(args, PAGE: gl.constexpr, DIRECT: gl.constexpr):
    """Warpgroup 1: the odd blocks' scores, O columns 256-511."""
    (q_desc, kv_desc, table_ptr, q_bar, full, bars, bar_l, sQ, sK, sP, sVT, sStat, o_ptr,
     lse_ptr, qs_ptr, ks_ptr, q_row0, b, o_row0, lse_row0, lse_stride, start, end, n_tiles,
     sm_scale_log2, stride_bt, num_blocks) = args
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                 instr_shape=[16, 64, 32])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                 instr_shape=[16, 256, 32])
    p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=4)
    row_s: gl.constexpr = gl.SliceLayout(1, s_l)
    row_o: gl.constexpr = gl.SliceLayout(1, o_l)
    k_scale = gl.load(ks_ptr)
    scale_log2 = sm_scale_log2 * gl.load(qs_ptr) * k_scale
    acc = gl.zeros([64, 256], gl.float32, o_l)                   # O[:, 256:512]
    m = gl.full([64], float("-inf"), gl.float32, row_s)
    l = gl.zeros([64], gl.float32, row_s)
    cols = gl.arange(0, 64, layout=gl.SliceLayout(0, s_l))
    z = gl.minimum(start, 0)
    if n_tiles > 0:
        _load_half(kv_desc, table_ptr, full, sK, 0, 1, 0, n_tiles, b, start, stride_bt,
                   num_blocks, PAGE)
        _load_half(kv_desc, table_ptr, full, sK, 1, 1, 1, n_tiles, b, start, stride_bt,
                   num_blocks, PAGE)
        mbarrier.wait(q_bar, 0)
        tok = _qk(sQ, sK, 1, full, 0, n_tiles > 1, z, s_l)
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
            o_s = gl.convert_layout(a0 * s1, row_o)[:, None]
            if has_c:
                p8 = (p * P_SCALE).to(gl.float8e4nv)
                sP.index(1).store(p8)
                fence_async_shared()
                mbarrier.arrive(bars.index(3), count=1)
                _transpose(sK, 9 + 4, sVT.index(2), key_c, end)  # V_c[:, 256:512]
                _load_half(kv_desc, table_ptr, full, sK, 1, 1, a + 3, n_tiles, b, start,
                           stride_bt, num_blocks, PAGE)
                t = warpgroup_mma(gl.convert_layout(p8, p_l), sVT.index(2 + z).permute((1, 0)),
                                  acc * o_s, is_async=True)
                _transpose(sK, 4, sVT.index(3), key_a, end)      # V_a[:, 256:512]
                _load_half(kv_desc, table_ptr, full, sK, 0, 1, a + 2, n_tiles, b, start,
                           stride_bt, num_blocks, PAGE)
                mbarrier.wait(bars.index(2), ph)                 # P_a at the pair's max
                u = warpgroup_mma(sP.index(0 + z), sVT.index(3 + z).permute((1, 0)), t,
                                  is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=[u])
            else:
                _transpose(sK, 4, sVT.index(3), key_a, end)
                mbarrier.wait(bars.index(2), ph)
                u = warpgroup_mma(sP.index(0 + z), sVT.index(3 + z).permute((1, 0)), acc * o_s,
                                  is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=[u])
            tok = _qk(sQ, sK, 1, full, ph ^ 1, a + 3 < n_tiles, z, s_l)
            sc = warpgroup_mma_wait(num_outstanding=0, deps=[tok])
    _epilogue(1, acc, m, l, gl.load(ks_ptr), sStat, bar_l, o_ptr, lse_ptr, o_row0, lse_row0,
              lse_stride, s_l, o_l, DIRECT)


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
    slv: gl.constexpr = gl.NVMMASharedLayout.get_default_for([256, 64], f8)
    sQ = gl.allocate_shared_memory(f8, [9, 64, 64], sl)           # q (rope box last)
    sK = gl.allocate_shared_memory(f8, [18, 64, 64], sl)          # buffer * 9 + box
    sP = gl.allocate_shared_memory(f8, [2, 64, 64], sl)           # P_a, P_c
    sVT = gl.allocate_shared_memory(f8, [4, 256, 64], slv)        # WG0: a, c; WG1: c, a
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
    args = (q_desc, kv_desc, table_ptr, q_bar, full, bars, bar_l, sQ, sK, sP, sVT, sStat, o_ptr,
            lse_ptr, qs_ptr, ks_ptr, q_row0, b, o_row0, lse_row0, lse_stride, start, end,
            n_tiles, sm_scale_log2, stride_bt, num_blocks)
    gl.warp_specialize([(_wg0, (args, PAGE, DIRECT)), (_wg1, (args, PAGE, DIRECT))], [4], [240])
