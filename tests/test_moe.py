"""The converted DeepSeek MoE block (mla_ops/hf/moe.py): HF's router (same experts, same
weights, ties included) against HF's modules and an independent float64 re-implementation;
converted tiny V2 / V3 models against HF (logits, greedy tokens); the compiled decode step
fullgraph with no graph breaks, whatever config._experts_implementation says."""
import pytest
import torch
import torch._dynamo

import mla_ops.hf as H
from hf_models import (build_pair, graph_and_generate_tokens, left_padded, logit_err,
                       tiny_config)
from mla_ops.hf.moe import convert_moe, route

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def moe_config(family, topk_method="greedy", layers=3, **kw):
    cfg = tiny_config(family, layers=layers)
    # 16 experts in 4 groups, top-4 from the best 2 groups: group limits matter
    cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group = 16, 4, 4, 2
    if family == "v3":
        cfg.num_local_experts = 16
    else:
        cfg.num_experts = 16
        cfg.topk_method = topk_method
    cfg.n_shared_experts = 2
    cfg.routed_scaling_factor = 2.5
    for k, v in kw.items():
        setattr(cfg, k, v)
    return cfg


def moe_pair(family, seed=0, **kw):
    ref, model = build_pair(moe_config(family, **kw), seed=seed)
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for m in ref.modules():          # a bias that changes the choice (zeros by default)
            if hasattr(m, "e_score_correction_bias"):
                m.e_score_correction_bias.copy_(torch.rand(m.e_score_correction_bias.shape,
                                                           generator=g) * 0.5)
    model.load_state_dict(ref.state_dict())          # parameters and the bias buffers
    return ref, model


# ------------------------------------------------------------------------- router


def route_fp64(gate, family, x):
    """An independent router in float64, token by token with Python sorting: (sorted expert
    ids per token, their weights in that order)."""
    logits = x.double() @ gate.weight.double().T                              # [T, E]
    E, G, KG, K = gate.num_experts, gate.num_group, gate.topk_group, gate.top_k
    per = E // G
    out_idx, out_w = [], []
    for row in logits:
        if family == "v3":
            scores = torch.sigmoid(row)
            choice = scores + gate.e_score_correction_bias.double()
            gscore = [sum(sorted(choice[g * per:(g + 1) * per].tolist())[-2:]) for g in range(G)]
        else:
            scores = torch.softmax(row, -1)
            choice = scores.clone()
            gscore = [max(scores[g * per:(g + 1) * per].tolist()) for g in range(G)]
        limited = family == "v3" or gate.topk_method == "group_limited_greedy"
        groups = sorted(range(G), key=lambda g: -gscore[g])[:KG] if limited else range(G)
        cand = [e for g in groups for e in range(g * per, (g + 1) * per)]
        chosen = sorted(sorted(cand, key=lambda e: -choice[e].item())[:K])
        w = torch.stack([scores[e] for e in chosen])
        if family == "v3" and gate.norm_topk_prob:
            w = w / w.sum()
        out_idx.append(chosen)
        out_w.append(w * gate.routed_scaling_factor)
    return torch.tensor(out_idx), torch.stack(out_w)


def sorted_by_index(idx, w):
    order = idx.argsort(-1)
    return idx.gather(-1, order), w.gather(-1, order)


@pytest.mark.parametrize("family,method,norm", [
    ("v3", None, True), ("v3", None, False), ("v2", "greedy", None),
    ("v2", "group_limited_greedy", None)])
