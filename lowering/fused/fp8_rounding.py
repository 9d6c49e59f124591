"""The e4m3 rounding helpers every fp8 quant kernel shares (the quant kernels of this
package, mla_ops/cache/write_kernel.py, q_absorb_kernel.py).

Numerics match the torch reference (mla_ops/quant.py) exactly: x is widened to fp32,
divided by the scale with IEEE round-to-nearest (div_rn, not Triton's approximate '/'),
clamped to +-FP8_MAX and rounded to e4m3 by bit arithmetic (to_e4m3), so the result does
not depend on how the backend casts (the CPU interpreter's fp8 and 16-bit casts do not
carry into the exponent).
"""
from __future__ import annotations

import triton
import triton.language as tl

FP8_MAX = tl.constexpr(448.0)


@triton.jit
def div_rn(x, s):
    return tl.math.div_rn(x, s)


@triton.jit
def to_e4m3(y, dst):
    """Round fp32 y (already clamped to +-448) to the e4m3 grid, ties to even, then cast.

    The cast is then exact, so the result does not depend on how the backend rounds
    (the CPU interpreter's fp8 cast does not carry into the exponent).
    """
    return round_e4m3(y).to(dst.dtype.element_ty)


@triton.jit
def round_e4m3(y):
    """fp32 y (already clamped to +-448) -> the nearest e4m3 value (ties to even), as fp32."""
    a = tl.abs(y)
    bits = a.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576   # keep 3 mantissa bits, RTNE
    normal = bits.to(tl.float32, bitcast=True)
    sub = (a + 16384.0) - 16384.0                              # multiples of 2^-9, RTNE
    r = tl.where(a < 0.015625, sub, normal)
    # copy y's sign bit (a negation would be 0 - r on GPU, losing -0.0)
    sign = y.to(tl.int32, bitcast=True) & -2147483648
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def round16(x, IS_BF16: tl.constexpr):
    """fp32 -> nearest bf16 / fp16 value (ties to even), as fp32, by bit arithmetic.

    Used under the CPU interpreter, whose 16-bit casts do not carry; fp16 subnormals
    and overflow are not handled (attention outputs stay in the normal range).
    """
    bits = x.to(tl.int32, bitcast=True)
    if IS_BF16:
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    else:
        bits = (bits + 0xFFF + ((bits >> 13) & 1)) & -8192
    return bits.to(tl.float32, bitcast=True)
