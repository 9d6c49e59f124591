"""Launcher of the fp8-cache stage-1 kernel (triton_fp8_cache_kernel.py).

triton_decode.triton_decode sizes the splits, allocates the outputs and merges; this
launches stage 1 where the config table names the kernel "fp8_cache" (the fp8 cache
at few query rows, the memory-bound shapes). Host logic from shapes only.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton

from lowering.decode.triton_fp8_cache_kernel import mla_decode_fp8_cache_kernel

# The kernel cuts the L value columns into four chunks that are MMA operands (>= 16 wide).
MIN_L = 64


def fp8_cache_unmet(kv_kind: int, head_dim_v: int) -> Optional[str]:
    """None if the fp8-cache kernel serves this call, else why not (the launcher then
    runs the general stage-1 kernel)."""
    if kv_kind == 0:
        return "the cache is not fp8"
    if head_dim_v < MIN_L:
        return f"head_dim_v (L) {head_dim_v} < {MIN_L}: its L / 4 chunks are MMA operands"
    return None


def fp8_cache_block_m(cfg: dict) -> int:
    """Query rows per program of the fp8-cache kernel (16 unless the config names more)."""
    return cfg.get("BLOCK_M", 16)


def launch_fp8_cache_stage1(q, kv_cache, block_table, cache_seqlens, q_scale, k_scale, o1, l1,
                            softmax_scale: float, causal: bool, head_dim_v: int, splits: int,
                            fixed_chunk: int, cfg: dict, on_gpu: bool) -> None:
    """Stage 1 into (o1, l1): the final (out [B, s_q, H, L], lse [B, H, s_q]) with one
    split, else the fp32 partials [B, splits, s_q * H, L] / [B, splits, s_q * H].
    q [B, s_q, H, L + R] contiguous (bf16/fp16, or fp8 with q_scale [1]); kv_cache fp8
    [num_blocks, page, L + R]; k_scale [1] fp32."""
    B, s_q, H, D = q.shape
    page = kv_cache.shape[1]
    block_m = fp8_cache_block_m(cfg)
    m_blocks = triton.cdiv(s_q * H, block_m)
    dummy = cache_seqlens  # stands in for an absent q_scale (never read)
    torch.library.wrap_triton(mla_decode_fp8_cache_kernel)[(m_blocks, B, splits)](
        q, kv_cache, block_table, cache_seqlens,
        q_scale if q_scale is not None else dummy, k_scale,
        o1, l1, softmax_scale, q.stride(0), block_table.stride(0), block_table.shape[1],
        kv_cache.shape[0],
        S_Q=s_q, H=H, L=head_dim_v, R=D - head_dim_v, PAGE=page, CAUSAL=causal,
        num_splits=splits, DIRECT=splits == 1, FIXED_CHUNK=fixed_chunk,
        FP8_Q=q_scale is not None, BLOCK_M=block_m, BLOCK_N=cfg["BLOCK_N"],
        RELOAD_V=cfg.get("RELOAD_V", False), DOT_F32=not on_gpu,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
