"""The tail of a DeepSeek MoE decoder layer at a decode step's few rows, as one launch
(tail_kernel.py), in two graph ops:

    mla::moe_block_decode_residual(x [T, H], residual [T, H], router_weight [E, H],
                                   bias [E] | None, mode, top_k, n_group, topk_group,
                                   norm_topk_prob, scale, gate_up [E, 2I, H],
                                   down [E, H, I], shared_gate [S, H], shared_up [S, H],
                                   shared_down [H, S]) -> out [T, H]
        out = residual + block(x): the block as mla::moe_block_decode computes it, then
        the sum mla_ops/hf/moe.py makes of that op's outputs and the residual add

    mla::moe_layer_tail_decode(o_rows [T, NV], o_proj [H, NV], residual [T, H],
                               norm_weight [H], eps, <the block's arguments after x>)
        -> out [T, H]
        h1 = residual + o_rows @ o_proj.T (rounded as HF's add), x = RMSNorm(h1) as
        mla::residual_rms_norm computes it, out = h1 + block(x): the decoder layer after
        its attention's W_UV

Against the shipped ops (o_proj's split-K partials, mla::residual_rms_norm,
mla::moe_block_decode on two streams, the sum): the same products and roundings, fp32
sums in another order (o_proj's slices, the router's partials), so the same experts
except where two choice values lie within that rounding.

serves() says where the kernel runs these tensors (CUDA, bf16 / fp16, at most MAX_ROWS
rows, contiguous weights; on the CPU under TRITON_INTERPRET=1); callers check it first and
run the separate ops elsewhere. The launch keeps its work queue's counters in a buffer
per device that every launch leaves zeroed: launches of the tail on one device run one
after another (one stream, as a decode step and its CUDA graph do).
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import triton

from lowering.moe import block as moe_block
from lowering.moe import experts as moe_experts
from lowering.moe import router as moe_router
from lowering.moe.tail_kernel import moe_tail_kernel

MAX_ROWS = 16                # one 16-wide dot column per row

# (BLOCK_ER, CH_R, BN_G, BN_D, BLOCK_K, CH_S, num_warps, num_stages, programs per SM,
# CH_G): router items of BLOCK_ER experts over CH_R of H; gate + up items of BN_G rows over
# CH_G of H; down items of BN_D rows (the shared experts' over CH_S of S); K tiles of
# BLOCK_K. The SM90 build (triton 3.6) of the default: 184-190 registers, no spills, 60 KB
# of shared memory, the K loops pipelined with cp.async; two programs an SM.
DEFAULT_CONFIG = (16, 512, 32, 64, 128, 2048, 4, 3, 2, 2048)
CONFIGS: dict[tuple[int, int, int, int], tuple] = {}       # (E, H, I, S) -> config
# the front's o_proj items: (BN_O rows of H, CH_O of NV)
DEFAULT_FRONT = (32, 512)
FRONT_CONFIGS: dict[tuple[int, int], tuple[int, int]] = {}  # (H, NV) -> front config
BLOCK_NORM = 1024            # the front's RMSNorm walks a row in chunks of this many

_SYNC: dict = {}


def _counters(dev: torch.device, n: int) -> torch.Tensor:
    """At least n int32 counters, zero: the device's buffer (made once, or larger when a
    launch needs more; every launch leaves it zeroed). While a CUDA graph captures and the
    buffer is missing or short, a buffer of the call's own, zeroed inside the graph (a
    memset before each replay's launch), so nothing made during a capture is kept."""
    buf = _SYNC.get(dev)
    if buf is not None and buf.numel() >= n:
        return buf
    if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.zeros(n, dtype=torch.int32, device=dev)
    _SYNC[dev] = torch.zeros(max(n, 1024), dtype=torch.int32, device=dev)
    return _SYNC[dev]


def config_of(E: int, H: int, I: int, S: int) -> tuple:
    return CONFIGS.get((E, H, I, S), DEFAULT_CONFIG)


def front_config_of(H: int, NV: int) -> tuple[int, int]:
    return FRONT_CONFIGS.get((H, NV), DEFAULT_FRONT)


def rows_serve(x: torch.Tensor, router_weight: torch.Tensor) -> bool:
    """x [T, H] of 1 to MAX_ROWS rows on CUDA that the router's kernels serve (bf16 / fp16):
    what both tails' serves ask of the rows."""
    return (x.is_cuda and x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS
            and moe_router.kernel_serves(x, router_weight) is None)


