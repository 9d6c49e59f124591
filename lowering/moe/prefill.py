"""A DeepSeek MoE block's routed experts for a prefill batch: the pairs sorted by expert,
two grouped GEMMs, then one kernel that weights and sums the pairs' outputs back per token.

    grouped_experts(x [T, H], topk_idx [T, K], topk_weight [T, K], gate_up [E, 2I, H],
                    down [E, H, I]) -> [T, H] in x's dtype

Many pairs per expert (past STREAM_PAIRS on average): HF's grouped_mm experts
(transformers.integrations.moe), the same torch calls in the same order up to the down
projection, so the same GEMMs run on the same rows:

    ids, perm = sort(topk_idx.flatten())             pairs in expert order     [P]
    xs = x[perm // K]                                                          [P, H]
    offs = cumsum(histc(ids, E))                     each expert's last row    [E]
    h = SiLU(gate) * up,  [gate | up] = xs @ gate_up[e].T  (grouped)           [P, I]
    y = h @ down[e].T                                      (grouped)           [P, H]

Few pairs per expert (a prefill chunk or a short prompt over many experts: DeepSeek-V3's
512 tokens give its 256 experts 16 pairs each): the GEMMs are bound by the experts' bytes,
so streamed_experts runs lowering/gemm/grouped_kernel.py, which streams each expert's
weights once per tile of its pairs: gate and up in one kernel with SiLU(gate) * up in its
epilogue (rounded as above), reading x's rows in place (no gathered copy), then down.

Both end in mla::moe_combine (combine_kernel.py): out[t] = sum_k w[t, k] * y[slot[t, k]]
in fp32, rounded once, where HF makes an fp32 weighted copy of y, gathers it back to token
order and sums it (three passes over P x H fp32 values: at DeepSeek-V3's shape and 8192
tokens, 3.9 ms of a 51 ms forward on an H200). The sums run in another order than
torch's, so a result can differ from HF's by an fp32 rounding before the final one.

Served where serves() says (CUDA, bf16 / fp16, torch with _grouped_mm, no grad wanted);
the block falls back to HF's experts elsewhere.
"""
from __future__ import annotations

import torch
import triton

from lowering.fused.silu_mul import silu_mul
from lowering.gemm.fp8_act_quant import quantized
from lowering.gemm.grouped import launch
from lowering.moe.combine_kernel import moe_combine_kernel

BLOCK_H = 1024
# While an expert gets at most STREAM_PAIRS (token, k) pairs on average, the weight-streaming
# grouped kernel (streamed_experts) beats torch's grouped GEMM; past it, the grouped GEMM.
# H200, bench_moe.py --sweep-stream: V3's experts at 16 pairs 5.23 vs 7.01 ms (1.0x their
# bytes), at 64 pairs ~6.9 vs 7.15 ms; V2-Lite's at 48 pairs 0.39 vs 0.46 ms; at 192 and
# 256 pairs the grouped GEMM wins by 1.2-1.5x.
STREAM_PAIRS = 64
# BLOCK_M (stream_block_m) -> {kernel: (BLOCK_N, BLOCK_K, num_warps, num_stages)}, the
# sweep's best per pairs an expert (16 for 32, 48 for 64, 64 for 128; 16 untimed)
STREAM_CONFIGS = {
    16: {"gate_up": (64, 64, 4, 4), "down": (128, 64, 4, 3)},
    32: {"gate_up": (64, 64, 4, 4), "down": (128, 64, 4, 3)},
    64: {"gate_up": (64, 64, 4, 4), "down": (128, 64, 8, 3)},
    128: {"gate_up": (64, 64, 4, 3), "down": (128, 64, 8, 3)},
}


def serves(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and gate_up.dtype == down.dtype == x.dtype and hasattr(torch, "_grouped_mm")
            and x.shape[0] > 0)


def launch_combine(y, slot, weight, out):
    """out [T, H] = sum_k weight[t, k] * y[slot[t, k]] (combine_kernel.py); y [P, H] with unit
    last stride, slot and weight [T, K] contiguous."""
    T, K = slot.shape
    P, H = y.shape
    torch.library.wrap_triton(moe_combine_kernel)[(T, triton.cdiv(H, BLOCK_H))](
        y, slot, weight, out, P, H, y.stride(0), out.stride(0),
        K=K, KP=triton.next_power_of_2(K), BLOCK_H=BLOCK_H, num_warps=4)


