"""Fusion passes under torch.compile (Inductor, post-grad, auto_functionalized v2 and v1).

Every fused result is compared with the same function run eagerly without passes (the
unfused graph's numerics), bit for bit where the issue asks for it, and with the float64
dense reference where the fp8 rounding allows.
"""
import pytest
import torch
import torch._dynamo.utils as dyn_utils
from torch._inductor import config as inductor_config

import passes
import passes.manager as manager
import passes.pass_b as pass_b
from passes import FP8_GROUP_64, FP8_GROUP_128, FP8_STATIC_TENSOR, MLAFusionPass
from passes.quant import FP8_GROUP_128_POW2
from scenario import Dims, Step, make_layer

D = Dims(N=2, P=16, R=16, V=128, L=32)
CTX, QL = [5, 3, 0], [1, 1, 3]          # two decode rows, one prefill request


@pytest.fixture(autouse=True)
def _fresh():
    torch._dynamo.reset()
    # records come from running the pass, so no FX-graph cache hits here (kernels still cached)
    with inductor_config.patch(fx_graph_cache=False):
        yield


def u8(t):
    return t.view(torch.uint8)


def quant_after(key, scale=None):
    def q(o):
        if key.per_tensor:
            return (torch.ops.mla.quant_fp8_static(o, scale),)
        return torch.ops.mla.quant_fp8_group(o, key.group_size, key.pow2)
    return q


def build(d=D, dtype=torch.bfloat16, kv="fp8", fp8_query=False, ctx=CTX, ql=QL, seed=0):
    layer, kv_b = make_layer(d, dtype, kv_cache_dtype=kv, seed=seed)
    if fp8_query:
        layer.enable_fp8_decode_query(0.04)
    step = Step(d, ctx, ql, dtype=dtype, kv_cache_dtype=kv, k_scale=0.03, seed=seed + 1)
    return layer, kv_b, step


def run_both(fn, step, **compile_kw):
    """(fused outputs, eager outputs, fusion pass); each run on its own copy of the cache."""
    q, kv_c, k_pe = step.inputs()
    kv0 = step.cache.kv[0].clone()
    compiled = passes.compile_with_passes(fn, **compile_kw)
    fused = compiled(q, kv_c, k_pe, step.cache.kv[0], step.cache.k_scale, step.meta)
    kv_fused = step.cache.kv[0].clone()
    step.cache.kv[0].copy_(kv0)
    eager = fn(q, kv_c, k_pe, step.cache.kv[0], step.cache.k_scale, step.meta)
    assert torch.equal(u8(kv_fused) if kv_fused.dtype == torch.float8_e4m3fn else kv_fused,
                       u8(step.cache.kv[0]) if kv_fused.dtype == torch.float8_e4m3fn
                       else step.cache.kv[0]), "the fused graph must write the same cache rows"
    return fused, eager, compiled.fusion


def assert_same(a, b):
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(u8(x) if x.dtype == torch.float8_e4m3fn else x,
                           u8(y) if y.dtype == torch.float8_e4m3fn else y)


# ------------------------------------------------------------------ Pass B

@pytest.mark.parametrize("key", [FP8_STATIC_TENSOR, FP8_GROUP_128, FP8_GROUP_64],
                         ids=str)
