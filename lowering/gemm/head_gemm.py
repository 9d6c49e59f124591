"""MLA's two absorbed per-head GEMMs of a decode step, on the kernel of head_gemm_kernel.py.

    absorb_query(q [t, N, P+R], W_UK_T [N, P, L]) -> [t, N, L+R] = [q_nope @ W_UK_T | q_pe]
    absorb_output(o [t, N, L], W_UV [N, L, V], out [t, N*V])       out = o @ W_UV per head

Both read a per-head weight once for a few rows. On CUDA, bf16/fp16, at most MAX_ROWS rows
and power-of-two widths that the configs divide, one Triton launch serves each (for the
query: the GEMM and the q_pe copy in one launch, no temporary); anything else, or
lowering.config.head_gemm_impl = "torch" (see head_gemm_unmet), runs torch.bmm into the
same destination (cuBLAS), so CPU and prefill-sized calls keep cuBLAS's numerics. Called
from inside mla::attention_with_output's body, so these are plain launches (the op is
opaque to the compiler, and the setting is read at each call). Importable without triton
(the torch path then serves every call).
"""
from __future__ import annotations

import importlib.util
from typing import Optional

import torch

from lowering import config as mla_config

MAX_ROWS = 64
HAVE_TRITON = importlib.util.find_spec("triton") is not None

# (K, J, rows <= 16) -> (BLOCK_J, BLOCK_K, num_warps, num_stages); DeepSeek's absorbed
# query (K = P = 128, J = L = 512) and output (K = L = 512, J = V = 128) at 128 heads,
# measured on an H200 with benchmarks/bench_head_gemm.py (graph replay, L2 flushed; cuBLAS
# in brackets, for the query bmm + the q_pe copy).
CONFIGS: dict[tuple, tuple[int, int, int, int]] = {
    (128, 512, True): (64, 64, 4, 3),     # query,  1 row:  11.3 µs (14.8)
    (512, 128, True): (64, 128, 4, 3),    # output, 1 row:  11.3 µs (11.7)
    (128, 512, False): (64, 64, 4, 3),    # query,  32 rows: 13.1 µs (16.6)
    (512, 128, False): (64, 64, 4, 3),    # output, 32 rows: 13.0 µs (13.4)
}
DEFAULT_CONFIG = (64, 64, 4, 3)


def pick_config(K: int, J: int, rows: int) -> tuple[int, int, int, int]:
    block_j, block_k, warps, stages = CONFIGS.get((K, J, rows <= 16), DEFAULT_CONFIG)
    return min(block_j, J), min(block_k, K), warps, stages


def head_gemm_unmet(a: torch.Tensor, w: torch.Tensor, copy: int = 0) -> Optional[str]:
    """None when the kernel serves a [t, N, K (+copy)] @ w [N, K, J], else why not (the
    caller then runs torch.bmm)."""
    t, K, J = a.shape[0], w.shape[1], w.shape[2]
    if mla_config.head_gemm_impl == "torch":
        return "lowering.config.head_gemm_impl is 'torch'"
    if not HAVE_TRITON:
        return "triton is not installed"
    if not a.is_cuda:
        return "not on CUDA (tests run launch() under TRITON_INTERPRET=1)"
    if a.dtype not in (torch.bfloat16, torch.float16) or w.dtype != a.dtype:
        return f"needs bf16/fp16 operands, got {a.dtype} and {w.dtype}"
    if not 0 < t <= MAX_ROWS:
        return f"{t} rows: the kernel serves 1 to {MAX_ROWS}"
    for name, v in (("K", K), ("J", J), ("copy width", copy or 16)):
        if v < 16 or v & (v - 1):
            return f"{name}={v} must be a power of two >= 16"
    if a.stride(-1) != 1 or w.stride(-1) != 1:
        return "needs unit stride in the last dims"
    return None


def launch(a: torch.Tensor, w: torch.Tensor, y: torch.Tensor, copy: int,
           config: Optional[tuple[int, int, int, int]] = None) -> None:
    """y[t, n, :J] = a[t, n, :K] @ w[n] (and y[..., J:J+copy] = a[..., K:K+copy]);
    a, y are [t, N, *] with unit last stride, w [N, K, J] with unit last stride."""
    import triton
    from lowering.gemm.head_gemm_kernel import head_gemm_kernel
    t, N = a.shape[:2]
    K, J = w.shape[1:]
    block_j, block_k, warps, stages = config or pick_config(K, J, t)
    block_t = max(16, triton.next_power_of_2(min(t, MAX_ROWS)))
    grid = (N, J // block_j, triton.cdiv(t, block_t))
    head_gemm_kernel[grid](
        a, w, y, t, a.stride(0), a.stride(1), w.stride(0), w.stride(1), y.stride(0),
        y.stride(1), K=K, J=J, COPY=copy, BLOCK_T=block_t, BLOCK_J=block_j, BLOCK_K=block_k,
        DOT_F32=not a.is_cuda, num_warps=warps, num_stages=stages)


def absorb_query(q: torch.Tensor, W_UK_T: torch.Tensor) -> torch.Tensor:
    """q [t, N, P+R] -> the absorbed MQA query [t, N, L+R] = [q_nope @ W_UK_T | q_pe]."""
    t, N, PR = q.shape
    P, L = W_UK_T.shape[1:]
    out = q.new_empty((t, N, L + PR - P))                                    # [t, N, L + R]
    if head_gemm_unmet(q, W_UK_T, PR - P) is None:
        launch(q, W_UK_T, out, PR - P)
        return out
    q_nope, q_pe = q.split([P, PR - P], dim=-1)
    with torch.no_grad():   # inference only; out= refuses inputs that require grad
        # [N, t, L] straight into the first L columns (a strided batch): no temporary
        torch.bmm(q_nope.transpose(0, 1), W_UK_T, out=out.transpose(0, 1)[..., :L])
        out[..., L:] = q_pe
    return out


def absorb_output(o: torch.Tensor, W_UV: torch.Tensor, out: torch.Tensor) -> None:
    """out [t, N*V] (contiguous, o's dtype) = o [t, N, L] @ W_UV [N, L, V], head by head."""
    t, N = o.shape[:2]
    V = W_UV.shape[-1]
    y = out.view(t, N, V)                                                    # [t, N, V]
    if head_gemm_unmet(o, W_UV) is None:
        launch(o, W_UV, y, 0)
        return
    with torch.no_grad():   # straight into out viewed [N, t, V] (strided batch): no copy
        torch.bmm(o.transpose(0, 1), W_UV, out=y.transpose(0, 1))
