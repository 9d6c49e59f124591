"""A DeepSeek MoE block's decode rows as one graph op, the shared experts on a second stream.

    mla::moe_block_decode(x [T, H], router_weight [E, H], bias [E] | None, mode, top_k,
                          n_group, topk_group, norm_topk_prob, scale,
                          gate_up [E, 2I, H], down [E, H, I],
                          shared_gate [S, H], shared_up [S, H], shared_down [H, S])
        -> pairs [T, K, H] fp32, shared [split_k, T, H]

    pairs[t, k]  = topk_weight[t, k] * expert_{topk_idx[t, k]}(x[t]), the experts and
                   weights mla::moe_route picks (router.py), each pair's output as
                   mla::moe_experts_decode's kernels leave it before their sum;
    shared       = the shared experts' down_proj(SiLU(gate(x)) * up(x)) as the decode GEMM
                   kernels leave it: fp32 partial sums over split_k ranges of S when their
                   config splits K (shared_split_k), else [1, T, H] in x's dtype.

The caller sums, pairs.sum(1).to(dtype) + the shared output (its partials summed and
rounded, shared.sum(0).to(dtype); one split is added as it is), the very expression the
block's separate ops leave in the graph (so Inductor fuses it with the residual add as
before): the result is bit for bit the block run op by op.

Why one op: at a decode step's few rows the router's two kernels and the shared experts'
two GEMMs each leave most of the GPU idle. Here the shared experts run on a side stream,
forked from the caller's stream after the outputs are allocated and joined before the op
returns (a CUDA graph captures both branches), beside the router and the routed experts'
first waves. A converted block's decode rows on an H200 (docs/notes/probe_moe_streams.py):
V2-Lite 290.9 -> 278.3 µs at 32 rows and 61.5 -> 51.4 at 1, V3 215.3 -> 198.4 at 1.

CUDA runs the streams; on the CPU (tests, TRITON_INTERPRET=1) the same launches run in
order. Callers check block_serves first (mla_ops/hf/moe.py); the op checks shapes and
dtypes, and on CUDA that its kernels serve (host ints only, nothing read from the device).
"""
from __future__ import annotations

import os
from typing import Callable, Optional

import torch

from lowering.gemm import linear as gemm
from lowering.moe import experts as moe_experts
from lowering.moe import router as moe_router

