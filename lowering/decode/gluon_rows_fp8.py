"""The few-rows kernel's FP8 feed (gluon_rows_kernel.py, its FP8 mode): the bf16 query as
two e4m3 terms per element in shared memory, and the widener partition that turns each
ring slot's eight e4m3 value chunks into fp16 for P V (MN-major V^T, which fp8 MMAs do
not read). See gluon_rows_kernel.py for the schedule they serve."""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from lowering.decode.gluon_common import partition_barrier

WIDEN_REGS = gl.constexpr(128)    # registers per thread of the FP8 widener partition


@gluon.jit
def _widen(sK, s, sW, w0, key0, end, BN: gl.constexpr):
    """Ring slot s's eight value chunks [BN, 64] e4m3 -> sW chunks w0 .. w0 + 7 fp16; in a
    split's last tile keys at or past end become 0 (unwritten rows may hold NaN, and 0 x
    NaN is NaN). All eight are read before the first is written back, so the shared-memory
    loads overlap. (The rope chunk feeds only QK, which reads the ring slot itself.)"""
    w_l: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])      # [32, 64]
    x0 = sK.index(s * 9 + 0).load(w_l)                                    # [BN, 64] each
    x1 = sK.index(s * 9 + 1).load(w_l)
    x2 = sK.index(s * 9 + 2).load(w_l)
    x3 = sK.index(s * 9 + 3).load(w_l)
    x4 = sK.index(s * 9 + 4).load(w_l)
    x5 = sK.index(s * 9 + 5).load(w_l)
    x6 = sK.index(s * 9 + 6).load(w_l)
    x7 = sK.index(s * 9 + 7).load(w_l)
    keep = (key0 + gl.arange(0, BN, layout=gl.SliceLayout(1, w_l)) < end)[:, None]
    if key0 + BN > end:
        _put_all(sW, w0, x0, x1, x2, x3, x4, x5, x6, x7, keep, True)
    else:
        _put_all(sW, w0, x0, x1, x2, x3, x4, x5, x6, x7, keep, False)


@gluon.jit
def _put_all(sW, w0, x0, x1, x2, x3, x4, x5, x6, x7, keep, MASKED: gl.constexpr):
    _put(sW, w0 + 0, x0, keep, MASKED)
    _put(sW, w0 + 1, x1, keep, MASKED)
    _put(sW, w0 + 2, x2, keep, MASKED)
    _put(sW, w0 + 3, x3, keep, MASKED)
    _put(sW, w0 + 4, x4, keep, MASKED)
    _put(sW, w0 + 5, x5, keep, MASKED)
    _put(sW, w0 + 6, x6, keep, MASKED)
    _put(sW, w0 + 7, x7, keep, MASKED)


@gluon.jit
def _put(sW, c, x, keep, MASKED: gl.constexpr):
    """Chunk c of the widened tile: x [BN, 64] e4m3 as fp16, rows not kept 0 where MASKED."""
    y = x.to(gl.float16)
    if MASKED:
        y = gl.where(keep, y, gl.zeros_like(y))
    sW.index(c).store(y)


