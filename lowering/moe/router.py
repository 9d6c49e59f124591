"""A DeepSeek MoE block's router for a decode step's few rows, as one graph op.

    mla::moe_route(x [T, H], weight [E, H], bias [E] or None, mode, top_k, n_group,
                   topk_group, norm_topk_prob, scale)
        -> (topk_idx [T, K] int64, topk_weight [T, K] fp32)

HF's router modules on x (route_torch: their exact torch calls):
    mode 0  DeepseekV3TopkRouter (V3, V3.2): sigmoid scores, bias (e_score_correction_bias)
            for the choice only, groups ranked by the sum of their top-2 biased scores,
            norm_topk_prob, weights * scale (routed_scaling_factor)
    mode 1  DeepseekV2TopkRouter, topk_method "greedy": softmax scores, top_k of all
    mode 2  DeepseekV2TopkRouter, "group_limited_greedy": groups ranked by their best score,
            the other groups' scores 0.0, then top_k
n_group / topk_group matter in modes 0 and 2, norm_topk_prob in mode 0, bias in mode 0 only.

On CUDA for bf16 / fp16 tokens (kernel_serves): the logits, then the per-token selection
(router_select_kernel.py) in one launch, in place of the torch kernels of HF's router
after its GEMM (3 for V2's greedy softmax, ~12 for V3's groups). The logits: for at most
MAX_ROWS tokens (a decode step) split-H fp32 partials (router_logits_kernel.py), the same
experts as HF's router except where two choice values are within the fp32 rounding of
the logits' summation order; for more (a prefill) HF's own fp32 GEMM, so the same
experts. Exact ties go to the lower index, as torch's CUDA topk does; the weights within
an ulp or so. The experts come in descending choice order (HF's torch.topk(sorted=False)
order is unspecified). Anything else runs route_torch.
Defined with torch.library.triton_op, so Inductor sees the kernels.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import triton

from lowering.moe.experts import MAX_ROWS
from lowering.moe.router_logits_kernel import router_logits_kernel
from lowering.moe.router_select_kernel import router_select_kernel

MODES = (0, 1, 2)            # V3 sigmoid + groups, V2 greedy, V2 group_limited_greedy
MAX_EXPERTS = 512            # the select kernel holds a token's E logits in one block

# router_logits_kernel: (E, H) -> (BLOCK_E, SPLIT, BLOCK_K, num_warps, num_stages), the
# weight read spread over ~128 programs (an H200 has 132 SMs). Chosen by that count; a
# sweep of 48 tiles (docs/notes/probe_router_configs.py, H100, bf16 weights) found none
# faster for V3 at 1 and 32 rows or V2-Lite at 1 row (BENCHMARKS.md, "The router"). V2's
# is not swept.
LOGITS_CONFIGS: dict[tuple[int, int], tuple[int, int, int, int, int]] = {
    (256, 7168): (32, 16, 64, 4, 3),     # V3: 8 expert blocks x 16 slices of 448 = 128
    (64, 2048): (16, 32, 64, 4, 2),      # V2-Lite: 4 expert blocks x 32 slices of 64 = 128
    (160, 5120): (32, 26, 64, 4, 3),     # V2: 5 expert blocks x 20 slices of 256 = 100
}
PROGRAMS = 128               # the target of logits_config's default
# router_select_kernel: one warp per token, so its block reductions (~15 at V3's shape)
# stay within warp shuffles, no shared-memory round trips (H200: 4 warps within 4 % of one
# at V3 and V2, 2 and 4 warps 0.88-0.92x at V2-Lite; BENCHMARKS.md, "The router's selection")
SELECT_WARPS = 1
# the logits kernel's ROW_FMA form (router_logits_kernel.py) up to this many rows over an
# fp32 weight; on an H100 at one row: V3 11.0 µs a router call against 25.9 with the IEEE
# dot, V2-Lite 5.0 against 5.9. Over a bf16 weight the dot stays faster (9.7 against 11.8,
# 4.6 against 5.1), so row_fma takes fp32 weights only.
ROW_FMA_ROWS = 4


def logits_config(E: int, H: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_E, SPLIT, BLOCK_K, num_warps, num_stages) for a router of E experts over H."""
    if (E, H) in LOGITS_CONFIGS:
        return LOGITS_CONFIGS[(E, H)]
    block_e = 32 if E >= 128 else 16
    block_k = 64
    split = max(1, min(triton.cdiv(PROGRAMS, triton.cdiv(E, block_e)), triton.cdiv(H, block_k)))
    return block_e, split, block_k, 4, 3