def test_pass_b_fuses_each_quant_key(key):
    layer, kv_b, step = build()
    scale = torch.tensor([0.02])
    qf = quant_after(key, scale)
    fn = lambda *a: qf(layer(*a))                                        # noqa: E731
    fused, eager, fusion = run_both(fn, step)
    assert_same(fused, eager)
    b, a = fusion.ops_before, fusion.ops_after
    qop = "mla::quant_fp8_static" if key.per_tensor else "mla::quant_fp8_group"
    assert (b[qop], a[qop]) == (1, 0)
    assert b["mla::attention_with_output"] == a["mla::attention_with_output"] == 1
    assert b["mla::kv_cache_update"] == a["mla::kv_cache_update"] == 1
    assert fusion.match_counts("B") == {str(key): 1}
    assert [r["layer"] for r in fusion.records if r["pass_"] == "B"] == [0]
    # the op now writes the quantized output itself, through the right argument
    attn = fusion.graph_after.split("mla.attention_with_output.default")[1].split("\n")[0]
    if key.per_tensor:
        assert "_output_block_scale_base_index: None" in attn and "output_scale: %" in attn
    else:
        assert "_output_block_scale_base_index: 1" in attn and "output_scale: None" in attn
    # and against the float64 dense reference (dequantized)
    ref = step.reference(kv_b, layer.softmax_scale)
    if key.per_tensor:
        deq = fused[0].double() * scale.double()
    else:
        g = key.group_size
        deq = (fused[0].double().view(len(ref), -1, g) * fused[1].double()[..., None]).view(len(ref), -1)
    assert ((deq - ref).norm() / ref.norm()).item() < 0.08


def test_pass_b_fuses_a_call_carrying_a_decode_schedule():
    """A decode step whose plan carries FlashMLA's per-step schedule (the CPU backend
    ignores it) is its own pattern variant: fused, and the schedule still reaches the op."""
    layer, kv_b, step = build(kv="auto", ctx=[5, 3, 9], ql=[1, 1, 1])
    g = torch.Generator().manual_seed(3)
    step.meta.decode_schedule = (torch.randint(0, 64, (66, 8), generator=g, dtype=torch.int32),
                                 torch.randint(0, 64, (4,), generator=g, dtype=torch.int32))
    qf = quant_after(FP8_GROUP_128)
    fused, eager, fusion = run_both(lambda *a: qf(layer(*a)), step)
    assert_same(fused, eager)
    assert fusion.match_counts("B") == {str(FP8_GROUP_128): 1}
    attn = fusion.graph_after.split("mla.attention_with_output.default")[1].split("\n")[0]
    assert "decode_schedule: %" in attn and "decode_splits: %" in attn


def test_per_group_never_matches_as_per_tensor_and_reverse():
    layer, _, step = build()
    scale = torch.tensor([0.02])
    cases = [(FP8_GROUP_64, (FP8_STATIC_TENSOR, FP8_GROUP_128)),      # group 64 vs others
             (FP8_GROUP_128, (FP8_STATIC_TENSOR, FP8_GROUP_64)),
             (FP8_STATIC_TENSOR, (FP8_GROUP_128, FP8_GROUP_64))]
    for graph_key, pass_keys in cases:
        torch._dynamo.reset()
        qf = quant_after(graph_key, scale)
        fn = lambda *a: qf(layer(*a))                                    # noqa: E731
        fused, eager, fusion = run_both(fn, step, quant_keys=pass_keys)
        assert_same(fused, eager)
        assert fusion.match_counts("B") == {}, (graph_key, pass_keys)
        assert fusion.ops_after == fusion.ops_before


def test_pass_b_must_not_fire_second_user():
    layer, _, step = build()
    fn = lambda *a: (*quant_after(FP8_GROUP_128)(o := layer(*a)), o.sum())   # noqa: E731
    fused, eager, fusion = run_both(fn, step)
    assert_same(fused[:2], eager[:2])
    [rec] = [r for r in fusion.records if r["pass_"] == "B"]
    assert not rec["matched"] and "users" in rec["reason"]
    assert fusion.ops_after["mla::quant_fp8_group"] == 1


def test_pass_b_must_not_fire_fp32():
    layer, _, step = build(dtype=torch.float32)
    fn = lambda *a: quant_after(FP8_GROUP_128)(layer(*a))               # noqa: E731
    fused, eager, fusion = run_both(fn, step)
    assert_same(fused, eager)
    [rec] = [r for r in fusion.records if r["pass_"] == "B"]
    assert not rec["matched"] and "dtype" in rec["reason"]


