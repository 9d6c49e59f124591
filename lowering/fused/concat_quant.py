"""mla::concat_quant_fp8_static's Triton kernel and launcher (the fused op Pass A
inserts): a [t, H, LA], b [t, H, LB] -> fp8(cat([a, b], -1) / scale) [t, H, LA + LB] in one
pass.

    grid = (t, H)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowering.fused.fp8_rounding import FP8_MAX, div_rn, to_e4m3


@triton.jit
def concat_quant_kernel(a_ptr, b_ptr, y_ptr, scale_ptr, H,
                        sa_t, sa_h, sb_t, sb_h,
                        LA: tl.constexpr, LB: tl.constexpr,
                        BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr):
    # one program per (token, head): y[t, h] = fp8([a[t, h] | b[t, h]] / scale)
    t = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.load(scale_ptr)
    out = y_ptr + (t * H + h) * (LA + LB)
    ca = tl.arange(0, BLOCK_A)
    ma = ca < LA
    a = tl.load(a_ptr + t * sa_t + h * sa_h + ca, mask=ma, other=0.0).to(tl.float32)
    a = tl.clamp(div_rn(a, s + tl.zeros_like(a)), -FP8_MAX, FP8_MAX)
    tl.store(out + ca, to_e4m3(a, y_ptr), mask=ma)
    cb = tl.arange(0, BLOCK_B)
    mb = cb < LB
    b = tl.load(b_ptr + t * sb_t + h * sb_h + cb, mask=mb, other=0.0).to(tl.float32)
    b = tl.clamp(div_rn(b, s + tl.zeros_like(b)), -FP8_MAX, FP8_MAX)
    tl.store(out + LA + cb, to_e4m3(b, y_ptr), mask=mb)


def concat_quant(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """a [t, H, LA], b [t, H, LB] (any strides, last dim unit) -> fp8 [t, H, LA + LB]."""
    t, H, LA = a.shape
    LB = b.shape[-1]
    if a.stride(-1) != 1:
        a = a.contiguous()
    if b.stride(-1) != 1:
        b = b.contiguous()
    y = torch.empty((t, H, LA + LB), dtype=torch.float8_e4m3fn, device=a.device)
    if t and H:
        concat_quant_kernel[(t, H)](a, b, y, scale.reshape(1), H, a.stride(0), a.stride(1),
                                    b.stride(0), b.stride(1), LA=LA, LB=LB,
                                    BLOCK_A=triton.next_power_of_2(LA),
                                    BLOCK_B=triton.next_power_of_2(LB))
    return y
