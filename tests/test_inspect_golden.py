"""Golden post-pass FX graphs of one MLA layer (decode / prefill, bf16 / fp8 KV), on CPU.

Regenerate after an intended graph change with
    EXPECTTEST_ACCEPT=1 python -m pytest tests/test_inspect_golden.py
and review the diff. Graphs are normalized (passes.inspect.normalize_graph) so only a
real change of the graph changes them.
"""
import pytest
import torch

# a test dependency ([test] extra); where it is absent the goldens skip, not the suite
expecttest = pytest.importorskip("expecttest")
from torch._inductor import config as inductor_config  # noqa: E402

import passes  # noqa: E402
from passes.inspect import normalize_graph  # noqa: E402
from scenario import Dims, Step, make_layer  # noqa: E402

D = Dims(N=2, P=16, R=16, V=64, L=32)


def post_pass_graph(phase: str, kv: str) -> str:
    """fp8: fp8 decode query in the layer and an FP8 group-64 quant of the output."""
    torch._dynamo.reset()
    layer, _ = make_layer(D, torch.bfloat16, kv_cache_dtype=kv)
    if kv == "fp8":
        layer.enable_fp8_decode_query(0.05)
    ctx, ql = ([4, 2], [1, 1]) if phase == "decode" else ([3], [5])
    step = Step(D, ctx, ql, dtype=torch.bfloat16, kv_cache_dtype=kv, k_scale=0.03)

    def fn(q, kv_c, k_pe, cache, k_scale, meta):
        out = layer(q, kv_c, k_pe, cache, k_scale, meta)
        return torch.ops.mla.quant_fp8_group(out, 64, False) if kv == "fp8" else (out,)

    compiled = passes.compile_with_passes(fn, fullgraph=True)
    q, kv_c, k_pe = step.inputs()
    with inductor_config.patch(fx_graph_cache=False):
        compiled(q, kv_c, k_pe, step.cache.kv[0], step.cache.k_scale, step.meta)
    return normalize_graph(compiled.fusion.graph_after)


