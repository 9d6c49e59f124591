"""y = x @ w.T for a few rows of x: the weight-streaming GEMM of a decode step.

A measuring tool for bench_layer_gemms.py (how close a plain kernel gets to the copy
ceiling where cuBLAS does not); the model's GEMMs stay cuBLAS's.

    x [M, K] (M <= 64), w [N, K] (an nn.Linear weight, K contiguous), y [M, N]

At decode batch sizes every weight byte is read once and used M times, so the GEMM is a
copy of w through the SMs. Each program owns BLOCK_N rows of w and walks K in BLOCK_K
tiles, multiplying w-tile @ x-tile.T ([BLOCK_N, BLOCK_K] x [BLOCK_K, BLOCK_M], the weight
as the tall operand: "swap AB") into an fp32 [BLOCK_N, BLOCK_M] accumulator. No split-K,
so there is no second kernel and no workspace; BLOCK_N is chosen so that N / BLOCK_N fills
the SMs a few times over.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def skinny_gemm_kernel(
    x_ptr, w_ptr, y_ptr,            # [M, K], [N, K], [M, N]
    M, N, K,
    stride_xm, stride_wn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)                   # [BLOCK_N]
    offs_m = tl.arange(0, BLOCK_M)                                   # [BLOCK_M]
    offs_k = tl.arange(0, BLOCK_K)                                   # [BLOCK_K]
    n_ok = offs_n < N
    m_ok = offs_m < M
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]   # [BLOCK_N, BLOCK_K]
    x_ptrs = x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None]               # [BLOCK_K, BLOCK_M]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
            x = tl.load(x_ptrs, mask=m_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < K - k * BLOCK_K
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_ptrs, mask=m_ok[None, :] & k_ok[:, None], other=0.0)
        acc = tl.dot(w, x, acc)                                      # [BLOCK_N, BLOCK_M]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    y_ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]   # y.T tile
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[None, :] & n_ok[:, None])


def skinny_gemm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, *,
                block_n: int = 32, block_k: int = 256, num_warps: int = 4,
                num_stages: int = 4) -> torch.Tensor:
    """x [M, K] @ w[N, K].T -> [M, N] in x's dtype (fp32 accumulation)."""
    M, K = x.shape
    N = w.shape[0]
    if w.shape[1] != K:
        raise ValueError(f"w must be [N, {K}] to match x [M, {K}]; got {tuple(w.shape)}")
    if M > 64:
        raise ValueError(f"skinny_gemm serves at most 64 rows of x; got {M}")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("x and w need a contiguous last dimension")
    if out is None:
        out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    block_m = max(16, triton.next_power_of_2(M))
    skinny_gemm_kernel[(triton.cdiv(N, block_n),)](
        x, w, out, M, N, K, x.stride(0), w.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=K % block_k == 0,
        num_warps=num_warps, num_stages=num_stages)
    return out
