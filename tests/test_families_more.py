"""convert() on LongCat-Flash, Kimi Linear, GLM-5 (glm_moe_dsa), A.X K1, A.X K2 and Ling 3
(bailing_hybrid): converted vs HF's own model of that class (fp32, CPU), left-padded batch,
24 new greedy tokens equal and logits within 1e-4; what each family's adapter adds
(LongCat's constant factors, the hybrid cache, the output gates) checked to matter; a
compiled decode loop fullgraph for LongCat-Flash, Kimi Linear and GLM-5, DecodeGraph for
Ling 3 (GLM-5's shared top-k and the refusals: test_families_dsa.py). A family whose
classes the installed transformers lacks skips with the reason."""
import contextlib
import copy
from unittest import mock

import pytest
import torch
import torch._dynamo

import mla_ops.hf as H
from family_models import (FAMILIES, LENGTHS, NEW, TOL, assert_matches, build,  # noqa: F401
                           flushed_denormals, generate, mla_modules, paged)
from hf_models import cache_kw, left_padded, logit_err


@pytest.mark.parametrize("family", list(FAMILIES))
def test_generate_matches_hf(family):
    ref, model = build(family)
    H.convert(model)
    tag = family.replace("_q_lora", "")
    assert {m.mla_family for m in mla_modules(model)} == {tag}
    ids, mask = left_padded(LENGTHS)
    cache = paged(model)
    out, exp = generate(model, ids, mask, **cache_kw(cache)), generate(ref, ids, mask)
    assert_matches(out, exp)
    assert cache.seq_lens() == [n + NEW - 1 for n in LENGTHS]            # the paged path ran


def test_longcat_two_blocks_per_layer_own_cache_layers():
    """Each decoder layer's two MLA blocks hold HF's layer indices 2i and 2i + 1, each its
    own rows of the paged cache (sized 2 * num_layers); both are converted."""
    ref, model = build("longcat_flash")
    H.convert(model)
    attns = [a for layer in model.model.layers for a in layer.self_attn]
    assert [a.layer_idx for a in attns] == [0, 1, 2, 3]
    assert all(a.mla_converted for a in attns)
    cache = paged(model)
    assert cache.mla_layers == (0, 1, 2, 3) and len(cache.pool.kv) == 4
    ids, mask = left_padded([7, 11], seed=4)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, **cache_kw(cache))
    rows = [cache.kv(i).flatten(0, 1) for i in range(4)]                  # [slots, L+R]
    written = [int((r.abs().sum(-1) > 0).sum()) for r in rows]
    assert written == [18] * 4                                           # 7 + 11 real tokens
    for i in range(3):                                                   # different blocks
        assert not torch.allclose(rows[i], rows[i + 1])


def test_longcat_other_attention_in_the_list_refused():
    """A non-MLA module among a layer's attention blocks is named, and nothing converted."""
    _, model = build("longcat_flash")
    model.model.layers[1].self_attn[1] = torch.nn.Identity()
    with pytest.raises(TypeError, match=r"all MLA.*layers\.1\.self_attn\.1 \(Identity\)"):
        H.convert(model)
    assert not H.is_converted(model)


def test_longcat_latent_scales_matter():
    """Without LongCat's mla_scale_q_lora / mla_scale_kv_lora folded in, logits move."""
    ref, model = build("longcat_flash")
    plain = copy.deepcopy(model)
    H.convert(model)
    a = model.model.layers[0].self_attn[0]
    assert a.mla_scale_q_lora != 1.0 and a.mla_scale_kv_lora != 1.0
    unscaled = H.convert(plain)
    for m in mla_modules(unscaled):                 # undo the folding on this copy only
        m.mla_attn.softmax_scale /= m.mla_scale_q_lora
        m.mla_attn.W_UK_T /= m.mla_scale_kv_lora
        m.mla_attn.W_UV /= m.mla_scale_kv_lora
    ids, mask = left_padded(LENGTHS)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)

    def logits(m):
        with torch.no_grad():
            return m(input_ids=ids, attention_mask=mask, position_ids=pos,
                     **cache_kw(paged(m))).logits[mask.bool()]
    with torch.no_grad():
        exp = ref(input_ids=ids, attention_mask=mask, position_ids=pos).logits[mask.bool()]
    assert logit_err(logits(model), exp) <= TOL
    assert logit_err(logits(unscaled), exp) > 1e-2


