"""The launchers of fp8_linear_kernel.py (the fp8 decode GEMM and its split-K reduce), as
fp8_linear.py's ops and the fp8 MoE block's shared experts (lowering/moe/fp8_block.py) run
them:

    launch(x2, w1, s1, w2, s2, mode, y1, y2, group_n, group_k, config)   one kernel launch
    reduce_partials(parts, y1, ...)      the fp32 split-K partials summed, one launch
    scratch(x2, w1, w2, mode, group_k, config)   run()'s scratch, made beforehand
    run(x2, w1, s1, w2, s2, mode, y1, y2, group_n, group_k, config)   launch (+ reduce)

mode 0: x @ W1.T (residual optional); 1: the pair [x @ W1.T | x @ W2.T]; 2: SiLU(x @ W1.T)
x (x @ W2.T). Callers check the arguments (fp8_linear.py's ops and checks).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton

from lowering.gemm.fp8_act_quant import quant_buffers, quantized
from lowering.gemm.fp8_linear_configs import pre_quant_of, split_k_for
from lowering.gemm.fp8_linear_kernel import fp8_linear_kernel, fp8_split_reduce_kernel
from lowering.gemm.linear import max_shared_bytes


def launch(x2: torch.Tensor, w1, s1, w2, s2, mode: int, y1: torch.Tensor,
           y2: Optional[torch.Tensor], group_n: int, group_k: int, config: tuple, *,
           residual: Optional[torch.Tensor] = None, y2_col0: int = 0,
           pre_quant: bool = True, x_quant=None, quant_out=None) -> None:
    """Run fp8_linear_kernel with config (BLOCK_N, num_warps, num_stages[, SPLIT_K]) (with
    pre_quant, act_quant_kernel first: x quantized once, as every program would): x2
    [M, K] (K contiguous), w1/w2 [N, K] fp8 contiguous with their scale_inv; y1/y2 [M, N],
    or with SPLIT_K > 1 (modes 0 and 1) fp32 partials [SPLIT_K, M, N] whose sum over dim 0
    is the product (run() reduces them). Mode 0 without split-K may add residual [M, N1]
    (last dim contiguous) in the epilogue; mode 1 with y2=None and y2_col0 > 0 writes
    x @ W2.T into y1 from column y2_col0 on. x_quant: x already quantized by its producer
    ((e4m3 [M, K], fp32 scales [M, cdiv(K, group_k)]), contiguous): no quant launch.
    quant_out: the quant launch's output buffers (fp8_act_quant.quant_buffers), if made
    beforehand."""
    split_k = config[3] if len(config) > 3 else 1
    if not isinstance(split_k, int) or split_k < 1:
        raise ValueError(f"config's SPLIT_K must be a positive int, got {split_k!r}")
    if split_k > 1 and (mode == 2 or residual is not None or y2 is not None
                        or y1.dim() != 3 or y1.shape[0] != split_k
                        or y1.dtype != torch.float32):
        raise ValueError(f"SPLIT_K={split_k} needs mode 0 or 1 without a residual or y2 and "
                         f"y1 fp32 [{split_k}, M, N] (mode 1: W2's columns from y2_col0); "
                         f"got mode {mode}, y1 {y1.dtype} {tuple(y1.shape)}")
    if mode == 1 and y2 is None and not 0 < y2_col0 <= y1.shape[-1] - w2.shape[0]:
        raise ValueError(f"mode 1 without y2 needs 0 < y2_col0 and y1 of y2_col0 + "
                         f"{w2.shape[0]} columns; got y2_col0={y2_col0}, y1 {tuple(y1.shape)}")
    M, K = x2.shape
    N1 = w1.shape[0]
    N2 = w2.shape[0] if w2 is not None else 0
    block_n, warps, stages = config[:3]
    block_m = max(16, triton.next_power_of_2(M))
    pre_quant = pre_quant or x_quant is not None
    x2, xs, stride_xs = quantized(x2, group_k, pre_quant, x_quant,  # once for all programs
                                  out=quant_out)
    if x2.is_cuda:       # per stage: an x tile and one weight tile (two in mode 2)
        per_stage = group_k * (block_m * x2.element_size() + block_n * (2 if mode == 2 else 1))
        per_stage *= 2 if mode == 1 else 1          # mode 1 compiles the loop twice
        stages = max(1, min(stages, max_shared_bytes(x2.device.index) // per_stage))
    n1_blocks = triton.cdiv(N1, block_n)
    grid = (n1_blocks + (triton.cdiv(N2, block_n) if mode == 1 else 0), split_k)
    w2_, s2_ = (w2, s2) if w2 is not None else (w1, s1)
    y2_ = y2 if y2 is not None else y1
    r_ = residual if residual is not None else x2
    torch.library.wrap_triton(fp8_linear_kernel)[grid](
        x2, w1, s1, w2_, s2_, y1, y2_, r_, M, N1, N2, K,
        x2.stride(0), w1.stride(0), s1.stride(0), w2_.stride(0), s2_.stride(0),
        y1.stride(-2), y2_.stride(-2), r_.stride(0) if residual is not None else 0, n1_blocks,
        y1.stride(0) if split_k > 1 else 0,
        MODE=mode, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=group_k, GROUP_N=group_n,
        EVEN_K=K % group_k == 0, DOT_F32=not x2.is_cuda, HAS_RES=residual is not None,
        Y2_COL0=y2_col0 if (mode == 1 and y2 is None) else 0, SPLIT_K=split_k,
        xs_ptr=xs, stride_xs=stride_xs, PRE_Q=pre_quant, num_warps=warps, num_stages=stages)


REDUCE_BLOCK = 256


def reduce_partials(parts: torch.Tensor, y1: torch.Tensor, y2: Optional[torch.Tensor] = None,
                    *, residual: Optional[torch.Tensor] = None, gated: bool = False) -> None:
    """fp8_split_reduce_kernel: the sum over dim 0 of parts fp32 [S, M, NP] rounded once
    to y1's dtype into y1 [M, N1] (and columns N1 on into y2 [M, NP - N1]); or plus
    residual [M, N1] (rounded again); or gated: parts [S, M, 2 N1] hold gate | up and
    y1 = silu(gate) * up. Every output's and the residual's last dim contiguous. (Unused
    pointer arguments get parts, never written, rather than an alias of an output.)"""
    S, M, NP = parts.shape
    N1 = y1.shape[-1]
    if gated:
        epilogue = 2
    elif residual is not None:
        epilogue = 1
    else:
        epilogue = 3 if y2 is not None else 0
    if NP != (2 * N1 if gated else N1 + (y2.shape[-1] if y2 is not None else 0)):
        raise ValueError(f"partials {tuple(parts.shape)} do not match outputs of {N1} columns"
                         f"{' (gated: gate | up)' if gated else ''}")
    y2_ = y2 if y2 is not None else parts
    r_ = residual if residual is not None else parts
    grid = (M, triton.cdiv(NP if epilogue == 3 else N1, REDUCE_BLOCK))
    torch.library.wrap_triton(fp8_split_reduce_kernel)[grid](
        parts, y1, y2_, r_, M, N1, NP, parts.stride(0), parts.stride(1), y1.stride(0),
        y2_.stride(-2), r_.stride(-2), SPLIT_K=S, EPILOGUE=epilogue, BLOCK=REDUCE_BLOCK,
        num_warps=2)


def scratch(x2: torch.Tensor, w1, w2, mode: int, group_k: int, config: tuple,
            x_quant=None) -> dict:
    """run()'s scratch for these arguments, made now: {"quant_out": the activations'
    quant buffers or None, "parts": the fp32 split-K partials or None}. A caller that
    runs the GEMM on another stream makes them first on its own (lowering/moe/block.py's
    fork_shared)."""
    M, K = x2.shape
    N1 = w1.shape[0]
    N = N1 + (w2.shape[0] if mode == 1 else 0)
    split_k = split_k_for(config, mode, M, N, K, group_k)
    pre = pre_quant_of(config) and x_quant is None
    cols = 2 * N1 if mode == 2 else N
    return {"quant_out": quant_buffers(x2, group_k) if pre else None,
            "parts": (torch.empty((split_k, M, cols), dtype=torch.float32, device=x2.device)
                      if split_k > 1 else None)}


def run(x2: torch.Tensor, w1, s1, w2, s2, mode: int, y1: torch.Tensor,
        y2: Optional[torch.Tensor], group_n: int, group_k: int, config: tuple, *,
        residual: Optional[torch.Tensor] = None, pre_quant: Optional[bool] = None,
        x_quant=None, made: Optional[dict] = None) -> None:
    """The GEMM of `mode` into y1 (and y2 for mode 1) in their dtype, residual added for
    mode 0: one launch where split_k_for(config) is 1, else the split kernel into fp32
    partials (mode 2: gate and up as mode 1's pair) and reduce_partials. pre_quant: the
    activations quantized once first (None: as config says, pre_quant_of); x_quant: x
    quantized by its producer (launch's), which every launch then reads; made: scratch()
    of the same arguments, made beforehand (else made here)."""
    if pre_quant is None:
        pre_quant = pre_quant_of(config)
    made = made or scratch(x2, w1, w2, mode, group_k, config, x_quant)
    quant_out, parts = made["quant_out"], made["parts"]            # parts [S, M, N] or None
    N1 = w1.shape[0]
    if parts is None:                                              # one launch, no split
        launch(x2, w1, s1, w2, s2, mode, y1, y2, group_n, group_k, config[:3],
               residual=residual, pre_quant=pre_quant, x_quant=x_quant, quant_out=quant_out)
        return
    tile = (*config[:3], parts.shape[0])
    if mode == 2:                                                  # parts [S, M, 2 N1]
        launch(x2, w1, s1, w2, s2, 1, parts, None, group_n, group_k, tile, y2_col0=N1,
               pre_quant=pre_quant, x_quant=x_quant, quant_out=quant_out)
        reduce_partials(parts, y1, gated=True)
        return
    launch(x2, w1, s1, w2, s2, mode, parts, None, group_n, group_k, tile,
           y2_col0=N1 if mode == 1 else 0, pre_quant=pre_quant, x_quant=x_quant,
           quant_out=quant_out)
    reduce_partials(parts, y1, y2 if mode == 1 else None, residual=residual)
