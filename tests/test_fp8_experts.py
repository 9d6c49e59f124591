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




# tokens, experts, k, I, H, (BLOCK_M, BLOCK_N): several tiles per expert and an expert with
# no pair; I and H not multiples of the tiles or of 128 (partial scale blocks, K not a
# multiple of the group); one token
GROUPED_CASES = [(37, 5, 2, 128, 256, (16, 64)), (23, 4, 3, 192, 200, (16, 32)),
                 (1, 3, 2, 64, 128, (16, 64))]


@pytest.mark.parametrize("T,E,K,I,H,tile", GROUPED_CASES)
def test_grouped_prefill_experts_vs_fp64(T, E, K, I, H, tile):
    """The prefill batches' grouped W8A8 GEMMs (lowering/moe/fp8_prefill.py) against the
    float64 W8A8 reference; a pair whose expert is outside [0, E) adds zero."""
    from lowering.moe import fp8_prefill
    g = torch.Generator().manual_seed(T + E + I)
    x = torch.randn(T, H, generator=g)
    idx = torch.stack([torch.randperm(E - 1, generator=g)[:K] for _ in range(T)])  # E-1 idle
    wts = torch.rand(T, K, generator=g)
    gu = (torch.randn(E, 2 * I, H, generator=g) * 100).clamp(-448, 448).to(FP8)
    gus = torch.rand(E, 2 * (-(-I // 128)), -(-H // 128), generator=g) * 0.02 + 1e-3
    dn = (torch.randn(E, H, I, generator=g) * 100).clamp(-448, 448).to(FP8)
    dns = torch.rand(E, -(-H // 128), -(-I // 128), generator=g) * 0.02 + 1e-3
    dt, tol = (torch.bfloat16, 3e-2) if CUDA else (torch.float32, 1e-5)
    cast = (lambda t: t.to(dt).double())
    xs = x.to(DEV, dt)
    cfg = {k: (*tile, 4, 2) for k in ("gate_up", "down")}
    dev = [t.to(DEV) for t in (idx, wts, gu, gus, dn, dns)]
    got = fp8_prefill.grouped_experts(xs, *dev, 128, 128, configs=cfg)
    assert got.dtype == dt
    assert rel(got, moe_w8a8_ref(xs.cpu().float(), idx, wts, gu, gus, dn, dns, cast)) < tol
    bad = idx.clone()
    keep = torch.ones(T, K)
    bad[0, 0], keep[0, 0] = -1, 0                             # outside [0, E): below
    if T > 1:
        bad[-1, -1], keep[-1, -1] = E, 0                      # and above
    got = fp8_prefill.grouped_experts(xs, bad.to(DEV), *dev[1:], 128, 128, configs=cfg)
    want = moe_w8a8_ref(xs.cpu().float(), idx, wts * keep, gu, gus, dn, dns, cast)
    assert torch.isfinite(got).all() and rel(got, want) < tol


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_op_takes_the_grouped_path_past_the_decode_rows():
    """mla::moe_experts_decode_fp8 at 200 tokens in bf16 on CUDA: the grouped path (not the
    per-pair reference) serves it, within bf16 rounding of the float64 W8A8 experts."""
    from lowering.moe import fp8_experts, fp8_prefill
    g = torch.Generator().manual_seed(7)
    T, E, K, I, H = 200, 8, 2, 256, 384
    x = torch.randn(T, H, generator=g).to("cuda", torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    wts = torch.rand(T, K, generator=g)
    gu = (torch.randn(E, 2 * I, H, generator=g) * 100).clamp(-448, 448).to(FP8)
    gus = torch.rand(E, 2 * (I // 128), H // 128, generator=g) * 0.02 + 1e-3
    dn = (torch.randn(E, H, I, generator=g) * 100).clamp(-448, 448).to(FP8)
    dns = torch.rand(E, H // 128, I // 128, generator=g) * 0.02 + 1e-3
    args = [t.cuda() for t in (idx, wts, gu, gus, dn, dns)]
    assert not fp8_experts.kernel_serves(x, *args[2:], 128)
    assert fp8_prefill.serves(x, *args[2:], 128)
    got = torch.ops.mla.moe_experts_decode_fp8(x, *args, 128, 128)
    cast = (lambda t: t.to(torch.bfloat16).double())
    ref = moe_w8a8_ref(x.cpu().float(), idx, wts, gu, gus, dn, dns, cast)
    assert rel(got, ref) < 3e-2
