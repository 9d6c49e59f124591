"""A step's commit to a bump-allocated paged cache's state, one program per row:
the state after step_plan_kernel.py's plan, written in place in one launch.

    table[b, :] = pack's table' row b;  lens[b] = pack's seq_lens[b]  (= lens[b] + tokens)
    program 0:  used += pack's blocks taken;  seen += tokens
    (the fields at the offsets *_at of step_layout.py)

    grid = (B,)
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def decode_commit_kernel(
    table_ptr, lens_ptr, used_ptr, seen_ptr,   # the state, written ([B, M] / [B] / [] / [])
    pack_ptr,                                  # the plan: pack as step_plan_kernel wrote it
    B, M, tokens, table_at, lens_at, taken_at,   # pack's field offsets
    BLOCK_M: tl.constexpr,
):
    b = tl.program_id(0)
    src = pack_ptr + table_at + b.to(tl.int64) * M
    dst = table_ptr + b.to(tl.int64) * M
    for c0 in range(0, M, BLOCK_M):
        c = c0 + tl.arange(0, BLOCK_M)
        tl.store(dst + c, tl.load(src + c, mask=c < M), mask=c < M)
    tl.store(lens_ptr + b, tl.load(pack_ptr + lens_at + b))
    if b == 0:
        tl.store(used_ptr, tl.load(used_ptr) + tl.load(pack_ptr + taken_at).to(tl.int64))
        tl.store(seen_ptr, tl.load(seen_ptr) + tokens)
