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


def _fp8_weight(N, A, B, along, g):
    """An FP8 checkpoint's head weight: e4m3 [N, A, B] from random values, scales [N,
    ceil(dim / 128)] along dim `along` (varied per group, so a wrong group index shows),
    and its float64 value (each e4m3 value times its scale)."""
    w8 = (torch.randn(N, A, B, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    dim = (A, B)[along - 1]
    s = torch.rand(N, -(-dim // 128), generator=g) * 0.02 + 0.001         # [N, groups] fp32
    sx = s.double().repeat_interleave(128, dim=1)[:, :dim]
    w64 = w8.double() * (sx[:, None, :] if along == 2 else sx[:, :, None])
    return w8.to(DEV), s.to(DEV), w64


# rows, heads, K, J, scale axis (1: along K as W_UV, 2: along J as W_UK_T), config
FP8_CASES = [
    (1, 2, 512, 32, 1, (32, 128, 4, 2)),     # W_UV-like: four K groups, one step each
    (3, 3, 256, 16, 1, (16, 64, 4, 2)),      # two K steps per group
    (17, 2, 32, 384, 2, (128, 16, 4, 2)),    # W_UK_T-like: three column groups, rows > 16
    (1, 2, 16, 256, 2, (64, 16, 4, 1)),      # four column blocks, two per group
]


@pytest.mark.parametrize("t,N,K,J,along,cfg", FP8_CASES)
def test_head_gemm_kernel_fp8_weight_vs_fp64(t, N, K, J, along, cfg):
    """An e4m3 weight with per-(head, 128 columns) scales, widened in the kernel: the
    product of a with the weight's exact values, against float64."""
    g = torch.Generator().manual_seed(t * 10 + K + J)
    a, a64 = _rand(t, N, K + 16, g=g)
    w8, s, w64 = _fp8_weight(N, K, J, along, g)
    y = torch.full((t, N, J + 16), float("nan"), device=DEV, dtype=DT)
    head_gemm.launch(a, w8, y, 16, cfg, scale=s, along=along)
    ref = torch.einsum("tnk,nkj->tnj", a64[..., :K], w64)
    assert _rel(y[..., :J], ref) < TOL
    assert torch.equal(y[..., J:].cpu(), a[..., K:].cpu())


def test_absorb_fp8_weights_match_dequantized(monkeypatch):
    """absorb_query / absorb_output with e4m3 weights and scales: the kernel (CUDA) and the
    torch path (dequantize_heads, then bmm) agree with float64, at DeepSeek widths."""
    g = torch.Generator().manual_seed(11)
    t, N, P, R, L, V = 2, 3, 128, 64, 512, 128
    q, q64 = _rand(t, N, P + R, g=g)
    o, o64 = _rand(t, N, L, g=g)
    wk8, sk, wk64 = _fp8_weight(N, P, L, 2, g)
    wv8, sv, wv64 = _fp8_weight(N, L, V, 1, g)
    ref_q = torch.einsum("tnp,npl->tnl", q64[..., :P], wk64)
    ref_o = torch.einsum("tnl,nlv->tnv", o64, wv64)
    tol = 1e-2 if DT == torch.bfloat16 else 1e-6
    for impl in ("triton", "torch"):
        monkeypatch.setattr(mla_config, "head_gemm_impl", impl)
        qm = head_gemm.absorb_query(q, wk8, sk)
        out = torch.empty(t, N * V, device=DEV, dtype=DT)
        head_gemm.absorb_output(o, wv8, out, sv)
        assert _rel(qm[..., :L], ref_q) < tol, impl
        assert torch.equal(qm[..., L:].cpu(), q[..., P:].cpu())
        assert _rel(out.view(t, N, V), ref_o) < tol, impl


def test_dequantize_heads_groups():
    """dequantize_heads: each value times its own group's scale, along either axis, and
    a last group shorter than 128 columns."""
    g = torch.Generator().manual_seed(5)
    for along, shape in ((1, (2, 200, 8)), (2, (2, 8, 300))):
        w8, s, w64 = _fp8_weight(*shape, along, g)
        got = head_gemm.dequantize_heads(w8.cpu(), s.cpu(), along, torch.float64)
        assert torch.allclose(got, w64, rtol=2 ** -23, atol=0)    # one fp32 rounding


def test_check_head_scales_names_the_argument():
    s = torch.ones(4, 4)
    head_gemm.check_head_scales("W_UV_scale", s, 4, 512, s.device)
    with pytest.raises(ValueError, match=r"W_UV_scale must be contiguous \[4, 4\]"):
        head_gemm.check_head_scales("W_UV_scale", torch.ones(4, 3), 4, 512, s.device)
    with pytest.raises(TypeError, match="W_UK_T_scale must be a float32 tensor"):
        head_gemm.check_head_scales("W_UK_T_scale", s.half(), 4, 512, s.device)