def test_router_vs_fp64_and_hf(family, method, norm):
    kw = {} if method is None else {"topk_method": method}
    if norm is not None:
        kw["norm_topk_prob"] = norm
    ref, model = moe_pair(family, **kw)
    convert_moe(model)
    hf_block, block = ref.model.layers[1].mlp, model.model.layers[1].mlp
    g = torch.Generator().manual_seed(11)
    x = torch.randn(37, 256, generator=g)
    idx, w = route(block, x)
    _, hf_w, hf_idx = hf_block.gate(x)
    assert torch.equal(idx, hf_idx) and torch.equal(w, hf_w)          # same calls, same values
    exp_idx, exp_w = route_fp64(block.gate, family, x)
    got_idx, got_w = sorted_by_index(idx, w)
    assert torch.equal(got_idx, exp_idx)
    assert torch.allclose(got_w.double(), exp_w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family,method", [("v3", None), ("v2", "greedy"),
                                           ("v2", "group_limited_greedy")])
def test_router_ties_broken_as_hf(family, method):
    """Experts with equal router rows (equal scores) and whole groups alike: HF's and our
    choice agree index for index (on the GPU where there is one)."""
    ref, model = moe_pair(family, **({} if method is None else {"topk_method": method}))
    convert_moe(model)
    hf_gate, block = ref.model.layers[1].mlp.gate, model.model.layers[1].mlp
    with torch.no_grad():
        wgt = hf_gate.weight
        wgt[1] = wgt[0]                   # experts 0 and 1 tie, and 2 and 5
        wgt[5] = wgt[2]
        wgt[8:12] = wgt[4:8]              # groups 1 and 2 alike
        if family == "v3":
            bias = hf_gate.e_score_correction_bias
            bias[1], bias[5] = bias[0], bias[2]
            bias[8:12] = bias[4:8]
        block.gate.load_state_dict(hf_gate.state_dict())
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(5))
    x[:8] = 0.0                           # all scores equal within each token
    hf_gate, block, x = hf_gate.to(DEVICE), block.to(DEVICE), x.to(DEVICE)   # GPU too
    idx, w = route(block, x)
    _, hf_w, hf_idx = hf_gate(x)
    assert torch.equal(idx, hf_idx) and torch.equal(w, hf_w)


# ------------------------------------------------------------------------- models


@pytest.mark.parametrize("family,method", [("v3", None), ("v2", "greedy"),
                                           ("v2", "group_limited_greedy")])
@pytest.mark.parametrize("impl", ["grouped_mm", "eager", "batched_mm"])
def test_converted_model_matches_hf(family, method, impl):
    ref, model = moe_pair(family, **({} if method is None else {"topk_method": method}))
    for m in (ref, model):
        m.config._experts_implementation = impl
    assert convert_moe(model) == 2                      # layers 1 and 2 (first_k_dense_replace 1)
    assert convert_moe(model) == 0                      # idempotent
    assert type(model.model.layers[0].mlp).__name__.endswith("MLP")   # the dense layer
    ids, mask = left_padded([7, 12, 3])
    with torch.no_grad():
        a, b = ref(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits
        assert logit_err(b, a) <= 1e-5
        kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False)
        assert torch.equal(model.generate(ids, **kw), ref.generate(ids, **kw))


def test_convert_moe_keeps_parameters_and_rejects_bad_blocks():
    ref, model = moe_pair("v3")
    params = {n: p.data_ptr() for n, p in model.named_parameters()}
    convert_moe(model)
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == params
    assert model.state_dict().keys() == ref.state_dict().keys()
    with pytest.raises(TypeError, match="nn.Module"):
        convert_moe("model")
    _, bad = moe_pair("v2", topk_method="greedy")
    bad.config._experts_implementation = "no_such_impl"
    with pytest.raises(ValueError, match="_experts_implementation"):
        convert_moe(bad)
    assert not any(getattr(m, "mla_converted", False) for m in bad.modules())   # untouched
    _, bad = moe_pair("v2", topk_method="greedy")
    bad.model.layers[2].mlp.gate.topk_method = "noaux_tc"
    with pytest.raises(ValueError, match="topk_method"):
        convert_moe(bad)
    assert not any(getattr(m, "mla_converted", False) for m in bad.modules())
    _, bad = moe_pair("v3")
    bad.model.layers[2].mlp.gate.topk_group = 5                      # more than n_group
    with pytest.raises(ValueError, match="topk_group"):
        convert_moe(bad)
    _, bad = moe_pair("v3")
    bad.config.hidden_act = "gelu"
    with pytest.raises(ValueError, match="SiLU"):
        convert_moe(bad)
    assert not any(getattr(m, "mla_converted", False) for m in bad.modules())


