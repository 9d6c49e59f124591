"""DeepSeek-V2 without q_lora (V2-Lite): a decode step's absorbed query and cache row from
the q_proj + kv_a GEMM's split-K partials, one launch.

    part [SPLIT, T, N (P + R) + L + R]  fp32 partial sums of [q | kv_c | k_pe]
    y[:, h]  = [q_h[:, :P] @ W_UK_T[h] | RoPE(q_h[:, P:])]   [T, N, L + R]  (absorbed query)
    kv_out   = [rms_norm(kv_c) * w_kv | RoPE(k_pe)]           [T, L + R]     (the cache row)
    q_h      = sum(part)[:, h (P + R) : (h + 1)(P + R)] rounded to the activation dtype

    grid = (N * L_SPLIT + BLOCK_T, cdiv(T, BLOCK_T)): program (h * L_SPLIT + i, b) the
    query head h of token block b, its absorbed columns [i L / L_SPLIT, (i + 1) L / L_SPLIT)
    (and with i = 0 its rope columns), program (N * L_SPLIT + i, b) the cache row of token
    b * BLOCK_T + i

Unfused these are the prologue (prologue_kernel.py's V2 form: the cache row and the query
with RoPE through memory) and the attention op's absorbed W_UK_T GEMM
(lowering/gemm/head_gemm.py). Here a query program sums its head's partials in split order,
rounds them (the GEMM's output), and hands them to q_absorb_kernel.py's tail, which
absorbs the nope part (its share of W_UK_T[h]: a model with few heads, V2-Lite's 16, would
otherwise stream the whole weight from 16 programs) and rotates the rope part (V2's complex pairs, ROPE 2, angles the
real and imaginary parts of its freqs_cis [T, R / 2] in fp32). The cache row's program is
the prologue's program 0 for its token. Roundings are the unfused ops'.
"""
from __future__ import annotations

import triton
import triton.language as tl

from lowering.fused.prologue_kernel import _rms_norm, _rope, _row_sum
from lowering.fused.q_absorb_kernel import absorb_rope_store, rope_rows


@triton.jit
def q_kv_absorb_kernel(
    part_ptr,                  # [SPLIT, T, N * (P + R) + L + R] fp32, contiguous
    wkv_ptr,                   # [L] kv_a_layernorm's weight
    wuk_ptr,                   # W_UK_T [N, P, L] contiguous, in the activation dtype
    cos_ptr, sin_ptr,          # [T, R / 2] fp32 rows, strides (stride_cs, stride_cc)
    y_ptr,                     # [T, N, L + R] contiguous: the absorbed query
    kv_ptr,                    # [T, L + R] contiguous: the cache rows
    T, N, stride_split, stride_cs, stride_cc, eps_kv,
    P: tl.constexpr, R: tl.constexpr, L: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_LK: tl.constexpr,
    BLOCK_H: tl.constexpr, ROPE: tl.constexpr, DOT_F32: tl.constexpr,
    L_SPLIT: tl.constexpr,
):
    pid = tl.program_id(0)
    row0 = tl.program_id(1) * BLOCK_T
    dt: tl.constexpr = wuk_ptr.dtype.element_ty
    NQ = N * (P + R)
    W = NQ + L + R                                                   # a partial row's width
    if pid < N * L_SPLIT:
        h = pid // L_SPLIT
        part = pid % L_SPLIT
        rows = row0 + tl.arange(0, BLOCK_T)                                      # [BLOCK_T]
        r_ok = rows < T
        head = part_ptr + rows.to(tl.int64)[None, :] * W + h * (P + R)          # [1, BLOCK_T]
        p = tl.arange(0, P)
        ir = rope_rows(R, ROPE)
        m = r_ok[None, :]
        acc_n = tl.load(head + p[:, None], mask=m, other=0.0)                   # [P, BLOCK_T]
        acc_r = tl.load(head + (P + ir)[:, None], mask=m, other=0.0)            # [R, BLOCK_T]
        for s in tl.static_range(1, SPLIT):                      # the splits, in order
            acc_n += tl.load(head + s * stride_split + p[:, None], mask=m, other=0.0)
            acc_r += tl.load(head + s * stride_split + (P + ir)[:, None], mask=m, other=0.0)
        LP: tl.constexpr = L // L_SPLIT
        absorb_rope_store(acc_n, acc_r, h, rows, r_ok, wuk_ptr, cos_ptr, sin_ptr, y_ptr, 1.0,
                          N, stride_cs, part * LP, part * LP + LP, part == 0, P, R, L,
                          BLOCK_T, BLOCK_L, ROPE, DOT_F32, False, dt)
    else:
        t = row0 + pid - N * L_SPLIT
        if t < T:
            row = part_ptr + t.to(tl.int64) * W
            out = kv_ptr + t.to(tl.int64) * (L + R)
            # kv_c -> kv_a_layernorm, into the row's first L columns
            ol = tl.arange(0, BLOCK_LK)
            ml = ol < L
            kv = _row_sum(row + NQ, ol, ml, stride_split, SPLIT).to(dt).to(tl.float32)
            tl.store(out + ol, _rms_norm(kv, wkv_ptr, ol, ml, L, eps_kv, dt), mask=ml)
            # k_pe -> RoPE, into the last R columns
            one = tl.full([1], 0, tl.int32)
            _rope(row + NQ + L, out + L, one, one == 0, cos_ptr + t.to(tl.int64) * stride_cs,
                  sin_ptr + t.to(tl.int64) * stride_cs, stride_cc, stride_split, dt, SPLIT, R,
                  BLOCK_H, ROPE)
