"""convert() on LongCat-Flash, Kimi Linear, GLM-5 (glm_moe_dsa), A.X K1 and Ling 3
(bailing_hybrid): converted vs HF's own model of that class (fp32, CPU), left-padded batch,
24 new greedy tokens equal and logits within 1e-4; what each family's adapter adds
(LongCat's constant factors, the hybrid cache, GLM-5's shared top-k, Ling 3's output gate)
checked to matter; one compiled decode loop fullgraph per family with an adapter. A family whose classes the installed transformers lacks skips with the reason."""
import contextlib
import copy
from unittest import mock

import pytest
import torch
import torch._dynamo

import mla_ops.hf as H
import mla_ops.hf.v32 as v32
from hf_models import left_padded, logit_err

TOL = 1e-4
LENGTHS = [5, 17, 30]          # left-padded, none a multiple of the block size
NEW = 24

MLA = dict(vocab_size=256, hidden_size=256, num_attention_heads=4, num_key_value_heads=4,
           kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
           max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)
MOE = dict(moe_intermediate_size=128, num_experts_per_tok=2)
KIMI_TYPES = ["linear_attention", "full_attention", "linear_attention", "full_attention"]

# name: (config class, causal LM class, config kwargs past MLA)
FAMILIES = {
    # two layers of two MLA blocks each: cache layers 0..3; q_lora 192 and L 512 make both
    # of LongCat's factors sqrt(256 / 192) and sqrt(256 / 512) differ from 1
    "longcat_flash": ("LongcatFlashConfig", "LongcatFlashForCausalLM",
                      dict(num_layers=2, q_lora_rank=192, ffn_hidden_size=512,
                           n_routed_experts=4, zero_expert_num=2, moe_topk=2,
                           expert_ffn_hidden_size=128)),
    "kimi_linear": ("KimiLinearConfig", "KimiLinearForCausalLM",
                    dict(MOE, intermediate_size=512, num_hidden_layers=4, num_experts=8,
                         q_lora_rank=None, layer_types=KIMI_TYPES, linear_head_dim=32,
                         linear_num_heads=4)),
    "kimi_linear_q_lora": ("KimiLinearConfig", "KimiLinearForCausalLM",
                           dict(MOE, intermediate_size=512, num_hidden_layers=4,
                                num_experts=8, q_lora_rank=192, layer_types=KIMI_TYPES,
                                linear_head_dim=32, linear_num_heads=4)),
    # top-k 8, below all but the shortest prompt; layer 1 reuses layer 0's selection
    "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM",
                    dict(MOE, intermediate_size=512, num_hidden_layers=3, n_routed_experts=8,
                         q_lora_rank=192, first_k_dense_replace=1, index_topk=8,
                         index_head_dim=128, index_n_heads=16,
                         indexer_types=["full", "shared", "full"])),
    "axk1": ("AXK1Config", "AXK1ForCausalLM",
             dict(MOE, intermediate_size=512, num_hidden_layers=2, n_routed_experts=8,
                  q_lora_rank=192, n_group=1, topk_group=1)),
    # layers 1 and 3 MLA (every layer_group_size-th), 0 and 2 KDA
    "bailing_hybrid": ("BailingHybridConfig", "BailingHybridForCausalLM",
                       dict(MOE, intermediate_size=512, num_hidden_layers=4, num_experts=8,
                            n_group=1, topk_group=1, q_lora_rank=None, layer_group_size=2,
                            first_k_dense_replace=1)),
}


def build(family, seed=0):
    """(HF model, deep copy to convert) of a tiny random config of the family's own class,
    weights scaled so attention (and DSA's index scores) are peaked."""
    import transformers
    cfg_name, lm_name, kw = FAMILIES[family]
    if not (hasattr(transformers, cfg_name) and hasattr(transformers, lm_name)):
        pytest.skip(f"transformers {transformers.__version__} has no {lm_name}")
    cfg = getattr(transformers, cfg_name)(**MLA, **kw)
    torch.manual_seed(seed)
    ref = getattr(transformers, lm_name)(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if p.dim() >= 2 and "embed" not in name:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        # a zero pad embedding would tie every DSA index score of a generated pad token
        ref.model.embed_tokens.weight[cfg.pad_token_id].normal_(0.0, 0.02, generator=g)
    return ref, copy.deepcopy(ref)


def mla_modules(model):
    return [m for m in model.modules() if getattr(m, "mla_converted", False)
            and hasattr(m, "mla_attn")]


def paged(model, rows=3, length=64, **kw):
    return H.PagedMLACache(model.config, max_batch_size=rows, max_cache_len=length,
                           block_size=16, dtype=torch.float32, **kw)


def generate(model, ids, mask, **kw):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                              output_logits=True, return_dict_in_generate=True, **kw)


def assert_matches(out, exp):
    errs = [logit_err(a, b) for a, b in zip(out.logits, exp.logits)]
    assert max(errs) <= TOL, f"max logit error {max(errs):.2e}"
    assert torch.equal(out.sequences, exp.sequences)
    assert len(set(out.sequences[:, -NEW:].flatten().tolist())) > 8      # not a degenerate run


