"""An FP8 checkpoint's MoE layer tail at decode rows as one launch: tail.py's ops over
e4m3 weights with 128 x 128 block scales (tail_kernel.py's FP8 mode).

    mla::moe_block_decode_fp8_residual(x [T, H], residual [T, H], <mla::moe_block_decode_fp8's
                                       arguments after x, through group_k>) -> out [T, H]
        out = residual + block(x), the block as mla::moe_block_decode_fp8 computes it
    mla::moe_layer_tail_decode_fp8(o_rows [T, NV], o_proj [H, NV] e4m3, o_proj_scale,
                                   residual, norm_weight, eps, <the same>) -> out [T, H]
        h1 = residual + o_proj(o_rows), out = h1 + block(RMSNorm(h1))

Every product is W8A8 as HF's FP8Linear computes it: the activations quantized per 128
columns in registers (the rows the launch reads or makes), an fp8 dot per 128-column
tile, scaled by the weight's block scale and the activations'. Only 128 x 128 blocks
(DeepSeek-V3 / R1's) are served.
"""
from __future__ import annotations

from typing import Optional

import torch

from lowering.gemm import fp8_linear as fp8_gemm
from lowering.moe import tail
from lowering.moe.fp8_block import check_block_args

FP8 = torch.float8_e4m3fn
GROUP = 128
# tail.py's config tuple; 64-row gate + up items (255 registers, no spills in the SM90
# build; 32-row ones spill 104 bytes)
DEFAULT_CONFIG = (16, 512, 64, 64, 128, 2048, 4, 3, 2, 2048)
CONFIGS: dict[tuple[int, int, int, int], tuple] = {}       # (E, H, I, S) -> config


def serves(x: torch.Tensor, router_weight: torch.Tensor, weights: tuple, scales: tuple,
           group_n: int, group_k: int) -> bool:
    """Whether the kernel serves these tensors (shapes, dtypes and devices only): x [T, H]
    of at most tail.MAX_ROWS rows on CUDA in bf16 / fp16, the router's kernels' weight,
    e4m3 weights and fp32 scales, contiguous, in 128 x 128 blocks; weights = (gate_up,
    down, shared gate, up, down[, o_proj]) and scales alike."""
    if (group_n, group_k) != (GROUP, GROUP):
        return False
    return (tail.rows_serve(x, router_weight)
            and all(w.dtype == FP8 and w.device == x.device and w.is_contiguous() for w in weights)
            and all(s.dtype == torch.float32 and s.device == x.device and s.is_contiguous()
                    for s in scales))


def _checked(op, x, residual, router_weight, bias, mode, top_k, n_group, topk_group,
             norm_topk_prob, scale, gate_up, gate_up_scale, down, down_scale, sg, sgs, su, sus, sd, sds,
             group_n, group_k, o_proj=None, o_proj_scale=None):
    """((gate_up, down, sg, su, sd), their scales) after the checks of the op's arguments."""
    shared = ((sg, sgs), (su, sus), (sd, sds))
    check_block_args(x, router_weight, bias, mode, top_k, n_group, topk_group, gate_up,
                     gate_up_scale, down, down_scale, shared, group_n, group_k)
    if residual.dtype != x.dtype:
        raise ValueError(f"residual must be {x.dtype} [{x.shape[0]}, {x.shape[1]}], got "
                         f"{residual.dtype} {tuple(residual.shape)}")
    tail.check_residual(x, residual, "moe_block_decode_fp8")
    weights, scales = (gate_up, down, sg, su, sd), (gate_up_scale, down_scale, sgs, sus, sds)
    if o_proj is not None:
        weights, scales = weights + (o_proj,), scales + (o_proj_scale,)
    if x.is_cuda and not serves(x, router_weight, weights, scales, group_n, group_k):
        raise ValueError(f"mla::{op}: its kernel does not serve these tensors "
                         f"(lowering.moe.fp8_tail.serves says which it does); run the "
                         f"layer's separate ops instead")
    tail.require_interpreter(op, x)
    return weights[:5], scales[:5]


