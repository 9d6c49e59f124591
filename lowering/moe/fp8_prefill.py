"""An FP8 checkpoint's routed experts for a prefill-sized batch (more tokens than the decode
kernels take), W8A8 as HF's FP8Linear computes each linear, without host syncs:

    the 16-bit prefill's streamed form (prefill.py's streamed_experts: pairs sorted by
    expert, their counts and tile counts on the device, the gate + up grouped GEMM
    (lowering/gemm/grouped.py, gated) into h [P, I], the down grouped GEMM into y [P, H],
    mla::moe_combine weighting and summing each token's pairs), with x and h quantized
    once per group_k columns for the W8A8 GEMMs.

Memory grows with the pairs (h, y and the quantized copies: about P (3 I + 3 H) bytes),
not with a dequantized copy of any weight. Before it, such batches ran the per-pair
reference of fp8_experts.py, which gathers one dequantized copy of its expert per pair
(P x 3 I H x 3 bytes: past memory for a few hundred tokens of DeepSeek-V3) wherever
transformers' own fp8 kernel does not load.
"""
from __future__ import annotations

import torch

from lowering.gemm.grouped import GROUPS_K
from lowering.moe.prefill import streamed_experts

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
    docstring): [T, H] in x's dtype, prefill.streamed_experts's steps in their W8A8 form. On
    any device the kernels can run (the CPU under TRITON_INTERPRET=1); callers check
    serves(). configs: {kernel: config} over CONFIGS."""
    configs = {k: (bm, bn, group_k, warps, stages)
               for k, (bm, bn, warps, stages) in {**CONFIGS, **(configs or {})}.items()}
    return streamed_experts(x, topk_idx, topk_weight, gate_up, down, configs,
                            fp8=(gate_up_scale, down_scale, group_n, group_k))