# ------------------------------------------------------------------------- compile


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("impl", ["grouped_mm", "eager", "batched_mm"])
def test_compiled_decode_step_fullgraph(fresh_dynamo, impl):
    """A converted model's decode steps under torch.compile(fullgraph=True): one graph, no
    graph breaks, HF's tokens; HF's eager experts loop included (replaced while tracing)."""
    from transformers.generation.configuration_utils import CompileConfig
    graphs = []

    def backend(gm, example_inputs, **kwargs):
        graphs.append(gm)
        return gm.forward

    ref, model = moe_pair("v3")
    for m in (ref, model):
        m.config._experts_implementation = impl
    model = H.convert(model)
    convert_moe(model)
    ref, model = ref.to(DEVICE), model.to(DEVICE)
    ids, mask = (t.to(DEVICE) for t in left_padded([6, 11]))
    cc = CompileConfig(fullgraph=True, dynamic=False, backend=backend, mode=None)
    cc._compile_all_devices = True
    cache = H.PagedMLACache(model.config, max_batch_size=2, max_cache_len=48, block_size=16,
                            device=DEVICE)
    kw = dict(attention_mask=mask, max_new_tokens=10, do_sample=False)
    with torch.no_grad():
        out = model.generate(ids, **H.cache_kwargs(model, cache), compile_config=cc, **kw)
        exp = ref.generate(ids, **kw)
    assert len(graphs) == 1
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
    assert torch.equal(out, exp)


# ------------------------------------------------------------------------- through convert()


@pytest.mark.parametrize("family", ["v3", "v2"])
def test_convert_swaps_moe_blocks(family):
    """convert() converts the MoE blocks by default (fuse_experts=True)."""
    ref, model = moe_pair(family)
    H.convert(model)
    assert all(getattr(model.model.layers[i].mlp, "mla_converted", False) for i in (1, 2))
    assert all(model.model.layers[i].mlp.mla_fuse_experts for i in (1, 2))
    ids, mask = left_padded([5, 9])
    cache = H.PagedMLACache(model.config, max_batch_size=2, max_cache_len=32, block_size=16)
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False)
    with torch.no_grad():
        assert torch.equal(model.generate(ids, **H.cache_kwargs(model, cache), **kw),
                           ref.generate(ids, **kw))


def test_convert_fuse_experts_false_keeps_hf_experts_path():
    """convert(fuse_experts=False) leaves the MoE blocks to HF; the block with our router
    and HF's experts is convert_moe(model, fuse_experts=False)."""
    from mla_ops.hf.moe import convert_moe
    _, model = moe_pair("v3")
    H.convert(model, fuse_experts=False)
    assert not getattr(model.model.layers[1].mlp, "mla_converted", False)
    assert convert_moe(model, fuse_experts=False) > 0
    block = model.model.layers[1].mlp
    assert block.mla_converted and not block.mla_fuse_experts


