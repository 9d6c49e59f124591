"""The grouped GEMM of grouped_kernel.py (W8A8 or 16-bit): its launcher, and an FP8
checkpoint's linear for a prefill's rows as one group.

    launch(a, a_scale, rows, w, w_scale, y, starts, ends, tile_ends, ...)   (the kernel)
    prefill_linear(x [M, K], w [N, K] e4m3, scale_inv, group_n, group_k) -> [M, N]

prefill_linear is HF's FP8Linear on a GPU (x quantized per group_k columns, fp8 x fp8 dots
times both block scales in fp32, rounded to x's dtype) for more rows than the decode GEMM
kernel takes (fp8_linear.py): one expert holding every row. It reads the fp8 weight as it
is, where the decode ops' torch path dequantizes the whole weight in each call (an fp32
product and a 16-bit copy, then cuBLAS).
"""
from __future__ import annotations

import torch
import triton

from lowering.gemm.fp8_act_quant import quantized
from lowering.gemm.grouped_kernel import grouped_kernel

# (BLOCK_M, BLOCK_N, num_warps, num_stages); not yet swept on a GPU
CONFIG = (64, 128, 8, 3)
GROUPS_K = (16, 32, 64, 128, 256)
GROUP_T = 8          # tiles whose rows stay in L2 while every column block is computed


def launch(a, a_scale, rows, w, w_scale, y, starts, ends, tile_ends, group_n: int,
           block_k: int, *, gated: bool = False, up_row0: int = 0, up_s_row0: int = 0,
           config=None) -> None:
    """y [P, N] from the activations a [R, K] (rows [P] int32 pick each sorted pair's row),
    the expert weights w [E, NW, K], starts / ends [E] int32 (where each expert's sorted
    pairs begin and end) and tile_ends [E] int32 (cumulative BLOCK_M tiles per expert;
    BLOCK_M is config's first entry); rows None: one expert (E = 1) over rows 0 .. P - 1
    of a (starts, ends and tile_ends unused).
    W8A8: a e4m3 with its scales a_scale [R, G] per block_k columns, w e4m3 with scale_inv
    w_scale in group_n x block_k blocks; with a_scale and w_scale None, a and w are 16-bit
    and block_k is the kernel's K tile.
    gated: gate rows [0, N) and up rows [up_row0, up_row0 + N) of each w[e] (up's scale
    rows from up_s_row0), y = SiLU(gate) * up."""
    P, N = y.shape
    E, _, K = w.shape
    bm, bn, warps, stages = config or CONFIG
    w8a8 = a_scale is not None
    one = rows is None                    # one expert, rows in order (prefill_linear)
    if one:                               # never read: pointers the kernel is given anyway
        rows = starts = ends = tile_ends = y
    if not w8a8:
        a_scale, w_scale, group_n = a, w, 1
    tiles, n_blocks = triton.cdiv(P, bm) + (0 if one else E), triton.cdiv(N, bn)
    torch.library.wrap_triton(grouped_kernel)[(tiles * n_blocks,)](
        a, a_scale, rows, w, w_scale, y, starts, ends, tile_ends, P, N, K, E, up_row0,
        up_s_row0, tiles, n_blocks, a.stride(0), a_scale.stride(0), w.stride(0), w.stride(1),
        w_scale.stride(0), w_scale.stride(1), y.stride(0), W8A8=w8a8, GATED=gated,
        BLOCK_E=triton.next_power_of_2(E), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=block_k,
        GROUP_N=group_n, GROUP_T=GROUP_T, EVEN_K=K % block_k == 0, ONE_GROUP=one,
        DOT_F32=not a.is_cuda, num_warps=warps, num_stages=stages)


def prefill_linear(x2: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor, group_n: int,
                   group_k: int, config=None, x_quant=None) -> torch.Tensor:
    """x2 [M, K] (K contiguous) @ W.T -> [M, N] in x2's dtype, W8A8 (module docstring); on
    any device the kernel runs (the CPU under TRITON_INTERPRET=1). w and scale_inv
    contiguous, group_k in GROUPS_K. x_quant: x2 already quantized per group_k columns
    (quantized(x2, group_k, True)[:2]), shared by GEMMs of the same input."""
    xq, xs = x_quant if x_quant is not None else quantized(x2, group_k, True)[:2]
    y = torch.empty((x2.shape[0], w.shape[0]), dtype=x2.dtype, device=x2.device)  # [M, N]
    launch(xq, xs, None, w[None], scale_inv[None], y, None, None, None, group_n, group_k,
           config=config)
    return y
