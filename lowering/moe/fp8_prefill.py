"""An FP8 checkpoint's routed experts for a prefill-sized batch (more tokens than the decode
kernels take), W8A8 as HF's FP8Linear computes each linear, without host syncs:

    pairs sorted by expert, their counts and tile counts on the device (prefill.py's
    sorted_pairs); x quantized once per 128 columns; the gate + up grouped GEMM
    (lowering/gemm/grouped.py, gated) into h [P, I]; h quantized; the down grouped
    GEMM into y [P, H]; mla::moe_combine weights and sums each token's pairs (prefill.py).

Memory grows with the pairs (h, y and the quantized copies: about P (3 I + 3 H) bytes),
not with a dequantized copy of any weight. Before it, such batches ran the per-pair
reference of fp8_experts.py, which gathers one dequantized copy of its expert per pair
(P x 3 I H x 3 bytes: past memory for a few hundred tokens of DeepSeek-V3) wherever
transformers' own fp8 kernel does not load.
"""
from __future__ import annotations

import torch
import triton

from lowering.gemm.fp8_act_quant import quantized
from lowering.gemm.grouped import GROUPS_K, launch
from lowering.moe.prefill import pair_ranges, sorted_pairs, tile_ends  # (+ moe_combine)

# kernel -> (BLOCK_M, BLOCK_N, num_warps, num_stages); not yet swept on a GPU
CONFIGS = {"gate_up": (64, 128, 8, 3), "down": (64, 128, 8, 3)}


def serves(x: torch.Tensor, gate_up, gate_up_scale, down, down_scale, gk: int) -> bool:
    """Whether grouped_experts serves a batch: CUDA, 16-bit x, a power-of-two scale group,
    contiguous weights (shapes, dtypes and devices only)."""
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and x.shape[0] > 0
            and gk in GROUPS_K
            and all(t.is_contiguous() for t in (gate_up, gate_up_scale, down, down_scale)))


def grouped_experts(x, topk_idx, topk_weight, gate_up, gate_up_scale, down, down_scale,
                    group_n: int, group_k: int, configs=None) -> torch.Tensor:
    """sum_k topk_weight[t, k] * expert_{topk_idx[t, k]}(x[t]) for x [T, H] (module
    docstring): [T, H] in x's dtype. On any device the kernels can run (the CPU under
    TRITON_INTERPRET=1); callers check serves(). configs: {kernel: config} over CONFIGS."""
    configs = {**CONFIGS, **(configs or {})}
    T, K = topk_idx.shape
    E, I = gate_up.shape[0], gate_up.shape[1] // 2
    P = T * K
    x = x if x.stride(-1) == 1 else x.contiguous()
    ids, perm, counts, slot = sorted_pairs(topk_idx, E)          # [P], [P], [E], [T, K]
    starts, ends = pair_ranges(ids, counts)                                      # [E] each
    tiles = {k: tile_ends(counts, cfg[0]) for k, cfg in configs.items()}  # per BLOCK_M
    xq, xs, _ = quantized(x, group_k, True)                     # e4m3 [T, H], [T, G]
    tokens = (perm // K).to(torch.int32)                        # the token of each sorted pair
    h = torch.empty((P, I), dtype=x.dtype, device=x.device)                     # [P, I]
    launch(xq, xs, tokens, gate_up, gate_up_scale, h, starts, ends, tiles["gate_up"],
           group_n, group_k, gated=True, up_row0=I, up_s_row0=triton.cdiv(I, group_n),
           config=configs["gate_up"])
    hq, hs, _ = quantized(h, group_k, True)                     # e4m3 [P, I], [P, G]
    y = torch.zeros((P, x.shape[1]), dtype=x.dtype, device=x.device)            # [P, H]
    launch(hq, hs, torch.arange(P, dtype=torch.int32, device=x.device), down, down_scale, y,
           starts, ends, tiles["down"], group_n, group_k, gated=False,
           config=configs["down"])
    return torch.ops.mla.moe_combine(y, slot, topk_weight)
