"""A split-K GEMM's partial sums, the residual add and the RMSNorm after it, one program per
row, the row in registers.

    h[t] = (r[t] + sum_s p[s, t].to(dtype)).to(dtype)            p [S, T, N] fp32, r [T, N]
    y[t] = w * (h[t] * rsqrt(mean(h[t]^2) + eps)).to(dtype)      (rms_norm_kernel.py's)

A decoder layer's `h = residual + o_proj(attn)` then `post_attention_layernorm(h)` when
o_proj's decode GEMM splits K: the partials are summed in split order in fp32 and rounded
once (the GEMM's output), the add rounded again (HF's `residual + ...`), and the norm
rounds as HF's RMSNorm. One launch where a sum-and-add kernel and a norm kernel ran.

With QUANT_K > 0 the program also writes y[t] quantized per QUANT_K columns, as the fp8
decode GEMMs quantize their activations (quant_act_tile: e4m3 yq [T, N] and fp32 scales
ys [T, cdiv(N, QUANT_K)]), for an fp8 MLP or MoE block after the norm: its GEMMs then read
them instead of quantizing y in a launch of their own.
"""
from __future__ import annotations

import triton
import triton.language as tl

from lowering.fused.rms_norm_kernel import normalized_row
from lowering.gemm.fp8_linear_kernel import quantize_row


@triton.jit
def residual_rms_norm_kernel(
    p_ptr,             # [S, T, N] fp32, contiguous
    r_ptr,             # [T, N], row stride stride_r, last dim contiguous
    w_ptr,             # [N]
    h_ptr, y_ptr,      # [T, N] contiguous each
    yq_ptr, ys_ptr,    # QUANT_K > 0: [T, N] e4m3 and [T, G] fp32, contiguous
    T, N, G, stride_r, eps,
    S: tl.constexpr, BLOCK: tl.constexpr,
    QUANT_K: tl.constexpr, NATIVE_CAST: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    dt = h_ptr.dtype.element_ty
    r = tl.load(r_ptr + t * stride_r + offs, mask=mask, other=0.0).to(tl.float32)     # [BLOCK]
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)                   # [BLOCK]
    acc = tl.load(p_ptr + t * N + offs, mask=mask, other=0.0)                        # split 0
    for s in tl.static_range(1, S):
        acc += tl.load(p_ptr + (s * T + t) * N + offs, mask=mask, other=0.0)
    h = (r + acc.to(dt).to(tl.float32)).to(dt)                   # the GEMM's output, the add
    tl.store(h_ptr + t * N + offs, h, mask=mask)
    y = normalized_row(h.to(tl.float32), w, N, eps, dt).to(dt)                     # [BLOCK]
    tl.store(y_ptr + t * N + offs, y, mask=mask)
    if QUANT_K > 0:      # y quantized for an fp8 GEMM (zeros past N)
        quantize_row(y.to(tl.float32), yq_ptr + t * N, ys_ptr + t * G, offs, mask, G, QUANT_K,
                     BLOCK, NATIVE_CAST)