def experts_impls() -> list:
    """Every config._experts_implementation the installed transformers accepts."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        return ["eager"]
    return ["eager"] + sorted(ALL_EXPERTS_FUNCTIONS.keys())


@pytest.mark.parametrize("impl", experts_impls())
def test_every_experts_implementation_works_or_is_refused(fresh_dynamo, impl):
    """convert()'s default on a model asking for each registered experts implementation:
    either the converted model gives HF's tokens eagerly and in DecodeGraph's compiled
    step (fullgraph, one graph, no graph breaks; CPU: no CUDA graph), or convert() raises
    a ValueError naming the setting and what to set, leaving the model as it was."""
    from mla_ops.hf.moe import SERVED_IMPLS
    graphs = []

    def backend(gm, example_inputs, **kwargs):
        graphs.append(gm)
        return gm.forward

    ref, model = moe_pair("v3", seed=3)
    model.config._experts_implementation = impl
    if impl not in SERVED_IMPLS:
        with pytest.raises(ValueError, match=f"_experts_implementation='{impl}'.*grouped_mm"):
            H.convert(model)
        assert not H.is_converted(model)
        return
    H.convert(model)
    ids, mask = left_padded([6, 11], seed=5)
    new = 8
    with torch.no_grad():
        assert logit_err(model(ids, attention_mask=mask).logits,
                         ref(ids, attention_mask=mask).logits) <= 1e-5
        exp = ref.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
        cache = H.PagedMLACache(model.config, max_batch_size=2, max_cache_len=32, block_size=16)
        got = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                             **H.cache_kwargs(model, cache))
        assert torch.equal(got, exp)
        cache.reset()
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        first = model(input_ids=ids, attention_mask=mask, position_ids=pos,
                      **H.cache_kwargs(model, cache)).logits[:, -1].argmax(-1)
    runner = H.DecodeGraph(model, cache, backend=backend, graph=False)
    tokens = torch.cat([first[:, None], runner.greedy(first, new - 1)], 1)
    assert torch.equal(tokens, exp[:, ids.shape[1]:])
    assert len(graphs) == 1
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0


def test_decode_op_compiles_fullgraph_on_cpu(fresh_dynamo):
    """The op traces with static shapes (here its torch path; the kernels on the GPU)."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 64, generator=g)
    gate_up, down = torch.randn(8, 48, 64, generator=g), torch.randn(8, 64, 24, generator=g)
    idx = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(3)])
    w = torch.rand(3, 2, generator=g)

    def f(x, idx, w):
        return torch.ops.mla.moe_experts_decode(x, idx, w, gate_up, down) * 2

    out = torch.compile(f, fullgraph=True, backend="aot_eager")(x, idx, w)
    assert torch.equal(out, f(x, idx, w))
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["v3", "v2"])
@pytest.mark.parametrize("T", [1, 3, 40])
def test_converted_block_bf16_on_gpu(family, T):
    """The block on the decode op (bf16, CUDA) against HF's grouped_mm block: same experts,
    output within bf16 rounding; the op serves these rows."""
    from lowering.moe import experts
    ref, model = moe_pair(family)
    ref, model = (m.to("cuda", torch.bfloat16) for m in (ref, model))
    convert_moe(model)
    hf_block, block = ref.model.layers[1].mlp, model.model.layers[1].mlp
    x = torch.randn(1, T, 256, device="cuda", dtype=torch.bfloat16)
    assert experts.kernel_serves(x.view(T, -1), block.experts.gate_up_proj, block.experts.down_proj)
    with torch.no_grad():
        a, b = hf_block(x).float(), block(x).float()
    assert ((a - b).abs().max() / a.abs().max()).item() < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("impl", ["grouped_mm", "eager", "batched_mm"])
def test_bf16_moe_decode_graph_captures(fresh_dynamo, impl):
    """bf16 on the GPU: the converted MoE decode step (routed experts on the decode op)
    captures in DecodeGraph whatever _experts_implementation says, and its replays give the
    tokens of generate() with the same compiled kernels."""
    _, model = build_pair(moe_config("v3"), seed=8, dtype=torch.bfloat16)
    model.config._experts_implementation = impl
    model = H.convert(model).to("cuda")
    convert_moe(model)
    ids, mask = (t.to("cuda") for t in left_padded([30, 70, 5], seed=8))
    cache = H.PagedMLACache(model.config, max_batch_size=3, max_cache_len=128, device="cuda",
                            dtype=torch.bfloat16)
    runner, got, exp = graph_and_generate_tokens(model, ids, mask, cache, 12)
    assert runner.graph_enabled
    assert torch.equal(got, exp)
