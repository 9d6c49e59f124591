"""A DeepSeek MoE block's routed experts over block-quantized fp8 weights (DeepSeek-V3 / R1
checkpoints loaded by HF's FineGrainedFP8: FP8Experts) for a decode step, as one graph op.

    mla::moe_experts_decode_fp8(x [T, H], topk_idx [T, K] int, topk_weight [T, K] fp32,
        gate_up [E, 2I, H] e4m3, gate_up_scale [E, 2 * cdiv(I, gn), cdiv(H, gk)] fp32,
        down [E, H, I] e4m3, down_scale [E, cdiv(H, gn), cdiv(I, gk)] fp32, gn, gk)
        -> [T, H] in x's dtype

the sum over k of topk_weight[t, k] * down[e] @ (SiLU(gate[e] @ x[t]) * (up[e] @ x[t])) with
the weights dequantized (value = stored * scale_inv of its (gn, gk) block; gate's and up's
blocks stored one after the other, as HF concatenates the checkpoint's gate_proj and
up_proj).

On CUDA in bf16 / fp16 with at most MAX_ROWS tokens: fp8_gate_up_kernel.py and
fp8_down_kernel.py, which stream only the chosen experts' fp8 rows and compute each linear
as HF's FP8Linear does (activations quantized per gk columns, W8A8 with fp32
accumulation); the routing sum as experts.py's kernels. More tokens on CUDA: the grouped
W8A8 GEMMs of fp8_prefill.py over the pairs sorted by expert (the same numerics per linear;
each pair's output rounded to x's dtype before the weighted sum, as HF's grouped path).
Anything else: the torch reference of experts.py on the chosen experts' weights
dequantized (what HF computes on the CPU, where it loads an FP8 checkpoint dequantized).
"""
from __future__ import annotations

import torch
import triton

from lowering.gemm.fp8_act_quant import quantized
from lowering.moe import experts as moe
from lowering.moe import fp8_prefill
from lowering.moe.fp8_down_kernel import moe_down_fp8_kernel
from lowering.moe.fp8_gate_up_kernel import moe_gate_up_fp8_kernel

FP8 = torch.float8_e4m3fn
MAX_ROWS = moe.MAX_ROWS

# (kernel, N, K, tokens <= 16) -> (BLOCK_N, num_warps, num_stages, PRE_QUANT); BLOCK_K is
# the scale group; PRE_QUANT: the kernel's activations (x for gate_up, h for down)
# quantized once before it by act_quant_kernel, else by every program in registers (the
# same numbers either way). docs/notes/probe_fp8_experts_prequant.py on an H200 (torch
# 2.11, triton 3.6, 2026-12-04), DeepSeek-V3's experts, top-8 of 256, µs of both kernels:
# in-program quant 187.4 (1 token) / 3752.0 (32), quantized once 136.7 / 1940.9, and with
# gate_up's tile below 113.7 / 1701.9. DEFAULT_CONFIG serves the other shapes.
CONFIGS: dict[tuple, tuple[int, int, int, bool]] = {
    ("gate_up", 2048, 7168, True): (64, 4, 3, True),      # V3, 1 token
    ("gate_up", 2048, 7168, False): (64, 4, 3, True),     # V3, 32 tokens
}
DEFAULT_CONFIG = {"gate_up": (32, 4, 3, True), "down": (64, 4, 3, True)}
ACT_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


def pick_config(kernel: str, N: int, K: int, T: int) -> tuple[int, int, int, bool]:
    return CONFIGS.get((kernel, N, K, T <= 16), DEFAULT_CONFIG[kernel])


