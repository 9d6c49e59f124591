"""A DeepSeek MoE block's decode rows over fp8 block-quantized weights (DeepSeek-V3 / R1
checkpoints: HF's FP8Experts and FP8Linear shared experts) as one graph op, the shared
experts on a second stream: block.py's op for an FP8 checkpoint.

    mla::moe_block_decode_fp8(x [T, H], router_weight [E, H], bias [E] | None, mode, top_k,
                              n_group, topk_group, norm_topk_prob, scale,
                              gate_up [E, 2I, H] e4m3, gate_up_scale, down [E, H, I] e4m3,
                              down_scale, shared_gate [S, H] e4m3, shared_gate_scale,
                              shared_up [S, H] e4m3, shared_up_scale, shared_down [H, S]
                              e4m3, shared_down_scale, group_n, group_k,
                              x_q=None, x_s=None)
        -> pairs [T, K, H] fp32, shared [1, T, H] in x's dtype

    pairs[t, k] = topk_weight[t, k] * expert_{topk_idx[t, k]}(x[t]): the router as
                  mla::moe_route picks (router.py), each pair as fp8_experts.py's kernels
                  leave it before their sum over k;
    shared      = the shared experts' down_proj(SiLU(gate(x)) * up(x)) as the fp8 decode
                  GEMM ops compute it (W8A8, HF's FP8Linear numerics), rounded to x's dtype.

x_q, x_s (optional): x already quantized per group_k columns by the kernel that produced it
(the post-attention norm, mla::residual_rms_norm_fp8): the routed experts' gate_up and the
shared experts' gate + up read them instead of quantizing x themselves (the same values).

The caller sums, pairs.sum(1).to(dtype) + shared[0] (block.py's expression), which is
what the separate ops (mla::moe_route, mla::moe_experts_decode_fp8,
mla::decode_gate_up_fp8, mla::decode_linear_fp8) leave in the graph: the result is bit
for bit the block run op by op.

Why: at one row the shared experts' GEMMs (two launches and their split-K reduces) and
the router's two kernels each leave most SMs idle while the routed experts stream at the
bandwidth. Here the shared experts run on a side stream, forked after the outputs and
the branch's scratch (its hidden row, quantized activations, split-K partials:
shared_scratch) are allocated on the caller's stream, and joined before the op returns
(a CUDA graph captures both branches), as fork_shared asks of its callers.

CUDA runs the streams; on the CPU (tests, TRITON_INTERPRET=1) the same launches run in
order. Callers check block_serves first (mla_ops/hf/moe.py); the op checks shapes,
dtypes and scales (host ints only, nothing read from the device).
"""
from __future__ import annotations

from typing import Optional

import torch

from lowering.gemm import fp8_launch, fp8_linear as fp8_gemm
from lowering.gemm.fp8_act_quant import given_quant
from lowering.gemm.fp8_linear_configs import pick_config
from lowering.moe import fp8_experts
from lowering.moe import router as moe_router
from lowering.moe.block import check_shared_shapes, fork_shared, require_kernels


def block_serves(x: torch.Tensor, router_weight: torch.Tensor, gate_up, gate_up_scale, down,
                 down_scale, shared_gate, shared_gate_scale, shared_up, shared_up_scale,
                 shared_down, shared_down_scale, group_n: int, group_k: int) -> bool:
    """Whether the op's kernels serve these tensors (shapes, dtypes, devices and settings
    only, so traced code can branch on it): the router's, the fp8 routed experts' and the
    fp8 decode GEMMs' for the shared experts."""
    if x.dim() != 2 or moe_router.kernel_serves(x, router_weight) is not None:
        return False
    if not fp8_experts.kernel_serves(x, gate_up, gate_up_scale, down, down_scale, group_k):
        return False
    S, H = shared_gate.shape if shared_gate.dim() == 2 else (-1, -1)
    if (H != x.shape[1] or shared_up.shape != shared_gate.shape
            or tuple(shared_down.shape) != (H, S)):
        return False
    pairs = [(shared_gate, shared_gate_scale), (shared_up, shared_up_scale),
             (shared_down, shared_down_scale)]
    return fp8_gemm.fp8_linear_unmet(x, pairs, group_n, group_k) is None


def _check(x, router_weight, bias, mode, top_k, n_group, topk_group, gate_up, gate_up_scale,
           down, down_scale, shared, group_n, group_k) -> None:
    moe_router.check_args(x, router_weight, bias, mode, top_k, n_group, topk_group)
    fp8_experts.check_scales(gate_up, gate_up_scale, down, down_scale, group_n, group_k)
    H = x.shape[1]
    if gate_up.shape[2] != H:
        raise ValueError(f"gate_up must be [E, 2I, {H}] for x [T, {H}], got "
                         f"{tuple(gate_up.shape)}")
    (sg, sgs), (su, sus), (sd, sds) = shared
    check_shared_shapes(H, sg, su, sd)
    for name, w, s in (("shared_gate", sg, sgs), ("shared_up", su, sus),
                       ("shared_down", sd, sds)):
        fp8_gemm.check_fp8_weight(name, w, s, group_n, group_k)
        if w.device != x.device:
            raise ValueError(f"{name} is on {w.device}, x on {x.device}")