def check_args(x, weight, bias, mode, top_k, n_group, topk_group) -> tuple[int, int, int]:
    """(T, H, E) after checking shapes, dtypes, devices and the routing ints (host only)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"x must be a floating [T, H] tensor, got "
                         f"{getattr(x, 'shape', type(x).__name__)}")
    T, H = x.shape
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != H:
        raise ValueError(f"weight must be [E, {H}] (the router's weight), got "
                         f"{getattr(weight, 'shape', type(weight).__name__)}")
    if not weight.is_floating_point():
        raise TypeError(f"weight must be floating point, got {weight.dtype}")
    E = weight.shape[0]
    if mode not in MODES:
        raise ValueError(f"mode must be 0 (V3), 1 (V2 greedy) or 2 (V2 group_limited_greedy), "
                         f"got {mode!r}")
    if mode == 0:
        if bias is None:
            raise ValueError("bias (e_score_correction_bias [E]) is required with mode 0")
        if tuple(bias.shape) != (E,):
            raise ValueError(f"bias must be [{E}], got {tuple(bias.shape)}")
        if not bias.is_floating_point():
            raise TypeError(f"bias must be floating point, got {bias.dtype}")
    if mode != 1:
        if not (isinstance(n_group, int) and n_group >= 1 and E % n_group == 0):
            raise ValueError(f"n_group={n_group!r} must divide the {E} experts")
        if mode == 0 and E // n_group < 2:
            raise ValueError(f"n_group={n_group}: mode 0 ranks groups by their top-2 scores, "
                             f"each group needs >= 2 of the {E} experts")
        if not (isinstance(topk_group, int) and 1 <= topk_group <= n_group):
            raise ValueError(f"topk_group={topk_group!r} must lie in [1, n_group={n_group}]")
    room = E if mode == 1 else topk_group * (E // n_group)
    if not (isinstance(top_k, int) and 1 <= top_k <= room):
        raise ValueError(f"top_k={top_k!r} must lie in [1, {room}] (the experts it picks from)")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
    return T, H, E


def kernel_serves(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """None when the Triton kernels run a moe_route call of these tensors, else the unmet
    condition (route_torch then runs)."""
    if not x.is_cuda:
        return f"x is on {x.device}, the kernels run on CUDA"
    if x.dtype not in (torch.bfloat16, torch.float16):
        return f"x is {x.dtype}, the kernels take bf16 / fp16"
    if weight.dtype not in (x.dtype, torch.float32):
        return f"weight is {weight.dtype}, the kernels take x's dtype {x.dtype} or float32"
    if x.dim() != 2 or x.shape[0] < 1:
        return f"x is {tuple(x.shape)}: the kernels serve [T, H] with T >= 1 rows"
    if weight.shape[0] > MAX_EXPERTS:
        return f"{weight.shape[0]} experts: the kernels serve at most {MAX_EXPERTS}"
    if weight.stride(-1) != 1:
        return "weight's last dim must be contiguous"
    return None


def row_fma(T: int, weight: torch.Tensor) -> bool:
    """Whether the logits kernel sums per lane (ROW_FMA) rather than in a dot: an fp32
    weight (the dot would be IEEE fp32 on the CUDA cores, T padded to 16) and at most
    ROW_FMA_ROWS rows."""
    return weight.dtype == torch.float32 and T <= ROW_FMA_ROWS


def launch(x, weight, bias, mode, top_k, n_group, topk_group, norm_topk_prob, scale, *,
           config=None, fma=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits and the selection kernel (on CPU tensors under TRITON_INTERPRET=1 too):
    x [T, H], weight [E, H] (H contiguous), bias [E] with mode 0. Up to MAX_ROWS rows the
    logits kernel (config: logits_config's tuple; fma: ROW_FMA, row_fma's rule when None),
    past it HF's fp32 GEMM."""
    T, H = x.shape
    E = weight.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    if T > MAX_ROWS:                  # a prefill: HF's GEMM, the same logits (one "split")
        split = 1
        partial = F.linear(x.type(torch.float32), weight.type(torch.float32))[None]
    else:
        block_e, split, block_k, warps, stages = config or logits_config(E, H)
        chunk = triton.cdiv(triton.cdiv(H, split), block_k) * block_k  # H values per split
        split = triton.cdiv(H, chunk)                                  # no empty splits
        partial = torch.empty((split, T, E), dtype=torch.float32, device=x.device)
        fma = row_fma(T, weight) if fma is None else fma
        kernel = torch.library.wrap_triton(router_logits_kernel)         # [SPLIT, T, E]
        kernel[(triton.cdiv(E, block_e), split)](
            x, weight, partial, T, E, H, chunk, x.stride(0), weight.stride(0),
            BLOCK_T=triton.next_power_of_2(T) if fma else max(16, triton.next_power_of_2(T)),
            BLOCK_E=block_e, BLOCK_K=block_k, EVEN_K=H % chunk == 0,
            W_F32=weight.dtype == torch.float32, DOT_F32=not x.is_cuda, ROW_FMA=bool(fma),
            num_warps=warps, num_stages=stages)
    topk_idx = torch.empty((T, top_k), dtype=torch.int64, device=x.device)          # [T, K]
    topk_weight = torch.empty((T, top_k), dtype=torch.float32, device=x.device)     # [T, K]
    grouped = mode != 1
    lanes_e = max(16, triton.next_power_of_2(E))                     # the select's blocks
    lanes_g = max(2, triton.next_power_of_2(n_group if grouped else 1))
    if mode == 0:
        bias = bias if bias.stride(-1) == 1 else bias.contiguous()
    select = torch.library.wrap_triton(router_select_kernel)
    select[(T,)](
        partial, bias if mode == 0 else partial, topk_idx, topk_weight,
        T, E, E // n_group if grouped else E, n_group if grouped else 1,
        topk_group if grouped else 1, top_k, float(scale),
        SPLIT=split, MODE=mode, NORM=bool(norm_topk_prob) and mode == 0,
        BLOCK_E=lanes_e, BLOCK_G=lanes_g, BLOCK_K=max(2, triton.next_power_of_2(top_k)),
        GROUPS_2D=grouped and E == lanes_e and n_group == lanes_g, LIBDEVICE=x.is_cuda,
        num_warps=SELECT_WARPS, num_stages=1)
    return topk_idx, topk_weight


