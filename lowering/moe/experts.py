"""A DeepSeek MoE block's routed experts for a decode step's few rows, as one graph op.

    mla::moe_experts_decode(x [T, H], topk_idx [T, K] int, topk_weight [T, K] fp32,
                            gate_up [E, 2I, H], down [E, H, I]) -> [T, H] in x's dtype
        = sum over k of topk_weight[t, k] * down[e] @ (SiLU(gate[e] @ x[t]) * (up[e] @ x[t])),
          e = topk_idx[t, k]; gate = gate_up[:, :I], up = gate_up[:, I:]

HF's DeepseekV3Experts / DeepseekV2Experts with their weights as stored (no copies). Each
linear's output is rounded to x's dtype, the weighted products summed over k in fp32 and
rounded once (what HF's grouped_mm experts compute, in another summation order).

On CUDA in bf16 / fp16 with at most MAX_ROWS tokens: two weight-streaming Triton kernels
(gate_up_kernel.py, down_kernel.py) over the (token, k) pairs, one program per chosen expert
serving all its pairs (expert_run.py), so a decode step reads each chosen expert's weights
once; static shapes and no host syncs, so a
compiled step captures in a CUDA graph. Anything else runs the torch reference below
(pairs gathered, for small T; the HF block uses a grouped GEMM for more rows).
Defined with torch.library.triton_op, so Inductor sees the kernels.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton

from lowering.moe.down_kernel import moe_down_kernel
from lowering.moe.gate_up_kernel import moe_gate_up_kernel

MAX_ROWS = 64

# (kernel, N, K, tokens <= 16) -> (BLOCK_N, BLOCK_K, num_warps, num_stages), N the weight
# rows a kernel streams per expert (gate_up: I, down: H) and K their length; DEFAULT_CONFIG
# elsewhere. Entries come from benchmarks/bench_moe.py --sweep on the target GPU.
# BLOCK_M (tokens of one expert per dot) is 16, the smallest tl.dot takes.
# H200, torch 2.11, triton 3.6 (2026-12-02): "<= 16" rows take the T = 1 winner (the
# latency case; at T = 8 every config sat at the byte floor within a few percent), "> 16"
# the T = 32 winner.
CONFIGS: dict[tuple, tuple[int, int, int, int]] = {
    ("gate_up", 1408, 2048, True): (32, 128, 4, 3),     # V2-Lite T=1: 28.3 µs
    ("down", 2048, 1408, True): (64, 128, 4, 4),        # V2-Lite T=1: 17.5 µs
    ("gate_up", 1408, 2048, False): (64, 128, 4, 2),    # V2-Lite T=32: 179.4 µs
    ("down", 2048, 1408, False): (64, 128, 4, 4),       # V2-Lite T=32: 98.5 µs
    ("gate_up", 2048, 7168, True): (64, 128, 4, 3),     # V3 T=1: 119.7 µs
    ("down", 7168, 2048, True): (64, 128, 4, 4),        # V3 T=1: 68.1 µs
    ("gate_up", 2048, 7168, False): (64, 128, 8, 3),    # V3 T=32: 1932.7 µs
    ("down", 7168, 2048, False): (64, 128, 4, 4),       # V3 T=32: 981.6 µs
}
DEFAULT_CONFIG = {"gate_up": (32, 128, 4, 3), "down": (64, 128, 4, 3)}
BLOCK_M = 16


def pick_config(kernel: str, N: int, K: int, T: int) -> tuple[int, int, int, int]:
    return CONFIGS.get((kernel, N, K, T <= 16), DEFAULT_CONFIG[kernel])


def check_args(x, topk_idx, topk_weight, gate_up, down) -> tuple[int, int, int, int, int]:
    """(T, K, E, I, H) after checking shapes, dtypes and devices (host-only checks). Expert
    ids are not read on the host: the kernels skip pairs whose id is outside [0, E) (their
    rows add zero), the torch reference raises indexing them."""
    T, H, E, I = check_weights(x, gate_up, down)
    if topk_idx.dim() != 2 or topk_idx.shape[0] != T:
        raise ValueError(f"topk_idx must be [{T}, K], got {tuple(topk_idx.shape)}")
    if tuple(topk_weight.shape) != tuple(topk_idx.shape):
        raise ValueError(f"topk_weight must be {tuple(topk_idx.shape)} like topk_idx, got "
                         f"{tuple(topk_weight.shape)}")
    if topk_idx.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_idx must be int32 or int64, got {topk_idx.dtype}")
    if not topk_weight.is_floating_point():
        raise TypeError(f"topk_weight must be floating point, got {topk_weight.dtype}")
    for name, t in (("topk_idx", topk_idx), ("topk_weight", topk_weight)):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
    return T, topk_idx.shape[1], E, I, H


def check_weights(x, gate_up, down) -> tuple[int, int, int, int]:
    """(T, H, E, I) after checking x [T, H] and the experts' weights (shapes, dtypes,
    devices; host-only checks)."""
    if x.dim() != 2:
        raise ValueError(f"x must be [T, H], got {tuple(x.shape)}")
    T, H = x.shape
    if gate_up.dim() != 3 or gate_up.shape[2] != H or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [E, 2I, {H}], got {tuple(gate_up.shape)}")
    E, I = gate_up.shape[0], gate_up.shape[1] // 2
    if tuple(down.shape) != (E, H, I):
        raise ValueError(f"down must be [{E}, {H}, {I}] to match gate_up, got {tuple(down.shape)}")
    for name, w in (("gate_up", gate_up), ("down", down)):
        if w.dtype != x.dtype:
            raise TypeError(f"{name} is {w.dtype}, x is {x.dtype}: they must match")
        if w.device != x.device:
            raise ValueError(f"{name} is on {w.device}, x on {x.device}")
    return T, H, E, I


def kernel_serves(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether the Triton kernels serve this call (else the torch reference does)."""
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and 0 < x.shape[0] <= MAX_ROWS
            and gate_up.stride(-1) == 1 and down.stride(-1) == 1)