def test_kimi_linear_hybrid_cache():
    """Kimi Linear on a PagedMLACache: the pool holds the MLA layers only, the KDA layers
    keep their conv / recurrent state in HF's LinearAttentionLayer inside the same cache;
    snapshot / restore and reset cover that state too."""
    from transformers.cache_utils import LinearAttentionLayer
    ref, model = build("kimi_linear")
    H.convert(model)
    assert [m.layer_idx for m in mla_modules(model)] == [1, 3]
    assert not getattr(model.model.layers[0].self_attn, "mla_converted", False)   # KDA: HF's
    cache = paged(model)
    assert cache.mla_layers == (1, 3) and len(cache.pool.kv) == 2
    assert isinstance(cache.layers[0], LinearAttentionLayer)
    assert cache.kv(3).data_ptr() == cache.pool.kv[1].data_ptr()
    with pytest.raises(ValueError, match="linear-attention layer"):
        cache.kv(2)
    ids, mask = left_padded([7, 12], seed=4)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, position_ids=pos, **cache_kw(cache))
    states = cache.linear_states()
    assert len(states) == 4 and all(s.abs().sum() > 0 for s in states)   # 2 layers x conv, rec
    saved = cache.snapshot()
    step = dict(input_ids=torch.tensor([[5], [9]]), position_ids=pos[:, -1:] + 1)
    with torch.no_grad():
        first = model(**step, **cache_kw(cache)).logits
        cache.restore(saved)                      # the KDA state goes back too
        again = model(**step, **cache_kw(cache)).logits
    assert torch.equal(first, again)
    cache.reset()
    assert all(s.abs().sum() == 0 for s in cache.linear_states())
    assert cache.seq_lens() == [0, 0, 0]


@pytest.mark.parametrize("family, first", [("bailing_hybrid", 1), ("axk2", 0)])
def test_output_gate_matters(family, first):
    """Ling 3's per-head and A.X K2's per-channel output gates: applied (without them,
    logits move). Ling 3's KDA layers 0 and 2 stay HF's."""
    ref, model = build(family)
    H.convert(model)
    assert [m.layer_idx for m in mla_modules(model)][0] == first
    ids, mask = left_padded(LENGTHS)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)

    def logits():
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=mask, position_ids=pos,
                         **cache_kw(paged(model))).logits[mask.bool()]
    with torch.no_grad():
        exp = ref(input_ids=ids, attention_mask=mask, position_ids=pos).logits[mask.bool()]
    assert logit_err(logits(), exp) <= TOL
    cls = type(model.model.layers[first].self_attn)
    gate = cls.mla_output_gate
    with mock.patch.object(cls, "mla_output_gate", lambda self, x, out, g: out):
        assert logit_err(logits(), exp) > 1e-2
    assert cls.mla_output_gate is gate


def test_kimi_linear_default_cache_and_hf_cache():
    """generate() with no cache argument builds the hybrid PagedMLACache; with HF's own
    DynamicCache the converted MLA layers run HF's forward (same tokens as HF)."""
    from transformers import DynamicCache
    ref, model = build("kimi_linear", seed=4)
    H.convert(model)
    ids, mask = left_padded([12, 25], seed=6)
    exp = generate(ref, ids, mask)
    assert_matches(generate(model, ids, mask), exp)
    out = generate(model, ids, mask, **cache_kw(DynamicCache(config=model.config)))
    assert torch.equal(out.sequences, exp.sequences)


def dense_longcat_experts(self, hidden_states, top_k_index, top_k_weights):
    """LongcatFlashExperts' result with static shapes: every routed expert on every token
    [T, E, H], the chosen ones weighted and summed. transformers <= 5.24 hands the experts
    the zero-compute experts' ids too (the token itself is their output); from 5.25 the MoE
    block adds those itself and hands the experts routed ids only (zero weight where a
    zero-compute expert was chosen). HF's own loop reads the experts hit on the host, which
    no fullgraph compile can take."""
    n = getattr(self, "num_routed_experts", self.gate_up_proj.shape[0])
    gate, up = torch.einsum("th,eih->tei", hidden_states,
                            self.gate_up_proj[:n]).chunk(2, dim=-1)
    every = torch.einsum("tei,ehi->teh", self.act_fn(gate) * up, self.down_proj[:n])
    zero = getattr(self, "zero_expert_num", 0)
    if zero:
        ident = hidden_states[:, None].expand(-1, zero, -1)
        every = torch.cat([every, ident], dim=1)                         # [T, E + Z, H]
    chosen = every.gather(1, top_k_index[..., None].expand(-1, -1, every.shape[-1]))
    return (chosen * top_k_weights[..., None]).sum(1).to(hidden_states.dtype)


