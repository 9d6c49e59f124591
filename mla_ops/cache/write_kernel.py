"""Write this step's latent rows into the paged cache: one program per token.

    kv_cache[slot_mapping[t]] = [kv_c_normed[t] | k_pe[t]]        (L + R wide)

A token whose slot is -1 (padding) or outside the cache is skipped, so one launch
with a fixed grid serves CUDA-graph replays whatever the slots are, and a bad slot
can never write outside the cache. With an fp8 cache the row is quantized on the
way: fp8(x / k_scale), saturated to +-448, rounded as mla_ops.quant does (the rounding
helpers are shared with the quant kernels, so the bytes equal the torch path's).

This replaces concat + quant + a sync-free scatter (eight or more small kernels
under graph capture) with one kernel.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowering.fused.fp8_rounding import FP8_MAX, div_rn, to_e4m3


@triton.jit
def cache_write_kernel(
    kv_c_ptr,        # [T, L] rows, stride stride_c
    k_pe_ptr,        # [T, R] rows, stride stride_pe
    cache_ptr,       # [num_slots, L + R] contiguous
    slot_ptr,        # [T] int64
    k_scale_ptr,     # [1] fp32 (read when QUANT)
    num_slots,
    stride_c, stride_pe,
    L: tl.constexpr, R: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
    QUANT: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if (slot >= 0) & (slot < num_slots):
        offs_l = tl.arange(0, BLOCK_L)
        offs_r = tl.arange(0, BLOCK_R)
        c = tl.load(kv_c_ptr + t.to(tl.int64) * stride_c + offs_l, mask=offs_l < L)     # [BLOCK_L]
        pe = tl.load(k_pe_ptr + t.to(tl.int64) * stride_pe + offs_r, mask=offs_r < R)  # [BLOCK_R]
        dst = cache_ptr + slot * (L + R)
        if QUANT:
            s = tl.load(k_scale_ptr)
            c = tl.clamp(div_rn(c.to(tl.float32), s + tl.zeros_like(c.to(tl.float32))),
                         -FP8_MAX, FP8_MAX)
            pe = tl.clamp(div_rn(pe.to(tl.float32), s + tl.zeros_like(pe.to(tl.float32))),
                          -FP8_MAX, FP8_MAX)
            tl.store(dst + offs_l, to_e4m3(c, cache_ptr), mask=offs_l < L)
            tl.store(dst + L + offs_r, to_e4m3(pe, cache_ptr), mask=offs_r < R)
        else:
            tl.store(dst + offs_l, c.to(cache_ptr.dtype.element_ty), mask=offs_l < L)
            tl.store(dst + L + offs_r, pe.to(cache_ptr.dtype.element_ty), mask=offs_r < R)


def write_cache_rows(kv_c_normed: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                     slot_mapping: torch.Tensor, k_scale: torch.Tensor | None) -> None:
    """Launcher (arguments validated by mla::kv_cache_update).

    kv_c_normed [T, L], k_pe [T, R] (last dim contiguous), kv_cache [blocks, page, L + R]
    contiguous, slot_mapping [T] int64, k_scale [1] fp32 for an fp8 cache else None.
    """
    T, L = kv_c_normed.shape
    R = k_pe.shape[-1]
    if T == 0:
        return
    if kv_c_normed.stride(-1) != 1:
        kv_c_normed = kv_c_normed.contiguous()
    if k_pe.stride(-1) != 1:
        k_pe = k_pe.contiguous()
    flat = kv_cache.view(-1, L + R)
    quant = kv_cache.dtype == torch.float8_e4m3fn
    cache_write_kernel[(T,)](
        kv_c_normed, k_pe, flat, slot_mapping,
        k_scale if quant else slot_mapping, flat.shape[0],
        kv_c_normed.stride(0), k_pe.stride(0),
        L=L, R=R, BLOCK_L=triton.next_power_of_2(L), BLOCK_R=triton.next_power_of_2(R),
        QUANT=quant, num_warps=4)
