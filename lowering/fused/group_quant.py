"""mla::quant_fp8_group's Triton kernel and launcher: dynamic per-token-group fp8,
x [T, C] -> (fp8 [T, C], scales [T, C // group_size] fp32), scale = amax(|group|) / 448,
rounded up to a power of two by integer bit arithmetic when pow2 (exact, unlike
exp2(ceil(log2(s))); equal to the reference for normal numbers).

    grid = (T, C // GROUP)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowering.fused.fp8_rounding import FP8_MAX, div_rn, to_e4m3


@triton.jit
def group_quant_kernel(x_ptr, y_ptr, s_ptr, C, stride_x, GROUP: tl.constexpr,
                       POW2: tl.constexpr):
    row = tl.program_id(0)
    grp = tl.program_id(1)
    cols = grp * GROUP + tl.arange(0, GROUP)
    x = tl.load(x_ptr + row * stride_x + cols).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=0)
    amax = tl.maximum(amax, 1e-10)
    s = div_rn(amax, amax * 0.0 + FP8_MAX)
    if POW2:
        bits = s.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFFFF) & 0x7F800000          # next power of two >= s
        s = bits.to(tl.float32, bitcast=True)
    y = tl.clamp(div_rn(x, s + tl.zeros_like(x)), -FP8_MAX, FP8_MAX)
    tl.store(y_ptr + row * C + cols, to_e4m3(y, y_ptr))
    tl.store(s_ptr + row * (C // GROUP) + grp, s)


def group_quant(x: torch.Tensor, group_size: int, pow2: bool):
    """x [T, C] -> (fp8 [T, C], scales [T, C // group_size] fp32)."""
    T, C = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty((T, C), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((T, C // group_size), dtype=torch.float32, device=x.device)
    if T:
        group_quant_kernel[(T, C // group_size)](x, y, s, C, x.stride(0), GROUP=group_size,
                                                 POW2=bool(pow2))
    return y, s
