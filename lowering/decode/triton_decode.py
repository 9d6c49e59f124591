"""Launcher for the Triton MLA decode kernels, as the custom op mla::triton_decode.

The op is defined with torch.library.triton_op and launches through wrap_triton, so
torch.compile/Inductor sees the kernels (they appear in its generated code) and the
whole call can be captured in a CUDA graph. All host logic here uses shapes only:
no device->host copies, so the grid is fixed for a given shape and graph replays
with changing lengths stay correct (each request's split size is derived from its
length on the device).

Routes (lowering.decode.registry):
  run_triton(call)       "triton" of lowering.mla_decode: q bf16/fp16; cache the same
                         dtype, or fp8 e4m3 with k_scale.
  run_triton_fp8q(call)  "triton-fp8q" of lowering.mla_decode_fp8q: fp8 query x fp8 cache
                         with per-tensor scales (value = stored * scale); the scores use
                         fp8 tensor-core dots (QGMMA on Hopper), P @ V runs in fp16.
Both read lowering.config.batch_invariant at call time: every request is then cut into
fixed INVARIANT_CHUNK-key splits merged in split order, with one kernel config per head
count, so a request's result is bit-identical whatever else is in the batch.

Eager calls launch the kernels directly (triton_decode); traced calls go through the op
(triton_decode_op), which is what Inductor sees.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton

from lowering import config
from lowering.decode.merge_kernel import mla_decode_merge_kernel
from lowering.decode.registry import sm_count
from lowering.decode.triton_decode_kernel import mla_decode_stage1_kernel

# ---- configs as data ----------------------------------------------------------------
# key: (kv_kind, "wide" | "narrow" (BLOCK_M = 64 or less), "gpu")
#   kv_kind 0: bf16/fp16 cache; 1: fp8 cache, bf16 q; 2: fp8 q and fp8 cache.
# Values: BLOCK_N keys per step, warps, pipeline stages, CTAs per SM used to size splits;
# optional BLOCK_M / V_PARTS (below) and min_split_keys (default MIN_SPLIT_KEYS).
CONFIGS = {
    (0, "wide", "gpu"): dict(BLOCK_N=64, num_warps=8, num_stages=2, ctas_per_sm=1),
    (0, "narrow", "gpu"): dict(BLOCK_N=128, num_warps=4, num_stages=2, ctas_per_sm=1),
    (1, "wide", "gpu"): dict(BLOCK_N=64, num_warps=8, num_stages=3, ctas_per_sm=1),
    (1, "narrow", "gpu"): dict(BLOCK_N=64, num_warps=8, num_stages=3, ctas_per_sm=1),
    (2, "wide", "gpu"): dict(BLOCK_N=64, num_warps=8, num_stages=3, ctas_per_sm=1,
                             BLOCK_M=128, V_PARTS=2),
    (2, "narrow", "gpu"): dict(BLOCK_N=64, num_warps=8, num_stages=3, ctas_per_sm=1),
}
# (Chosen from the H200 sweeps in benchmarks/NOTES-decode.md; "wide" means 64 or more
# query rows (BLOCK_M = 64 unless the config names one), "narrow" 16 or 32. Optional
# BLOCK_M / V_PARTS: 128 rows per block, each block as two half-value-column programs.)
# Under the CPU interpreter (tests set smaller blocks or more splits through these two):
CPU_CONFIG = dict(BLOCK_N=16, num_warps=4, num_stages=1, ctas_per_sm=1)
CPU_SM_COUNT = 4          # split sizing under the CPU interpreter
MIN_SPLIT_KEYS = 128      # never cut a request into splits shorter than this
MAX_SPLITS = 64
MERGE_SPLIT_BLOCK = 16    # splits the merge reads per step (fixed: batch invariance needs it)
INVARIANT_CHUNK = 1024    # split size in batch-invariant mode (a multiple of every BLOCK_N)
MERGE_PART_L = 64         # value columns per merge program where few rows are merged:
MERGE_PARTS_MAX_ROWS = 64 # at most this many (request, query row) pairs (H200, 16 heads)


def merge_block_l(B: int, rows: int, L: int, batch_invariant: bool) -> int:
    """Value columns per merge program: MERGE_PART_L where B x rows is small (more programs
    for a latency-bound merge), else the whole row. Batch-invariant mode keeps whole rows
    (the tile shape fixes the reduction order)."""
    if (batch_invariant or B * rows > MERGE_PARTS_MAX_ROWS or L <= MERGE_PART_L
            or L % MERGE_PART_L):
        return L
    return MERGE_PART_L


def block_m_for(rows: int) -> int:
    """Query rows (s_q * H) per program: 64 fills a Hopper warpgroup MMA; fewer rows pad to 16+."""
    return 64 if rows >= 64 else max(16, triton.next_power_of_2(rows))


def pick_config(kv_kind: int, rows: int, on_gpu: bool) -> dict:
    if not on_gpu:
        return CPU_CONFIG
    return CONFIGS[(kv_kind, "wide" if block_m_for(rows) >= 64 else "narrow", "gpu")]


def device_sm_count(device: torch.device) -> int:
    return sm_count(device) if device.type == "cuda" else CPU_SM_COUNT


def choose_num_splits(batch: int, m_blocks: int, max_len: int, sm_count: int,
                      ctas_per_sm: int = 1, min_split_keys: int = MIN_SPLIT_KEYS) -> int:
    """Splits per request so that batch x row-blocks x splits about fills the GPU once.

    max_len is the longest length the block table allows (a shape, so no host sync);
    the kernel then divides each request's actual length evenly over the splits.
    """
    ctas = batch * m_blocks
    target = sm_count * ctas_per_sm
    if ctas >= target:
        return 1
    cap = max(1, triton.cdiv(max_len, min_split_keys))
    return max(1, min(target // ctas, cap, MAX_SPLITS))


def stage1_outputs(B: int, s_q: int, H: int, L: int, splits: int, out_dtype, device):
    """(out [B, s_q, H, L], lse [B, H, s_q] fp32, o1, l1): what stage 1 writes, which is
    out / lse themselves with one split, else fp32 partials o1 [B, splits, s_q * H, L]
    and l1 [B, splits, s_q * H] for the merge kernel."""
    out = torch.empty((B, s_q, H, L), dtype=out_dtype, device=device)
    lse = torch.empty((B, H, s_q), dtype=torch.float32, device=device)
    if splits == 1:
        return out, lse, out, lse
    o1 = torch.empty((B, splits, s_q * H, L), dtype=torch.float32, device=device)
    l1 = torch.empty((B, splits, s_q * H), dtype=torch.float32, device=device)
    return out, lse, o1, l1


def triton_decode(
    q: torch.Tensor,              # [B, s_q, H, L + R]
    kv_cache: torch.Tensor,       # [num_blocks, PAGE, L + R]
    block_table: torch.Tensor,    # [B, max_blocks] int32
    cache_seqlens: torch.Tensor,  # [B] int32
    q_scale: Optional[torch.Tensor],
    k_scale: Optional[torch.Tensor],
    softmax_scale: float,
    causal: bool,
    head_dim_v: int,
    kv_kind: int,
    batch_invariant: bool,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 1 and, with more than one split, the merge: (out [B, s_q, H, L] out_dtype,
    lse [B, H, s_q] fp32). Host logic from shapes only (no device->host copies)."""
    B, s_q, H, D = q.shape
    _, page, _ = kv_cache.shape
    L, R = head_dim_v, D - head_dim_v
    rows = s_q * H
    q = q.contiguous()
    on_gpu = q.device.type == "cuda"
    cfg = pick_config(kv_kind, rows, on_gpu)
    BLOCK_M = cfg.get("BLOCK_M", block_m_for(rows))
    V_PARTS = cfg.get("V_PARTS", 1)
    if rows < BLOCK_M:                      # a config's 128-row block needs 128 rows
        BLOCK_M, V_PARTS = block_m_for(rows), 1
    m_blocks = triton.cdiv(rows, BLOCK_M)
    max_len = block_table.shape[1] * page
    if batch_invariant:
        fixed_chunk = INVARIANT_CHUNK
        splits = triton.cdiv(max_len, fixed_chunk)
    else:
        fixed_chunk = 0
        splits = choose_num_splits(B, m_blocks * V_PARTS, max_len, device_sm_count(q.device),
                                   cfg["ctas_per_sm"], cfg.get("min_split_keys", MIN_SPLIT_KEYS))

    out, lse, o1, l1 = stage1_outputs(B, s_q, H, L, splits, out_dtype, q.device)
    dummy = cache_seqlens  # stands in for absent scale pointers (never read)
    torch.library.wrap_triton(mla_decode_stage1_kernel)[(m_blocks * V_PARTS, B, splits)](
        q, kv_cache, block_table, cache_seqlens,
        q_scale if q_scale is not None else dummy,
        k_scale if k_scale is not None else dummy,
        o1, l1, softmax_scale, q.stride(0), block_table.stride(0), block_table.shape[1],
        kv_cache.shape[0],
        S_Q=s_q, H=H, L=L, R=R, PAGE=page, CAUSAL=causal,
        num_splits=splits, DIRECT=splits == 1, FIXED_CHUNK=fixed_chunk, KV_KIND=kv_kind,
        BLOCK_M=BLOCK_M, BLOCK_N=cfg["BLOCK_N"], V_PARTS=V_PARTS, DOT_F32=not on_gpu,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if splits > 1:
        # fewer splits than a merge step: a smaller step (batch-invariant mode keeps one)
        sb = MERGE_SPLIT_BLOCK if batch_invariant else min(MERGE_SPLIT_BLOCK,
                                                           triton.next_power_of_2(splits))
        bl = merge_block_l(B, rows, L, batch_invariant)
        torch.library.wrap_triton(mla_decode_merge_kernel)[(rows, B, L // bl)](
            o1, l1, out, lse, splits, S_Q=s_q, H=H, L=L, SPLIT_BLOCK=sb, BLOCK_L=bl,
            num_warps=4)
    return out, lse


try:      # torch's switch between wrap_triton's traced op and a direct launch
    from torch._library.triton import set_wrap_triton_enabled
except ImportError:
    set_wrap_triton_enabled = None

# The op Inductor sees (kernels visible in its generated code, capturable in CUDA graphs).
triton_decode_op = torch.library.triton_op("mla::triton_decode", mutates_args={})(triton_decode)


def _launch(*args):
    """The op while torch.compile traces; in eager mode the launcher itself, its kernels
    launched directly (through the op where this torch has no switch for that)."""
    if torch.compiler.is_compiling() or set_wrap_triton_enabled is None:
        return triton_decode_op(*args)
    # wrap_triton in eager code dispatches a higher-order op per launch (0.3-0.7 ms of
    # host time on an H200); with plain tensors it need not: launch directly
    with set_wrap_triton_enabled(False):
        return triton_decode(*args)


def run_triton(call):
    """Route "triton" of lowering.mla_decode (a checked DecodeCall)."""
    k_scale = call.k_scale
    return _launch(call.q, call.kv_cache, call.block_table, call.cache_seqlens, None,
                   k_scale.reshape(1) if k_scale is not None else None, call.softmax_scale,
                   call.causal, call.head_dim_v, 1 if call.kind == "fp8" else 0,
                   config.batch_invariant, call.q.dtype)


def run_triton_fp8q(call):
    """Route "triton-fp8q" of lowering.mla_decode_fp8q (a checked DecodeCall)."""
    return _launch(call.q, call.kv_cache, call.block_table, call.cache_seqlens,
                   call.q_scale.reshape(1), call.k_scale.reshape(1), call.softmax_scale,
                   call.causal, call.head_dim_v, 2, config.batch_invariant, call.out_dtype)
