"""The benchmarks' own Triton kernel (benchmarks/skinny_gemm.py) vs float64 matmul, so the
GEMM table it fills in BENCHMARKS.md compares a correct kernel. CPU: the interpreter."""
import os
import sys

import pytest
import torch

pytest.importorskip("triton")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))

from skinny_gemm import skinny_gemm  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# bf16 on a GPU (the benchmark's dtype; output rounding bounds the error); fp32 under the
# CPU interpreter, which mis-multiplies bf16 dots
DTYPE, TOL = (torch.bfloat16, 1e-2) if DEV == "cuda" else (torch.float32, 1e-4)


@pytest.mark.parametrize("M,N,K,block_n,block_k", [
    (1, 100, 300, 32, 128),      # one row, N and K not multiples of the blocks
    (32, 64, 256, 16, 128),      # 32 rows, even K
    (5, 77, 512, 64, 256),       # rows padded to 16
])
def test_skinny_gemm_vs_fp64(M, N, K, block_n, block_k):
    g = torch.Generator().manual_seed(M * N + K)
    x = torch.randn(M, K, generator=g).to(DEV, DTYPE)
    w = torch.randn(N, K, generator=g).to(DEV, DTYPE)
    y = skinny_gemm(x, w, block_n=block_n, block_k=block_k)
    ref = x.double() @ w.double().T
    assert y.shape == (M, N)
    assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < TOL


def test_skinny_gemm_bad_input():
    x, w = torch.randn(2, 64), torch.randn(8, 32)
    with pytest.raises(ValueError, match="w must be"):
        skinny_gemm(x.to(DEV), w.to(DEV))
    with pytest.raises(ValueError, match="at most 64"):
        skinny_gemm(torch.randn(65, 32).to(DEV), w.to(DEV))