@pytest.mark.parametrize("family", list(FAMILIES))
def test_generate_matches_hf(family):
    ref, model = build(family)
    H.convert(model)
    tag = family.replace("_q_lora", "")
    assert {m.mla_family for m in mla_modules(model)} == {tag}
    ids, mask = left_padded(LENGTHS)
    cache = paged(model)
    out, exp = generate(model, ids, mask, past_key_values=cache), generate(ref, ids, mask)
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
        model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    rows = [cache.kv(i).flatten(0, 1) for i in range(4)]                  # [slots, L+R]
    written = [int((r.abs().sum(-1) > 0).sum()) for r in rows]
    assert written == [18] * 4                                           # 7 + 11 real tokens
    for i in range(3):                                                   # different blocks
        assert not torch.allclose(rows[i], rows[i + 1])


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
                     past_key_values=paged(m)).logits[mask.bool()]
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
        model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache)
    states = cache.linear_states()
    assert len(states) == 4 and all(s.abs().sum() > 0 for s in states)   # 2 layers x conv, rec
    saved = cache.snapshot()
    step = dict(input_ids=torch.tensor([[5], [9]]), position_ids=pos[:, -1:] + 1)
    with torch.no_grad():
        first = model(**step, past_key_values=cache).logits
        cache.restore(saved)                      # the KDA state goes back too
        again = model(**step, past_key_values=cache).logits
    assert torch.equal(first, again)
    cache.reset()
    assert all(s.abs().sum() == 0 for s in cache.linear_states())
    assert cache.seq_lens() == [0, 0, 0]


def test_bailing_hybrid_output_gate_matters():
    """Ling 3: the converted MLA layers apply the per-head output gate (without it, logits
    move); the KDA layers stay HF's, their state in the cache's HF layers."""
    ref, model = build("bailing_hybrid")
    H.convert(model)
    assert [m.layer_idx for m in mla_modules(model)] == [1, 3]
    ids, mask = left_padded(LENGTHS)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)

    def logits():
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=mask, position_ids=pos,
                         past_key_values=paged(model)).logits[mask.bool()]
    with torch.no_grad():
        exp = ref(input_ids=ids, attention_mask=mask, position_ids=pos).logits[mask.bool()]
    assert logit_err(logits(), exp) <= TOL
    with mock.patch.object(type(model.model.layers[1].self_attn), "mla_output_gate", None):
        assert logit_err(logits(), exp) > 1e-2


def test_kimi_linear_default_cache_and_hf_cache():
    """generate() with no cache argument builds the hybrid PagedMLACache; with HF's own
    DynamicCache the converted MLA layers run HF's forward (same tokens as HF)."""
    from transformers import DynamicCache
    ref, model = build("kimi_linear", seed=4)
    H.convert(model)
    ids, mask = left_padded([12, 25], seed=6)
    exp = generate(ref, ids, mask)
    assert_matches(generate(model, ids, mask), exp)
    out = generate(model, ids, mask, past_key_values=DynamicCache(config=model.config))
    assert torch.equal(out.sequences, exp.sequences)


def test_glm_moe_dsa_shared_layer_reuses_the_selection():
    """GLM-5: the "shared" layer runs no indexer and reads the previous layer's slots; the
    selection matters (HF's model attending to every token decodes otherwise)."""
    ref, model = build("glm_moe_dsa")
    H.convert(model)
    assert model.model.layers[1].self_attn.indexer is None
    ids, mask = left_padded(LENGTHS)
    calls, attn_calls = [], []
    select, attend = v32.select_slots, v32.sparse_attention

    def counted_select(*a, **k):
        calls.append(1)
        return select(*a, **k)

    def counted_attend(*a, **k):
        attn_calls.append(a[-1])
        return attend(*a, **k)
    with mock.patch.object(v32, "select_slots", counted_select), \
            mock.patch.object(v32, "sparse_attention", counted_attend):
        out = generate(model, ids, mask, past_key_values=paged(model))
    exp = generate(ref, ids, mask)
    assert_matches(out, exp)
    assert len(calls) == 2 * NEW and len(attn_calls) == 3 * NEW      # layers 0, 2 select
    assert all(attn_calls[i + 1] is attn_calls[i] for i in range(0, 3 * NEW, 3))
    dense = copy.deepcopy(ref)
    dense.config.index_topk = 10 ** 6
    for layer in dense.model.layers:
        if layer.self_attn.indexer is not None:
            layer.self_attn.indexer.index_topk = 10 ** 6
    full = generate(dense, ids, mask)
    assert max(logit_err(a, b) for a, b in zip(full.logits, exp.logits)) > 100 * TOL


