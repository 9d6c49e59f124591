"""Gluon MLA decode stage 1 for Hopper, a prototype: two consumer warpgroups in ping-pong.

Not used by the library. It compiles for sm_90 with triton 3.6 without a GPU
(`python benchmarks/gluon_decode_proto.py` prints its wgmma count, shared memory and
register use); `benchmarks/bench_gluon_decode.py` checks it against float64 and times it
on an H200. It has not run on a GPU yet. What is left before it could be a backend: fewer than 64
heads, fp8, and the tests the Triton kernel has.

CTA = 64 query rows (heads of one token) x one split of one request's keys.
  producer (1 warp):   Q once (9 TMA boxes of [64, 64]); each key tile of BN keys (one page
                       slice) as 9 boxes [BN, 64] into a STAGES-deep ring (kv_full / kv_empty).
  consumer WG w (w = 0, 1), owning O[:, 256 w : 256 w + 256] as four [64, 64] fp32 accumulators:
    tile i with i % 2 == w:  S_i = sum_c Q_c K_c^T (9 chained async wgmma), base-2 online
                             softmax from the state the other warpgroup left after tile i - 1,
                             P_i (bf16) and (m_i, l_i, alpha_i) published in slot w (p_full[w]);
                             own PV from P in registers.
    tile i with i % 2 != w:  wait p_full[1 - w]; PV with P from shared memory; p_empty[1 - w].
  So one warpgroup's softmax overlaps the other's MMAs; each PV is P @ V_half.
Query rows r = t * H + h of the step's S_Q tokens (token t sees keys up to seqlen - S_Q + t).
Output as triton_decode_kernel's stage 1: DIRECT -> out [B, ROWS, 512] bf16 + lse [B, H, S_Q]
(natural log); else fp32 partials [B, splits, ROWS, 512] (normalized) + lse [B, splits, ROWS].
H a multiple of 64 (a row block is one token's heads), page a multiple of BN, bf16.
"""
from __future__ import annotations

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)

LOG2E = 1.4426950408889634