def shared_scratch(x, shared, group_k, x_quant) -> tuple:
    """(h [T, S], the gate + up GEMM's scratch, the down GEMM's): every buffer _shared
    writes besides its output, made on the caller's stream before the fork."""
    (sg, _), (su, _), (sd, _) = shared
    T, H = x.shape
    S = sg.shape[0]
    h = torch.empty((T, S), dtype=x.dtype, device=x.device)                   # [T, S]
    return (h, fp8_launch.scratch(x, sg, su, 2, group_k, pick_config(2, S, H, T, group_k),
                                x_quant),
            fp8_launch.scratch(h, sd, None, 0, group_k, pick_config(0, H, S, T, group_k)))


def _shared(x, shared, out, group_n, group_k, x_quant, made) -> None:
    """out [T, H] = down(SiLU(x @ gate.T) * (x @ up.T)), each GEMM as its decode op runs it;
    made: shared_scratch()."""
    (sg, sgs), (su, sus), (sd, sds) = shared
    T, H = x.shape
    S = sg.shape[0]
    h, made_gate_up, made_down = made
    fp8_launch.run(x, sg, sgs, su, sus, 2, h, None, group_n, group_k,
                 pick_config(2, S, H, T, group_k), x_quant=x_quant, made=made_gate_up)
    fp8_launch.run(h, sd, sds, None, None, 0, out, None, group_n, group_k,
                 pick_config(0, H, S, T, group_k), made=made_down)


def _routed(x, route, gate_up, gate_up_scale, down, down_scale, group_n, group_k,
            pairs, x_quant) -> None:
    topk_idx, topk_weight = moe_router.launch(x, *route)
    T, K, H = pairs.shape
    fp8_experts.launch_pairs(x, topk_idx, topk_weight, gate_up, gate_up_scale, down,
                             down_scale, group_n, group_k, pairs.view(T * K, H),
                             x_quant=x_quant)


@torch.library.custom_op("mla::moe_block_decode_fp8", mutates_args=())
def moe_block_decode_fp8(x: torch.Tensor, router_weight: torch.Tensor,
                         bias: Optional[torch.Tensor], mode: int, top_k: int, n_group: int,
                         topk_group: int, norm_topk_prob: bool, scale: float,
                         gate_up: torch.Tensor, gate_up_scale: torch.Tensor,
                         down: torch.Tensor, down_scale: torch.Tensor,
                         shared_gate: torch.Tensor, shared_gate_scale: torch.Tensor,
                         shared_up: torch.Tensor, shared_up_scale: torch.Tensor,
                         shared_down: torch.Tensor, shared_down_scale: torch.Tensor,
                         group_n: int, group_k: int, x_q: Optional[torch.Tensor] = None,
                         x_s: Optional[torch.Tensor] = None) -> tuple[torch.Tensor,
                                                                      torch.Tensor]:
    shared_w = ((shared_gate, shared_gate_scale), (shared_up, shared_up_scale),
                (shared_down, shared_down_scale))
    _check(x, router_weight, bias, mode, top_k, n_group, topk_group, gate_up, gate_up_scale,
           down, down_scale, shared_w, group_n, group_k)
    x_quant = given_quant(x, x_q, x_s, group_k)                   # [T, H], [T, G] or None
    weights = (gate_up, gate_up_scale, down, down_scale, *shared_w[0], *shared_w[1],
               *shared_w[2], group_n, group_k)
    require_kernels("moe_block_decode_fp8", x,
                    lambda: block_serves(x, router_weight, *weights),
                    "lowering.moe.fp8_block.block_serves",
                    "mla::moe_route, mla::moe_experts_decode_fp8, the fp8 decode GEMMs")
    T, H = x.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    route = (router_weight, bias, mode, top_k, n_group, topk_group, norm_topk_prob, scale)
    # the outputs are allocated here, on the caller's stream
    shared = torch.empty((1, T, H), dtype=x.dtype, device=x.device)             # [1, T, H]
    pairs = torch.empty((T, top_k, H), dtype=torch.float32, device=x.device)    # [T, K, H]
    routed = (x, route, gate_up, gate_up_scale, down, down_scale, group_n, group_k, pairs,
              x_quant)
    made = shared_scratch(x, shared_w, group_k, x_quant)       # the side branch's scratch
    fork_shared(x, lambda: _shared(x, shared_w, shared[0], group_n, group_k, x_quant, made),
                lambda: _routed(*routed))
    return pairs, shared


@moe_block_decode_fp8.register_fake
def _(x, router_weight, bias, mode, top_k, n_group, topk_group, norm_topk_prob, scale,
      gate_up, gate_up_scale, down, down_scale, shared_gate, shared_gate_scale, shared_up,
      shared_up_scale, shared_down, shared_down_scale, group_n, group_k, x_q=None, x_s=None):
    T, H = x.shape
    return x.new_empty((T, top_k, H), dtype=torch.float32), x.new_empty((1, T, H))
