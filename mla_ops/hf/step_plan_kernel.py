"""A decode step's plan for a bump-allocated paged cache, one program per row: the block
table after the step, the slot of the row's new token, the lengths the attention reads.

    lens [B] int32     real tokens per row before the step (row b's new token: position lens[b])
    table [B, M] int32 block ids per row (-1: none); used [] int64: the allocator's top
    ->  pack int32: the fields of step_layout.py at the offsets *_at it gives: table' [B, M],
                    seq_lens [B], query_start_loc [B + 1], with BOUND bounded_table (table'
                    clamped to [0, num_blocks - 1]) and bounded_lens (seq_lens clamped to
                    [1, M * BS]: what a decode kernel may read), taken [1] (blocks taken)
        slots [B] int64 (-1: not written)

A row whose token starts a new block takes the next id of the allocator: row b's is
used + (blocks taken by rows 0 .. b-1), as a cumulative sum in row order would give; ids
past num_blocks become -1 (pool exhausted: the token is not written). A row at max_len
takes no block and writes no slot. Each program counts the rows before it itself (one
pass over lens), so one launch does what Inductor made four to five kernels of.

    grid = (B,)
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def decode_plan_kernel(
    lens_ptr, table_ptr, used_ptr,        # state before the step (rows [0, B) read)
    pack_ptr, slots_ptr,                  # outputs
    B, M, num_blocks, max_len,
    table_at, lens_at, qsl_at, btable_at, blens_at, taken_at,   # pack's field offsets
    BS: tl.constexpr, BOUND: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_M: tl.constexpr,
):
    b = tl.program_id(0)
    # blocks taken by the rows before b, and by all rows
    before = tl.zeros((), dtype=tl.int64)
    total = tl.zeros((), dtype=tl.int64)
    for i0 in range(0, B, BLOCK_B):
        i = i0 + tl.arange(0, BLOCK_B)
        n = tl.load(lens_ptr + i, mask=i < B, other=0).to(tl.int64)
        need = (tl.minimum(n + 1, max_len) + BS - 1) // BS - (n + BS - 1) // BS
        need = tl.where(i < B, need, 0)
        before += tl.sum(tl.where(i < b, need, 0))
        total += tl.sum(need)

    n = tl.load(lens_ptr + b).to(tl.int64)                  # the new token's position
    nb_old = (n + BS - 1) // BS
    nb_new = (tl.minimum(n + 1, max_len) + BS - 1) // BS
    start = tl.load(used_ptr) + before                       # id for block column nb_old
    row = table_ptr + b.to(tl.int64) * M
    for c0 in range(0, M, BLOCK_M):
        c = c0 + tl.arange(0, BLOCK_M)
        ok = c < M
        old = tl.load(row + c, mask=ok, other=-1)
        ids = start + c - nb_old
        ids = tl.where(ids < num_blocks, ids, -1)
        t = tl.where((c >= nb_old) & (c < nb_new), ids, old).to(tl.int32)
        tl.store(pack_ptr + table_at + b * M + c, t, mask=ok)
        if BOUND:
            tl.store(pack_ptr + btable_at + b * M + c,
                     tl.minimum(tl.maximum(t, 0), num_blocks - 1), mask=ok)

    col = tl.minimum(n // BS, M - 1)                        # the token's block column
    ids = start + col - nb_old
    ids = tl.where(ids < num_blocks, ids, -1)
    blk = tl.where((col >= nb_old) & (col < nb_new), ids, tl.load(row + col).to(tl.int64))
    slot = tl.where((n < max_len) & (blk >= 0), blk * BS + n % BS, -1)
    tl.store(slots_ptr + b, slot)
    seq = (n + 1).to(tl.int32)
    tl.store(pack_ptr + lens_at + b, seq)                   # seq_lens
    tl.store(pack_ptr + qsl_at + b, b)                      # query_start_loc
    if BOUND:
        tl.store(pack_ptr + blens_at + b, tl.minimum(tl.maximum(seq, 1), M * BS))
    if b == 0:
        tl.store(pack_ptr + qsl_at + B, B)
        tl.store(pack_ptr + taken_at, total.to(tl.int32))
