"""Triton kernels for the FP8 quant ops (static per-tensor, dynamic per-token-group, fused
concat + static quant). Each has a torch twin in passes/quant.py; tests compare them
bit for bit (TRITON_INTERPRET=1 on CPU).

Numerics match the torch reference exactly: x is widened to fp32, divided by the scale
with IEEE round-to-nearest (div_rn, not Triton's approximate '/'), clamped to +-448 and
rounded to e4m3. Power-of-two scales round the fp32 scale up by integer bit arithmetic
(exact, unlike exp2(ceil(log2(s)))), which equals the reference for normal numbers.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0


@triton.jit
def _div_rn(x, s):
    return tl.math.div_rn(x, s)


@triton.jit
def _to_e4m3(y, dst):
    """Round fp32 y (already clamped to +-448) to the e4m3 grid, ties to even, then cast.

    The cast is then exact, so the result does not depend on how the backend rounds
    (the CPU interpreter's fp8 cast does not carry into the exponent).
    """
    a = tl.abs(y)
    bits = a.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576   # keep 3 mantissa bits, RTNE
    normal = bits.to(tl.float32, bitcast=True)
    sub = (a + 16384.0) - 16384.0                              # multiples of 2^-9, RTNE
    r = tl.where(a < 0.015625, sub, normal)
    r = tl.where(y.to(tl.int32, bitcast=True) < 0, -r, r)      # keeps -0.0
    return r.to(dst.dtype.element_ty)


@triton.jit
def _static_quant_kernel(x_ptr, y_ptr, scale_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    s = tl.load(scale_ptr)
    x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
    y = tl.clamp(_div_rn(x, s + tl.zeros_like(x)), -FP8_MAX, FP8_MAX)
    tl.store(y_ptr + offs, _to_e4m3(y, y_ptr), mask=m)


@triton.jit
def _group_quant_kernel(x_ptr, y_ptr, s_ptr, C, stride_x, GROUP: tl.constexpr,
                        POW2: tl.constexpr):
    row = tl.program_id(0)
    grp = tl.program_id(1)
    cols = grp * GROUP + tl.arange(0, GROUP)
    x = tl.load(x_ptr + row * stride_x + cols).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=0)
    s = _div_rn(tl.maximum(amax, 1e-10), FP8_MAX)
    if POW2:
        bits = s.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFFFF) & 0x7F800000          # next power of two >= s
        s = bits.to(tl.float32, bitcast=True)
    y = tl.clamp(_div_rn(x, s + tl.zeros_like(x)), -FP8_MAX, FP8_MAX)
    tl.store(y_ptr + row * C + cols, _to_e4m3(y, y_ptr))
    tl.store(s_ptr + row * (C // GROUP) + grp, s)


@triton.jit
def _concat_quant_kernel(a_ptr, b_ptr, y_ptr, scale_ptr, H,
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
    a = tl.clamp(_div_rn(a, s + tl.zeros_like(a)), -FP8_MAX, FP8_MAX)
    tl.store(out + ca, _to_e4m3(a, y_ptr), mask=ma)
    cb = tl.arange(0, BLOCK_B)
    mb = cb < LB
    b = tl.load(b_ptr + t * sb_t + h * sb_h + cb, mask=mb, other=0.0).to(tl.float32)
    b = tl.clamp(_div_rn(b, s + tl.zeros_like(b)), -FP8_MAX, FP8_MAX)
    tl.store(out + LA + cb, _to_e4m3(b, y_ptr), mask=mb)


def static_quant(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp8(x / scale) for any shape; scale one-element fp32."""
    xc = x.contiguous()
    y = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    n = xc.numel()
    if n:
        BLOCK = 1024
        _static_quant_kernel[(triton.cdiv(n, BLOCK),)](xc, y, scale.reshape(1), n, BLOCK=BLOCK)
    return y


def group_quant(x: torch.Tensor, group_size: int, pow2: bool):
    """x [T, C] -> (fp8 [T, C], scales [T, C // group_size] fp32)."""
    T, C = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty((T, C), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((T, C // group_size), dtype=torch.float32, device=x.device)
    if T:
        _group_quant_kernel[(T, C // group_size)](x, y, s, C, x.stride(0), GROUP=group_size,
                                                  POW2=bool(pow2))
    return y, s


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
        _concat_quant_kernel[(t, H)](a, b, y, scale.reshape(1), H, a.stride(0), a.stride(1),
                                     b.stride(0), b.stride(1), LA=LA, LB=LB,
                                     BLOCK_A=triton.next_power_of_2(LA),
                                     BLOCK_B=triton.next_power_of_2(LB))
    return y