def check_residual(x, residual, separate: str) -> None:
    """Raise a ValueError unless residual is [T, H] like x and T lies in [1, MAX_ROWS]
    (separate: the op that runs more rows)."""
    T, H = x.shape
    if tuple(residual.shape) != (T, H):
        raise ValueError(f"residual must be [{T}, {H}], got {tuple(residual.shape)}")
    if not 1 <= T <= MAX_ROWS:
        raise ValueError(f"{T} rows: the tail kernel takes 1 to {MAX_ROWS} (a decode step's "
                         f"rows); run mla::{separate} for more")


def serves(x: torch.Tensor, router_weight: torch.Tensor, gate_up: torch.Tensor,
           down: torch.Tensor, shared_gate: torch.Tensor, shared_up: torch.Tensor,
           shared_down: torch.Tensor, o_proj: Optional[torch.Tensor] = None) -> bool:
    """Whether the tail kernel serves these tensors (shapes, dtypes and devices only, so
    traced code can branch on it): x [T, H] of at most MAX_ROWS rows on CUDA in bf16 /
    fp16, the router's kernels' weights, 16-bit experts and shared experts in x's dtype
    with contiguous rows; with o_proj, o_proj [H, NV] likewise."""
    if not rows_serve(x, router_weight):
        return False
    H = x.shape[1]
    ws = (gate_up, down, shared_gate, shared_up, shared_down) + (
        (o_proj,) if o_proj is not None else ())
    if any(w.dtype != x.dtype or w.device != x.device or not w.is_contiguous() for w in ws):
        return False
    S = shared_gate.shape[0]
    return (gate_up.dim() == 3 and gate_up.shape[2] == H and down.dim() == 3
            and tuple(down.shape) == (gate_up.shape[0], H, gate_up.shape[1] // 2)
            and shared_gate.dim() == 2 and shared_gate.shape[1] == H
            and shared_up.shape == shared_gate.shape and tuple(shared_down.shape) == (H, S)
            and (o_proj is None or (o_proj.dim() == 2 and o_proj.shape[0] == H)))


def require_interpreter(op: str, x) -> None:
    """Raise a ValueError where the kernel cannot run x: off CUDA without the interpreter."""
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"mla::{op} runs its kernel on CUDA (x is on {x.device}); on the "
                         f"CPU only under TRITON_INTERPRET=1")


def _require(op: str, x, serves_now: bool) -> None:
    if x.is_cuda and not serves_now:
        raise ValueError(f"mla::{op}: its kernel does not serve these tensors "
                         f"(lowering.moe.tail.serves says which it does); run the layer's "
                         f"separate ops instead (o_proj, mla::residual_rms_norm, "
                         f"mla::moe_block_decode)")
    require_interpreter(op, x)


def check_front(o_rows, residual, norm_weight) -> None:
    """Raise a ValueError / TypeError naming the argument unless o_rows [T, NV], residual
    [T, H] and norm_weight [H] agree (o_proj's own checks are its op's)."""
    if residual.dim() != 2:
        raise ValueError(f"residual must be [T, H], got {tuple(residual.shape)}")
    T, H = residual.shape
    if o_rows.dim() != 2 or o_rows.shape[0] != T:
        raise ValueError(f"o_rows must be [{T}, NV] (the attention's rows after W_UV), got "
                         f"{tuple(o_rows.shape)}")
    if tuple(norm_weight.shape) != (H,):
        raise ValueError(f"norm_weight must be [{H}], got {tuple(norm_weight.shape)}")
    for name, t in (("o_rows", o_rows), ("norm_weight", norm_weight)):
        if t.dtype != residual.dtype or t.device != residual.device:
            raise TypeError(f"{name} must be {residual.dtype} on {residual.device}, got "
                            f"{t.dtype} on {t.device}")


def _check_block(x, router_weight, bias, mode, top_k, n_group, topk_group, gate_up, down,
                 shared_gate, shared_up, shared_down, residual) -> None:
    moe_router.check_args(x, router_weight, bias, mode, top_k, n_group, topk_group)
    H = moe_experts.check_weights(x, gate_up, down)[1]
    moe_block.check_shared_shapes(H, shared_gate, shared_up, shared_down)
    for name, w in (("shared_gate", shared_gate), ("shared_up", shared_up),
                    ("shared_down", shared_down), ("residual", residual)):
        if w.dtype != x.dtype or w.device != x.device:
            raise TypeError(f"{name} must be {x.dtype} on {x.device}, got {w.dtype} on "
                            f"{w.device}")
    check_residual(x, residual, "moe_block_decode")


