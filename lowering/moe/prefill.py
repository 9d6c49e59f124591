"""A DeepSeek MoE block's routed experts for a prefill batch: torch's grouped GEMM, then one
kernel that weights and sums the pairs' outputs back per token.

    grouped_experts(x [T, H], topk_idx [T, K], topk_weight [T, K], gate_up [E, 2I, H],
                    down [E, H, I]) -> [T, H] in x's dtype

The steps are HF's grouped_mm experts (transformers.integrations.moe), the same torch
calls in the same order up to the down projection, so the same GEMMs run on the same
rows:

    ids, perm = sort(topk_idx.flatten())             pairs in expert order     [P]
    xs = x[perm // K]                                                          [P, H]
    offs = cumsum(histc(ids, E))                     each expert's last row    [E]
    h = SiLU(gate) * up,  [gate | up] = xs @ gate_up[e].T  (grouped)           [P, I]
    y = h @ down[e].T                                      (grouped)           [P, H]

then mla::moe_combine (combine_kernel.py) writes out[t] = sum_k w[t, k] * y[slot[t, k]]
in fp32, rounded once, where HF makes an fp32 weighted copy of y, gathers it back to token
order and sums it (three passes over P x H fp32 values: at DeepSeek-V3's shape and 8192
tokens, 3.9 ms of a 51 ms forward on an H200). The sum over k runs in another order than
torch's, so a result can differ from HF's by an fp32 rounding before the final one.

Served where serves() says (CUDA, bf16 / fp16, torch with _grouped_mm, no grad wanted);
the block falls back to HF's experts elsewhere.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton

from lowering.moe.combine_kernel import moe_combine_kernel

BLOCK_H = 1024


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


def grouped_experts(x, topk_idx, topk_weight, gate_up, down) -> torch.Tensor:
    """The routed experts of a prefill batch (module docstring): [T, H] in x's dtype."""
    K = topk_idx.shape[1]
    E, I = gate_up.shape[0], gate_up.shape[1] // 2
    _, perm, counts, slot = sorted_pairs(topk_idx, E)
    xs = x[perm // K]                                                            # [P, H]
    offs = torch.cumsum(counts, dim=0, dtype=torch.int32)                        # [E]
    gu = torch._grouped_mm(xs, gate_up.transpose(-2, -1), offs=offs)             # [P, 2I]
    h = F.silu(gu[:, :I]) * gu[:, I:]                                            # [P, I]
    y = torch._grouped_mm(h, down.transpose(-2, -1), offs=offs)                  # [P, H]
    return torch.ops.mla.moe_combine(y, slot, topk_weight)
