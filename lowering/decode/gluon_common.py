"""Gluon helpers shared by the Hopper decode kernels (gluon_ring_kernel.py,
gluon_pair_kernel.py, gluon_fp8_kernel.py, gluon_rows_kernel.py): which work a CTA
does, its barriers, the producer's ring of tiles, and how it finishes and stores its rows.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

# The TMA global -> shared copy was renamed after triton 3.6 (async_load).
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
# A barrier over the calling partition's warps (renamed after triton 3.6).
partition_barrier = getattr(gl, "thread_barrier", None) or gl.barrier

LOG2E = 1.4426950408889634


@gluon.jit
def store_half(W: gl.constexpr, acc0, acc1, acc2, acc3, inv, o_ptr, o_row0, o_l: gl.constexpr,
               DIRECT: gl.constexpr):
    """Warpgroup W's 256 output columns, four [64, 64] accumulators scaled by inv (per row):
    bf16 where DIRECT, else the fp32 partials."""
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, o_l))
    cols64 = gl.arange(0, 64, layout=gl.SliceLayout(0, o_l))
    base = o_ptr + (o_row0 + rows)[:, None].to(gl.int64) * 512 + 256 * W + cols64[None, :]
    inv = inv[:, None]
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


@gluon.jit
def load_ring(kv_desc, table_ptr, kv_full, kv_empty, sK, b, start, n_tiles, stride_bt,
              num_blocks, BN: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr,
              NCH: gl.constexpr, ELEM_BYTES: gl.constexpr = 1):
    """A producer's loop: tile i (keys start + i BN ..., within one page) of request b,
    NCH TMA boxes of [BN, 64] elements of ELEM_BYTES, into ring slot i % STAGES once the
    consumers freed it (page ids bounded into the cache)."""
    nxt = gl.load(table_ptr + b * stride_bt + start // PAGE, mask=n_tiles > 0, other=0)
    for i in range(n_tiles):
        s = i % STAGES
        key = start + i * BN
        page = nxt
        nxt = gl.load(table_ptr + b * stride_bt + (key + BN) // PAGE, mask=i + 1 < n_tiles,
                      other=0)
        mbarrier.wait(kv_empty.index(s), ((i // STAGES) & 1) ^ 1)
        page = gl.minimum(gl.maximum(page, 0), num_blocks - 1)
        row = page * PAGE + key % PAGE
        mbarrier.expect(kv_full.index(s), NCH * BN * 64 * ELEM_BYTES)
        for c in gl.static_range(NCH):
            tma_load(kv_desc, [row, c * 64], kv_full.index(s), sK.index(s * NCH + c))


@gluon.jit
def ring_barriers(STAGES: gl.constexpr):
    """The mbarriers of a CTA: q loaded; each ring stage full / empty (both consumer
    warpgroups release a stage); each warpgroup's P and row state published / read."""
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    p_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    p_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(kv_full.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=2)
    for i in gl.static_range(2):
        mbarrier.init(p_full.index(i), count=1)
        mbarrier.init(p_empty.index(i), count=1)
    return q_bar, kv_full, kv_empty, p_full, p_empty


@gluon.jit
def finish_rows(W: gl.constexpr, m, l, lse_ptr, lse_row0, lse_stride, row_l: gl.constexpr):
    """The rows' natural-log LSE from base-2 (m, l), stored by warpgroup 0 (-inf where a
    row saw no key); returns l, 1 where it is 0, to normalize O by."""
    has = l > 0.0
    l_safe = gl.where(has, l, 1.0)
    if W == 0:
        lse = gl.where(has, (m + gl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        gl.store(lse_ptr + lse_row0 + gl.arange(0, 64, layout=row_l) * lse_stride, lse)
    return l_safe


@gluon.jit
def cta_work(lens_ptr, max_blocks, num_splits, S_Q: gl.constexpr, H: gl.constexpr,
             PAGE: gl.constexpr, BN: gl.constexpr, DIRECT: gl.constexpr,
             CAUSAL: gl.constexpr):
    """This CTA's request b, its keys [start, end) in n_tiles tiles, and where its rows
    go: (b, start, end, n_tiles, q_row0, o_row0, lse_row0, lse_stride)."""
    ROWS: gl.constexpr = S_Q * H                # rows r = t * H + h; a 64-row block is one token's
    pid_m = gl.program_id(0)
    b = gl.program_id(1)
    split = gl.program_id(2)
    t = (pid_m * 64) // H
    h0 = (pid_m * 64) % H
    seqlen = gl.minimum(gl.maximum(gl.load(lens_ptr + b), 1), max_blocks * PAGE)
    chunk = gl.cdiv(gl.cdiv(seqlen, num_splits), BN) * BN
    start = split * chunk
    end = gl.minimum(start + chunk, seqlen)
    if CAUSAL:
        # token t sees keys [0, seqlen - S_Q + t]; tiles past that are not loaded, so a
        # split's first tile always holds a visible key
        end = gl.minimum(end, seqlen - S_Q + t + 1)
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
    return b, start, end, n_tiles, q_row0, o_row0, lse_row0, lse_stride