def launch(x, residual, router_weight, bias, mode, top_k, n_group, topk_group,
           norm_topk_prob, scale, gate_up, down, shared_gate, shared_up, shared_down, *,
           front=None, config=None, front_config=None, programs=None, scales=None):
    """(out [T, H], topk_idx [P] int32, topk_weight [P] fp32, x, h1): the kernel on checked,
    contiguous tensors. front = (o_rows [T, NV], o_proj [H, NV], norm weight [H], eps[,
    o_proj's block scales]): x is made in the launch from residual (then x may be None)
    and h1 is the residual the block's output is added to; else h1 is residual. scales =
    the experts' and shared experts' 128 x 128 block scales (gate_up, down, shared gate,
    up, down) for e4m3 weights. config / front_config / programs: the defaults of the
    shape when None (a benchmark's sweep passes its own)."""
    T, H = residual.shape
    E, I, S = router_weight.shape[0], gate_up.shape[1] // 2, shared_gate.shape[0]
    P = T * top_k
    block_er, ch_r, bn_g, bn_d, block_k, ch_s, warps, stages, per_sm, ch_g = (
        config or config_of(E, H, I, S))
    ch_r = triton.cdiv(min(ch_r, H), block_k) * block_k
    ch_s = triton.cdiv(min(ch_s, S), block_k) * block_k
    ch_g = triton.cdiv(min(ch_g, H), block_k) * block_k
    ks_g = triton.cdiv(H, ch_g)
    dt, dev = residual.dtype, residual.device
    fp8_o = front is not None and len(front) > 4          # (..., eps, o_proj's scales)
    gus, dns, sgs, sus, sds = scales if scales is not None else (gate_up,) * 5
    f32 = dict(dtype=torch.float32, device=dev)
    if front is not None:
        a, wo, nw, eps = front[:4]
        wos = front[4] if fp8_o else wo
        NV = a.shape[1]
        bn_o, ch_o = front_config or front_config_of(H, NV)
        ch_o = triton.cdiv(min(ch_o, NV), block_k) * block_k
        x = torch.empty((T, H), dtype=dt, device=dev)                           # [T, H]
        h1 = torch.empty((T, H), dtype=dt, device=dev)                          # [T, H]
        po = torch.empty((triton.cdiv(NV, ch_o), T, H), **f32)                  # [KS_O, T, H]
    else:
        a = wo = wos = nw = po = x
        NV, bn_o, ch_o, eps = 1, 16, block_k, 0.0
        h1 = residual
    lp = torch.empty((triton.cdiv(H, ch_r), T, E), **f32)                      # [SPLIT_R, T, E]
    idx = torch.empty(P, dtype=torch.int32, device=dev)                         # [P]
    wgt = torch.empty(P, **f32)                                                 # [P]
    hs = torch.empty((T, S), dtype=dt, device=dev)                              # [T, S]
    hr = torch.empty((P, I), dtype=dt, device=dev)                              # [P, I]
    pr = torch.empty((P, H), **f32)                                             # [P, H]
    ps = torch.empty((triton.cdiv(S, ch_s), T, H), **f32)                      # [KS, T, H]
    out = torch.empty((T, H), dtype=dt, device=dev)                             # [T, H]
    pgs = torch.empty((ks_g, T, 2 * S) if ks_g > 1 else (1,), **f32)            # [KS_G, T, 2S]
    pgr = torch.empty((ks_g, P, 2 * I) if ks_g > 1 else (1,), **f32)            # [KS_G, P, 2I]
    nsync = 7 + P + triton.cdiv(H, bn_d) + triton.cdiv(S, bn_g) + P * triton.cdiv(I, bn_g)
    sync = _counters(dev, nsync)
    if programs is None:
        programs = (torch.cuda.get_device_properties(dev).multi_processor_count * per_sm
                    if dev.type == "cuda" else 3)
    grouped = mode != 1
    lanes_e = max(16, triton.next_power_of_2(E))
    lanes_g = max(2, triton.next_power_of_2(n_group if grouped else 1))
    on_gpu = dev.type == "cuda"
    moe_tail_kernel[(programs,)](
        x, residual, out, a, wo, nw, wos, po, h1, h1,
        router_weight, bias if mode == 0 else router_weight, gate_up, down, shared_gate,
        shared_up, shared_down, gus, dns, sgs, sus, sds, pgs, pgr, lp, idx, wgt, hs, hr, pr,
        ps, sync,
        T, H, E, I, S, top_k, E // n_group if grouped else E, n_group if grouped else 1,
        topk_group if grouped else 1, float(scale), ch_r, ch_s, NV, ch_o, float(eps), ch_g,
        FRONT=front is not None, BN_O=bn_o, BLOCK_NORM=BLOCK_NORM, FP8=scales is not None,
        GROUP_N=128, FP8_O=fp8_o,
        MODE=mode, NORM=bool(norm_topk_prob) and mode == 0, RESIDUAL=True,
        W_F32=router_weight.dtype == torch.float32, BLOCK_M=MAX_ROWS, BLOCK_ER=block_er,
        BN_G=bn_g, BN_D=bn_d, BLOCK_K=block_k, BLOCK_E=lanes_e, BLOCK_G=lanes_g,
        BLOCK_TK=max(2, triton.next_power_of_2(top_k)),
        BLOCK_SYNC=min(1024, triton.next_power_of_2(nsync)), BLOCK_R=max(16, triton.next_power_of_2(P)),
        GROUPS_2D=grouped and E == lanes_e and n_group == lanes_g, LIBDEVICE=on_gpu,
        DOT_F32=not on_gpu, NAP=on_gpu, num_warps=warps, num_stages=stages)
    return out, idx, wgt, x, h1