def _group_mask(group_scores: torch.Tensor, topk_group: int, num_experts: int) -> torch.Tensor:
    """bool [T, E]: the experts of each token's topk_group best groups (group_scores [T, G])."""
    T, G = group_scores.shape
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]   # [T, topk_group]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    return group_mask.unsqueeze(-1).expand(-1, G, num_experts // G).reshape(-1, num_experts).bool()


def route_torch(x, weight, bias, mode, top_k, n_group, topk_group, norm_topk_prob,
                scale) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_idx [T, K] int64, topk_weight [T, K] fp32): HF's router modules' own torch calls
    (DeepseekV3TopkRouter for mode 0, DeepseekV2TopkRouter for modes 1 and 2) on x [T, H]."""
    E = weight.shape[0]
    logits = F.linear(x.type(torch.float32), weight.type(torch.float32))      # [T, E]
    if mode == 0:
        G = n_group
        scores = logits.sigmoid()
        choice = scores + bias
        group_scores = choice.view(-1, G, E // G).topk(2, dim=-1)[0].sum(dim=-1)   # [T, G]
        choice = choice.masked_fill(~_group_mask(group_scores, topk_group, E), float("-inf"))
        topk_idx = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]       # [T, K]
        topk_weight = scores.gather(1, topk_idx)
        if norm_topk_prob:
            topk_weight = topk_weight / (topk_weight.sum(dim=-1, keepdim=True) + 1e-20)
        return topk_idx, topk_weight * scale
    scores = logits.softmax(dim=-1, dtype=torch.float32)
    if mode == 2:
        G = n_group
        group_scores = scores.view(-1, G, E // G).max(dim=-1).values             # [T, G]
        scores = scores.masked_fill(~_group_mask(group_scores, topk_group, E), 0.0)
    topk_weight, topk_idx = torch.topk(scores, k=top_k, dim=-1, sorted=False)
    return topk_idx, topk_weight * scale


@torch.library.triton_op("mla::moe_route", mutates_args={})
def moe_route(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], mode: int,
              top_k: int, n_group: int, topk_group: int, norm_topk_prob: bool,
              scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    check_args(x, weight, bias, mode, top_k, n_group, topk_group)
    args = (x, weight, bias, mode, top_k, n_group, topk_group, norm_topk_prob, scale)
    if kernel_serves(x, weight) is not None:
        return route_torch(*args)
    return launch(*args)


@moe_route.register_fake
def _(x, weight, bias, mode, top_k, n_group, topk_group, norm_topk_prob, scale):
    T = check_args(x, weight, bias, mode, top_k, n_group, topk_group)[0]
    return (x.new_empty((T, top_k), dtype=torch.int64),
            x.new_empty((T, top_k), dtype=torch.float32))
