"""The W_UV GEMM with an fp8 quant epilogue (mla_ops/attention.py's decode_output): the
absorbed output o = a [t, N, L] @ W_UV [N, L, V], rounded to the 16-bit dtype as the unfused
graph would, then quantized per tensor (static scale) or per group of the output row
(scales amax / 448), written as fp8 [t, N*V] (+ scales [t, N*V / group]).

    grid = (cdiv(t, BLOCK_T), N)
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from lowering.fused.fp8_rounding import FP8_MAX, div_rn, round16, to_e4m3

# rows <= 16 -> (BLOCK_L, num_warps, num_stages) of the launch (BLOCK_L falls back to the
# largest of 64, 32, 16 dividing L where it does not divide L). The fastest at V3's 128
# heads on an H100 (docs/notes/probe_wuv_quant.py --sweep, group 128): 11.6 µs at 1 row
# and 11.8 at 4 (4 warps, 3 stages: 12.7 / 12.8), 13.2 at 32 (13.4); the head GEMM and
# the act-quant launch it replaces take 11.2 / 11.8 / 15.8.
CONFIGS = {True: (64, 8, 4), False: (64, 8, 3)}


@triton.jit
def wuv_quant_kernel(a_ptr, w_ptr, y_ptr, s_ptr, scale_ptr, T, N,
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
        x = round16(acc, a_ptr.dtype.element_ty == tl.bfloat16)
    else:
        x = acc.to(a_ptr.dtype.element_ty).to(tl.float32)
    out = y_ptr + rows[:, None] * (N * V) + n * V + cols[None, :]
    if STATIC:
        s = tl.load(scale_ptr)
        y = tl.clamp(div_rn(x, s + tl.zeros_like(x)), -FP8_MAX, FP8_MAX)
        tl.store(out, to_e4m3(y, y_ptr), mask=rmask[:, None])
    else:
        xg = tl.reshape(x, (BLOCK_T, V // GROUP, GROUP))
        amax = tl.max(tl.abs(xg), axis=2)                                # [BLOCK_T, V/G]
        sg = div_rn(tl.maximum(amax, 1e-10), tl.zeros_like(amax) + FP8_MAX)
        y = tl.clamp(div_rn(xg, sg[:, :, None] + tl.zeros_like(xg)), -FP8_MAX, FP8_MAX)
        y = tl.reshape(y, (BLOCK_T, V))
        tl.store(out, to_e4m3(y, y_ptr), mask=rmask[:, None])
        gi = tl.arange(0, V // GROUP)
        G = N * V // GROUP
        tl.store(s_ptr + rows[:, None] * G + n * (V // GROUP) + gi[None, :], sg,
                 mask=rmask[:, None])


def wuv_quant_unmet(a: torch.Tensor, W_UV: torch.Tensor, group_size) -> str | None:
    """None when the fused W_UV GEMM + quant kernel serves these shapes, else the unmet
    condition."""
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
              out=None, block_scale=None, config=None):
    """a [t, N, L] (any strides, unit last), W_UV [N, L, V] -> fp8 [t, N*V] (+ [t, N*V/g]).

    static (scale given): fp8(o / scale); per-group: scales amax/448 of each group of
    the 16-bit output o = a @ W_UV, written with the fp8 values from the GEMM's epilogue.
    config: (BLOCK_L, num_warps, num_stages), by default CONFIGS' for t.
    """
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
        BLOCK_L, warps, stages = config or CONFIGS[t <= 16]
        if L % BLOCK_L:
            BLOCK_L = 64 if L % 64 == 0 else (32 if L % 32 == 0 else 16)
        dummy = y
        wuv_quant_kernel[(triton.cdiv(t, BLOCK_T), N)](
            a, W, y, s if s is not None else dummy, scale.reshape(1) if static else dummy,
            t, N, a.stride(0), a.stride(1), W.stride(0), W.stride(1), L=L, V=V, GROUP=g,
            STATIC=static, BLOCK_T=BLOCK_T, BLOCK_L=BLOCK_L,
            F32_DOT=os.environ.get("TRITON_INTERPRET") == "1", num_warps=warps,
            num_stages=stages)
    return y, s