def test_pass_b_must_not_fire_group_straddles_heads():
    d = Dims(N=2, P=16, R=16, V=96, L=32)                 # N*V = 192 = 3 groups of 64
    layer, _, step = build(d=d)
    fn = lambda *a: quant_after(FP8_GROUP_64)(layer(*a))                # noqa: E731
    fused, eager, fusion = run_both(fn, step)
    assert_same(fused, eager)
    [rec] = [r for r in fusion.records if r["pass_"] == "B"]
    assert not rec["matched"] and "straddle" in rec["reason"]


def test_pass_b_must_not_fire_pow2_scales():
    layer, _, step = build()
    fn = lambda *a: quant_after(FP8_GROUP_128_POW2)(layer(*a))          # noqa: E731
    fused, eager, fusion = run_both(fn, step)
    assert_same(fused, eager)
    [rec] = [r for r in fusion.records if r["pass_"] == "B"]
    assert not rec["matched"] and "power-of-two" in rec["reason"]


def test_pass_b_must_not_fire_on_a_slice_of_the_output():
    layer, _, step = build()
    fn = lambda *a: quant_after(FP8_GROUP_128)(layer(*a)[:2])           # noqa: E731
    fused, eager, fusion = run_both(fn, step)
    assert_same(fused, eager)
    assert fusion.match_counts("B") == {} and fusion.ops_after == fusion.ops_before


# ------------------------------------------------------------------ kv-cache dependency

def test_fused_graph_keeps_cache_write_before_read():
    # context 0: each decode token attends only to the key the cache write puts there
    layer, kv_b, step = build(ctx=[0, 0], ql=[1, 1])
    fn = lambda *a: quant_after(FP8_GROUP_128)(layer(*a))               # noqa: E731
    fused, eager, fusion = run_both(fn, step)
    assert_same(fused, eager)
    assert fusion.match_counts("B") == {"fp8_dynamic_group128": 1}
    assert "mla.kv_cache_update" in fusion.graph_after
    ref = step.reference(kv_b, layer.softmax_scale)
    deq = (fused[0].double().view(2, -1, 128) * fused[1].double()[..., None]).view(2, -1)
    assert ((deq - ref).norm() / ref.norm()).item() < 0.08


def test_dropping_the_cache_dependency_is_caught(monkeypatch):
    """A replacement that feeds the attention a fresh tensor instead of kv_cache_dep fails."""
    orig = pass_b._attn

    def broken(v2, t, scalars, strings, bases, **k):
        if bases[0].dtype == torch.float8_e4m3fn:          # only in the replacement
            t = dict(t, kv_cache_dep=torch.empty(0, dtype=t["kv_cache_dep"].dtype))
        return orig(v2, t, scalars, strings, bases, **k)

    monkeypatch.setattr(pass_b, "_attn", broken)
    layer, _, step = build()
    fn = lambda *a: quant_after(FP8_GROUP_128)(layer(*a))               # noqa: E731
    with pytest.raises(Exception, match="not the result of mla::kv_cache_update"):
        run_both(fn, step)


def _split_layer(layer, meta, graph_break):
    """The layer's two ops by hand, optionally with a graph break between write and read."""
    def fn(q, kv_c, k_pe, kv, k_scale, dep=None):
        if dep is None:
            dep = torch.ops.mla.kv_cache_update(kv_c, k_pe, kv, meta.slot_mapping, "fp8", k_scale)
        if graph_break:
            torch._dynamo.graph_break()
        out = q.new_empty(q.shape[0], layer.num_heads * layer.v_head_dim)
        torch.ops.mla.attention_with_output(
            q, kv_c, k_pe, kv, layer.W_UK_T, layer.W_UV, meta.block_table, meta.seq_lens,
            meta.query_start_loc, meta.num_decode_tokens, layer.softmax_scale, "fp8", k_scale,
            dep, out, None, None, layer.workspace_rows, layer.backend, None, None)
        return quant_after(FP8_GROUP_128)(out)
    return fn