@gluon.jit
def _producer(q_desc, kv_desc, table_ptr, q_bar, kv_full, kv_empty, sQ, sQr, sK, sKr,
              q_row0, b, start, n_tiles, stride_bt, num_blocks,
              BN: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr, NCH: gl.constexpr):
    mbarrier.expect(q_bar, NCH * 64 * 64 * 2)
    for c in gl.static_range(NCH - 1):
        tma.async_copy_global_to_shared(q_desc, [q_row0, c * 64], q_bar, sQ.index(c))
    tma.async_copy_global_to_shared(q_desc, [q_row0, (NCH - 1) * 64], q_bar, sQr)
    for i in range(n_tiles):
        s = i % STAGES
        ph = (i // STAGES) & 1
        mbarrier.wait(kv_empty.index(s), ph ^ 1)
        key = start + i * BN
        page = gl.load(table_ptr + b * stride_bt + key // PAGE)
        page = gl.minimum(gl.maximum(page, 0), num_blocks - 1)
        row = page * PAGE + key % PAGE
        mbarrier.expect(kv_full.index(s), NCH * BN * 64 * 2)
        for c in gl.static_range(NCH - 1):
            tma.async_copy_global_to_shared(kv_desc, [row, c * 64], kv_full.index(s),
                                            sK.index(s * (NCH - 1) + c))
        tma.async_copy_global_to_shared(kv_desc, [row, (NCH - 1) * 64], kv_full.index(s),
                                        sKr.index(s))


@gluon.jit
def _consumer(W: gl.constexpr, q_bar, kv_full, kv_empty, p_full, p_empty, sQ, sQr, sK, sKr, sP,
              sStat,
              o_ptr, lse_ptr, o_row0, lse_row0, lse_stride, start, end, n_tiles, scale_log2,
              BN: gl.constexpr, STAGES: gl.constexpr, NCH: gl.constexpr, DIRECT: gl.constexpr):
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
    cols = gl.arange(0, BN, layout=gl.SliceLayout(0, s_l))
    mbarrier.wait(q_bar, 0)
    for i in range(n_tiles):
        s = i % STAGES
        mbarrier.wait(kv_full.index(s), (i // STAGES) & 1)
        v0 = s * (NCH - 1) + 4 * W
        if i % 2 == W:
            # ---- scores and softmax of this warpgroup's tile ----------------------------
            tok = warpgroup_mma(sQr, sKr.index(s).permute((1, 0)),
                                gl.zeros([64, BN], gl.float32, s_l), is_async=True)
            for c in gl.static_range(NCH - 1):
                tok = warpgroup_mma(sQ.index(c), sK.index(s * (NCH - 1) + c).permute((1, 0)),
                                    tok, is_async=True)
            sc = warpgroup_mma_wait(num_outstanding=0, deps=[tok])
            key0 = start + i * BN
            sc = gl.where((key0 + cols < end)[None, :], sc * scale_log2, float("-inf"))
            m_new = gl.maximum(m_prev, gl.max(sc, axis=1))     # finite: tile 0 has a key
            alpha = gl.exp2(m_prev - m_new)
            p = gl.exp2(sc - m_new[:, None])
            l_new = l_prev * alpha + gl.sum(p, axis=1)
            p16 = p.to(gl.bfloat16)
            k = i // 2
            mbarrier.wait(p_empty.index(W), (k & 1) ^ 1)
            sP.index(W).store(p16)
            sStat.slice((W * 3 + 0) * 64, 64).store(m_new)
            sStat.slice((W * 3 + 1) * 64, 64).store(l_new)
            sStat.slice((W * 3 + 2) * 64, 64).store(alpha)
            if key0 + BN > end:
                # the split's last tile: rows past its end (another split's keys, or
                # whatever an unwritten page holds) must not reach P @ V as NaN x 0
                zl: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
                keep = (key0 + gl.arange(0, BN, layout=gl.SliceLayout(1, zl)) < end)[:, None]
                for c in gl.static_range(NCH - 1):
                    buf = sK.index(s * (NCH - 1) + c)
                    x = buf.load(zl)
                    buf.store(gl.where(keep, x, gl.zeros_like(x)))
            fence_async_shared()
            mbarrier.arrive(p_full.index(W), count=1)
            pa = gl.convert_layout(p16, p_l)
            a_o = gl.convert_layout(alpha, row_o)[:, None]
            t0 = warpgroup_mma(pa, sK.index(v0 + 0), acc0 * a_o, is_async=True)
            t1 = warpgroup_mma(pa, sK.index(v0 + 1), acc1 * a_o, is_async=True)
            t2 = warpgroup_mma(pa, sK.index(v0 + 2), acc2 * a_o, is_async=True)
            t3 = warpgroup_mma(pa, sK.index(v0 + 3), acc3 * a_o, is_async=True)
            acc0, acc1, acc2, acc3 = warpgroup_mma_wait(num_outstanding=0, deps=[t0, t1, t2, t3])
            m_prev = m_new
            l_prev = l_new
        else:
            # ---- the other warpgroup's tile: its P from shared memory ---------------------
            k = i // 2
            mbarrier.wait(p_full.index(1 - W), k & 1)
            m_prev = sStat.slice(((1 - W) * 3 + 0) * 64, 64).load(row_s)
            l_prev = sStat.slice(((1 - W) * 3 + 1) * 64, 64).load(row_s)
            a_o = sStat.slice(((1 - W) * 3 + 2) * 64, 64).load(row_o)[:, None]
            pb = sP.index(1 - W)
            t0 = warpgroup_mma(pb, sK.index(v0 + 0), acc0 * a_o, is_async=True)
            t1 = warpgroup_mma(pb, sK.index(v0 + 1), acc1 * a_o, is_async=True)
            t2 = warpgroup_mma(pb, sK.index(v0 + 2), acc2 * a_o, is_async=True)
            t3 = warpgroup_mma(pb, sK.index(v0 + 3), acc3 * a_o, is_async=True)
            acc0, acc1, acc2, acc3 = warpgroup_mma_wait(num_outstanding=0, deps=[t0, t1, t2, t3])
            mbarrier.arrive(p_empty.index(1 - W), count=1)
        mbarrier.arrive(kv_empty.index(s), count=1)

    # ---- epilogue: this warpgroup's 256 columns ------------------------------------------
    has = l_prev > 0.0
    l_safe = gl.where(has, l_prev, 1.0)
    lse = gl.where(has, (m_prev + gl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    inv = gl.convert_layout(1.0 / l_safe, row_o)[:, None]
    rows = gl.arange(0, 64, layout=row_o)
    cols64 = gl.arange(0, 64, layout=gl.SliceLayout(0, o_l))
    base = o_ptr + (o_row0 + rows)[:, None].to(gl.int64) * 512 + 256 * W + cols64[None, :]
    if DIRECT:
        gl.store(base + 0, (acc0 * inv).to(gl.bfloat16))
        gl.store(base + 64, (acc1 * inv).to(gl.bfloat16))
        gl.store(base + 128, (acc2 * inv).to(gl.bfloat16))
        gl.store(base + 192, (acc3 * inv).to(gl.bfloat16))
    else:
        gl.store(base + 0, acc0 * inv)
        gl.store(base + 64, acc1 * inv)
        gl.store(base + 128, acc2 * inv)
        gl.store(base + 192, acc3 * inv)
    if W == 0:
        gl.store(lse_ptr + lse_row0 + gl.arange(0, 64, layout=row_s) * lse_stride, lse)


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
    (q_desc, kv_desc, table_ptr, q_bar, kv_full, kv_empty, sQ, sQr, sK, sKr, q_row0, b, start,
     n_tiles, stride_bt, num_blocks) = pargs
    _producer(q_desc, kv_desc, table_ptr, q_bar, kv_full, kv_empty, sQ, sQr, sK, sKr, q_row0, b,
              start,
              n_tiles, stride_bt, num_blocks, BN, PAGE, STAGES, NCH)


@gluon.jit
def mla_decode_pingpong_kernel(q_desc, kv_desc, table_ptr, lens_ptr, o_ptr, lse_ptr, scale_log2,
                               stride_bt, max_blocks, num_blocks, num_splits,
                               S_Q: gl.constexpr, H: gl.constexpr, PAGE: gl.constexpr,
                               BN: gl.constexpr, STAGES: gl.constexpr, DIRECT: gl.constexpr):
    NCH: gl.constexpr = 9                       # 576 = 8 value chunks of 64 + the rope chunk
    ROWS: gl.constexpr = S_Q * H                # rows r = t * H + h; a 64-row block is one token's
    pid_m = gl.program_id(0)
    b = gl.program_id(1)
    split = gl.program_id(2)
    t = (pid_m * 64) // H
    h0 = (pid_m * 64) % H
    seqlen = gl.minimum(gl.maximum(gl.load(lens_ptr + b), 1), max_blocks * PAGE)
    chunk = gl.cdiv(gl.cdiv(seqlen, num_splits), BN) * BN
    start = split * chunk
    # causal within the step: token t sees keys [0, seqlen - S_Q + t]; tiles past that
    # are not loaded, so a split's first tile always holds a visible key
    end = gl.minimum(gl.minimum(start + chunk, seqlen), seqlen - S_Q + t + 1)
    n_tiles = gl.maximum(gl.cdiv(end - start, BN), 0)
    q_row0 = b * ROWS + pid_m * 64
    if DIRECT:
        o_row0 = q_row0
        lse_row0 = b * ROWS + h0 * S_Q + t                  # lse [B, H, S_Q]
        lse_stride = S_Q
    else:
        o_row0 = (b * num_splits + split) * ROWS + pid_m * 64
        lse_row0 = o_row0
        lse_stride = 1

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
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    p_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    p_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(kv_full.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=2)      # both warpgroups release a stage
    for i in gl.static_range(2):
        mbarrier.init(p_full.index(i), count=1)
        mbarrier.init(p_empty.index(i), count=1)

    cargs = (q_bar, kv_full, kv_empty, p_full, p_empty, sQ, sQr, sK, sKr, sP, sStat, o_ptr,
             lse_ptr, o_row0, lse_row0, lse_stride, start, end, n_tiles, scale_log2)
    pargs = (q_desc, kv_desc, table_ptr, q_bar, kv_full, kv_empty, sQ, sQr, sK, sKr, q_row0, b,
             start, n_tiles, stride_bt, num_blocks)
    # the workers share a signature (W is unused by the producer)
    gl.warp_specialize([(_wg, (cargs, pargs, 0, BN, STAGES, NCH, DIRECT, PAGE)),
                        (_wg, (cargs, pargs, 1, BN, STAGES, NCH, DIRECT, PAGE)),
                        (_load, (cargs, pargs, 1, BN, STAGES, NCH, DIRECT, PAGE))],
                       [4, 1], [240, 24])


def compile_offline(BN=32, STAGES=2, DIRECT=False, H=128, PAGE=64, S_Q=1):
    """Compile for sm_90 without a GPU; returns the CompiledKernel."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    lay_q = "NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2, transposed=False, fp4_padded=False, cga_layout=[])"
    sig = {"q_desc": f"tensordesc<bf16[64, 64],{lay_q}>", "kv_desc": f"tensordesc<bf16[{BN}, 64],{lay_q}>",
           "table_ptr": "*i32", "lens_ptr": "*i32", "o_ptr": "*bf16" if DIRECT else "*fp32",
           "lse_ptr": "*fp32", "scale_log2": "fp32", "stride_bt": "i32", "max_blocks": "i32",
           "num_blocks": "i32", "num_splits": "i32", "S_Q": "constexpr", "H": "constexpr",
           "PAGE": "constexpr",
           "BN": "constexpr", "STAGES": "constexpr", "DIRECT": "constexpr"}
    src = GluonASTSource(mla_decode_pingpong_kernel, signature=sig,
                         constexprs={"S_Q": S_Q, "H": H, "PAGE": PAGE, "BN": BN, "STAGES": STAGES,
                                     "DIRECT": DIRECT})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))


if __name__ == "__main__":
    import subprocess
    import sys
    import tempfile
    k = compile_offline(*(int(a) for a in sys.argv[1:3])) if len(sys.argv) > 2 else compile_offline()
    ptx = k.asm["ptx"]
    print("wgmma:", ptx.count("wgmma.mma_async"), "smem:", k.metadata.shared)
    f = tempfile.NamedTemporaryFile(suffix=".cubin", delete=False)
    f.write(k.asm["cubin"])
    f.close()
    import triton as _t
    import os
    tool = os.path.join(os.path.dirname(_t.__file__), "backends", "nvidia", "bin", "cuobjdump")
    print(subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout[-200:])
