"""SiLU(gate) * up for a prefill's rows, the two elementwise passes of HF's MLP in one:

    y[m, n] = (SiLU(g[m, n]) rounded to y's dtype) * u[m, n], rounded       g, u, y [M, N]

As torch computes F.silu(g) * u on a GPU: SiLU(x) = x / (1 + exp(-x)) in fp32 (libdevice's
expf, IEEE division), rounded to the 16-bit dtype, then the product in fp32 rounded once,
so the result is bit for bit torch's. Torch's two kernels read g and u and write SiLU(g)
in between (five passes over [M, N]); this reads g and u once and writes y once (three).
LIBDEVICE False (the CPU interpreter, which cannot call libdevice) takes tl.exp.

    grid = (M, cdiv(N, BLOCK_N))
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from lowering.fused.fp8_rounding import div_rn


@triton.jit
def silu_mul_kernel(g_ptr, u_ptr, y_ptr, N, stride_g, stride_u, stride_y,
                    BLOCK_N: tl.constexpr, LIBDEVICE: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)                  # [BLOCK_N]
    ok = cols < N
    g = tl.load(g_ptr + m * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + m * stride_u + cols, mask=ok, other=0.0).to(tl.float32)
    if LIBDEVICE:
        e = libdevice.exp(-g)
    else:
        e = tl.exp(-g)
    dt = y_ptr.dtype.element_ty
    s = div_rn(g, 1.0 + e).to(dt).to(tl.float32)                        # F.silu(g), rounded
    tl.store(y_ptr + m * stride_y + cols, (s * u).to(dt), mask=ok)
