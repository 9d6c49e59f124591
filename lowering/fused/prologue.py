"""The attention prologue of a decode step as graph ops, after the GEMM's split-K partials.
DeepSeek-V3 (after q_a + kv_a):

    mla::decode_qkv_prologue(part [S, *lead, NQ + L + R] fp32, w_q [NQ], w_kv [L],
                             cos, sin, eps_q, eps_kv, rope)
        -> (q_out [*lead, NQ], kv_row [*lead, L + R])   in w_q's dtype

    rope as q_rope.py's ROPES: 0 / 1 (a bool interleave) with HF's rows cos / sin
    [*lead, R]; 2 (DeepSeek-V2 with q_lora) with its freqs_cis parts [*lead, R / 2], fp32

    q_out  = RMSNorm(sum(part)[..., :NQ]) * w_q                            (q_a_layernorm)
    kv_row = [RMSNorm(sum(part)[..., NQ:NQ+L]) * w_kv | RoPE(sum(part)[..., NQ+L:])]

    mla::decode_qkv_prologue_fp8(part, w_q, w_kv, cos, sin, eps_q, eps_kv, rope, group_k)
        -> (q_out, kv_row, q_q [*lead, NQ] e4m3, q_s [*lead, cdiv(NQ, group_k)] fp32)
    the same, and q_out quantized per group_k columns as the fp8 decode GEMMs quantize their
    activations (lowering/gemm/fp8_linear.py's quantize_rows_torch), in the same launch: for
    an FP8 checkpoint's q_b_proj, whose GEMM then reads them

DeepSeek-V2 without q_lora (after q_proj + kv_a; RoPE on the complex pairs of V2's
freqs_cis, whose real and imaginary parts are cos / sin):

    mla::decode_q_kv_rope(part [S, *lead, NQ + L + R] fp32, w_kv [L], cos [*lead, R / 2],
                          sin [*lead, R / 2], eps_kv, num_heads)
        -> (q [*lead, NH, NQ / NH], kv_row [*lead, L + R])   in w_kv's dtype

    q      = sum(part)[..., :NQ] as NH heads, each with RoPE on its last R columns
    kv_row = [RMSNorm(sum(part)[..., NQ:NQ+L]) * w_kv | RoPE(sum(part)[..., NQ+L:])]

part is the GEMM's fp32 split-K partials (a decode step's rows), or its one output in the
weights' dtype ([1, *lead, ...]: a prefill's rows after cuBLAS, which HF's modules round
the same way). On CUDA one Triton launch each, one program per token (roundings in
prologue_kernel.py); elsewhere HF's own steps in torch ops, bit for bit what its modules
and RoPE functions compute. Defined with torch.library.triton_op, so Inductor sees the kernel in the graph.
The query's RoPE after q_b is q_rope.py's op; q_b, RoPE and absorption in one launch
q_absorb.py's.
"""
from __future__ import annotations

import torch
import triton

from lowering.fused.decode_rows import angle_rows, check_angles, row_kernels_unmet
from lowering.fused.norm import rms_norm_torch
from lowering.fused.prologue_kernel import qkv_prologue_kernel
from lowering.fused.q_rope import ROPES, q_rope_any, rope_complex_torch, rope_torch
from lowering.gemm.fp8_act_quant import check_producer_group, quantize_rows_torch


def _check_part(part, cos, sin, dtype):
    check_angles(cos, sin)
    one = part.dim() >= 2 and part.shape[0] == 1 and part.dtype == dtype
    if part.dim() < 2 or not (part.dtype == torch.float32 or one):
        raise TypeError(f"part must be fp32 [split, *lead, NQ + L + R] partial sums, or one "
                        f"[1, *lead, NQ + L + R] GEMM output in the weights' dtype {dtype}; "
                        f"got {part.dtype} {tuple(part.shape)}")


def _check_rows(part, cos, sin, width):
    want = (*part.shape[1:-1], width)
    for name, c in (("cos", cos), ("sin", sin)):
        if tuple(c.shape) != want or c.device != part.device:
            raise ValueError(f"{name} must be {want} on {part.device} (one row per token), got "
                             f"{tuple(c.shape)} on {c.device}")


