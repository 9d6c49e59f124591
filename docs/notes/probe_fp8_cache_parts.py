"""Where the fp8-cache kernel's time goes (H200 probe, not maintained): a copy of the
first version of lowering/decode/gluon_rows_kernel.py (the widening chunk by
chunk, the row sums per tile; the landed kernel reads all chunks first and sums once)
with switches that leave parts out (the
widening, the QK MMAs, the P V MMAs; values then wrong: timing only) or sum the row sums
once at the end instead of per tile (LAZY_L, correct), timed as the library's launcher
runs it at (B, 16, S).

    python docs/notes/probe_fp8_cache_parts.py [B:S,...]
"""
from __future__ import annotations

import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier,
                                                              warpgroup_mma, warpgroup_mma_wait)

from lowering.decode.gluon_common import load_ring
from lowering.decode.gluon_rows_kernel import _store_chunk


@gluon.jit
def _widen(sK, s, sW, key0, end, BN: gl.constexpr, NCH: gl.constexpr):
    """Ring slot s [BN, 576] e4m3 -> sW fp16; in a split's last tile keys at or past end
    become 0 (unwritten rows may hold NaN, and 0 x NaN is NaN)."""
    w_l: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])      # [32, 64]
    if key0 + BN > end:
        keep = (key0 + gl.arange(0, BN, layout=gl.SliceLayout(1, w_l)) < end)[:, None]
        for c in gl.static_range(NCH):
            x = sK.index(s * NCH + c).load(w_l).to(gl.float16)               # [BN, 64]
            sW.index(c).store(gl.where(keep, x, gl.zeros_like(x)))
    else:
        for c in gl.static_range(NCH):
            sW.index(c).store(sK.index(s * NCH + c).load(w_l).to(gl.float16))


