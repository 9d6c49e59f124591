"""A DeepSeek MoE router's logits for a decode step, as fp32 partial sums over H slices:

    x [T, H], weight [E, H] (the router's weight, H contiguous)
    partial[s, t, e] = sum over h in slice s of x[t, h] * weight[e, h]          [SPLIT, T, E]

The router's weight is one GEMV-sized read per layer (V3: 256 x 7168), too small for one
program per expert block to keep the GPU busy, so H is cut into SPLIT slices of CHUNK
values (a multiple of BLOCK_K; the last one may be shorter) and program (i, s) streams
rows i * BLOCK_E of the weight over slice s. The weight is the tall operand of the dot, as
in lowering/gemm/linear_kernel.py: [BLOCK_E, BLOCK_K] x [BLOCK_K, BLOCK_T] into an fp32
[BLOCK_E, BLOCK_T] accumulator, all T rows at once (BLOCK_T >= 16, the smallest tl.dot
takes). No atomics: router_select_kernel.py adds the SPLIT partials in split order, so the
logits do not depend on scheduling.

Numerics: HF computes F.linear(x.float(), weight.float()). x and a weight of x's 16-bit
dtype are multiplied in that dtype (each product is exact in fp32) with fp32 accumulation;
an fp32 weight (a router kept in fp32) is multiplied with x widened to fp32 (exact) in an
IEEE fp32 dot (input_precision="ieee", no TF32). The result differs from
torch's fp32 GEMM only in the summation order. DOT_F32 (the CPU interpreter, which
mis-multiplies 16-bit dots) widens both operands and uses the IEEE fp32 dot.

ROW_FMA (a few rows over an fp32 weight, where the IEEE dot pads T to 16 rows and runs on
the CUDA cores anyway): no dot; each lane keeps fp32 sums of its k column's products
[BLOCK_E, BLOCK_T, BLOCK_K] across the slice's tiles, summed over k once at the end. The
same products, another summation order.

    grid = (cdiv(E, BLOCK_E), SPLIT)
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def router_logits_kernel(
    x_ptr,                        # [T, H], stride stride_xt (H contiguous)
    w_ptr,                        # [E, H], stride stride_we (H contiguous); x's dtype or fp32
    part_ptr,                     # [SPLIT, T, E] fp32 contiguous
    T, E, H, CHUNK,               # CHUNK: the H values of one split, a multiple of BLOCK_K
    stride_xt, stride_we,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,         # H % CHUNK == 0: every slice is whole BLOCK_K tiles
    W_F32: tl.constexpr,          # the weight is fp32: IEEE fp32 dot
    DOT_F32: tl.constexpr,        # the CPU interpreter: every dot in fp32
    ROW_FMA: tl.constexpr,        # few rows, fp32 weight: per-lane fp32 sums, no dot
):
    s = tl.program_id(1)
    offs_e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)              # [BLOCK_E]
    offs_t = tl.arange(0, BLOCK_T)                                           # [BLOCK_T]
    offs_k = tl.arange(0, BLOCK_K)                                           # [BLOCK_K]
    e_ok = offs_e < E
    t_ok = offs_t < T
    w_rows = w_ptr + offs_e.to(tl.int64)[:, None] * stride_we                # [BLOCK_E, 1]
    x_cols = x_ptr + offs_t.to(tl.int64)[None, :] * stride_xt                # [1, BLOCK_T]
    h_lo = s * CHUNK
    h_hi = tl.minimum(H, h_lo + CHUNK)
    if ROW_FMA:                  # [BLOCK_E, BLOCK_T, BLOCK_K] per-lane fp32 sums
        acc3 = tl.zeros((BLOCK_E, BLOCK_T, BLOCK_K), dtype=tl.float32)
        x_rows = x_ptr + offs_t.to(tl.int64)[:, None] * stride_xt           # [BLOCK_T, 1]
        for k0 in range(h_lo, h_hi, BLOCK_K):
            kk = k0 + offs_k                                                 # [BLOCK_K]
            k_ok = kk < h_hi
            w = tl.load(w_rows + kk[None, :], mask=e_ok[:, None] & k_ok[None, :],
                        other=0.0).to(tl.float32)                            # [BLOCK_E, BLOCK_K]
            x = tl.load(x_rows + kk[None, :], mask=t_ok[:, None] & k_ok[None, :],
                        other=0.0).to(tl.float32)                            # [BLOCK_T, BLOCK_K]
            acc3 += w[:, None, :] * x[None, :, :]
        acc = tl.sum(acc3, axis=2)                                           # [BLOCK_E, BLOCK_T]
    else:
        acc = tl.zeros((BLOCK_E, BLOCK_T), dtype=tl.float32)
        for k0 in range(h_lo, h_hi, BLOCK_K):
            kk = k0 + offs_k                                                 # [BLOCK_K]
            if EVEN_K:           # no ragged slice: row masks only (vector loads)
                w = tl.load(w_rows + kk[None, :], mask=e_ok[:, None], other=0.0)
                x = tl.load(x_cols + kk[:, None], mask=t_ok[None, :], other=0.0)
            else:
                k_ok = kk < h_hi
                w = tl.load(w_rows + kk[None, :], mask=e_ok[:, None] & k_ok[None, :], other=0.0)
                x = tl.load(x_cols + kk[:, None], mask=t_ok[None, :] & k_ok[:, None], other=0.0)
            if DOT_F32 or W_F32:  # exact widening, then an IEEE fp32 dot
                acc = tl.dot(w.to(tl.float32), x.to(tl.float32), acc, input_precision="ieee")
            else:                 # 16-bit products, exact in the fp32 accumulator
                acc = tl.dot(w, x, acc)                                      # [BLOCK_E, BLOCK_T]
    # partial[s, t, e]: the accumulator transposed
    p_ptrs = part_ptr + (s * T + offs_t)[None, :] * E + offs_e[:, None]      # [BLOCK_E, BLOCK_T]
    tl.store(p_ptrs, acc, mask=e_ok[:, None] & t_ok[None, :])