def check_scales(gate_up, gate_up_scale, down, down_scale, gn: int, gk: int) -> None:
    """Raise a ValueError / TypeError naming the tensor unless the fp8 expert weights and
    their scales agree (host-only checks)."""
    for name, w in (("gate_up", gate_up), ("down", down)):
        if w.dtype != FP8 or w.dim() != 3:
            raise TypeError(f"{name} must be a 3-D float8_e4m3fn tensor, got {w.dtype} "
                            f"{tuple(w.shape)}")
    E, I2, H = gate_up.shape
    if I2 % 2 or tuple(down.shape) != (E, H, I2 // 2):
        raise ValueError(f"gate_up [E, 2I, H] and down [E, H, I] disagree: "
                         f"{tuple(gate_up.shape)}, {tuple(down.shape)}")
    I = I2 // 2
    want = {"gate_up_scale": (E, 2 * triton.cdiv(I, gn), triton.cdiv(H, gk)),
            "down_scale": (E, triton.cdiv(H, gn), triton.cdiv(I, gk))}
    for name, s in (("gate_up_scale", gate_up_scale), ("down_scale", down_scale)):
        if s.dtype != torch.float32 or tuple(s.shape) != want[name]:
            raise ValueError(f"{name} must be fp32 {want[name]} in ({gn}, {gk}) blocks, got "
                             f"{s.dtype} {tuple(s.shape)}")
        if s.device != gate_up.device:
            raise ValueError(f"{name} is on {s.device}, the weights on {gate_up.device}")


def kernel_serves(x: torch.Tensor, gate_up, gate_up_scale, down, down_scale, gk: int) -> bool:
    """Whether the Triton kernels serve this call (else the dequantizing reference does)."""
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and 0 < x.shape[0] <= MAX_ROWS and gk in (16, 32, 64, 128, 256)
            and all(t.is_contiguous() for t in (gate_up, gate_up_scale, down, down_scale)))


def dequantize_rows(w: torch.Tensor, s: torch.Tensor, gn: int, gk: int, dtype,
                    split: int = 0) -> torch.Tensor:
    """w [P, N, K] e4m3 with s [P, ceil-blocks] -> [P, N, K] in dtype (fp32 product, rounded
    once). split > 0: rows [0, split) and [split, N) have blocks of their own (gate, up)."""
    def expand(s_part, n):
        return s_part.repeat_interleave(gn, 1)[:, :n].repeat_interleave(gk, 2)[..., :w.shape[2]]
    if split:
        rows = triton.cdiv(split, gn)
        scale = torch.cat([expand(s[:, :rows], split),
                           expand(s[:, rows:], w.shape[1] - split)], dim=1)
    else:
        scale = expand(s, w.shape[1])
    return (w.float() * scale.float()).to(dtype)


def reference(x, topk_idx, topk_weight, gate_up, gate_up_scale, down, down_scale, gn, gk):
    """experts.py's reference on the chosen experts' dequantized weights (per pair)."""
    idx = topk_idx.reshape(-1)                                               # [P]
    I = gate_up.shape[1] // 2
    gu = dequantize_rows(gate_up[idx], gate_up_scale[idx], gn, gk, x.dtype, split=I)
    dn = dequantize_rows(down[idx], down_scale[idx], gn, gk, x.dtype)
    pairs = torch.arange(idx.numel(), device=x.device).view_as(topk_idx)     # [T, K]
    return moe.reference(x, pairs, topk_weight, gu, dn)