@gluon.jit
def _consumer(q_ptr, ks_ptr, o_ptr, lse_ptr, kv_full, kv_empty, sK, sW, sQ, sP, b, split,
              seqlen, start, end, n_tiles, sm_scale_log2, num_splits, S_Q: gl.constexpr,
              H: gl.constexpr, BN: gl.constexpr, NR: gl.constexpr, STAGES: gl.constexpr,
              NCH: gl.constexpr, DIRECT: gl.constexpr, CAUSAL: gl.constexpr,
        SKIP_WIDEN: gl.constexpr, SKIP_QK: gl.constexpr, SKIP_PV: gl.constexpr, LAZY_L: gl.constexpr):
    ROWS: gl.constexpr = S_Q * H
    f16: gl.constexpr = gl.float16
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                 instr_shape=[16, NR, 16])
    row_l: gl.constexpr = gl.SliceLayout(0, s_l)             # [NR] query rows (S^T columns)
    key_l: gl.constexpr = gl.SliceLayout(1, s_l)             # [BN] keys

    # ---- q [NR, 576] / 16 as fp16 into sQ (9 chunks of 64 columns; padded rows 0) --------
    q_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])       # [16, 64]
    qr = gl.arange(0, NR, layout=gl.SliceLayout(1, q_l))
    qc = gl.arange(0, 64, layout=gl.SliceLayout(0, q_l))
    q_rows = q_ptr + (b * ROWS + qr)[:, None].to(gl.int64) * 576 + qc[None, :]
    q_mask = (qr[:, None] < ROWS) & (qc[None, :] < 64)
    for c in gl.static_range(NCH):
        x = gl.load(q_rows + 64 * c, mask=q_mask, other=0.0)
        sQ.index(c).store((x.to(gl.float32) * 0.0625).to(f16))
    fence_async_shared()

    k_scale = gl.load(ks_ptr)
    scale_log2 = sm_scale_log2 * 16.0 * k_scale
    rows = gl.arange(0, NR, layout=row_l)
    if CAUSAL:
        limit = seqlen - S_Q + rows // H + 1                 # keys visible to each row
    else:
        limit = rows * 0 + seqlen
    m_i = gl.full([NR], float("-inf"), gl.float32, row_l)   # running max (base 2)
    l_i = gl.zeros([NR], gl.float32, row_l)
    acc0 = gl.zeros([64, NR], gl.float32, s_l)              # O^T, value columns 0-63
    acc1 = gl.zeros([64, NR], gl.float32, s_l)
    acc2 = gl.zeros([64, NR], gl.float32, s_l)
    acc3 = gl.zeros([64, NR], gl.float32, s_l)
    acc4 = gl.zeros([64, NR], gl.float32, s_l)
    acc5 = gl.zeros([64, NR], gl.float32, s_l)
    acc6 = gl.zeros([64, NR], gl.float32, s_l)
    acc7 = gl.zeros([64, NR], gl.float32, s_l)              # value columns 448-511
    l_acc = gl.zeros([64, NR], gl.float32, s_l)
    for i in range(n_tiles):
        s = i % STAGES
        key0 = start + i * BN
        mbarrier.wait(kv_full.index(s), (i // STAGES) & 1)
        if not SKIP_WIDEN:
            _widen(sK, s, sW, key0, end, BN, NCH)
        mbarrier.arrive(kv_empty.index(s), count=1)
        fence_async_shared()
        # S^T = K q^T: 9 chained MMAs over the 576 columns
        if SKIP_QK:
            sc = gl.zeros([BN, NR], gl.float32, s_l) + key0.to(gl.float32)
        else:
            tok = warpgroup_mma(sW.index(0), sQ.index(0).permute((1, 0)),
                                gl.zeros([BN, NR], gl.float32, s_l), is_async=True)
            for c in gl.static_range(1, NCH):
                tok = warpgroup_mma(sW.index(c), sQ.index(c).permute((1, 0)), tok, is_async=True)
            sc = warpgroup_mma_wait(num_outstanding=0, deps=[tok])             # [BN, NR]
        keys = key0 + gl.arange(0, BN, layout=key_l)
        vis = (keys[:, None] < end) & (keys[:, None] < limit[None, :])
        sc = gl.where(vis, sc * scale_log2, float("-inf"))
        # online softmax along the keys; a row with nothing visible yet keeps m = -inf
        m_new = gl.maximum(m_i, gl.max(sc, axis=0))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(sc - m_use[None, :])
        if LAZY_L:
            l_acc = l_acc * alpha[None, :] + p
        else:
            l_i = l_i * alpha + gl.sum(p, axis=0)
        m_i = m_new
        sP.store(gl.permute(p.to(f16), [1, 0]))                             # P [NR, BN]
        fence_async_shared()
        # O^T += V^T P^T, per 64 value columns (V^T: the widened tile read MN-major)
        a = alpha[None, :]
        pt = sP.permute((1, 0))
        if not SKIP_PV:
            acc0 = warpgroup_mma(sW.index(0).permute((1, 0)), pt, acc0 * a, is_async=True)
            acc1 = warpgroup_mma(sW.index(1).permute((1, 0)), pt, acc1 * a, is_async=True)
            acc2 = warpgroup_mma(sW.index(2).permute((1, 0)), pt, acc2 * a, is_async=True)
            acc3 = warpgroup_mma(sW.index(3).permute((1, 0)), pt, acc3 * a, is_async=True)
            acc4 = warpgroup_mma(sW.index(4).permute((1, 0)), pt, acc4 * a, is_async=True)
            acc5 = warpgroup_mma(sW.index(5).permute((1, 0)), pt, acc5 * a, is_async=True)
            acc6 = warpgroup_mma(sW.index(6).permute((1, 0)), pt, acc6 * a, is_async=True)
            acc7 = warpgroup_mma(sW.index(7).permute((1, 0)), pt, acc7 * a, is_async=True)
            acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = warpgroup_mma_wait(
                num_outstanding=0, deps=[acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7])

    # ---- epilogue ---------------------------------------------------------------------
    if LAZY_L:
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
             DIRECT: gl.constexpr, CAUSAL: gl.constexpr,
        SKIP_WIDEN: gl.constexpr, SKIP_QK: gl.constexpr, SKIP_PV: gl.constexpr, LAZY_L: gl.constexpr):
    (q_ptr, ks_ptr, o_ptr, lse_ptr, kv_full, kv_empty, sK, sW, sQ, sP, b, split, seqlen, start,
     end, n_tiles, sm_scale_log2, num_splits) = cargs
    _consumer(q_ptr, ks_ptr, o_ptr, lse_ptr, kv_full, kv_empty, sK, sW, sQ, sP, b, split,
              seqlen, start, end, n_tiles, sm_scale_log2, num_splits, S_Q, H, BN, NR, STAGES,
              NCH, DIRECT, CAUSAL, SKIP_WIDEN, SKIP_QK, SKIP_PV, LAZY_L)


@gluon.jit
def _load(cargs, pargs, BN: gl.constexpr, NR: gl.constexpr, STAGES: gl.constexpr,
          NCH: gl.constexpr, S_Q: gl.constexpr, H: gl.constexpr, PAGE: gl.constexpr,
          DIRECT: gl.constexpr, CAUSAL: gl.constexpr,
        SKIP_WIDEN: gl.constexpr, SKIP_QK: gl.constexpr, SKIP_PV: gl.constexpr, LAZY_L: gl.constexpr):
    kv_desc, table_ptr, kv_full, kv_empty, sK, b, start, n_tiles, stride_bt, num_blocks = pargs
    load_ring(kv_desc, table_ptr, kv_full, kv_empty, sK, b, start, n_tiles, stride_bt,
              num_blocks, BN, PAGE, STAGES, NCH)


@gluon.jit
def mla_decode_fp8_cache_kernel(q_ptr, kv_desc, table_ptr, lens_ptr, ks_ptr, o_ptr, lse_ptr,
                                sm_scale_log2, stride_bt, max_blocks, num_blocks, num_splits,
                                S_Q: gl.constexpr, H: gl.constexpr, PAGE: gl.constexpr,
                                BN: gl.constexpr, NR: gl.constexpr, STAGES: gl.constexpr,
                                DIRECT: gl.constexpr, CAUSAL: gl.constexpr,
        SKIP_WIDEN: gl.constexpr, SKIP_QK: gl.constexpr, SKIP_PV: gl.constexpr, LAZY_L: gl.constexpr):
    """grid (B, num_splits); 4 warps (the consumer) plus the producer warp."""
    NCH: gl.constexpr = 9                       # 576 = 8 value chunks of 64 + the rope chunk
    b = gl.program_id(0)
    split = gl.program_id(1)
    # lengths bounded here (CUDA-graph replays are not checked on the host)
    seqlen = gl.minimum(gl.maximum(gl.load(lens_ptr + b), 1), max_blocks * PAGE)
    chunk = gl.cdiv(gl.cdiv(seqlen, num_splits), BN) * BN
    start = split * chunk
    end = gl.minimum(start + chunk, seqlen)
    n_tiles = gl.maximum(gl.cdiv(end - start, BN), 0)

    f8: gl.constexpr = gl.float8e4nv
    f16: gl.constexpr = gl.float16
    sK = gl.allocate_shared_memory(f8, [STAGES * NCH, BN, 64],
                                   gl.NVMMASharedLayout.get_default_for([BN, 64], f8))
    sW = gl.allocate_shared_memory(f16, [NCH, BN, 64],
                                   gl.NVMMASharedLayout.get_default_for([BN, 64], f16))
    sQ = gl.allocate_shared_memory(f16, [NCH, NR, 64],
                                   gl.NVMMASharedLayout.get_default_for([NR, 64], f16))
    sP = gl.allocate_shared_memory(f16, [NR, BN],
                                   gl.NVMMASharedLayout.get_default_for([NR, BN], f16))
    kv_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(kv_full.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=1)

    cargs = (q_ptr, ks_ptr, o_ptr, lse_ptr, kv_full, kv_empty, sK, sW, sQ, sP, b, split, seqlen,
             start, end, n_tiles, sm_scale_log2, num_splits)
    pargs = (kv_desc, table_ptr, kv_full, kv_empty, sK, b, start, n_tiles, stride_bt,
             num_blocks)
    gl.warp_specialize([(_consume, (cargs, pargs, BN, NR, STAGES, NCH, S_Q, H, PAGE, DIRECT,
                                    CAUSAL, SKIP_WIDEN, SKIP_QK, SKIP_PV, LAZY_L)),
                        (_load, (cargs, pargs, BN, NR, STAGES, NCH, S_Q, H, PAGE, DIRECT,
                                 CAUSAL, SKIP_WIDEN, SKIP_QK, SKIP_PV, LAZY_L))],
                       [1], [24])


def run(q, kv8, bt, lens, ks, flags, splits=0):
    import lowering.decode.gluon_decode as gd
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from lowering.decode.gluon_common import LOG2E
    from lowering.decode.registry import sm_count
    from lowering.decode.triton_decode import choose_num_splits, stage1_outputs
    B, s_q, H, D = q.shape
    num_blocks, page, _ = kv8.shape
    cfg = gd.FP8_CACHE_CONFIGS[16]
    splits = splits or choose_num_splits(B, 1, bt.shape[1] * page, sm_count(q.device),
                                         min_split_keys=gd.MIN_SPLIT_KEYS)
    lay = gl.NVMMASharedLayout.get_default_for([64, 64], gl.float8e4nv)
    desc = TensorDescriptor.from_tensor(kv8.view(num_blocks * page, D), [64, 64], lay)
    out, lse, o1, l1 = stage1_outputs(B, s_q, H, 512, splits, torch.bfloat16, q.device)
    mla_decode_fp8_cache_kernel[(B, splits)](
        q, desc, bt, lens, ks, o1, l1, 192 ** -0.5 * LOG2E, bt.stride(0), bt.shape[1],
        num_blocks, splits, S_Q=s_q, H=H, PAGE=page, BN=64, NR=16, STAGES=cfg["STAGES"],
        DIRECT=splits == 1, CAUSAL=True, num_warps=4, **flags)
    if splits > 1:
        gd._merge(o1, l1, out, lse, splits)
    return out, lse


def main():
    sys.path.insert(0, "benchmarks")
    from timing import capture, kernel_time_us
    import lowering.decode.gluon_decode as gd
    shapes = sys.argv[1] if len(sys.argv) > 1 else "128:4096,256:1024,32:4096"
    base = dict(SKIP_WIDEN=False, SKIP_QK=False, SKIP_PV=False, LAZY_L=False)
    variants = {"as shipped": {}, "lazy l": dict(LAZY_L=True), "no widen": dict(SKIP_WIDEN=True),
                "no QK": dict(SKIP_QK=True), "no P V": dict(SKIP_PV=True),
                "no QK, no P V": dict(SKIP_QK=True, SKIP_PV=True),
                "loads only": dict(SKIP_WIDEN=True, SKIP_QK=True, SKIP_PV=True)}
    for spec in shapes.split(","):
        B, S = (int(x) for x in spec.split(":"))
        blocks = B * S // 64
        q = torch.randn(B, 1, 16, 576, device="cuda", dtype=torch.bfloat16)
        kv = torch.randn(blocks, 64, 576, device="cuda", dtype=torch.bfloat16)
        bt = torch.randperm(blocks, device="cuda").int().reshape(B, S // 64)
        lens = torch.full((B,), S, dtype=torch.int32, device="cuda")
        ks = (kv.float().abs().amax() / 448.0).reshape(1)
        kv8 = (kv.float() / ks).to(torch.float8_e4m3fn)
        ref = gd.gluon_decode_fp8_cache(q, kv8, bt, lens, ks, 192 ** -0.5, True)[0].float()
        print(f"B={B} S={S} (16 heads)")
        for name, f in variants.items():
            flags = dict(base, **f)
            fn = lambda: run(q, kv8, bt, lens, ks, flags)
            out = fn()[0].float()
            err = ((out - ref).norm() / ref.norm()).item()
            us = kernel_time_us(capture(fn, 2).replay, reps=20)
            print(f"  {name:16s} {us:8.1f} us  {B * S * 576 / us / 1e3:6.0f} GB/s  "
                  f"vs shipped {err:.1e}")


if __name__ == "__main__":
    main()