@pytest.mark.parametrize("where", ["before the compiled function", "before a graph break"])
def test_cache_write_outside_the_graph_is_accepted(where):
    """The write ran before this graph (its result is a graph input): order is kept by
    program order, so the passes fire instead of refusing the graph."""
    layer, kv_b, step = build()
    q, kv_c, k_pe = step.inputs()
    kv, ks, meta = step.cache.kv[0], step.cache.k_scale, step.meta
    kv0 = kv.clone()
    fn = _split_layer(layer, meta, graph_break=where.endswith("break"))
    compiled = passes.compile_with_passes(fn)
    if where.startswith("before the compiled"):
        dep = torch.ops.mla.kv_cache_update(kv_c, k_pe, kv, meta.slot_mapping, "fp8", ks)
        fused = compiled(q, kv_c, k_pe, kv, ks, dep)
    else:
        fused = compiled(q, kv_c, k_pe, kv, ks)
    kv.copy_(kv0)
    eager = fn(q, kv_c, k_pe, kv, ks)
    assert_same(fused, eager)
    assert compiled.fusion.match_counts("B") == {"fp8_dynamic_group128": 1}
    assert "mla.kv_cache_update" not in compiled.fusion.graph_after


# ------------------------------------------------------------------ Pass A

def test_pass_a_fuses_decode_query_bitwise():
    layer, kv_b, step = build(fp8_query=True)
    fn = lambda *a: (layer(*a),)                                         # noqa: E731
    fused, eager, fusion = run_both(fn, step)
    assert_same(fused, eager)                       # bitwise: static scale
    b, a = fusion.ops_before, fusion.ops_after
    assert (b["aten::cat"], b["mla::quant_fp8_static"], b["mla::concat_quant_fp8_static"]) == (1, 1, 0)
    assert (a["aten::cat"], a["mla::quant_fp8_static"], a["mla::concat_quant_fp8_static"]) == (0, 0, 1)
    assert fusion.match_counts("A") == {"cat_quant_fp8_static": 1}
    assert [r["layer"] for r in fusion.records if r["pass_"] == "A"] == [0]
    ref = step.reference(kv_b, layer.softmax_scale)
    assert ((fused[0].double() - ref).norm() / ref.norm()).item() < 0.05


def test_pass_a_and_b_together():
    layer, _, step = build(fp8_query=True)
    fn = lambda *a: quant_after(FP8_GROUP_64)(layer(*a))                # noqa: E731
    fused, eager, fusion = run_both(fn, step)
    assert_same(fused, eager)
    assert fusion.match_counts("A") == {"cat_quant_fp8_static": 1}
    assert fusion.match_counts("B") == {"fp8_dynamic_group64": 1}


def _cat_quant_fn(dim, extra_user=False, two_d=False):
    s = torch.tensor([0.05])

    def fn(a, b):
        if two_d:
            a, b = a[:, 0], b[:, 0]
        c = torch.cat([a, b], dim=dim)
        y = torch.ops.mla.quant_fp8_static(c, s)
        return (y, c.float().sum()) if extra_user else (y,)
    return fn


@pytest.mark.parametrize("case,reason", [("other_user", "users"), ("two_d", "3-D"),
                                         ("dim1", "dim 1")])
def test_pass_a_must_not_fire(case, reason):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(3, 4, 32, generator=g).bfloat16()
    b = torch.randn(3, 4, 16, generator=g).bfloat16()
    if case == "dim1":
        b = torch.randn(3, 2, 32, generator=g).bfloat16()
    fn = _cat_quant_fn(1 if case == "dim1" else -1, extra_user=case == "other_user",
                       two_d=case == "two_d")
    compiled = passes.compile_with_passes(fn)
    out = compiled(a, b)
    assert_same(out[:1], fn(a, b)[:1])
    fusion = compiled.fusion
    assert fusion.ops_after["mla::quant_fp8_static"] == 1
    assert fusion.match_counts("A") == {}
    recs = [r for r in fusion.records if r["pass_"] == "A"]
    assert len(recs) == 1 and not recs[0]["matched"] and reason in recs[0]["reason"]


# ------------------------------------------------------------------ functionalization forms