def _check(part, w_q, w_kv, cos, sin, rope):
    _check_part(part, cos, sin, w_q.dtype)
    for name, w in (("w_q", w_q), ("w_kv", w_kv)):
        if w.dim() != 1 or w.dtype != w_q.dtype or w.device != part.device:
            raise ValueError(f"{name} must be 1-D, of w_q's dtype, on {part.device}; got "
                             f"{w.dtype} {tuple(w.shape)} on {w.device}")
    NQ, L = w_q.shape[0], w_kv.shape[0]
    R = part.shape[-1] - NQ - L
    if R <= 0 or R % 2:
        raise ValueError(f"part's last dim {part.shape[-1]} must be NQ={NQ} + L={L} + an even R")
    if rope not in ROPES:
        raise ValueError(f"rope must be one of {ROPES}, got {rope!r}")
    _check_rows(part, cos, sin, R // 2 if rope == 2 else R)
    return NQ, L, R


HEADS = 16          # V2 query heads per program of the prologue kernel


def launch(part, w_q, w_kv, cos, sin, eps_q, eps_kv, rope, q_out, kv_out, quant=None,
           group_k: int = 0):
    """Run qkv_prologue_kernel with q_a's norm: part [S, T, NQ + L + R] fp32 contiguous,
    cos / sin [T, R] ([T, R / 2] with rope 2; both of the same strides), q_out [T, NQ],
    kv_out [T, L + R] contiguous; with quant = (q_q [T, NQ] e4m3, q_s [T, cdiv(NQ,
    group_k)] fp32) q_out also quantized per group_k columns."""
    S, T, _ = part.shape
    NQ, L = w_q.shape[0], w_kv.shape[0]
    R = part.shape[-1] - NQ - L
    qq, qs = quant if quant is not None else (q_out, q_out)
    kernel = torch.library.wrap_triton(qkv_prologue_kernel)
    kernel[(T, 2)](
        part, w_q, w_kv, cos, sin, q_out, kv_out, qq, qs,
        part.stride(0), cos.stride(0), cos.stride(1), eps_q, eps_kv,
        SPLIT=S, NQ=NQ, L=L, R=R, BLOCK_Q=triton.next_power_of_2(max(NQ, group_k)),
        BLOCK_L=triton.next_power_of_2(L), BLOCK_H=triton.next_power_of_2(R // 2),
        ROPE=int(rope), Q_ROPE=False, NH=1, HEADS=1, BLOCK_P=1,
        QUANT_K=group_k if quant is not None else 0, QG=qs.shape[-1] if quant is not None else 1,
        NATIVE_CAST=part.is_cuda, num_warps=4)


def launch_v2(part, w_kv, cos, sin, eps_kv, num_heads, q_out, kv_out):
    """Run qkv_prologue_kernel for V2: part [S, T, NQ + L + R] fp32 contiguous, cos / sin
    [T, >= R / 2] (both of the same strides), q_out [T, NQ], kv_out [T, L + R] contiguous."""
    S, T, W = part.shape
    NQ, L = q_out.shape[-1], w_kv.shape[0]
    R = W - NQ - L
    heads = min(HEADS, triton.next_power_of_2(num_heads))
    kernel = torch.library.wrap_triton(qkv_prologue_kernel)
    kernel[(T, 1 + triton.cdiv(num_heads, heads))](
        part, w_kv, w_kv, cos, sin, q_out, kv_out, q_out, q_out,
        part.stride(0), cos.stride(0), cos.stride(1), 0.0, eps_kv,
        SPLIT=S, NQ=NQ, L=L, R=R, BLOCK_Q=1, BLOCK_L=triton.next_power_of_2(L),
        BLOCK_H=triton.next_power_of_2(R // 2), ROPE=2, Q_ROPE=True, NH=num_heads,
        HEADS=heads, BLOCK_P=triton.next_power_of_2(NQ // num_heads - R), QUANT_K=0, QG=1,
        NATIVE_CAST=part.is_cuda, num_warps=4)


def _prologue(part, w_q, w_kv, cos, sin, eps_q, eps_kv, rope, group_k: int = 0):
    """Both ops' body: (q_out, kv_row[, q_q, q_s]) (the quantized q_a where group_k > 0)."""
    NQ, L, R = _check(part, w_q, w_kv, cos, sin, rope)
    lead = part.shape[1:-1]
    if part.numel() == 0 or row_kernels_unmet(part.device, w_q.dtype) is not None:
        x = part.sum(0).to(w_q.dtype)                                     # [*lead, NQ+L+R]
        q, kv, k = x.split([NQ, L, R], dim=-1)
        k = (rope_complex_torch(k, cos, sin) if rope == 2
             else rope_torch(k, cos.to(x.dtype), sin.to(x.dtype), bool(rope)))
        kv_row = torch.cat([rms_norm_torch(kv, w_kv, eps_kv), k], dim=-1)
        q = rms_norm_torch(q, w_q, eps_q)
        return (q, kv_row, *quantize_rows_torch(q, group_k)) if group_k else (q, kv_row)
    p = part.reshape(part.shape[0], -1, part.shape[-1]).contiguous()      # [S, T, NQ+L+R]
    T = p.shape[1]
    c, s = angle_rows(cos, sin, T, torch.float32 if rope == 2 else w_q.dtype, strided=True)
    q_out = torch.empty((T, NQ), dtype=w_q.dtype, device=part.device)
    kv_out = torch.empty((T, L + R), dtype=w_q.dtype, device=part.device)
    quant = None
    if group_k:
        quant = (torch.empty((T, NQ), dtype=torch.float8_e4m3fn, device=part.device),
                 torch.empty((T, triton.cdiv(NQ, group_k)), dtype=torch.float32,
                             device=part.device))                       # [T, NQ], [T, G]
    launch(p, w_q, w_kv, c, s, float(eps_q), float(eps_kv), int(rope), q_out, kv_out, quant,
           group_k)
    out = (q_out.view(*lead, NQ), kv_out.view(*lead, L + R))
    if quant is None:
        return out
    return (*out, quant[0].view(*lead, NQ), quant[1].view(*lead, -1))


@torch.library.triton_op("mla::decode_qkv_prologue", mutates_args={})
def decode_qkv_prologue(part: torch.Tensor, w_q: torch.Tensor, w_kv: torch.Tensor,
                        cos: torch.Tensor, sin: torch.Tensor, eps_q: float, eps_kv: float,
                        rope: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _prologue(part, w_q, w_kv, cos, sin, eps_q, eps_kv, rope)


@torch.library.triton_op("mla::decode_qkv_prologue_fp8", mutates_args={})
def decode_qkv_prologue_fp8(part: torch.Tensor, w_q: torch.Tensor, w_kv: torch.Tensor,
                            cos: torch.Tensor, sin: torch.Tensor, eps_q: float, eps_kv: float,
                            rope: int, group_k: int) -> tuple[torch.Tensor, torch.Tensor,
                                                              torch.Tensor, torch.Tensor]:
    check_producer_group(group_k)
    return _prologue(part, w_q, w_kv, cos, sin, eps_q, eps_kv, rope, group_k)


def _check_v2(part, w_kv, cos, sin, num_heads):
    _check_part(part, cos, sin, w_kv.dtype)
    if w_kv.dim() != 1 or w_kv.device != part.device or not w_kv.is_floating_point():
        raise ValueError(f"w_kv must be a 1-D floating tensor on {part.device}, got "
                         f"{w_kv.dtype} {tuple(w_kv.shape)} on {w_kv.device}")
    H = cos.shape[-1] if cos.dim() else 0
    L, R = w_kv.shape[0], 2 * H
    NQ = part.shape[-1] - L - R
    if not isinstance(num_heads, int) or num_heads < 1 or H < 1 or NQ <= 0 \
            or NQ % num_heads or NQ // num_heads <= R:
        raise ValueError(f"part's last dim {part.shape[-1]} must be num_heads={num_heads} "
                         f"heads of P + R columns (R = 2 x cos's last dim {H}, P > 0) + L={L}"
                         f" + R")
    _check_rows(part, cos, sin, H)
    return NQ, L, R


@torch.library.triton_op("mla::decode_q_kv_rope", mutates_args={})
def decode_q_kv_rope(part: torch.Tensor, w_kv: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, eps_kv: float,
                     num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    NQ, L, R = _check_v2(part, w_kv, cos, sin, num_heads)
    lead, dt = part.shape[1:-1], w_kv.dtype
    T = part[0].numel() // part.shape[-1]
    if T == 0 or row_kernels_unmet(part.device, dt) is not None:
        x = part.sum(0).to(dt)                                            # [*lead, NQ+L+R]
        q, kv, k = x.split([NQ, L, R], dim=-1)
        q = q_rope_any(q.reshape(*lead, num_heads, NQ // num_heads), cos, sin, 2)
        kv_row = torch.cat([rms_norm_torch(kv, w_kv, eps_kv), rope_complex_torch(k, cos, sin)],
                           dim=-1)
        return q, kv_row
    p = part.reshape(part.shape[0], -1, part.shape[-1]).contiguous()      # [S, T, NQ+L+R]
    c, s = angle_rows(cos, sin, T, torch.float32, strided=True)            # fp32, as V2's
    q_out = torch.empty((T, NQ), dtype=dt, device=part.device)
    kv_out = torch.empty((T, L + R), dtype=dt, device=part.device)
    launch_v2(p, w_kv, c, s, float(eps_kv), num_heads, q_out, kv_out)
    return q_out.view(*lead, num_heads, NQ // num_heads), kv_out.view(*lead, L + R)