@gluon.jit
def store_q_terms(q_ptr, sQ, b, ROWS: gl.constexpr, NR: gl.constexpr):
    """FP8: q [NR, 576] (rows past ROWS 0) as two e4m3 terms, hi = e4m3(q s) and lo =
    e4m3(q s - hi), with s [NR] a power of two per row that brings its largest |q| into
    (128, 256]: hi + lo keeps a bf16's 8 significant bits wherever q s >= 1/4. sQ chunk c
    [2 NR, 64] holds the hi rows, then the lo rows. Returns s."""
    q_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])       # [16, 64]
    qr = gl.arange(0, NR, layout=gl.SliceLayout(1, q_l))
    qc = gl.arange(0, 64, layout=gl.SliceLayout(0, q_l))
    q_rows = q_ptr + (b * ROWS + qr)[:, None].to(gl.int64) * 576 + qc[None, :]
    q_mask = (qr[:, None] < ROWS) & (qc[None, :] < 64)
    x0 = gl.load(q_rows + 0, mask=q_mask, other=0.0).to(gl.float32)     # [NR, 64] each
    x1 = gl.load(q_rows + 64, mask=q_mask, other=0.0).to(gl.float32)
    x2 = gl.load(q_rows + 128, mask=q_mask, other=0.0).to(gl.float32)
    x3 = gl.load(q_rows + 192, mask=q_mask, other=0.0).to(gl.float32)
    x4 = gl.load(q_rows + 256, mask=q_mask, other=0.0).to(gl.float32)
    x5 = gl.load(q_rows + 320, mask=q_mask, other=0.0).to(gl.float32)
    x6 = gl.load(q_rows + 384, mask=q_mask, other=0.0).to(gl.float32)
    x7 = gl.load(q_rows + 448, mask=q_mask, other=0.0).to(gl.float32)
    x8 = gl.load(q_rows + 512, mask=q_mask, other=0.0).to(gl.float32)
    amax = gl.maximum(gl.maximum(gl.maximum(_amax(x0), _amax(x1)), gl.maximum(_amax(x2),
                      _amax(x3))), gl.maximum(gl.maximum(_amax(x4), _amax(x5)),
                      gl.maximum(gl.maximum(_amax(x6), _amax(x7)), _amax(x8))))
    s = gl.exp2(gl.floor(gl.log2(256.0 / gl.maximum(amax, 1e-30))))        # [NR]
    _put_terms(sQ, 0, x0, s, NR)
    _put_terms(sQ, 1, x1, s, NR)
    _put_terms(sQ, 2, x2, s, NR)
    _put_terms(sQ, 3, x3, s, NR)
    _put_terms(sQ, 4, x4, s, NR)
    _put_terms(sQ, 5, x5, s, NR)
    _put_terms(sQ, 6, x6, s, NR)
    _put_terms(sQ, 7, x7, s, NR)
    _put_terms(sQ, 8, x8, s, NR)
    return s


@gluon.jit
def _amax(x):
    return gl.max(gl.abs(x), axis=1)


@gluon.jit
def _put_terms(sQ, c: gl.constexpr, x, s, NR: gl.constexpr):
    """sQ chunk c [2 NR, 64] = [hi; lo] of x [NR, 64] fp32 times s [NR]."""
    xs = x * s[:, None]
    dst = sQ.index(c)
    dst.slice(0, NR).store(xs.to(gl.float8e4nv))                              # hi: rows 0..NR-1
    # hi read back from shared memory: widening the e4m3 registers the cast just packed
    # miscompiles (the ptxas of CUDA 12.8, which triton 3.6 ships, widens the stack
    # pointer register instead)
    hi = dst.slice(0, NR).load(x.type.layout).to(gl.float32)
    dst.slice(NR, NR).store((xs - hi).to(gl.float8e4nv))                      # lo: rows NR..2NR-1


@gluon.jit
def widen_tiles(cargs, BN: gl.constexpr, STAGES: gl.constexpr, NCH: gl.constexpr,
                 WBUF: gl.constexpr):
    """FP8: the widener partition (4 warps). Tile i's values, once in ring slot i % STAGES,
    become fp16 in sW buffer i % WBUF once the consumer's P V of tile i - WBUF has read it;
    the slot is released here and by the consumer's QK (kv_empty counts both)."""
    (q_ptr, ks_ptr, o_ptr, lse_ptr, kv_full, kv_empty, w_full, w_empty, sK, sW, sQ, sP, b, split,
     seqlen, start, end, n_tiles, sm_scale_log2, num_splits) = cargs
    for i in range(n_tiles):
        s = i % STAGES
        mbarrier.wait(kv_full.index(s), (i // STAGES) & 1)
        mbarrier.wait(w_empty.index(i % WBUF), ((i // WBUF) & 1) ^ 1)
        _widen(sK, s, sW, (i % WBUF) * (NCH - 1), start + i * BN, end, BN)
        fence_async_shared()            # the generic stores, before the MMAs read them
        partition_barrier()             # every warp's, before one thread arrives
        mbarrier.arrive(w_full.index(i % WBUF), count=1)
        mbarrier.arrive(kv_empty.index(s), count=1)
