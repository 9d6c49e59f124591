"""Launcher for the Triton MLA decode kernels, as the custom op mla::triton_decode.

The op is defined with torch.library.triton_op and launches through wrap_triton, so
torch.compile/Inductor sees the kernels (they appear in its generated code) and the
whole call can be captured in a CUDA graph. All host logic here uses shapes only:
no device->host copies, so the grid is fixed for a given shape and graph replays
with changing lengths stay correct (each request's split size is derived from its
length on the device).

Public entries:
  triton_mla_decode(q, kv_cache, block_table, cache_seqlens, softmax_scale, *, causal,
                    kind, k_scale, head_dim_v, batch_invariant=None)
      the "triton" backend of lowering.mla_decode (q bf16/fp16; cache same dtype, or
      fp8 e4m3 with k_scale).
  mla_decode_fp8q(q_fp8, kv_cache_fp8, block_table, cache_seqlens, softmax_scale, *,
                  q_scale, k_scale, causal=True, head_dim_v=None, out_dtype=bf16,
                  batch_invariant=None)
      fp8 query x fp8 cache with per-tensor scales (value = stored * scale): the scores
      use fp8 tensor-core dots (QGMMA on Hopper); P @ V runs in fp16 by default (PV_FP8
      below: fp8 there needs V transposed per tile, measured 5x slower). L and R >= 32.
      Returns (out [B, s_q, H, L] out_dtype, lse [B, H, s_q]).
  set_batch_invariant(flag)
      batch-invariant mode: every request is cut into fixed INVARIANT_CHUNK-key splits
      merged in split order, with one kernel config per head count, so a request's
      result is bit-identical whatever else is in the batch. Also on with
      MLA_BATCH_INVARIANT=1 in the environment.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import triton

from lowering.decode.triton_decode_kernel import mla_decode_stage1_kernel
from lowering.decode.merge_kernel import mla_decode_merge_kernel

# ---- configs as data ----------------------------------------------------------------
# key: (kv_kind, "wide" | "narrow" (BLOCK_M = 64 or less), "gpu")
#   kv_kind 0: bf16/fp16 cache; 1: fp8 cache, bf16 q; 2: fp8 q and fp8 cache.
# Values: BLOCK_N keys per step, warps, pipeline stages, CTAs per SM used to size splits.
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
CPU_CONFIG = dict(BLOCK_N=16, num_warps=4, num_stages=1, ctas_per_sm=1)
CPU_SM_COUNT = 4          # split sizing under the CPU interpreter
MIN_SPLIT_KEYS = 128      # never cut a request into splits shorter than this
MAX_SPLITS = 64
MERGE_SPLIT_BLOCK = 16    # splits the merge reads per step (fixed: batch invariance needs it)
INVARIANT_CHUNK = 1024    # split size in batch-invariant mode (a multiple of every BLOCK_N)
P_SCALE = 256.0           # fp8 P @ V: p in [0, 1] is scaled into e4m3's normal range
PV_FP8 = False            # fp8 q path: P @ V with fp8 dots (else fp16; see the kernel)

_batch_invariant = os.environ.get("MLA_BATCH_INVARIANT", "0") == "1"


def set_batch_invariant(flag: bool) -> None:
    global _batch_invariant
    _batch_invariant = bool(flag)


def batch_invariant_enabled() -> bool:
    return _batch_invariant


def block_m_for(rows: int) -> int:
    """Query rows (s_q * H) per program: 64 fills a Hopper warpgroup MMA; fewer rows pad to 16+."""
    return 64 if rows >= 64 else max(16, triton.next_power_of_2(rows))


def pick_config(kv_kind: int, rows: int, on_gpu: bool) -> dict:
    if not on_gpu:
        return dict(CPU_CONFIG)
    return dict(CONFIGS[(kv_kind, "wide" if block_m_for(rows) >= 64 else "narrow", "gpu")])


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return CPU_SM_COUNT


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


@torch.library.triton_op("mla::triton_decode", mutates_args={})
def triton_decode_op(
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
    num_splits: int = 0,          # 0: choose from the shapes and SM count
    block_n: int = 0,             # 0: from CONFIGS
    num_warps: int = 0,
    num_stages: int = 0,
    lazy_rescale: int = -1,       # -1: from CONFIGS
    warp_specialize: bool = False,
    block_m: int = 0,             # 0: from the row count (block_m_for) or CONFIGS
    v_parts: int = 0,             # 0: from CONFIGS (1 when absent)
) -> tuple[torch.Tensor, torch.Tensor]:
    B, s_q, H, D = q.shape
    _, page, _ = kv_cache.shape
    L, R = head_dim_v, D - head_dim_v
    rows = s_q * H
    q = q.contiguous()
    on_gpu = q.device.type == "cuda"
    cfg = pick_config(kv_kind, rows, on_gpu)
    if block_n:
        cfg["BLOCK_N"] = block_n
    if num_warps:
        cfg["num_warps"] = num_warps
    if num_stages:
        cfg["num_stages"] = num_stages
    if lazy_rescale >= 0:
        cfg["lazy"] = bool(lazy_rescale)
    if block_m:
        cfg["BLOCK_M"] = block_m
    if v_parts:
        cfg["V_PARTS"] = v_parts
    lazy = cfg.get("lazy", False) and not (kv_kind == 2 and PV_FP8)  # fp8 P needs p <= 1
    BLOCK_M = cfg.get("BLOCK_M", block_m_for(rows))
    V_PARTS = cfg.get("V_PARTS", 1)
    if not block_m and rows < BLOCK_M:      # a config's 128-row block needs 128 rows
        BLOCK_M, V_PARTS = block_m_for(rows), v_parts or 1
    if V_PARTS not in (1, 2) or L % V_PARTS:
        raise ValueError(f"v_parts must be 1 or 2 (and divide head_dim_v {L}), got {V_PARTS}")
    m_blocks = triton.cdiv(rows, BLOCK_M)
    max_len = block_table.shape[1] * page
    if batch_invariant:
        fixed_chunk = INVARIANT_CHUNK
        splits = triton.cdiv(max_len, fixed_chunk)
    else:
        fixed_chunk = 0
        splits = num_splits or choose_num_splits(B, m_blocks * V_PARTS, max_len,
                                                 _sm_count(q.device), cfg["ctas_per_sm"])

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
        PV_FP8=PV_FP8, P_SCALE=P_SCALE, BLOCK_M=BLOCK_M, BLOCK_N=cfg["BLOCK_N"],
        V_PARTS=V_PARTS, DOT_F32=not on_gpu, LAZY_RESCALE=lazy, WARP_SPEC=warp_specialize, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if splits > 1:
        # fewer splits than a merge step: a smaller step (batch-invariant mode keeps one)
        sb = MERGE_SPLIT_BLOCK if batch_invariant else min(MERGE_SPLIT_BLOCK,
                                                           triton.next_power_of_2(splits))
        torch.library.wrap_triton(mla_decode_merge_kernel)[(rows, B)](
            o1, l1, out, lse, splits, S_Q=s_q, H=H, L=L, SPLIT_BLOCK=sb, num_warps=4)
    return out, lse


def _check_widths(D: int, head_dim_v: int, least: int = 16) -> None:
    """L and R must be powers of two (tl.arange); fp8 dots need K >= 32."""
    from lowering.decode.registry import BackendUnavailable
    L, R = head_dim_v, D - head_dim_v
    for name, v in (("head_dim_v (L)", L), ("rope width D - head_dim_v (R)", R)):
        if v < least or v & (v - 1):
            raise BackendUnavailable(
                f"backend 'triton' needs {name} to be a power of two >= {least}, got {v}")


def triton_mla_decode(q, kv_cache, block_table, cache_seqlens, softmax_scale, *, causal, kind,
                      k_scale, head_dim_v, batch_invariant=None, **tuning):
    """Backend "triton" of lowering.mla_decode (arguments already validated there)."""
    _check_widths(q.shape[-1], head_dim_v)
    kv_kind = 1 if kind == "fp8" else 0
    if batch_invariant is None:
        batch_invariant = _batch_invariant
    return triton_decode_op(q, kv_cache, block_table, cache_seqlens, None,
                            k_scale.reshape(1) if k_scale is not None else None,
                            float(softmax_scale), bool(causal), int(head_dim_v), kv_kind,
                            bool(batch_invariant), q.dtype, **tuning)


def mla_decode_fp8q(q, kv_cache, block_table, cache_seqlens, softmax_scale, *, q_scale, k_scale,
                    causal=True, head_dim_v=None, out_dtype=torch.bfloat16, batch_invariant=None,
                    **tuning):
    """fp8 query and fp8 cache (true values = stored * scale), fp8 tensor-core dots: the
    Triton route of lowering.mla_decode_fp8q (which picks between it and the Gluon kernel).

    q [B, s_q, H, L+R] float8_e4m3fn, kv_cache [num_blocks, page, L+R] float8_e4m3fn,
    q_scale and k_scale one-element fp32 tensors. Returns (out [B, s_q, H, L] out_dtype,
    lse [B, H, s_q] fp32).
    """
    from lowering.checks import check_fp8q_args
    head_dim_v = check_fp8q_args(q, kv_cache, block_table, cache_seqlens, softmax_scale,
                                 q_scale, k_scale, head_dim_v, out_dtype)
    return triton_fp8q_checked(q, kv_cache, block_table, cache_seqlens, softmax_scale,
                               q_scale, k_scale, causal, head_dim_v, out_dtype, batch_invariant,
                               **tuning)


def triton_fp8q_checked(q, kv_cache, block_table, cache_seqlens, softmax_scale, q_scale, k_scale,
                        causal, head_dim_v, out_dtype, batch_invariant=None, **tuning):
    """mla_decode_fp8q after checks.check_fp8q_args (head_dim_v resolved)."""
    _check_widths(q.shape[-1], head_dim_v, least=32)
    if batch_invariant is None:
        batch_invariant = _batch_invariant
    from lowering.decode.entry import record_choice
    record_choice("triton-fp8q")                 # reported by the inspection tool
    return triton_decode_op(q, kv_cache, block_table, cache_seqlens, q_scale.reshape(1),
                            k_scale.reshape(1), float(softmax_scale), bool(causal),
                            int(head_dim_v), 2, bool(batch_invariant), out_dtype, **tuning)