def launch_pairs(x, topk_idx, topk_weight, gate_up, gate_up_scale, down, down_scale, gn, gk,
                 out, pre_quant=None, x_quant=None) -> None:
    """Both kernels into out fp32 [T * K, H] (every row written): pair (t, k)'s weighted
    expert output, before the sum over k. x [T, H] with a unit last stride. pre_quant:
    (gate_up's, down's) PRE_QUANT over the configs' (None: as they say). x_quant: x
    already quantized by its producer ((e4m3 [T, H], fp32 [T, cdiv(H, gk)]), contiguous),
    which gate_up then reads."""
    T, H = x.shape
    K = topk_idx.shape[1]
    E, I = gate_up.shape[0], gate_up.shape[1] // 2
    P = T * K
    pairs = moe.flat_pairs(topk_idx)                                         # [P]
    weight = topk_weight.reshape(-1).to(torch.float32)                       # [P]
    block_r = max(16, triton.next_power_of_2(P))
    h = torch.empty((P, I), dtype=x.dtype, device=x.device)                  # [P, I]
    bn, warps, stages, pq = pick_config("gate_up", I, H, T)
    pq = (pq if pre_quant is None else pre_quant[0]) or x_quant is not None
    xa, xs, stride_xs = quantized(x, gk, pq, x_quant)         # x, or e4m3 [T, H] + scales
    torch.library.wrap_triton(moe_gate_up_fp8_kernel)[(P, triton.cdiv(I, bn))](
        xa, gate_up, gate_up_scale, h, pairs, P, E, I, H, K,
        triton.cdiv(I, gn), xa.stride(0), gate_up.stride(0), gate_up.stride(1),
        gate_up_scale.stride(0), gate_up_scale.stride(1), h.stride(0),
        BLOCK_R=block_r, BLOCK_M=moe.BLOCK_M, BLOCK_N=bn, BLOCK_K=gk, GROUP_N=gn,
        EVEN_K=H % gk == 0, DOT_F32=not x.is_cuda, xs_ptr=xs, stride_xs=stride_xs,
        PRE_Q=pq, num_warps=warps, num_stages=stages)
    bn, warps, stages, pq = pick_config("down", H, I, T)
    pq = pq if pre_quant is None else pre_quant[1]
    ha, hs, stride_hs = quantized(h, gk, pq)                  # h, or e4m3 [P, I] + scales
    torch.library.wrap_triton(moe_down_fp8_kernel)[(P, triton.cdiv(H, bn))](
        ha, down, down_scale, weight, out, pairs, P, E, H, I, K,
        ha.stride(0), down.stride(0), down.stride(1), down_scale.stride(0),
        down_scale.stride(1), out.stride(0),
        BLOCK_R=block_r, BLOCK_M=moe.BLOCK_M, BLOCK_N=bn, BLOCK_K=gk, GROUP_N=gn,
        EVEN_K=I % gk == 0, DOT_F32=not x.is_cuda, hs_ptr=hs, stride_hs=stride_hs,
        PRE_Q=pq, ACT=ACT_CODES[x.dtype], num_warps=warps, num_stages=stages)


def run_kernels(x, topk_idx, topk_weight, gate_up, gate_up_scale, down, down_scale, gn, gk,
                pre_quant=None):
    """The op's kernel path on any device (on CPU under TRITON_INTERPRET=1): launch_pairs,
    then the sum over k, rounded once to x's dtype."""
    T, H = x.shape
    K = topk_idx.shape[1]
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty((T * K, H), dtype=torch.float32, device=x.device)      # [P, H]
    launch_pairs(x, topk_idx, topk_weight, gate_up, gate_up_scale, down, down_scale, gn, gk,
                 out, pre_quant)
    return out.view(T, K, H).sum(1).to(x.dtype)                              # [T, H]


@torch.library.triton_op("mla::moe_experts_decode_fp8", mutates_args={})
def moe_experts_decode_fp8(x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor,
                           gate_up: torch.Tensor, gate_up_scale: torch.Tensor,
                           down: torch.Tensor, down_scale: torch.Tensor, group_n: int,
                           group_k: int) -> torch.Tensor:
    """Arguments checked by the caller (the converted MoE block checks the scales once at
    convert(); routing tensors come from its own router)."""
    if not kernel_serves(x, gate_up, gate_up_scale, down, down_scale, group_k):
        if fp8_prefill.serves(x, gate_up, gate_up_scale, down, down_scale, group_k):
            return fp8_prefill.grouped_experts(x, topk_idx, topk_weight, gate_up,
                                               gate_up_scale, down, down_scale, group_n,
                                               group_k)                   # prefill-sized
        return reference(x, topk_idx, topk_weight, gate_up, gate_up_scale, down, down_scale,
                         group_n, group_k)
    return run_kernels(x, topk_idx, topk_weight, gate_up, gate_up_scale, down, down_scale,
                       group_n, group_k)