def _config(gate_up, H, sg) -> tuple:
    E, I, S = gate_up.shape[0], gate_up.shape[1] // 2, sg.shape[0]
    return CONFIGS.get((E, H, I, S), DEFAULT_CONFIG)


@torch.library.custom_op("mla::moe_block_decode_fp8_residual", mutates_args=())
def moe_block_decode_fp8_residual(
        x: torch.Tensor, residual: torch.Tensor, router_weight: torch.Tensor,
        bias: Optional[torch.Tensor], mode: int, top_k: int, n_group: int, topk_group: int,
        norm_topk_prob: bool, scale: float, gate_up: torch.Tensor,
        gate_up_scale: torch.Tensor, down: torch.Tensor, down_scale: torch.Tensor,
        shared_gate: torch.Tensor, shared_gate_scale: torch.Tensor, shared_up: torch.Tensor,
        shared_up_scale: torch.Tensor, shared_down: torch.Tensor,
        shared_down_scale: torch.Tensor, group_n: int, group_k: int) -> torch.Tensor:
    route = (router_weight, bias, mode, top_k, n_group, topk_group, norm_topk_prob, scale)
    (gu, dn, sg, su, sd), scales = _checked(
        "moe_block_decode_fp8_residual", x, residual, *route, gate_up, gate_up_scale, down,
        down_scale, shared_gate, shared_gate_scale, shared_up, shared_up_scale, shared_down,
        shared_down_scale, group_n, group_k)
    return tail.launch(x.contiguous(), residual.contiguous(), *route, gu, dn, sg, su, sd,
                       config=_config(gu, x.shape[1], sg), scales=scales)[0]


@moe_block_decode_fp8_residual.register_fake
def _(x, residual, *rest):
    return torch.empty_like(residual)


@torch.library.custom_op("mla::moe_layer_tail_decode_fp8", mutates_args=())
def moe_layer_tail_decode_fp8(
        o_rows: torch.Tensor, o_proj: torch.Tensor, o_proj_scale: torch.Tensor,
        residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
        router_weight: torch.Tensor, bias: Optional[torch.Tensor], mode: int, top_k: int,
        n_group: int, topk_group: int, norm_topk_prob: bool, scale: float,
        gate_up: torch.Tensor, gate_up_scale: torch.Tensor, down: torch.Tensor,
        down_scale: torch.Tensor, shared_gate: torch.Tensor, shared_gate_scale: torch.Tensor,
        shared_up: torch.Tensor, shared_up_scale: torch.Tensor, shared_down: torch.Tensor,
        shared_down_scale: torch.Tensor, group_n: int, group_k: int) -> torch.Tensor:
    tail.check_front(o_rows, residual, norm_weight)
    T, H = residual.shape
    if o_proj.dim() != 2 or tuple(o_proj.shape) != (H, o_rows.shape[1]):
        raise ValueError(f"o_proj must be [{H}, {o_rows.shape[1]}], got {tuple(o_proj.shape)}")
    fp8_gemm.check_fp8_weight("o_proj", o_proj, o_proj_scale, group_n, group_k)
    route = (router_weight, bias, mode, top_k, n_group, topk_group, norm_topk_prob, scale)
    (gu, dn, sg, su, sd), scales = _checked(
        "moe_layer_tail_decode_fp8", residual, residual, *route, gate_up, gate_up_scale, down,
        down_scale, shared_gate, shared_gate_scale, shared_up, shared_up_scale, shared_down,
        shared_down_scale, group_n, group_k, o_proj, o_proj_scale)
    front = (o_rows.contiguous(), o_proj, norm_weight, eps, o_proj_scale)
    return tail.launch(None, residual.contiguous(), *route, gu, dn, sg, su, sd, front=front,
                       config=_config(gu, H, sg), scales=scales)[0]


@moe_layer_tail_decode_fp8.register_fake
def _(o_rows, o_proj, o_proj_scale, residual, *rest):
    return torch.empty_like(residual)