def test_glm_moe_dsa_shared_layer_needs_the_previous_selection():
    ref, model = build("glm_moe_dsa")
    H.convert(model)

    def drop(module, args, kwargs):
        kwargs["prev_topk_indices"] = None
        return args, kwargs
    model.model.layers[1].self_attn.register_forward_pre_hook(drop, with_kwargs=True)
    ids, mask = left_padded([20, 12])
    with torch.no_grad(), pytest.raises(ValueError, match="reuses the previous layer"):
        model(input_ids=ids, attention_mask=mask, past_key_values=paged(model))


def test_mistral_large4_refused_with_the_differences():
    import transformers
    if not hasattr(transformers, "MistralLarge4TextModel"):
        pytest.skip(f"transformers {transformers.__version__} has no MistralLarge4TextModel")
    cfg = transformers.MistralLarge4TextConfig(
        **MLA, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=1,
        n_routed_experts=4, num_experts_per_tok=2, index_head_dim=64, index_n_heads=2)
    model = transformers.MistralLarge4TextModel(cfg)
    with pytest.raises(TypeError) as e:
        H.convert(model)
    for what in ("MistralLarge4TextAttention", "kv_sharing_modes", "no-RoPE", "indexer"):
        assert what in str(e.value)
    assert not H.is_converted(model)


def test_unsupported_model_error_names_every_family():
    from transformers import LlamaConfig, LlamaForCausalLM
    from mla_ops.hf.families import FAMILY_NAMES
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(TypeError) as e:
        H.convert(model)
    assert {"longcat_flash", "kimi_linear", "glm_moe_dsa", "axk1",
            "bailing_hybrid"} <= set(FAMILY_NAMES)
    for name in FAMILY_NAMES:
        assert name in str(e.value)


def dense_longcat_experts(self, hidden_states, top_k_index, top_k_weights):
    """LongcatFlashExperts' result with static shapes: every routed expert on every token
    [T, E, H], the chosen ones (zero-compute experts: the token itself) weighted and summed.
    HF's own loop reads the experts hit on the host, which no fullgraph compile can take."""
    gate, up = torch.einsum("th,eih->tei", hidden_states,
                            self.gate_up_proj[:self.num_routed_experts]).chunk(2, dim=-1)
    routed = torch.einsum("tei,ehi->teh", self.act_fn(gate) * up, self.down_proj)
    ident = hidden_states[:, None].expand(-1, self.zero_expert_num, -1)
    every = torch.cat([routed, ident], dim=1)                            # [T, E + Z, H]
    chosen = every.gather(1, top_k_index[..., None].expand(-1, -1, every.shape[-1]))
    return (chosen * top_k_weights[..., None]).sum(1).to(hidden_states.dtype)


@pytest.mark.parametrize("family", ["longcat_flash", "kimi_linear", "glm_moe_dsa",
                                    "bailing_hybrid"])
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
                      past_key_values=rcache).logits
            exps, toks, p, m = [exp], [exp[:, -1:].argmax(-1)], pos[:, -1:], mask
            for _ in range(6):
                p, m = p + 1, torch.cat([m, torch.ones_like(m[:, :1])], 1)
                exps.append(ref(input_ids=toks[-1], attention_mask=m, position_ids=p,
                                past_key_values=rcache).logits)
                toks.append(exps[-1][:, -1:].argmax(-1))
            with patch:
                got = fwd(input_ids=ids, attention_mask=mask, position_ids=pos,
                          past_key_values=cache).logits
                assert logit_err(got[mask.bool()], exp[mask.bool()]) <= TOL
                p = pos[:, -1:]
                for step in range(6):
                    p = p + 1
                    got = fwd(input_ids=toks[step], position_ids=p, past_key_values=cache).logits
                    assert logit_err(got, exps[step + 1]) <= TOL, f"step {step}"
        assert len(graphs) == 2, f"{len(graphs)} graphs: decode recompiled"
        assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
        assert cache.seq_lens() == [9 + 6, 4 + 6]
    finally:
        torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["longcat_flash", "kimi_linear", "glm_moe_dsa",
                                    "bailing_hybrid"])
def test_generate_matches_hf_cuda(family):
    """On CUDA (the decode kernels the backend picks there): same greedy tokens as HF's model
    and logits within 1e-4, fp32."""
    ref, model = build(family)
    ref, model = ref.cuda(), H.convert(model).cuda()
    ids, mask = (t.cuda() for t in left_padded(LENGTHS))
    out = generate(model, ids, mask, past_key_values=paged(model, device="cuda"))
    exp = generate(ref, ids, mask)
    assert_matches(out, exp)


def test_every_refused_family_has_its_reason():
    """Each REFUSED row whose class this transformers has is recognised (an instance made
    without __init__ suffices for isinstance) and gets its own reason."""
    from mla_ops.hf.families import REFUSED, _named_classes, family_of, refusal_of
    found = _named_classes((m, c, why) for m, c, why in REFUSED)
    assert found, "no refused family in this transformers"
    for why, cls in found:
        m = cls.__new__(cls)
        assert refusal_of(m) == why and family_of(m) is None