@pytest.mark.parametrize("v2", [True, False])
def test_patterns_match_under_both_functionalization_forms(v2):
    layer, _, step = build(fp8_query=True)
    fn = lambda *a: quant_after(FP8_GROUP_128)(layer(*a))               # noqa: E731
    fused, eager, fusion = run_both(fn, step, v2=v2)
    assert_same(fused, eager)
    hop = "auto_functionalized_v2" if v2 else "auto_functionalized]"
    assert hop in fusion.graph_after
    assert fusion.match_counts("A") == {"cat_quant_fp8_static": 1}
    assert fusion.match_counts("B") == {"fp8_dynamic_group128": 1}


def test_pass_built_for_v1_refuses_a_v2_graph():
    layer, _, step = build()
    fn = lambda *a: quant_after(FP8_GROUP_128)(layer(*a))               # noqa: E731
    fusion = MLAFusionPass(v2=False)
    compiled = torch.compile(fn, options={"post_grad_custom_post_pass": fusion,
                                          "enable_auto_functionalized_v2": True})
    q, kv_c, k_pe = step.inputs()
    with pytest.raises(Exception, match="auto_functionalized form"):
        compiled(q, kv_c, k_pe, step.cache.kv[0], step.cache.k_scale, step.meta)


# ------------------------------------------------------------------ installation and caching

def test_installed_per_compile_not_globally():
    before = (inductor_config.post_grad_custom_post_pass,
              inductor_config.enable_auto_functionalized_v2)
    layer, _, step = build()
    fn = lambda *a: quant_after(FP8_GROUP_128)(layer(*a))               # noqa: E731
    run_both(fn, step)
    assert (inductor_config.post_grad_custom_post_pass,
            inductor_config.enable_auto_functionalized_v2) == before
    # the registered backend does the same
    torch._dynamo.reset()
    dyn_utils.counters.clear()
    compiled = torch.compile(fn, backend="mla_inductor")
    q, kv_c, k_pe = step.inputs()
    out = compiled(q, kv_c, k_pe, step.cache.kv[0], step.cache.k_scale, step.meta)
    assert out[0].dtype == torch.float8_e4m3fn
    assert inductor_config.post_grad_custom_post_pass is before[0]


def test_uuid_hashes_sources_and_parameters(monkeypatch):
    a, b = MLAFusionPass(), MLAFusionPass()
    base = a.uuid()
    assert base == b.uuid()
    assert MLAFusionPass(quant_keys=[FP8_GROUP_64]).uuid() != a.uuid()
    assert MLAFusionPass(pass_a_on=False).uuid() != a.uuid()
    assert MLAFusionPass(v2=False).uuid() != a.uuid()
    real = manager.inspect.getsource
    monkeypatch.setattr(manager.inspect, "getsource",
                        lambda m: real(m) + ("# edited" if m is pass_b else ""))
    assert MLAFusionPass().uuid() != base


def test_second_identical_compile_is_a_cache_hit():
    from torch._inductor.utils import fresh_cache
    layer, _, step = build()
    fn = lambda *a: quant_after(FP8_GROUP_128)(layer(*a))               # noqa: E731
    q, kv_c, k_pe = step.inputs()
    args = (q, kv_c, k_pe, step.cache.kv[0], step.cache.k_scale, step.meta)
    with fresh_cache(), inductor_config.patch(fx_graph_cache=True):
        outs, stats = [], []
        for keys in (None, None, [FP8_GROUP_64]):
            torch._dynamo.reset()
            dyn_utils.counters.clear()
            kw = {} if keys is None else {"quant_keys": keys}
            compiled = passes.compile_with_passes(fn, **kw)
            outs.append(compiled(*args))
            stats.append((dyn_utils.counters["inductor"]["fxgraph_cache_hit"],
                          dyn_utils.counters["inductor"]["fxgraph_cache_miss"]))
    assert stats == [(0, 1), (1, 0), (0, 1)]      # miss, hit, miss on other parameters
    assert outs[1][0].dtype == torch.float8_e4m3fn


# ------------------------------------------------------------------ a two-layer model

