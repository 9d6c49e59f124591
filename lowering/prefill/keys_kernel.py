"""The prefill keys for the dense attention: each head's up-projected key beside the
token's one RoPE key, in one pass.

    k[t, h] = [k_nope[t, h] | k_pe[t]]        k_nope [T, N * P], k_pe [T, R] -> k [T, N, P + R]

The dense attention takes one key tensor 192 wide (P 128 + R 64 for DeepSeek), so the
shared k_pe is written once per head. torch.cat of k_nope with k_pe expanded over the
heads runs a generic strided copy (~1 TB/s on an H200 at V3's 128 heads); this kernel
reads each k_nope row once and k_pe once per program and stores whole head rows.

    grid = (T, cdiv(N, BLOCK_H)); a program writes BLOCK_H heads of one token.

keys_reference is the same in torch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def prefill_keys_kernel(
    nope_ptr,       # [T, N * P], row stride nope_stride, last dim contiguous
    pe_ptr,         # [T, R], row stride pe_stride, last dim contiguous
    out_ptr,        # [T, N, P + R] contiguous
    N, nope_stride, pe_stride,
    P: tl.constexpr, R: tl.constexpr, BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)       # [BH]
    mh = h < N
    p = tl.arange(0, P)
    r = tl.arange(0, R)
    nope = tl.load(nope_ptr + t * nope_stride + h[:, None] * P + p[None, :],
                   mask=mh[:, None])                              # [BH, P]
    pe = tl.load(pe_ptr + t * pe_stride + r)                      # [R]
    row = out_ptr + (t * N + h[:, None]) * (P + R)                # [BH, 1]
    tl.store(row + p[None, :], nope, mask=mh[:, None])
    tl.store(row + P + r[None, :], tl.broadcast_to(pe[None, :], (BLOCK_H, R)),
             mask=mh[:, None])


def prefill_keys(k_nope: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """k_nope [T, N, P] (heads contiguous per token), k_pe [T, R] -> k [T, N, P + R].
    P and R powers of two (DeepSeek's 128 and 64)."""
    T, N, P = k_nope.shape
    R = k_pe.shape[-1]
    out = torch.empty(T, N, P + R, dtype=k_nope.dtype, device=k_nope.device)
    if T == 0:
        return out
    BLOCK_H = min(8, triton.next_power_of_2(N))
    prefill_keys_kernel[(T, triton.cdiv(N, BLOCK_H))](
        k_nope, k_pe, out, N, k_nope.stride(0), k_pe.stride(0), P=P, R=R, BLOCK_H=BLOCK_H,
        num_warps=4)
    return out


def keys_unmet(k_nope: torch.Tensor, k_pe: torch.Tensor) -> str | None:
    """None when prefill_keys serves (k_nope, k_pe), else why keys_reference runs."""
    T, N, P = k_nope.shape
    R = k_pe.shape[-1]
    if k_nope.stride(2) != 1 or k_nope.stride(1) != P:
        return "k_nope's heads must be contiguous per token"
    if k_pe.dim() != 2 or k_pe.stride(-1) != 1:
        return "k_pe must be [T, R] with its last dim contiguous"
    if k_pe.dtype != k_nope.dtype:
        return f"k_pe is {k_pe.dtype}, k_nope {k_nope.dtype}"
    if P & (P - 1) or R & (R - 1):
        return f"P = {P} and R = {R} must be powers of two"
    return None


def keys_reference(k_nope: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """The same in torch: k_nope [..., N, P], k_pe [..., R] -> k [..., N, P + R]."""
    return torch.cat([k_nope, k_pe.unsqueeze(-2).expand(*k_nope.shape[:-1], k_pe.shape[-1])], -1)