@torch.library.custom_op("mla::moe_block_decode_residual", mutates_args=())
def moe_block_decode_residual(x: torch.Tensor, residual: torch.Tensor,
                              router_weight: torch.Tensor, bias: Optional[torch.Tensor],
                              mode: int, top_k: int, n_group: int, topk_group: int,
                              norm_topk_prob: bool, scale: float, gate_up: torch.Tensor,
                              down: torch.Tensor, shared_gate: torch.Tensor,
                              shared_up: torch.Tensor,
                              shared_down: torch.Tensor) -> torch.Tensor:
    block = (gate_up, down, shared_gate, shared_up, shared_down)
    _check_block(x, router_weight, bias, mode, top_k, n_group, topk_group, *block, residual)
    _require("moe_block_decode_residual", x, serves(x, router_weight, *block))
    return launch(x.contiguous(), residual.contiguous(), router_weight, bias, mode, top_k,
                  n_group, topk_group, norm_topk_prob, scale, *block)[0]


@moe_block_decode_residual.register_fake
def _(x, residual, router_weight, bias, mode, top_k, n_group, topk_group, norm_topk_prob,
      scale, gate_up, down, shared_gate, shared_up, shared_down):
    return torch.empty_like(residual)


@torch.library.custom_op("mla::moe_layer_tail_decode", mutates_args=())
def moe_layer_tail_decode(o_rows: torch.Tensor, o_proj: torch.Tensor, residual: torch.Tensor,
                          norm_weight: torch.Tensor, eps: float, router_weight: torch.Tensor,
                          bias: Optional[torch.Tensor], mode: int, top_k: int, n_group: int,
                          topk_group: int, norm_topk_prob: bool, scale: float,
                          gate_up: torch.Tensor, down: torch.Tensor,
                          shared_gate: torch.Tensor, shared_up: torch.Tensor,
                          shared_down: torch.Tensor) -> torch.Tensor:
    check_front(o_rows, residual, norm_weight)
    T, H = residual.shape
    if tuple(o_proj.shape) != (H, o_rows.shape[1]):
        raise ValueError(f"o_proj must be [{H}, {o_rows.shape[1]}], got {tuple(o_proj.shape)}")
    if o_proj.dtype != residual.dtype or o_proj.device != residual.device:
        raise TypeError(f"o_proj must be {residual.dtype} on {residual.device}, got "
                        f"{o_proj.dtype} on {o_proj.device}")
    block = (gate_up, down, shared_gate, shared_up, shared_down)
    _check_block(residual, router_weight, bias, mode, top_k, n_group, topk_group, *block,
                 residual)
    _require("moe_layer_tail_decode", residual,
             serves(residual, router_weight, *block, o_proj=o_proj)
             and norm_weight.is_contiguous())
    return launch(None, residual.contiguous(), router_weight, bias, mode, top_k, n_group,
                  topk_group, norm_topk_prob, scale, *block,
                  front=(o_rows.contiguous(), o_proj, norm_weight, eps))[0]


@moe_layer_tail_decode.register_fake
def _(o_rows, o_proj, residual, norm_weight, eps, router_weight, bias, mode, top_k, n_group,
      topk_group, norm_topk_prob, scale, gate_up, down, shared_gate, shared_up, shared_down):
    return torch.empty_like(residual)
