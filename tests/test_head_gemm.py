"""The absorbed per-head GEMM kernel (lowering/gemm/head_gemm.py) vs float64.

CPU: the kernel under the Triton interpreter in fp32 (it mis-multiplies 16-bit dots); CUDA:
bf16, and absorb_query / absorb_output as the attention op calls them."""
import pytest
import torch

pytest.importorskip("triton")

import lowering.config as mla_config  # noqa: E402
from lowering.gemm import head_gemm  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DT, TOL = (torch.bfloat16, 1e-2) if DEV == "cuda" else (torch.float32, 1e-5)


def _rel(a, ref):
    return ((a.double().cpu() - ref).abs().max() / ref.abs().max()).item()


def _rand(*shape, g):
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    return x.to(DEV, DT), x.to(DT).double()                     # (kernel input, its fp64 value)


# rows t (1: one request; 17: two row blocks of 16 with one row in the second; 33),
# heads, K, J, copy width, config (BLOCK_J, BLOCK_K, warps, stages)
CASES = [
    (1, 3, 32, 64, 16, (32, 16, 4, 2)),      # query-like: GEMM + tail copy, K in two steps
    (17, 2, 64, 32, 0, (32, 64, 4, 2)),      # output-like: one K step, BLOCK_T 32 > rows
    (33, 2, 16, 128, 32, (64, 16, 4, 1)),    # BLOCK_T 64, two column blocks
]


@pytest.mark.parametrize("t,N,K,J,copy,cfg", CASES)
def test_head_gemm_kernel_vs_fp64(t, N, K, J, copy, cfg):
    g = torch.Generator().manual_seed(t * 100 + K)
    a, a64 = _rand(t, N, K + copy, g=g)
    w, w64 = _rand(N, K, J, g=g)
    y = torch.full((t, N, J + copy), float("nan"), device=DEV, dtype=DT)
    head_gemm.launch(a, w, y, copy, cfg)
    ref = torch.einsum("tnk,nkj->tnj", a64[..., :K], w64)
    assert _rel(y[..., :J], ref) < TOL
    assert torch.equal(y[..., J:].cpu(), a[..., K:].cpu())      # the copied tail, exact


def test_head_gemm_kernel_strided_rows():
    """a and y as views with row/head strides of a larger buffer (as the op passes them)."""
    g = torch.Generator().manual_seed(7)
    big, big64 = _rand(5, 4, 96, g=g)
    a, a64 = big[:, 1:3, :48], big64[:, 1:3, :48]               # [5, 2, 48]: K 32 + copy 16
    w, w64 = _rand(2, 32, 64, g=g)
    y_buf = torch.zeros(5, 3, 100, device=DEV, dtype=DT)
    y = y_buf[:, 1:, 10:90]                                      # [5, 2, 80]
    head_gemm.launch(a, w, y, 16, (32, 32, 4, 2))
    assert _rel(y[..., :64], torch.einsum("tnk,nkj->tnj", a64[..., :32], w64)) < TOL
    assert torch.equal(y[..., 64:].cpu(), a[..., 32:].cpu())
    assert y_buf[:, 0].abs().sum() == 0 and y_buf[..., :10].abs().sum() == 0   # nothing else written


def test_absorb_paths_match_torch_fallback(monkeypatch):
    """absorb_query / absorb_output give what the torch.bmm fallback gives (kernel on CUDA,
    the fallback itself on CPU), at DeepSeek widths."""
    g = torch.Generator().manual_seed(3)
    t, N, P, R, L, V = 3, 4, 128, 64, 512, 128
    q, q64 = _rand(t, N, P + R, g=g)
    wk, wk64 = _rand(N, P, L, g=g)
    o, o64 = _rand(t, N, L, g=g)
    wv, wv64 = _rand(N, L, V, g=g)
    qm = head_gemm.absorb_query(q, wk)
    out = torch.empty(t, N * V, device=DEV, dtype=DT)
    head_gemm.absorb_output(o, wv, out)
    tol = 1e-2 if DT == torch.bfloat16 else 1e-6
    assert _rel(qm[..., :L], torch.einsum("tnp,npl->tnl", q64[..., :P], wk64)) < tol
    assert torch.equal(qm[..., L:].cpu(), q[..., P:].cpu())
    assert _rel(out.view(t, N, V), torch.einsum("tnl,nlv->tnv", o64, wv64)) < tol
    monkeypatch.setattr(mla_config, "head_gemm_impl", "torch")
    out_t = torch.empty_like(out)
    head_gemm.absorb_output(o, wv, out_t)
    assert _rel(out_t.view(t, N, V), torch.einsum("tnl,nlv->tnv", o64, wv64)) < tol
    assert _rel(head_gemm.absorb_query(q, wk)[..., :L], qm[..., :L].double().cpu()) < tol


def test_unmet_reasons():
    x = torch.empty(2, 4, 192, dtype=torch.bfloat16)
    w = torch.empty(4, 128, 512, dtype=torch.bfloat16)
    assert "CUDA" in head_gemm.head_gemm_unmet(x, w, 64)
    with mla_config.patch(head_gemm_impl="torch"):
        assert "head_gemm_impl" in head_gemm.head_gemm_unmet(x, w, 64)
    if DEV == "cuda":
        xc, wc = x.cuda(), w.cuda()
        assert head_gemm.head_gemm_unmet(xc, wc, 64) is None
        assert "rows" in head_gemm.head_gemm_unmet(torch.empty(65, 4, 192, dtype=x.dtype, device=DEV), wc, 64)
        assert "power of two" in head_gemm.head_gemm_unmet(xc, torch.empty(4, 128, 500, dtype=x.dtype, device=DEV), 64)
        assert "bf16/fp16" in head_gemm.head_gemm_unmet(xc.float(), wc.float(), 64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_head_gemm_kernel_16bit_inputs(dtype):
    """16-bit operands and output (the GPU's case), query-like with the tail copy."""
    g = torch.Generator().manual_seed(11)
    t, N, K, J, copy = 2, 3, 32, 64, 16
    a64 = torch.randn(t, N, K + copy, generator=g, dtype=torch.float64)
    w64 = torch.randn(N, K, J, generator=g, dtype=torch.float64)
    a, w = a64.to(DEV, dtype), w64.to(DEV, dtype)
    y = torch.full((t, N, J + copy), float("nan"), device=DEV, dtype=dtype)
    head_gemm.launch(a, w, y, copy, (32, 16, 4, 2))
    ref = torch.einsum("tnk,nkj->tnj", a.double().cpu()[..., :K], w.double().cpu())
    assert _rel(y[..., :J], ref) < 1e-2                       # 16-bit output rounding
    assert torch.equal(y[..., J:].cpu(), a[..., K:].cpu())
