"""RoPE of a decode step's query heads, written with the untouched columns into a new
buffer: one program per BLOCK_ROWS (token, head) rows.

    q [T * N, P + R] rows, cos / sin [T, R] (HF's cat(freqs, freqs) * scaling)
    y[:, :P] = q[:, :P];   y[:, P:] = RoPE(q[:, P:]) with token t = row // N's angles

RoPE as in prologue_kernel.py (INTERLEAVE: DeepSeek-V3's pairs, else rotate_half), in
fp32 and rounded once to q's dtype, as Inductor computes HF's RoPE functions. It replaces
the unfused graph's RoPE kernel and its write-back of the whole query.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rotate(x1, x2, cos1, sin1, cos2, sin2, dt):
    """RoPE's two halves from the rotated pairs (x1, x2), in fp32, each rounded once to dt:
    x1 * cos1 - x2 * sin1 and x2 * cos2 + x1 * sin2."""
    return (x1 * cos1 - x2 * sin1).to(dt), (x2 * cos2 + x1 * sin2).to(dt)


@triton.jit
def q_rope_kernel(
    q_ptr, y_ptr,              # [rows, P + R] each, contiguous
    cos_ptr, sin_ptr,          # [T, R] rows, stride stride_cs (last dim contiguous)
    rows, N, stride_cs,
    P: tl.constexpr, R: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr,
    INTERLEAVE: tl.constexpr,
):
    W: tl.constexpr = P + R
    H: tl.constexpr = R // 2
    dt = y_ptr.dtype.element_ty
    r = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)            # [BLOCK_ROWS]
    r_ok = r < rows
    base = r.to(tl.int64) * W

    op = tl.arange(0, BLOCK_P)                                               # q_nope: copied
    m = r_ok[:, None] & (op < P)[None, :]
    tl.store(y_ptr + base[:, None] + op[None, :],
             tl.load(q_ptr + base[:, None] + op[None, :], mask=m), mask=m)

    j = tl.arange(0, BLOCK_H)
    m = r_ok[:, None] & (j < H)[None, :]                                     # [BLOCK_ROWS, BLOCK_H]
    if INTERLEAVE:
        i1, i2, c2 = 2 * j, 2 * j + 1, j
    else:
        i1, i2, c2 = j, H + j, H + j
    src = q_ptr + base[:, None] + P
    x1 = tl.load(src + i1[None, :], mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src + i2[None, :], mask=m, other=0.0).to(tl.float32)
    cs = (r // N).to(tl.int64)[:, None] * stride_cs                          # token's row
    cos1 = tl.load(cos_ptr + cs + j[None, :], mask=m, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + cs + j[None, :], mask=m, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + cs + c2[None, :], mask=m, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + cs + c2[None, :], mask=m, other=0.0).to(tl.float32)
    o1, o2 = rotate(x1, x2, cos1, sin1, cos2, sin2, dt)
    dst = y_ptr + base[:, None] + P
    tl.store(dst + j[None, :], o1, mask=m)
    tl.store(dst + H + j[None, :], o2, mask=m)