@pytest.mark.parametrize("family", ["longcat_flash", "kimi_linear", "glm_moe_dsa"])
def test_compiled_decode_fullgraph(family):
    """A compiled forward, fullgraph: prefill then 6 decode steps, one graph for all decode
    steps, no graph breaks, logits as HF's (LongCat: HF's MoE experts swapped for the
    static-shape equivalent above in the compiled model, HF's loop in the reference)."""
    from transformers import DynamicCache
    ref, model = build(family, seed=2)
    H.convert(model)
    if family == "longcat_flash":
        experts = type(model.model.layers[0].mlp.experts)
        patch = mock.patch.object(experts, "forward", dense_longcat_experts)
    else:
        patch = contextlib.nullcontext()
    ids, mask = left_padded([9, 4], seed=5)
    cache = paged(model, rows=2, length=48)
    rcache = DynamicCache(config=ref.config)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    fwd = torch.compile(model.forward, fullgraph=True, dynamic=False, backend=backend)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    try:
        with torch.no_grad():             # HF's reference first, outside the patch
            exp = ref(input_ids=ids, attention_mask=mask, position_ids=pos,
                      **cache_kw(rcache)).logits
            exps, toks, p, m = [exp], [exp[:, -1:].argmax(-1)], pos[:, -1:], mask
            for _ in range(6):
                p, m = p + 1, torch.cat([m, torch.ones_like(m[:, :1])], 1)
                exps.append(ref(input_ids=toks[-1], attention_mask=m, position_ids=p,
                                **cache_kw(rcache)).logits)
                toks.append(exps[-1][:, -1:].argmax(-1))
            with patch:
                got = fwd(input_ids=ids, attention_mask=mask, position_ids=pos,
                          **cache_kw(cache)).logits
                assert logit_err(got[mask.bool()], exp[mask.bool()]) <= TOL
                p = pos[:, -1:]
                for step in range(6):
                    p = p + 1
                    got = fwd(input_ids=toks[step], position_ids=p, **cache_kw(cache)).logits
                    assert logit_err(got, exps[step + 1]) <= TOL, f"step {step}"
        assert len(graphs) == 2, f"{len(graphs)} graphs: decode recompiled"
        assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
        assert cache.seq_lens() == [9 + 6, 4 + 6]
    finally:
        torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["longcat_flash", "kimi_linear", "glm_moe_dsa",
                                    "axk1", "axk2", "bailing_hybrid"])
def test_generate_matches_hf_cuda(family):
    """On CUDA (the decode kernels the backend picks there): same greedy tokens as HF's model
    and logits within 1e-4, fp32."""
    ref, model = build(family)
    ref, model = ref.cuda(), H.convert(model).cuda()
    ids, mask = (t.cuda() for t in left_padded(LENGTHS))
    out = generate(model, ids, mask, **cache_kw(paged(model, device="cuda")))
    exp = generate(ref, ids, mask)
    assert_matches(out, exp)




def test_kimi_k25_multimodal_wrapper():
    """Kimi K2.5 (a vision tower beside a DeepSeek-V3 language model): convert() swaps the
    language model's MLA layers (the deepseek_v3 row), the vision attention stays HF's, and
    text generate() runs on its default PagedMLACache with HF's tokens."""
    import transformers
    if not hasattr(transformers, "Kimi_K25ForConditionalGeneration"):
        pytest.skip(f"transformers {transformers.__version__} has no Kimi_K25")
    from hf_models import tiny_config
    vision = dict(num_hidden_layers=1, hidden_size=64, intermediate_size=128,
                  num_attention_heads=2)
    cfg = transformers.Kimi_K25Config(text_config=tiny_config("v3").to_dict(),
                                      vision_config=vision, pad_token_id=0)
    torch.manual_seed(0)
    ref = transformers.Kimi_K25ForConditionalGeneration(cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if p.dim() >= 2 and "embed" not in name:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    model = H.convert(copy.deepcopy(ref))
    assert {m.mla_family for m in mla_modules(model)} == {"v3"} and len(mla_modules(model)) == 2
    ids, mask = left_padded(LENGTHS)
    out = generate(model, ids, mask)
    cache = out.cache if "cache" in out else out.past_key_values    # (transformers < 5.24)
    assert isinstance(cache, H.PagedMLACache)
    assert_matches(out, generate(ref, ids, mask))


def test_hybrid_decode_graph_matches_hf():
    """Ling 3 (KDA layers beside MLA) through DecodeGraph (its step compiled fullgraph): the
    greedy tokens are HF's. On CUDA the capture's warm-up steps are undone too, the KDA
    layers' state included (PagedMLACache.snapshot / restore)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    ref, model = build("bailing_hybrid", seed=2)
    ref, model = ref.to(dev), H.convert(model).to(dev)
    ids, mask = (t.to(dev) for t in left_padded([9, 4], seed=5))
    with torch.no_grad():
        exp = ref.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    cache = paged(model, rows=2, length=48, device=dev)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            first = model(input_ids=ids, attention_mask=mask, position_ids=pos,
                          **cache_kw(cache)).logits[:, -1].argmax(-1)      # [B]
            runner = H.DecodeGraph(model, cache, warmup=2,
                                   backend="inductor" if dev == "cuda" else "aot_eager")
            got = torch.cat([first[:, None], runner.greedy(first, 7)], 1)
    finally:
        torch._dynamo.reset()
    assert torch.equal(got, exp[:, ids.shape[1]:])
    assert cache.seq_lens() == [9 + 7, 4 + 7]