@torch.library.triton_op("mla::moe_combine", mutates_args={})
def moe_combine(y: torch.Tensor, slot: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[T, H] in y's dtype: sum_k weight[t, k] * y[slot[t, k]], fp32 inside. On CUDA the
    kernel, where slot values outside [0, P) read a clamped row (the caller computes them;
    nothing is checked on the host); elsewhere the same sum in torch."""
    if y.dim() != 2 or slot.dim() != 2 or weight.shape != slot.shape:
        raise ValueError(f"y must be [P, H] and slot, weight [T, K], got {tuple(y.shape)}, "
                         f"{tuple(slot.shape)}, {tuple(weight.shape)}")
    if slot.dtype not in (torch.int32, torch.int64) or not weight.is_floating_point():
        raise TypeError(f"slot must be int32/int64 and weight floating, got {slot.dtype}, "
                        f"{weight.dtype}")
    if not y.is_cuda:                                # the torch reference (CPU, traced on CPU)
        return (y[slot].float() * weight[..., None].float()).sum(1).to(y.dtype)
    y = y if y.stride(-1) == 1 else y.contiguous()
    out = torch.empty((slot.shape[0], y.shape[1]), dtype=y.dtype, device=y.device)
    launch_combine(y, slot.contiguous(), weight.contiguous(), out)
    return out


def sorted_pairs(topk_idx: torch.Tensor, E: int):
    """The (token, k) pairs of topk_idx [T, K] sorted by expert, without host syncs:
    (ids [P] sorted, perm [P]: the flat pair of each sorted position, counts [E] int32:
    pairs per expert in [0, E), slot [T, K]: each pair's sorted position)."""
    ids, perm = torch.sort(topk_idx.reshape(-1))                                 # [P]
    counts = torch.histc(ids.int() if ids.is_cuda else ids.float(), bins=E, min=0,
                         max=E - 1).to(torch.int32)                              # [E]
    slot = torch.empty_like(perm)
    slot[perm] = torch.arange(perm.shape[0], device=perm.device)                 # [P]
    return ids, perm, counts, slot.view(topk_idx.shape)


def pair_ranges(ids: torch.Tensor, counts: torch.Tensor):
    """(starts, ends) [E] int32: where each expert's pairs lie in the sorted order. Pairs
    whose expert is outside [0, E) (none from a router) sort before or after every
    expert's: no tile takes them."""
    ends = torch.cumsum(counts, 0, dtype=torch.int32) + (ids < 0).sum(dtype=torch.int32)
    return ends - counts, ends


def tile_ends(counts: torch.Tensor, block_m: int) -> torch.Tensor:
    """[E] int32: the cumulative count of BLOCK_M-pair tiles per expert (grouped_kernel.py)."""
    return torch.cumsum((counts + block_m - 1) // block_m, 0, dtype=torch.int32)


def stream_block_m(pairs: int, E: int) -> int:
    """The tile of pairs for the streamed path: one tile holds about every expert's pairs
    at this mean (pairs / E), so each expert's weights are read about once."""
    mean = pairs / E
    return 16 if mean <= 6 else 32 if mean <= 18 else 64 if mean <= 48 else 128


def grouped_experts(x, topk_idx, topk_weight, gate_up, down) -> torch.Tensor:
    """The routed experts of a prefill batch (module docstring): [T, H] in x's dtype."""
    T, K = topk_idx.shape
    E = gate_up.shape[0]
    if T * K <= STREAM_PAIRS * E and gate_up.stride(-1) == down.stride(-1) == 1:
        return streamed_experts(x, topk_idx, topk_weight, gate_up, down)
    return grouped_mm_experts(x, topk_idx, topk_weight, gate_up, down)


def grouped_mm_experts(x, topk_idx, topk_weight, gate_up, down) -> torch.Tensor:
    """The many-pairs-per-expert form, torch's grouped GEMM (module docstring)."""
    K = topk_idx.shape[1]
    E, I = gate_up.shape[0], gate_up.shape[1] // 2
    _, perm, counts, slot = sorted_pairs(topk_idx, E)
    xs = x[perm // K]                                                            # [P, H]
    offs = torch.cumsum(counts, dim=0, dtype=torch.int32)                        # [E]
    gu = torch._grouped_mm(xs, gate_up.transpose(-2, -1), offs=offs)             # [P, 2I]
    h = silu_mul(gu[:, :I], gu[:, I:])                           # F.silu(gate) * up, [P, I]
    y = torch._grouped_mm(h, down.transpose(-2, -1), offs=offs)                  # [P, H]
    return torch.ops.mla.moe_combine(y, slot, topk_weight)


def streamed_experts(x, topk_idx, topk_weight, gate_up, down, configs=None,
                     fp8=None) -> torch.Tensor:
    """The few-pairs-per-expert form (module docstring): [T, H] in x's dtype. On any device
    the kernels run (the CPU under TRITON_INTERPRET=1). configs: {kernel: (BLOCK_M,
    BLOCK_N, BLOCK_K, num_warps, num_stages)}, by default STREAM_CONFIGS[BLOCK_M] with BLOCK_M
    from stream_block_m. fp8: (gate_up_scale, down_scale, group_n, group_k) for e4m3 weights
    (lowering/moe/fp8_prefill.py): x and h quantized per group_k columns, W8A8, BLOCK_K
    the scale group."""
    T, K = topk_idx.shape
    E, I = gate_up.shape[0], gate_up.shape[1] // 2
    P = T * K
    bm = stream_block_m(P, E)
    configs = {k: (bm, *c) for k, c in STREAM_CONFIGS[bm].items()} | (configs or {})
    x = x if x.stride(-1) == 1 else x.contiguous()
    ids, perm, counts, slot = sorted_pairs(topk_idx, E)          # [P], [P], [E], [T, K]
    starts, ends = pair_ranges(ids, counts)
    tiles = {m: tile_ends(counts, m) for m in {c[0] for c in configs.values()}}
    gs, ds, gn, gk = fp8 if fp8 is not None else (None, None, 1, None)

    def operand(a):                  # a, or (W8A8) its e4m3 copy and scales per gk columns
        return (a, None) if fp8 is None else quantized(a, gk, True)[:2]

    h = torch.empty((P, I), dtype=x.dtype, device=x.device)                     # [P, I]
    bm, bn, bk, warps, stages = configs["gate_up"]
    launch(*operand(x), (perm // K).to(torch.int32), gate_up, gs, h, starts, ends, tiles[bm],
           gn, bk, gated=True, up_row0=I, up_s_row0=triton.cdiv(I, gn),
           config=(bm, bn, warps, stages))
    y = torch.zeros((P, x.shape[1]), dtype=x.dtype, device=x.device)   # [P, H]: rows no
    bm, bn, bk, warps, stages = configs["down"]                        # tile takes add 0
    launch(*operand(h), torch.arange(P, dtype=torch.int32, device=x.device), down, ds, y,
           starts, ends, tiles[bm], gn, bk, config=(bm, bn, warps, stages))
    return torch.ops.mla.moe_combine(y, slot, topk_weight)
