"""Fusion passes and quant kernels on CUDA (skipped without a GPU)."""
import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def u8(t):
    return t.view(torch.uint8)


def test_triton_quant_kernels_bitwise_on_cuda():
    import passes.quant as Q
    from lowering.fused import concat_quant, group_quant, static_quant, wuv_quant
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(257, 1024, generator=g, device="cuda") * 4).bfloat16()
    s = torch.tensor([0.013], device="cuda")
    assert torch.equal(u8(static_quant.static_quant(x, s)), u8(Q.ref_static(x, s)))
    for gs in (64, 128):
        for pow2 in (False, True):
            y, sc = group_quant.group_quant(x, gs, pow2)
            y2, sc2 = Q.ref_group(x, gs, pow2)
            assert torch.equal(sc, sc2) and torch.equal(u8(y), u8(y2))
    a = x.view(257, 2, 512)[..., :448].transpose(0, 1).contiguous().transpose(0, 1)
    b = x.view(257, 2, 512)[..., 448:]
    assert torch.equal(u8(concat_quant.concat_quant(a, b, s)), u8(Q.ref_concat_static(a, b, s)))


def test_wuv_epilogue_on_cuda():
    import passes.quant as Q
    from lowering.fused import wuv_quant
    g = torch.Generator(device="cuda").manual_seed(1)
    t, N, L, V = 70, 16, 512, 128
    a = torch.randn(N, t, L, generator=g, device="cuda").bfloat16().transpose(0, 1)
    W = (torch.randn(N, L, V, generator=g, device="cuda") / 16).bfloat16()
    o = torch.einsum("tnl,nlv->tnv", a.double(), W.double()).bfloat16().reshape(t, -1)
    y, sc = wuv_quant.wuv_quant(a, W, group_size=128)
    y2, sc2 = Q.ref_group(o, 128, False)
    d1 = y.double() * sc.repeat_interleave(128, 1).double()
    d2 = y2.double() * sc2.repeat_interleave(128, 1).double()
    assert (d1 != d2).double().mean() < 0.01
    assert ((d1 - d2).norm() / d2.norm()) < 0.01


@pytest.mark.parametrize("group", [128, 64])
def test_compiled_layer_fuses_on_cuda(group):
    import passes
    from mla_ops import MLAAttention, MLAMetadata, PagedLatentCache
    torch._dynamo.reset()
    N, P, R, V, L = 4, 32, 64, 128, 128
    g = torch.Generator(device="cuda").manual_seed(2)
    layer = MLAAttention(N, P, R, V, L, (P + R) ** -0.5, kv_cache_dtype="fp8").cuda()
    layer.absorb((torch.randn(N * (P + V), L, generator=g, device="cuda") / L ** 0.5).bfloat16())
    layer.enable_fp8_decode_query(0.05)
    cache = PagedLatentCache(1, 32, 64, kv_lora_rank=L, qk_rope_head_dim=R, dtype=torch.bfloat16,
                             kv_cache_dtype="fp8", k_scale=0.02, device="cuda")
    cache.kv[0].copy_((torch.randn(cache.kv[0].shape, generator=g, device="cuda") * 5)
                      .to(torch.float8_e4m3fn))
    for i, c in enumerate([100, 7, 300]):
        cache.allocator.allocate(i, c)
    meta = MLAMetadata.build(cache.allocator, [0, 1, 2], [1, 1, 5], device="cuda")
    T = 7
    q = torch.randn(T, N, P + R, generator=g, device="cuda").bfloat16()
    kv_c = torch.randn(T, L, generator=g, device="cuda").bfloat16()
    k_pe = torch.randn(T, 1, R, generator=g, device="cuda").bfloat16()

    def fn(q, kv_c, k_pe, kv, ks, meta):
        return torch.ops.mla.quant_fp8_group(layer(q, kv_c, k_pe, kv, ks, meta), group, False)

    snap = cache.kv[0].clone()
    compiled = passes.compile_with_passes(fn)
    y, s = compiled(q, kv_c, k_pe, cache.kv[0], cache.k_scale, meta)
    kv_fused = cache.kv[0].clone()
    cache.kv[0].copy_(snap)
    y2, s2 = fn(q, kv_c, k_pe, cache.kv[0], cache.k_scale, meta)
    assert torch.equal(u8(kv_fused), u8(cache.kv[0]))
    f = compiled.fusion
    if f.records:                      # empty on an FX-graph cache hit
        assert f.match_counts("A") == {"cat_quant_fp8_static": 1}
        assert f.match_counts("B") == {f"fp8_dynamic_group{group}": 1}
    d1 = y.double() * s.repeat_interleave(group, 1).double()
    d2 = y2.double() * s2.repeat_interleave(group, 1).double()
    assert ((d1 - d2).norm() / d2.norm()) < 0.02
