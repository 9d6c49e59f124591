"""mla::quant_fp8_static's Triton kernel and launcher: fp8(x / scale) for any shape,
scale one-element fp32 (per-tensor, static). The torch twin is mla_ops/quant.py's
quant_fp8_static; tests compare them bit for bit (TRITON_INTERPRET=1 on CPU).

    grid = (cdiv(numel, BLOCK),)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowering.fused.fp8_rounding import FP8_MAX, div_rn, to_e4m3


@triton.jit
def static_quant_kernel(x_ptr, y_ptr, scale_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    s = tl.load(scale_ptr)
    x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
    y = tl.clamp(div_rn(x, s + tl.zeros_like(x)), -FP8_MAX, FP8_MAX)
    tl.store(y_ptr + offs, to_e4m3(y, y_ptr), mask=m)


def static_quant(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp8(x / scale) for any shape; scale one-element fp32."""
    xc = x.contiguous()
    y = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    n = xc.numel()
    if n:
        BLOCK = 1024
        static_quant_kernel[(triton.cdiv(n, BLOCK),)](xc, y, scale.reshape(1), n, BLOCK=BLOCK)
    return y