def test_two_layer_model_with_fp8_o_proj_fuses_every_layer():
    """MLAAttention (fp8 cache, fp8 decode query) + Fp8BlockLinear o_proj, two layers."""
    from mla_ops import PagedLatentCache
    from passes.fp8_linear import Fp8BlockLinear
    layers, projs = [], []
    for i in range(2):
        layer, _, step = build(fp8_query=True, seed=10 * i)
        layers.append(layer)
        lin = torch.nn.Linear(D.N * D.V, 128, bias=False)
        torch.nn.init.normal_(lin.weight, std=0.05, generator=torch.Generator().manual_seed(i))
        projs.append(Fp8BlockLinear.from_linear(lin.to(torch.bfloat16)))
    cache2 = PagedLatentCache(1, step.cache.num_blocks, step.cache.block_size, kv_lora_rank=D.L,
                              qk_rope_head_dim=D.R, dtype=torch.bfloat16, kv_cache_dtype="fp8",
                              k_scale=0.03)
    cache2.kv[0].copy_(step.cache.kv[0])

    def model(q, kv_c, k_pe, kv0, k_scale, meta, kv1):
        h = 0
        for layer, proj, kv in zip(layers, projs, (kv0, kv1)):
            h = h + proj(layer(q, kv_c, k_pe, kv, k_scale, meta))
        return (h,)

    q, kv_c, k_pe = step.inputs()
    snap = [step.cache.kv[0].clone(), cache2.kv[0].clone()]
    compiled = passes.compile_with_passes(model)
    fused = compiled(q, kv_c, k_pe, step.cache.kv[0], step.cache.k_scale, step.meta, cache2.kv[0])
    step.cache.kv[0].copy_(snap[0])
    cache2.kv[0].copy_(snap[1])
    eager = model(q, kv_c, k_pe, step.cache.kv[0], step.cache.k_scale, step.meta, cache2.kv[0])
    assert torch.allclose(fused[0].float(), eager[0].float(), atol=2e-2, rtol=2e-2)
    fusion = compiled.fusion
    for p, pattern in (("A", "cat_quant_fp8_static"), ("B", "fp8_dynamic_group128")):
        recs = [r for r in fusion.records if r["pass_"] == p]
        assert sorted((r["layer"], r["matched"]) for r in recs) == [(0, True), (1, True)], p
        assert fusion.match_counts(p) == {pattern: 2}
    b, a = fusion.ops_before, fusion.ops_after
    assert (b["mla::quant_fp8_group"], a["mla::quant_fp8_group"]) == (2, 0)
    assert (b["mla::quant_fp8_static"], a["mla::quant_fp8_static"]) == (2, 0)
    assert a["mla::concat_quant_fp8_static"] == 2 and a["mla::kv_cache_update"] == 2


def test_patterns_match_with_dynamic_shapes():
    """Symbolic token counts: both passes still fire in every compile."""
    layer, _, step = build(fp8_query=True)
    fn = lambda *a: quant_after(FP8_GROUP_64)(layer(*a))                # noqa: E731
    compiled = passes.compile_with_passes(fn, dynamic=True)
    for ctx, ql in (([5, 3, 0], [1, 1, 3]), ([6, 2, 4, 0], [1, 1, 1, 4])):
        _, _, st = build(fp8_query=True, ctx=ctx, ql=ql)
        q, kv_c, k_pe = st.inputs()
        kv0 = st.cache.kv[0].clone()
        fused = compiled(q, kv_c, k_pe, st.cache.kv[0], st.cache.k_scale, st.meta)
        st.cache.kv[0].copy_(kv0)
        assert_same(fused, fn(q, kv_c, k_pe, st.cache.kv[0], st.cache.k_scale, st.meta))
    assert "sym_size" in compiled.fusion.graph_after or "s0" in compiled.fusion.graph_after
    recs = compiled.fusion.records
    assert recs and all(r["matched"] for r in recs)
    n = len([r for r in recs if r["pass_"] == "B"])
    assert compiled.fusion.match_counts("A") == {"cat_quant_fp8_static": n}
    assert compiled.fusion.match_counts("B") == {"fp8_dynamic_group64": n}