class TestGoldenGraphs(expecttest.TestCase):
    def test_normalization_is_stable(self):
        a = post_pass_graph("decode", "auto")
        self.assertEqual(a, post_pass_graph("decode", "auto"))
        self.assertNotIn("num_users", a)
        self.assertNotIn("arg0_1", a)

    def test_decode_bf16(self):
        self.assertExpectedInline(post_pass_graph("decode", "auto"), """\
graph():
    %in0 = placeholder
    %in1 = placeholder
    %in2 = placeholder
    %in3 = placeholder
    %in4 = placeholder
    %in5 = placeholder
    %in6 = placeholder
    %in7 = placeholder
    %in8 = placeholder
    %in9 = placeholder
    %in10 = placeholder
    %n0 = call_function[target=torch.ops.higher_order.auto_functionalized_v2](args = (mla.kv_cache_update.default,), kwargs = {kv_c_normed: %in1, k_pe: %in3, slot_mapping: %in5, kv_cache_dtype: auto, k_scale: %in6, _kv_cache_base_index: 0, _all_bases: [%in4]})
    %n1 = call_function[target=operator.getitem](args = (%n0, 0), kwargs = {})
    %n2 = call_function[target=operator.getitem](args = (%n0, 1), kwargs = {})
    %n3 = call_function[target=torch.ops.aten.empty.memory_format](args = ([2, 128],), kwargs = {dtype: torch.bfloat16, layout: torch.strided, device: cpu, pin_memory: False})
    %n4 = call_function[target=torch.ops.higher_order.auto_functionalized_v2](args = (mla.attention_with_output.default,), kwargs = {q: %in2, kv_c_normed: %in1, k_pe: %in3, kv_cache: %n2, W_UK_T: %in0, W_UV: %in7, block_table: %in8, seq_lens: %in9, query_start_loc: %in10, num_decode_tokens: 2, softmax_scale: 0.176777, kv_cache_dtype: auto, k_scale: %in6, kv_cache_dep: %n1, output_scale: None, workspace_rows: 8192, backend: auto, decode_q: None, decode_q_scale: None, decode_schedule: None, decode_splits: None, prefill_shape: None, _output_base_index: 0, _output_block_scale_base_index: None, _all_bases: [%n3]})
    %n5 = call_function[target=operator.getitem](args = (%n4, 1), kwargs = {})
    %n6 = call_function[target=torch.ops.aten.copy_.default](args = (%in4, %n2), kwargs = {})
    return (n5,)
""")

    def test_decode_fp8(self):
        self.assertExpectedInline(post_pass_graph("decode", "fp8"), """\
graph():
    %in0 = placeholder
    %in1 = placeholder
    %in2 = placeholder
    %in3 = placeholder
    %in4 = placeholder
    %in5 = placeholder
    %in6 = placeholder
    %in7 = placeholder
    %in8 = placeholder
    %in9 = placeholder
    %in10 = placeholder
    %in11 = placeholder
    %n0 = call_function[target=torch.ops.higher_order.auto_functionalized_v2](args = (mla.kv_cache_update.default,), kwargs = {kv_c_normed: %in2, k_pe: %in4, slot_mapping: %in6, kv_cache_dtype: fp8, k_scale: %in7, _kv_cache_base_index: 0, _all_bases: [%in5]})
    %n1 = call_function[target=operator.getitem](args = (%n0, 0), kwargs = {})
    %n2 = call_function[target=operator.getitem](args = (%n0, 1), kwargs = {})
    %n3 = call_function[target=torch.ops.aten.split_with_sizes.default](args = (%in3, [16, 16], -1), kwargs = {})
    %n4 = call_function[target=operator.getitem](args = (%n3, 0), kwargs = {})
    %n5 = call_function[target=operator.getitem](args = (%n3, 1), kwargs = {})
    %n6 = call_function[target=torch.ops.aten.permute.default](args = (%n4, [1, 0, 2]), kwargs = {})
    %n7 = call_function[target=torch.ops.aten.bmm.default](args = (%n6, %in0), kwargs = {})
    %n8 = call_function[target=torch.ops.aten.permute.default](args = (%n7, [1, 0, 2]), kwargs = {})
    %n9 = call_function[target=torch.ops.mla.concat_quant_fp8_static.default](args = (%n8, %n5, %in1), kwargs = {})
    %n10 = call_function[target=torch.ops.aten.empty.memory_format](args = ([2, 128],), kwargs = {dtype: torch.float8_e4m3fn, device: cpu, pin_memory: False})
    %n11 = call_function[target=torch.ops.aten.empty.memory_format](args = ([2, 2],), kwargs = {dtype: torch.float32, device: cpu, pin_memory: False})
    %n12 = call_function[target=torch.ops.higher_order.auto_functionalized_v2](args = (mla.attention_with_output.default,), kwargs = {q: %in3, kv_c_normed: %in2, k_pe: %in4, kv_cache: %n2, W_UK_T: %in0, W_UV: %in8, block_table: %in9, seq_lens: %in10, query_start_loc: %in11, num_decode_tokens: 2, softmax_scale: 0.176777, kv_cache_dtype: fp8, k_scale: %in7, kv_cache_dep: %n1, output_scale: None, workspace_rows: 8192, backend: auto, decode_q: %n9, decode_q_scale: %in1, decode_schedule: None, decode_splits: None, _output_base_index: 0, _output_block_scale_base_index: 1, _all_bases: [%n10, %n11]})
    %n13 = call_function[target=operator.getitem](args = (%n12, 1), kwargs = {})
    %n14 = call_function[target=operator.getitem](args = (%n12, 2), kwargs = {})
    %n15 = call_function[target=torch.ops.aten.copy_.default](args = (%in5, %n2), kwargs = {})
    return (n13, n14)
""")

    def test_prefill_bf16(self):
        self.assertExpectedInline(post_pass_graph("prefill", "auto"), """\
graph():
    %in0 = placeholder
    %in1 = placeholder
    %in2 = placeholder
    %in3 = placeholder
    %in4 = placeholder
    %in5 = placeholder
    %in6 = placeholder
    %in7 = placeholder
    %in8 = placeholder
    %in9 = placeholder
    %in10 = placeholder
    %n0 = call_function[target=torch.ops.higher_order.auto_functionalized_v2](args = (mla.kv_cache_update.default,), kwargs = {kv_c_normed: %in1, k_pe: %in3, slot_mapping: %in5, kv_cache_dtype: auto, k_scale: %in6, _kv_cache_base_index: 0, _all_bases: [%in4]})
    %n1 = call_function[target=operator.getitem](args = (%n0, 0), kwargs = {})
    %n2 = call_function[target=operator.getitem](args = (%n0, 1), kwargs = {})
    %n3 = call_function[target=torch.ops.aten.empty.memory_format](args = ([5, 128],), kwargs = {dtype: torch.bfloat16, layout: torch.strided, device: cpu, pin_memory: False})
    %n4 = call_function[target=torch.ops.higher_order.auto_functionalized_v2](args = (mla.attention_with_output.default,), kwargs = {q: %in2, kv_c_normed: %in1, k_pe: %in3, kv_cache: %n2, W_UK_T: %in0, W_UV: %in7, block_table: %in8, seq_lens: %in9, query_start_loc: %in10, num_decode_tokens: 0, softmax_scale: 0.176777, kv_cache_dtype: auto, k_scale: %in6, kv_cache_dep: %n1, output_scale: None, workspace_rows: 8192, backend: auto, decode_q: None, decode_q_scale: None, decode_schedule: None, decode_splits: None, prefill_shape: [1, 5, 3, 3], _output_base_index: 0, _output_block_scale_base_index: None, _all_bases: [%n3]})
    %n5 = call_function[target=operator.getitem](args = (%n4, 1), kwargs = {})
    %n6 = call_function[target=torch.ops.aten.copy_.default](args = (%in4, %n2), kwargs = {})
    return (n5,)
""")

    def test_prefill_fp8(self):
        self.assertExpectedInline(post_pass_graph("prefill", "fp8"), """\
graph():
    %in0 = placeholder
    %in1 = placeholder
    %in2 = placeholder
    %in3 = placeholder
    %in4 = placeholder
    %in5 = placeholder
    %in6 = placeholder
    %in7 = placeholder
    %in8 = placeholder
    %in9 = placeholder
    %in10 = placeholder
    %n0 = call_function[target=torch.ops.higher_order.auto_functionalized_v2](args = (mla.kv_cache_update.default,), kwargs = {kv_c_normed: %in1, k_pe: %in3, slot_mapping: %in5, kv_cache_dtype: fp8, k_scale: %in6, _kv_cache_base_index: 0, _all_bases: [%in4]})
    %n1 = call_function[target=operator.getitem](args = (%n0, 0), kwargs = {})
    %n2 = call_function[target=operator.getitem](args = (%n0, 1), kwargs = {})
    %n3 = call_function[target=torch.ops.aten.empty.memory_format](args = ([5, 128],), kwargs = {dtype: torch.float8_e4m3fn, device: cpu, pin_memory: False})
    %n4 = call_function[target=torch.ops.aten.empty.memory_format](args = ([5, 2],), kwargs = {dtype: torch.float32, device: cpu, pin_memory: False})
    %n5 = call_function[target=torch.ops.higher_order.auto_functionalized_v2](args = (mla.attention_with_output.default,), kwargs = {q: %in2, kv_c_normed: %in1, k_pe: %in3, kv_cache: %n2, W_UK_T: %in0, W_UV: %in7, block_table: %in8, seq_lens: %in9, query_start_loc: %in10, num_decode_tokens: 0, softmax_scale: 0.176777, kv_cache_dtype: fp8, k_scale: %in6, kv_cache_dep: %n1, output_scale: None, workspace_rows: 8192, backend: auto, decode_q: None, decode_q_scale: None, decode_schedule: None, decode_splits: None, _output_base_index: 0, _output_block_scale_base_index: 1, _all_bases: [%n3, %n4]})
    %n6 = call_function[target=operator.getitem](args = (%n5, 1), kwargs = {})
    %n7 = call_function[target=operator.getitem](args = (%n5, 2), kwargs = {})
    %n8 = call_function[target=torch.ops.aten.copy_.default](args = (%in4, %n2), kwargs = {})
    return (n6, n7)
""")
