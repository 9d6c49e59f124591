"""silu_mul(g, u) = F.silu(g) * u: one kernel on CUDA (silu_mul_kernel.py, the same
values), torch's two elsewhere. For a prefill's MLP (lowering/gemm/linear.py) and its
routed experts (lowering/moe/prefill.py); g and u may be column slices of one tensor."""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton

from lowering.fused.silu_mul_kernel import silu_mul_kernel

BLOCK_N = 1024


def silu_mul(g: torch.Tensor, u: torch.Tensor, *, kernel: bool | None = None) -> torch.Tensor:
    """F.silu(g) * u for g, u [..., N] of one float dtype (bf16, fp16 or fp32, unit last
    stride for the kernel): [..., N]. kernel: run the kernel (default: on CUDA; the CPU runs it under
    TRITON_INTERPRET=1)."""
    if kernel is None:
        kernel = g.is_cuda
    if (not kernel or g.shape != u.shape or g.dtype != u.dtype
            or g.dtype not in (torch.bfloat16, torch.float16, torch.float32)
            or g.stride(-1) != 1 or u.stride(-1) != 1 or g.numel() == 0):
        return F.silu(g) * u
    N = g.shape[-1]
    g2, u2 = g.reshape(-1, N), u.reshape(-1, N)          # views where the rows are strided
    y = torch.empty(g2.shape, dtype=g.dtype, device=g.device)                 # [M, N]
    torch.library.wrap_triton(silu_mul_kernel)[(g2.shape[0], triton.cdiv(N, BLOCK_N))](
        g2, u2, y, N, g2.stride(0), u2.stride(0), y.stride(0), BLOCK_N=BLOCK_N,
        LIBDEVICE=g.is_cuda, num_warps=4)
    return y.view(g.shape)
