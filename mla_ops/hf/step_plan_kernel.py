"""A step's plan for a bump-allocated paged cache when every row gets S real tokens (a
decode step: S = 1; an eager prefill without pads), one program per row: the block table
after the step, the slots of the row's new tokens, the lengths the attention reads, and
(ROOM) what the host needs to check the step fits.

    lens [B] int32     real tokens per row before the step (row b's tokens: positions
                       lens[b] .. lens[b] + S - 1)
    table [B, M] int32 block ids per row (-1: none); used [] int64: the allocator's top
    ->  pack int32: the fields of step_layout.py at the offsets *_at it gives: table' [B, M],
                    seq_lens [B], query_start_loc [B + 1], with BOUND bounded_table (table'
                    clamped to [0, num_blocks - 1]) and bounded_lens (seq_lens clamped to
                    [1, M * BS]: what a decode kernel may read), taken [1] (blocks taken)
        slots [B * S] int64 (-1: not written)
        room [6] int64 (ROOM): the longest row after the step, that row, the blocks taken,
                    used, and the longest and shortest row before it

A row's new blocks take the next ids of the allocator: row b's first is used + (blocks
taken by rows 0 .. b-1), as a cumulative sum in row order would give; ids past
num_blocks become -1 (pool exhausted: the token is not written). Tokens at or past
max_len take no block and write no slot. Each program counts the rows before it itself
(one pass over lens), so one launch does what torch ops or Inductor made several of.

    grid = (B,)
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def step_plan_kernel(
    lens_ptr, table_ptr, used_ptr,        # state before the step (rows [0, B) read)
    pack_ptr, slots_ptr, room_ptr,        # outputs (room_ptr: only with ROOM)
    B, M, S, num_blocks, max_len,
    table_at, lens_at, qsl_at, btable_at, blens_at, taken_at,   # pack's field offsets
    BS: tl.constexpr, BOUND: tl.constexpr, ROOM: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    # blocks taken by the rows before b, and by all rows; with ROOM the rows' extremes
    before = tl.zeros((), dtype=tl.int64)
    total = tl.zeros((), dtype=tl.int64)
    longest = tl.full((), -1, tl.int64)
    longest_row = tl.zeros((), dtype=tl.int64)
    ctx_max = tl.full((), -1, tl.int64)
    ctx_min = tl.full((), 2**62, tl.int64)
    for i0 in range(0, B, BLOCK_B):
        i = i0 + tl.arange(0, BLOCK_B)
        n = tl.load(lens_ptr + i, mask=i < B, other=0).to(tl.int64)
        need = (tl.minimum(n + S, max_len) + BS - 1) // BS - (n + BS - 1) // BS
        need = tl.where(i < B, need, 0)
        before += tl.sum(tl.where(i < b, need, 0))
        total += tl.sum(need)
        if ROOM:
            after = tl.where(i < B, n + S, -1)
            top = tl.max(after, axis=0)
            longest_row = tl.where(top > longest, i0 + tl.argmax(after, axis=0), longest_row)
            longest = tl.maximum(longest, top)
            ctx_max = tl.maximum(ctx_max, tl.max(tl.where(i < B, n, -1), axis=0))
            ctx_min = tl.minimum(ctx_min, tl.min(tl.where(i < B, n, 2**62), axis=0))

    n = tl.load(lens_ptr + b).to(tl.int64)                  # the row's first new position
    nb_old = (n + BS - 1) // BS
    nb_new = (tl.minimum(n + S, max_len) + BS - 1) // BS
    used = tl.load(used_ptr)
    start = used + before                                    # id for block column nb_old
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

    out = slots_ptr + b.to(tl.int64) * S
    for j0 in range(0, S, BLOCK_S):
        j = j0 + tl.arange(0, BLOCK_S)
        pos = n + j                                          # [BLOCK_S] token positions
        col = tl.minimum(pos // BS, M - 1)                   # their block columns
        fresh = (col >= nb_old) & (col < nb_new)
        ids = start + col - nb_old
        ids = tl.where(ids < num_blocks, ids, -1)
        old = tl.load(row + col, mask=(j < S) & ~fresh, other=-1).to(tl.int64)
        blk = tl.where(fresh, ids, old)
        slot = tl.where((pos < max_len) & (blk >= 0), blk * BS + pos % BS, -1)
        tl.store(out + j, slot, mask=j < S)
    seq = (n + S).to(tl.int32)
    tl.store(pack_ptr + lens_at + b, seq)                   # seq_lens
    tl.store(pack_ptr + qsl_at + b, b * S)                  # query_start_loc
    if BOUND:
        tl.store(pack_ptr + blens_at + b, tl.minimum(tl.maximum(seq, 1), M * BS))
    if b == 0:
        tl.store(pack_ptr + qsl_at + B, B * S)
        tl.store(pack_ptr + taken_at, total.to(tl.int32))
        if ROOM:
            tl.store(room_ptr + 0, longest)
            tl.store(room_ptr + 1, longest_row)
            tl.store(room_ptr + 2, total)
            tl.store(room_ptr + 3, used)
            tl.store(room_ptr + 4, ctx_max)
            tl.store(room_ptr + 5, ctx_min)
