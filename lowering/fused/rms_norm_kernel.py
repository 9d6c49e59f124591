"""RMSNorm of a few rows, one program per row, the whole row in registers.

    y[t] = w * (x[t] * rsqrt(mean(x[t]^2) + eps)).to(dtype)          x, y [T, N], w [N]

Rounded as HF's DeepseekV3RMSNorm (and V2's) computes it: the sum of squares in fp32, the
normalized row rounded to x's dtype, then the weight product rounded once. A decode step
normalizes B rows of hidden size (7168 for DeepSeek-V3): too few for a looped reduction to
hide its two passes over each row, so each program loads its row once (BLOCK >= N).
With QUANT_K > 0 it also writes y quantized per QUANT_K columns for an fp8 GEMM
(fp8_linear_kernel.py's quantize_row: e4m3 yq [T, N], fp32 ys [T, G]).
"""
from __future__ import annotations

import triton
import triton.language as tl

from lowering.gemm.fp8_linear_kernel import quantize_row


@triton.jit
def normalized_row(x, w, N, eps, dt):
    """w * (x * rsqrt(mean(x^2) + eps)).to(dt), in fp32, for one row x [BLOCK] fp32 (zeros
    past N) and its weight w [BLOCK] fp32: HF's roundings, the normalized row to dt first."""
    var = tl.sum(x * x, axis=0) / N
    y = (x * tl.math.rsqrt(var + eps)).to(dt).to(tl.float32)        # rounded as HF rounds
    return w * y


@triton.jit
def rms_norm_kernel(
    x_ptr,             # [T, N], row stride stride_x, last dim contiguous
    w_ptr,             # [N]
    y_ptr,             # [T, N] contiguous
    N, stride_x, eps,
    yq_ptr, ys_ptr, G,   # QUANT_K > 0: [T, N] e4m3, [T, G] fp32, contiguous (else unread)
    BLOCK: tl.constexpr, QUANT_K: tl.constexpr, NATIVE_CAST: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    dt = y_ptr.dtype.element_ty
    # both loads issued before the reduction: one memory latency, not two
    x = tl.load(x_ptr + t * stride_x + offs, mask=mask, other=0.0).to(tl.float32)   # [BLOCK]
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)                  # [BLOCK]
    y = normalized_row(x, w, N, eps, dt).to(dt)                                     # [BLOCK]
    tl.store(y_ptr + t * N + offs, y, mask=mask)
    if QUANT_K > 0:
        quantize_row(y.to(tl.float32), yq_ptr + t * N, ys_ptr + t * G, offs, mask, G, QUANT_K,
                     BLOCK, NATIVE_CAST)
