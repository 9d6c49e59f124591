"""FP8 feed of the pair kernel (gluon_pair_kernel.py): its e4m3 cache tiles staged by TMA
inside its own bf16 block buffers, then widened there to bf16 by a partition of 4 warps.

A buffer half (value boxes 4 HALF .. 4 HALF + 3, plus the rope box for buffer 0's half 1
and buffer 1's half 0) is refilled as four e4m3 boxes of 4 KB into the half's bf16 boxes
2 and 3, the rope's into the upper 4 KB of the bf16 rope box (stage_half), on the half's
"landed" barrier; widen_half writes the bf16 boxes in an order that never overwrites a
staged box before every warp of the partition has read it, and arrives on the half's
"full" barrier, which the pair kernel's warpgroups wait on as for a bf16 refill. So the
pair kernel's shared memory is what its bf16 form takes.

The widening moves bits (e4m3_to_bf16): exact, and at the integer rate, where the cast
runs one conversion a value at a quarter of it (docs/notes/NOTES-decode-fp8.md).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from lowering.decode.gluon_common import partition_barrier, tma_load

# an e4m3 TMA box [64 keys, 64 columns] (4 KB), as the cache's descriptor lays it out
E4M3_BOX = gl.constexpr(gl.NVMMASharedLayout.get_default_for([64, 64], gl.float8e4nv))
# the widener's registers for a box, 16 consecutive columns a thread ([32, 64] a pass)
W_L = gl.constexpr(gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0]))


# N e4m3 boxes [64, 64] over the bytes of a bf16 allocation (renamed after triton 3.6)
if hasattr(gl.shared_memory_descriptor, "reinterpret"):
    @gluon.jit
    def _as_e4m3(smem, N: gl.constexpr):
        return smem.reinterpret(gl.float8e4nv, [N, 64, 64], E4M3_BOX)
else:
    @gluon.jit
    def _as_e4m3(smem, N: gl.constexpr):
        return smem._reinterpret(gl.float8e4nv, [N, 64, 64], E4M3_BOX)


@gluon.jit
def stage_half(kv_desc, row, bar, sK, sKr, BUF: gl.constexpr, HALF: gl.constexpr, ok):
    """Copy the half's e4m3 boxes of cache row `row` (and the rope's, where the half holds
    it) into its staging place, on barrier bar (skipped where ok is false)."""
    ROPE: gl.constexpr = (BUF == 0 and HALF == 1) or (BUF == 1 and HALF == 0)
    NB: gl.constexpr = 5 if ROPE else 4
    mbarrier.expect(bar, NB * 64 * 64, pred=ok)
    # the half's bf16 value boxes 2-3, counted in 4 KB e4m3 boxes of sK
    s0: gl.constexpr = 2 * (BUF * 8 + 4 * HALF + 2)
    sK8 = _as_e4m3(sK, 32)
    for c in gl.static_range(4):
        tma_load(kv_desc, [row, (4 * HALF + c) * 64], bar, sK8.index(s0 + c), pred=ok)
    if ROPE:
        tma_load(kv_desc, [row, 512], bar, _as_e4m3(sKr, 4).index(2 * BUF + 1), pred=ok)


@gluon.jit
def e4m3_to_bf16(x):
    """e4m3 -> bf16, exact, by moving bits: sign | (exponent, mantissa) << 4 is the value
    times 2^-120 as a bf16 (subnormals included), then one bf16x2 product by 2^120. (The
    conversion instructions run at a quarter of the integer rate and bounded the widener.)
    The NaN codes (0x7f, 0xff) come out as +-480; the cache's writer stores none."""
    return gl.inline_asm_elementwise(
        asm="""{
        .reg .b32 a<2>, b<2>, c;
        prmt.b32 a0, 0, $2, 0x5040;
        prmt.b32 a1, 0, $2, 0x7060;
        lop3.b32 b0, a0, 0x7f007f00, 0, 0xc0;
        lop3.b32 b1, a1, 0x7f007f00, 0, 0xc0;
        shr.b32 b0, b0, 4;
        shr.b32 b1, b1, 4;
        lop3.b32 b0, b0, 0x80008000, a0, 0xf8;
        lop3.b32 b1, b1, 0x80008000, a1, 0xf8;
        mov.b32 c, 0x7b807b80;
        mul.rn.bf16x2 $0, b0, c;
        mul.rn.bf16x2 $1, b1, c;
        }""",
        constraints="=r,=r,r", args=[x], dtype=gl.bfloat16, is_pure=True, pack=4)


@gluon.jit
def _load_box(src):
    """An e4m3 box [64, 64] (shared memory) into registers."""
    return src.load(W_L)


@gluon.jit
def _store_box(dst, x):
    """A box _load_box read, widened, into bf16 box dst."""
    dst.store(e4m3_to_bf16(x))


@gluon.jit
def _zero_rows(box, keep):
    """A widened bf16 box's rows not kept to 0 (the split's last block)."""
    x = box.load(W_L)
    box.store(gl.where(keep, x, gl.zeros_like(x)))


@gluon.jit
def widen_half(landed, full, sK, sKr, BUF: gl.constexpr, HALF: gl.constexpr, ph, key0, end):
    """FP8: once half HALF of buffer BUF has landed (e4m3 boxes 0-1 in its bf16 box 2,
    2-3 in box 3, the rope in the upper half of the rope box), widen it in place and
    publish it on its full barrier. A bf16 box is written only after every warp of the
    partition has read the e4m3 boxes staged in it, so few registers hold staged values.
    In the split's last block keys at or past end become 0 (unwritten rows may hold NaN,
    and 0 x NaN is NaN)."""
    ROPE: gl.constexpr = (BUF == 0 and HALF == 1) or (BUF == 1 and HALF == 0)
    sK8 = _as_e4m3(sK, 32)
    s0: gl.constexpr = 2 * (BUF * 8 + 4 * HALF + 2)       # as stage_half stages it
    d0: gl.constexpr = BUF * 8 + 4 * HALF
    mbarrier.wait(landed.index(BUF * 2 + HALF), ph)
    _store_box(sK.index(d0 + 0), _load_box(sK8.index(s0 + 0)))
    _store_box(sK.index(d0 + 1), _load_box(sK8.index(s0 + 1)))
    partition_barrier()                # e4m3 boxes 0-1 read: bf16 box 2 is free
    _store_box(sK.index(d0 + 2), _load_box(sK8.index(s0 + 2)))
    x3 = _load_box(sK8.index(s0 + 3))
    if ROPE:
        sKr8 = _as_e4m3(sKr, 4)
        xr = _load_box(sKr8.index(2 * BUF + 1))
        partition_barrier()            # e4m3 boxes 2-3 and the rope read
        _store_box(sKr.index(BUF), xr)
    else:
        partition_barrier()
    _store_box(sK.index(d0 + 3), x3)
    if key0 + 64 > end:
        partition_barrier()            # every box written, by whichever thread
        keep = (key0 + gl.arange(0, 64, layout=gl.SliceLayout(1, W_L)) < end)[:, None]
        for c in gl.static_range(4):
            _zero_rows(sK.index(d0 + c), keep)
        if ROPE:
            _zero_rows(sKr.index(BUF), keep)
    fence_async_shared()                # the generic stores, before the MMAs read them
    partition_barrier()                # every warp's, before one thread arrives
    mbarrier.arrive(full.index(BUF * 2 + HALF), count=1)

