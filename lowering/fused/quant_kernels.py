"""Triton kernels for the FP8 quant ops (static per-tensor, dynamic per-token-group, fused
concat + static quant). Each has a torch twin in mla_ops/quant_ops.py; tests compare them
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

FP8_MAX = tl.constexpr(448.0)


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
    # copy y's sign bit (a negation would be 0 - r on GPU, losing -0.0)
    sign = y.to(tl.int32, bitcast=True) & -2147483648
    r = (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
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
    amax = tl.maximum(amax, 1e-10)
    s = _div_rn(amax, amax * 0.0 + FP8_MAX)
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


# ------------------------------------------------------------ W_UV GEMM + quant epilogue

@triton.jit
def _round16(x, IS_BF16: tl.constexpr):
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


@triton.jit
def _wuv_quant_kernel(a_ptr, w_ptr, y_ptr, s_ptr, scale_ptr, T, N,
                      sa_t, sa_n, sw_n, sw_l,
                      L: tl.constexpr, V: tl.constexpr, GROUP: tl.constexpr,
                      STATIC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_L: tl.constexpr,
                      F32_DOT: tl.constexpr):
    # one program: BLOCK_T tokens x one head; out[t, n*V:(n+1)*V] = a[t, n, :] @ W_UV[n]
    pid_t = tl.program_id(0)
    n = tl.program_id(1)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < T
    cols = tl.arange(0, V)
    acc = tl.zeros((BLOCK_T, V), dtype=tl.float32)
    for l0 in range(0, L, BLOCK_L):
        ls = l0 + tl.arange(0, BLOCK_L)
        a = tl.load(a_ptr + rows[:, None] * sa_t + n * sa_n + ls[None, :], mask=rmask[:, None],
                    other=0.0)
        w = tl.load(w_ptr + n * sw_n + ls[:, None] * sw_l + cols[None, :])
        if F32_DOT:      # the CPU interpreter's 16-bit dots are unreliable
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    # the unfused graph quantizes the 16-bit attention output: round to it first
    if F32_DOT:
        x = _round16(acc, a_ptr.dtype.element_ty == tl.bfloat16)
    else:
        x = acc.to(a_ptr.dtype.element_ty).to(tl.float32)
    out = y_ptr + rows[:, None] * (N * V) + n * V + cols[None, :]
    if STATIC:
        s = tl.load(scale_ptr)
        y = tl.clamp(_div_rn(x, s + tl.zeros_like(x)), -FP8_MAX, FP8_MAX)
        tl.store(out, _to_e4m3(y, y_ptr), mask=rmask[:, None])
    else:
        xg = tl.reshape(x, (BLOCK_T, V // GROUP, GROUP))
        amax = tl.max(tl.abs(xg), axis=2)                                # [BLOCK_T, V/G]
        sg = _div_rn(tl.maximum(amax, 1e-10), tl.zeros_like(amax) + FP8_MAX)
        y = tl.clamp(_div_rn(xg, sg[:, :, None] + tl.zeros_like(xg)), -FP8_MAX, FP8_MAX)
        y = tl.reshape(y, (BLOCK_T, V))
        tl.store(out, _to_e4m3(y, y_ptr), mask=rmask[:, None])
        gi = tl.arange(0, V // GROUP)
        G = N * V // GROUP
        tl.store(s_ptr + rows[:, None] * G + n * (V // GROUP) + gi[None, :], sg,
                 mask=rmask[:, None])


def wuv_quant_supported(a: torch.Tensor, W_UV: torch.Tensor, group_size) -> str | None:
    """None when the fused W_UV GEMM + quant kernel serves these shapes, else why not."""
    N, L, V = W_UV.shape
    if a.dtype not in (torch.bfloat16, torch.float16) or W_UV.dtype != a.dtype:
        return f"needs bf16/fp16 operands, got {a.dtype} and {W_UV.dtype}"
    if V & (V - 1) or V < 16 or V > 256:
        return f"v_head_dim {V} must be a power of two in [16, 256]"
    if L % 16:
        return f"kv_lora_rank {L} must be a multiple of 16"
    if group_size is not None and (V % group_size or group_size & (group_size - 1)):
        return f"group {group_size} must be a power of two dividing v_head_dim {V}"
    return None


def wuv_quant(a: torch.Tensor, W_UV: torch.Tensor, *, scale=None, group_size=None,
              out=None, block_scale=None):
    """a [t, N, L] (any strides, unit last), W_UV [N, L, V] -> fp8 [t, N*V] (+ [t, N*V/g]).

    static (scale given): fp8(o / scale); per-group: scales amax/448 of each group of
    the 16-bit output o = a @ W_UV, written with the fp8 values from the GEMM's epilogue.
    """
    import os
    t, N, L = a.shape
    V = W_UV.shape[-1]
    if a.stride(-1) != 1:
        a = a.contiguous()
    W = W_UV if W_UV.stride(-1) == 1 else W_UV.contiguous()
    y = out if out is not None else torch.empty((t, N * V), dtype=torch.float8_e4m3fn,
                                                 device=a.device)
    static = scale is not None
    g = V if static else group_size
    s = None
    if not static:
        s = block_scale if block_scale is not None else torch.empty(
            (t, N * V // g), dtype=torch.float32, device=a.device)
    if t:
        BLOCK_T = 16 if t <= 16 else 32
        BLOCK_L = 64 if L % 64 == 0 else (32 if L % 32 == 0 else 16)
        dummy = y
        _wuv_quant_kernel[(triton.cdiv(t, BLOCK_T), N)](
            a, W, y, s if s is not None else dummy, scale.reshape(1) if static else dummy,
            t, N, a.stride(0), a.stride(1), W.stride(0), W.stride(1), L=L, V=V, GROUP=g,
            STATIC=static, BLOCK_T=BLOCK_T, BLOCK_L=BLOCK_L,
            F32_DOT=os.environ.get("TRITON_INTERPRET") == "1")
    return y, s
