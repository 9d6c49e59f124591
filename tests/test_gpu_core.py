"""The layer on a CUDA device: bf16 vs float64, and compiled with CUDA graphs vs eager."""
import pytest
import torch

from mla_ops import MLAMetadata
from mla_ops.cache import mark_static
from scenario import Dims, Step, make_layer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def to_cuda(step, layer):
    step.cache.kv[0] = step.cache.kv[0].cuda()
    step.cache.k_scale = step.cache.k_scale.cuda()
    layer.cuda()
    m = step.meta
    step.meta = MLAMetadata(m.slot_mapping.cuda(), m.block_table.cuda(), m.seq_lens.cuda(),
                            m.query_start_loc.cuda(), m.num_decode_tokens)


@pytest.mark.parametrize("kind", ["auto", "fp8"])
def test_layer_on_gpu_matches_reference(kind):
    d = Dims(N=16, P=128, R=64, V=128, L=512)
    layer, kv_b = make_layer(d, torch.bfloat16, kv_cache_dtype=kind)
    step = Step(d, [300, 64, 0, 5], [1, 1, 40, 70], block_size=64, dtype=torch.bfloat16,
                kv_cache_dtype=kind, k_scale=0.02)
    ref = step.reference(kv_b, layer.softmax_scale)
    to_cuda(step, layer)
    q, kv_c, k_pe = (t.cuda() for t in step.inputs())
    out = layer(q, kv_c, k_pe, step.cache.kv[0], step.cache.k_scale, step.meta)
    err = ((out.double().cpu() - ref).norm() / ref.norm()).item()
    assert err < (2e-2 if kind == "auto" else 6e-2), err


def test_cuda_graph_decode_steps_match_eager():
    d = Dims(N=16, P=128, R=64, V=128, L=512)
    layer, kv_b = make_layer(d, torch.bfloat16)
    layer.cuda()
    torch._dynamo.utils.counters.clear()
    B, steps, M = 4, 20, 8
    compiled = torch.compile(layer, mode="reduce-overhead", fullgraph=True)
    ctx = [3, 70, 130, 1]
    eager_s = Step(d, ctx, [1] * B, block_size=64, dtype=torch.bfloat16, num_blocks=40)
    graph_s = Step(d, ctx, [1] * B, block_size=64, dtype=torch.bfloat16, num_blocks=40)
    for s in (eager_s, graph_s):
        s.cache.kv[0] = s.cache.kv[0].cuda()
        s.cache.k_scale = s.cache.k_scale.cuda()
        mark_static(s.cache.kv[0])
        mark_static(s.cache.k_scale)
    g = torch.Generator().manual_seed(7)
    for i in range(steps):
        metas = []
        for s in (eager_s, graph_s):
            m = s.meta if i == 0 else MLAMetadata.build(s.cache.allocator, range(B), [1] * B, max_blocks=M)
            bt = s.cache.allocator.block_table(range(B), M)
            metas.append(MLAMetadata(m.slot_mapping.cuda(), bt.cuda(), m.seq_lens.cuda(),
                                     m.query_start_loc.cuda(), m.num_decode_tokens))
        q = torch.randn(B, d.N, d.P + d.R, generator=g).bfloat16().cuda()
        kv_c = torch.randn(B, d.L, generator=g).bfloat16().cuda()
        k_pe = torch.randn(B, 1, d.R, generator=g).bfloat16().cuda()
        out_e = layer(q, kv_c, k_pe, eager_s.cache.kv[0], eager_s.cache.k_scale, metas[0])
        out_g = compiled(q, kv_c, k_pe, graph_s.cache.kv[0], graph_s.cache.k_scale, metas[1]).clone()
        err = ((out_g.float() - out_e.float()).norm() / out_e.float().norm()).item()
        assert err < 1e-2, (i, err)
    assert torch._dynamo.utils.counters["inductor"]["cudagraph_skips"] == 0


def test_cache_update_slots_checked_only_when_asked():
    """On CUDA the slot range check is opt-in (lowering.config.validate): without it a slot
    outside the cache is dropped by the write kernel, the other rows are written."""
    from lowering import config
    g = torch.Generator().manual_seed(2)
    kv = torch.zeros(4, 16, 576, dtype=torch.bfloat16, device="cuda")
    kv_c = torch.randn(3, 512, generator=g).to("cuda", torch.bfloat16)
    k_pe = torch.randn(3, 64, generator=g).to("cuda", torch.bfloat16)
    slots = torch.tensor([0, 21, 10 ** 6], device="cuda")
    k_scale = torch.ones(1, device="cuda")
    with config.patch(validate=True):
        with pytest.raises(ValueError, match="slot_mapping"):
            torch.ops.mla.kv_cache_update(kv_c, k_pe, kv, slots, "auto", k_scale)
    assert not kv.any()                                   # nothing written before the error
    torch.ops.mla.kv_cache_update(kv_c, k_pe, kv, slots, "auto", k_scale)
    flat = kv.view(-1, 576)
    want = torch.cat([kv_c, k_pe], dim=-1)
    assert torch.equal(flat[0], want[0]) and torch.equal(flat[21], want[1])
    assert flat[1:21].eq(0).all() and flat[22:].eq(0).all()