_SIDE: dict = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device, made once."""
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _SIDE:
        _SIDE[key] = torch.cuda.Stream(device=key)
    return _SIDE[key]


def require_kernels(op: str, x: torch.Tensor, serves: Callable[[], bool], serves_name: str,
                    separate: str) -> None:
    """Raise a ValueError unless a block op's kernels can run on x: on CUDA where serves()
    (serves_name) says they serve these tensors, on the CPU only under the Triton
    interpreter."""
    if x.is_cuda and not serves():
        raise ValueError(f"mla::{op}: its kernels do not serve these tensors ({serves_name} "
                         f"says which do); run the block's separate ops ({separate}) instead")
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"mla::{op} runs its kernels on CUDA (x is on {x.device}); on the "
                         f"CPU only under TRITON_INTERPRET=1")


def fork_shared(x: torch.Tensor, shared: Callable[[], None], routed: Callable[[], None]) -> None:
    """shared() on the side stream beside routed() on the caller's, forked after everything
    both write is allocated and joined before returning (a CUDA graph captures both
    branches); on the CPU (the interpreter) one after the other."""
    if not x.is_cuda:
        shared()
        routed()
        return
    main = torch.cuda.current_stream(x.device)
    side = side_stream(x.device)
    side.wait_stream(main)                   # the fork: x and the buffers are ready
    with torch.cuda.stream(side):
        shared()
    routed()
    main.wait_stream(side)                   # the join, before anything reads the shared output


def shared_configs(x: torch.Tensor, shared_gate: torch.Tensor):
    """(gate + up config, down config) of the decode GEMM kernels for the shared experts
    at x's rows; None for either where cuBLAS serves that shape (then block_serves is
    False)."""
    T, H = x.shape
    S = shared_gate.shape[0]
    return gemm.pick_config(2, S, H, T), gemm.pick_config(0, H, S, T)


def shared_split_k(x: torch.Tensor, shared_gate: torch.Tensor) -> int:
    return gemm.split_k_of(shared_configs(x, shared_gate)[1])


def block_serves(x: torch.Tensor, router_weight: torch.Tensor, gate_up: torch.Tensor,
                 down: torch.Tensor, shared_gate: torch.Tensor, shared_up: torch.Tensor,
                 shared_down: torch.Tensor) -> bool:
    """Whether the op's kernels serve these tensors (shapes, dtypes, devices and settings
    only, so traced code can branch on it): the router's, the routed experts' and the
    decode GEMMs' for the shared experts, all in x's dtype."""
    if x.dim() != 2 or moe_router.kernel_serves(x, router_weight) is not None:
        return False
    if not (gate_up.dtype == down.dtype == x.dtype
            and moe_experts.kernel_serves(x, gate_up, down)):
        return False
    S = shared_gate.shape[0]
    if (shared_up.shape != shared_gate.shape or shared_down.dim() != 2
            or tuple(shared_down.shape) != (x.shape[1], S)):
        return False
    if (gemm.linear_unmet(x, shared_gate, shared_up) is not None       # x's rows, the setting
            or not shared_down.is_contiguous() or shared_down.dtype != x.dtype
            or shared_down.device != x.device):
        return False
    return None not in shared_configs(x, shared_gate)


def check_shared_shapes(H: int, shared_gate, shared_up, shared_down) -> None:
    """Raise a ValueError unless the shared experts are gate, up [S, H] and down [H, S]."""
    S = shared_gate.shape[0] if shared_gate.dim() == 2 else -1
    if (shared_gate.dim() != 2 or shared_gate.shape[1] != H or shared_up.shape != shared_gate.shape
            or tuple(shared_down.shape) != (H, S)):
        raise ValueError(f"shared_gate and shared_up must be [S, {H}] and shared_down "
                         f"[{H}, S]; got {tuple(shared_gate.shape)}, {tuple(shared_up.shape)}, "
                         f"{tuple(shared_down.shape)}")


def _check(x, router_weight, bias, mode, top_k, n_group, topk_group, gate_up, down,
           shared_gate, shared_up, shared_down) -> None:
    moe_router.check_args(x, router_weight, bias, mode, top_k, n_group, topk_group)
    T, H, _, _ = moe_experts.check_weights(x, gate_up, down)
    check_shared_shapes(H, shared_gate, shared_up, shared_down)
    for name, w in (("shared_gate", shared_gate), ("shared_up", shared_up),
                    ("shared_down", shared_down)):
        if w.dtype != x.dtype or w.device != x.device:
            raise TypeError(f"{name} must be {x.dtype} on {x.device}, got {w.dtype} on {w.device}")


def _shared(x, shared_gate, shared_up, shared_down, h, out, configs) -> None:
    """h [T, S] = SiLU(x @ gate.T) * (x @ up.T); out = h @ down.T (partials or whole)."""
    gate_up_cfg, down_cfg = configs
    gemm.launch(x, shared_gate, shared_up, 2, h, None, gate_up_cfg)
    gemm.launch(h, shared_down, None, 0, out if gemm.split_k_of(down_cfg) > 1 else out[0],
                None, down_cfg)


def _routed(x, router_weight, bias, mode, top_k, n_group, topk_group, norm_topk_prob, scale,
            gate_up, down, hr, pairs) -> None:
    topk_idx, topk_weight = moe_router.launch(x, router_weight, bias, mode, top_k, n_group,
                                              topk_group, norm_topk_prob, scale)
    T, H = x.shape
    I = gate_up.shape[1] // 2
    flat = moe_experts.flat_pairs(topk_idx)                                  # [P]
    moe_experts.launch_gate_up(x, gate_up, flat, top_k, hr,
                               moe_experts.pick_config("gate_up", I, H, T))
    moe_experts.launch_down(hr, down, topk_weight.reshape(-1), flat, top_k,
                            pairs.view(T * top_k, H), moe_experts.pick_config("down", H, I, T))


@torch.library.custom_op("mla::moe_block_decode", mutates_args=())
def moe_block_decode(x: torch.Tensor, router_weight: torch.Tensor, bias: Optional[torch.Tensor],
                     mode: int, top_k: int, n_group: int, topk_group: int,
                     norm_topk_prob: bool, scale: float, gate_up: torch.Tensor,
                     down: torch.Tensor, shared_gate: torch.Tensor, shared_up: torch.Tensor,
                     shared_down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _check(x, router_weight, bias, mode, top_k, n_group, topk_group, gate_up, down,
           shared_gate, shared_up, shared_down)
    require_kernels("moe_block_decode", x,
                    lambda: block_serves(x, router_weight, gate_up, down, shared_gate,
                                         shared_up, shared_down),
                    "lowering.moe.block.block_serves",
                    "mla::moe_route, mla::moe_experts_decode, the decode GEMMs")
    T, H = x.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    S, I = shared_gate.shape[0], gate_up.shape[1] // 2
    configs = shared_configs(x, shared_gate)
    split_k = gemm.split_k_of(configs[1])
    # everything the two branches write is allocated here, on the caller's stream
    hs = torch.empty((T, S), dtype=x.dtype, device=x.device)                    # [T, S]
    shared = torch.empty((split_k, T, H), device=x.device,
                         dtype=torch.float32 if split_k > 1 else x.dtype)       # [split_k, T, H]
    hr = torch.empty((T * top_k, I), dtype=x.dtype, device=x.device)            # [P, I]
    pairs = torch.empty((T, top_k, H), dtype=torch.float32, device=x.device)    # [T, K, H]
    routed = (x, router_weight, bias, mode, top_k, n_group, topk_group, norm_topk_prob, scale,
              gate_up, down, hr, pairs)
    fork_shared(x, lambda: _shared(x, shared_gate, shared_up, shared_down, hs, shared, configs),
                lambda: _routed(*routed))
    return pairs, shared


@moe_block_decode.register_fake
def _(x, router_weight, bias, mode, top_k, n_group, topk_group, norm_topk_prob, scale,
      gate_up, down, shared_gate, shared_up, shared_down):
    T, H = x.shape
    split_k = shared_split_k(x, shared_gate)
    return (x.new_empty((T, top_k, H), dtype=torch.float32),
            x.new_empty((split_k, T, H), dtype=torch.float32 if split_k > 1 else x.dtype))
