"""torch.compile of the MLA layer: fullgraph, equal to eager, no recompiles, write-before-read."""
import torch
import torch._dynamo.utils as dyn_utils
from torch._inductor.utils import run_and_get_code

from mla_ops import MLAMetadata
from scenario import Dims, Step, make_layer

D = Dims()


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_compiled_layer_equals_eager_fullgraph():
    torch._dynamo.reset()
    dyn_utils.counters.clear()
    layer, kv_b = make_layer(D, torch.float32)
    eager_step = Step(D, [6, 3, 0], [1, 1, 7])
    comp_step = Step(D, [6, 3, 0], [1, 1, 7])
    q, kv_c, k_pe = eager_step.inputs()
    out_e = layer(q, kv_c, k_pe, eager_step.cache.kv[0], eager_step.cache.k_scale, eager_step.meta)
    compiled = torch.compile(layer, fullgraph=True)
    out_c = compiled(q, kv_c, k_pe, comp_step.cache.kv[0], comp_step.cache.k_scale, comp_step.meta)
    assert rel_err(out_c, out_e) < 1e-6
    assert rel_err(out_c, eager_step.reference(kv_b, layer.softmax_scale)) < 1e-5
    assert torch.equal(comp_step.cache.kv[0], eager_step.cache.kv[0])   # same rows written
    assert len(dyn_utils.counters["graph_break"]) == 0


def test_decode_steps_do_not_recompile():
    torch._dynamo.reset()
    dyn_utils.counters.clear()
    layer, kv_b = make_layer(D, torch.float32)
    step = Step(D, [5, 9], [1, 1], block_size=4, num_blocks=16)
    compiled = torch.compile(layer, fullgraph=True)
    alloc = step.cache.allocator
    g = torch.Generator().manual_seed(3)
    for i in range(6):
        meta = step.meta if i == 0 else MLAMetadata.build(alloc, [0, 1], [1, 1], max_blocks=8)
        if i == 0:
            meta.block_table = alloc.block_table([0, 1], 8)
        q = torch.randn(2, D.N, D.P + D.R, generator=g)
        kv_c, k_pe = torch.randn(2, D.L, generator=g), torch.randn(2, 1, D.R, generator=g)
        out = compiled(q, kv_c, k_pe, step.cache.kv[0], step.cache.k_scale, meta)
        assert out.isfinite().all()
    assert dyn_utils.counters["stats"]["unique_graphs"] == 1
    assert len(dyn_utils.counters["graph_break"]) == 0


def test_cache_write_is_kept_and_ordered_before_read():
    """A decode token attends to its own key, which only the cache write puts in the cache.

    If Inductor dropped the write or moved it after the read, the output would use the
    random row the cache was filled with and miss the reference.
    """
    torch._dynamo.reset()
    layer, kv_b = make_layer(D, torch.float32)
    step = Step(D, [0, 2], [1, 1], block_size=4)
    q, kv_c, k_pe = step.inputs()
    compiled = torch.compile(layer, fullgraph=True)
    out, (code, *_) = run_and_get_code(compiled, q, kv_c, k_pe, step.cache.kv[0],
                                       step.cache.k_scale, step.meta)
    assert rel_err(out, step.reference(kv_b, layer.softmax_scale)) < 1e-5
    w = code.find("mla.kv_cache_update")
    r = code.find("mla.attention_with_output")
    assert 0 <= w < r, "generated code must call the cache write before the attention read"
