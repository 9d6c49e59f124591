"""An FP8 checkpoint's routed experts (HF's FP8Experts) on the fp8 MoE kernels
(lowering/moe/fp8_experts.py): both kernels, with their activations quantized once or in
every program, against a float64 reference of HF's W8A8 numerics written here; the
dequantizing torch path; the scales' checks."""
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from mla_reference import nan_empty  # noqa: E402
from test_fp8_checkpoint import CUDA, DEV, FP8, expand_scales, rel, w8a8_ref  # noqa: E402


def moe_w8a8_ref(x, idx, wts, gu, gus, dn, dns, cast):
    """float64 sum over k of wts * down(SiLU(gate(x)) * up(x)), each linear W8A8 as HF's
    FP8Linear (gate's and up's scale blocks one after the other), each linear's output and
    the SiLU x up product rounded by `cast` (h's dtype), as HF's module rounds them."""
    I = gu.shape[1] // 2
    rows = -(-I // 128)
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            xt = x[t:t + 1]
            gate = cast(w8a8_ref(xt, gu[e, :I], gus[e, :rows]))
            up = cast(w8a8_ref(xt, gu[e, I:], gus[e, rows:]))
            h = cast(cast(F.silu(gate)) * up)
            y = cast(w8a8_ref(h.float(), dn[e], dns[e]))
            out[t] += float(wts[t, k]) * y[0]
    return out


@pytest.mark.parametrize("pre_quant", [(True, True), (False, False), (False, True)])
@pytest.mark.parametrize("T,E,K,I,H", [(1, 4, 2, 128, 256), (5, 6, 3, 192, 200),
                                       (17, 3, 2, 64, 384)])
def test_moe_fp8_kernels_vs_fp64(T, E, K, I, H, pre_quant):
    """Both kernels with their activations quantized once before them or by every
    program (the configs' PRE_QUANT), against the float64 W8A8 reference."""
    from lowering.moe import fp8_experts
    g = torch.Generator().manual_seed(T * 100 + I)
    x = torch.randn(T, H, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])   # [T, K]
    wts = torch.rand(T, K, generator=g)
    gu = (torch.randn(E, 2 * I, H, generator=g) * 100).clamp(-448, 448).to(FP8)
    gus = torch.rand(E, 2 * (-(-I // 128)), -(-H // 128), generator=g) * 0.02 + 1e-3
    dn = (torch.randn(E, H, I, generator=g) * 100).clamp(-448, 448).to(FP8)
    dns = torch.rand(E, -(-H // 128), -(-I // 128), generator=g) * 0.02 + 1e-3
    fp8_experts.check_scales(gu, gus, dn, dns, 128, 128)
    dt, tol = (torch.bfloat16, 3e-2) if CUDA else (torch.float32, 1e-5)
    cast = (lambda t: t.to(dt).double())
    xs = x.to(DEV, dt)
    ref = moe_w8a8_ref(xs.cpu().float(), idx, wts, gu, gus, dn, dns, cast)
    got = fp8_experts.run_kernels(xs, idx.to(DEV), wts.to(DEV), gu.to(DEV), gus.to(DEV),
                                  dn.to(DEV), dns.to(DEV), 128, 128, pre_quant=pre_quant)
    assert rel(got, ref) < tol
    # a pair whose expert is outside [0, E) adds zero (its output row is written as zeros;
    # the buffers are NaN-filled here so an unwritten row shows)
    bad = idx.clone()
    bad[0, 0] = -1
    keep = torch.ones(T, K)
    keep[0, 0] = 0
    with pytest.MonkeyPatch.context() as mp:
        nan_empty(mp)
        got = fp8_experts.run_kernels(xs, bad.to(DEV), wts.to(DEV), gu.to(DEV), gus.to(DEV),
                                      dn.to(DEV), dns.to(DEV), 128, 128, pre_quant=pre_quant)
    assert torch.isfinite(got).all()
    assert rel(got, moe_w8a8_ref(xs.cpu().float(), idx, wts * keep, gu, gus, dn, dns, cast)) < tol
    # the torch path: the chosen experts dequantized, no activation quant
    dequantized = fp8_experts.reference(x, idx, wts, gu, gus, dn, dns, 128, 128)
    half = gus.shape[1] // 2

    def deq(w, sc, n, k):
        return w.double() * torch.stack([expand_scales(sc[e], n, k) for e in range(E)])
    gud = torch.cat([deq(gu[:, :I], gus[:, :half], I, H), deq(gu[:, I:], gus[:, half:], I, H)], 1)
    dnd = deq(dn, dns, H, I)
    plain = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for k in range(K):
            e = int(idx[t, k])
            gt, u = gud[e, :I] @ x[t].double(), gud[e, I:] @ x[t].double()
            plain[t] += float(wts[t, k]) * (dnd[e] @ (F.silu(gt) * u))
    assert rel(dequantized, plain) < 1e-5


def test_moe_fp8_scales_checked():
    from lowering.moe import fp8_experts
    gu = torch.zeros(2, 256, 128, dtype=FP8)
    dn = torch.zeros(2, 128, 128, dtype=FP8)
    with pytest.raises(ValueError, match="gate_up_scale"):
        fp8_experts.check_scales(gu, torch.ones(2, 1, 1), dn, torch.ones(2, 1, 1), 128, 128)
    with pytest.raises(TypeError, match="down"):
        fp8_experts.check_scales(gu, torch.ones(2, 2, 1), dn.float(), torch.ones(2, 1, 1),
                                 128, 128)