def flat_pairs(topk_idx: torch.Tensor) -> torch.Tensor:
    """[P] the T * K pairs' experts, pair p = (token p // K, k p % K), as the kernels read
    them (expert_run.py: no sort)."""
    return topk_idx.reshape(-1).contiguous()


def launch_gate_up(x, gate_up, pairs, top_k, h, config):
    """h [P, I] = SiLU(gate) * up per pair (gate_up_kernel.py); x [T, H] with unit last
    stride, pairs [P] (flat_pairs)."""
    H = x.shape[1]
    P, I = h.shape
    block_n, block_k, warps, stages = config
    kernel = torch.library.wrap_triton(moe_gate_up_kernel)
    kernel[(P, triton.cdiv(I, block_n))](
        x, gate_up, h, pairs, P, gate_up.shape[0], I, H, top_k,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), h.stride(0),
        BLOCK_R=max(16, triton.next_power_of_2(P)), BLOCK_M=BLOCK_M, BLOCK_N=block_n,
        BLOCK_K=block_k, EVEN_K=H % block_k == 0, DOT_F32=not x.is_cuda,
        num_warps=warps, num_stages=stages)


def launch_down(h, down, weight, pairs, top_k, out, config):
    """out [P, H] fp32 = weight[p] * (h[p] @ down[e].T) per pair (down_kernel.py)."""
    P, I = h.shape
    H = down.shape[1]
    block_n, block_k, warps, stages = config
    kernel = torch.library.wrap_triton(moe_down_kernel)
    kernel[(P, triton.cdiv(H, block_n))](
        h, down, weight, out, pairs, P, down.shape[0], H, I, top_k,
        h.stride(0), down.stride(0), down.stride(1), out.stride(0),
        BLOCK_R=max(16, triton.next_power_of_2(P)), BLOCK_M=BLOCK_M, BLOCK_N=block_n,
        BLOCK_K=block_k, EVEN_K=I % block_k == 0, DOT_F32=not h.is_cuda,
        num_warps=warps, num_stages=stages)


def run_kernels(x, topk_idx, topk_weight, gate_up, down) -> torch.Tensor:
    """The op's kernel path on any device (on CPU under TRITON_INTERPRET=1): [T, H] in x's
    dtype. Arguments already checked (check_args)."""
    T, H = x.shape
    K = topk_idx.shape[1]
    E, I = gate_up.shape[0], gate_up.shape[1] // 2
    x = x if x.stride(-1) == 1 else x.contiguous()
    pairs = flat_pairs(topk_idx)                                             # [P]
    weight = topk_weight.reshape(-1).to(torch.float32)                       # [P]
    h = torch.empty((T * K, I), dtype=x.dtype, device=x.device)              # [P, I]
    launch_gate_up(x, gate_up, pairs, K, h, pick_config("gate_up", I, H, T))
    out = torch.empty((T * K, H), dtype=torch.float32, device=x.device)      # [P, H], all written
    launch_down(h, down, weight, pairs, K, out, pick_config("down", H, I, T))
    return out.view(T, K, H).sum(1).to(x.dtype)                              # [T, H]


def reference(x, topk_idx, topk_weight, gate_up, down) -> torch.Tensor:
    """The same sum in torch, the chosen experts' weights gathered per pair (small T)."""
    T, H = x.shape
    K = topk_idx.shape[1]
    I = gate_up.shape[1] // 2
    idx = topk_idx.reshape(-1)                                               # [P]
    xp = x.repeat_interleave(K, dim=0)                                       # [P, H]
    gu = torch.bmm(gate_up[idx], xp.unsqueeze(-1)).squeeze(-1)               # [P, 2I]
    h = F.silu(gu[:, :I]) * gu[:, I:]                                        # [P, I]
    y = torch.bmm(down[idx], h.unsqueeze(-1)).squeeze(-1)                    # [P, H]
    y = y * topk_weight.reshape(-1, 1).to(torch.float32)
    return y.view(T, K, H).sum(1).to(x.dtype)


@torch.library.triton_op("mla::moe_experts_decode", mutates_args={})
def moe_experts_decode(x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor,
                       gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    check_args(x, topk_idx, topk_weight, gate_up, down)
    if not kernel_serves(x, gate_up, down):
        return reference(x, topk_idx, topk_weight, gate_up, down)
    return run_kernels(x, topk_idx, topk_weight, gate_up, down)
