"""convert() on the MLA families past DeepSeek (GLM-4.7-Flash, Youtu, MiniCPM3, Mistral 4):
converted vs HF's own model of that class (fp32, CPU), left-padded batch, greedy tokens
equal and logits within 1e-4; one compiled decode loop fullgraph. A family whose classes
the installed transformers lacks skips with the reason."""
import copy

import pytest
import torch
import torch._dynamo

import mla_ops.hf as H
from hf_models import cache_kw, left_padded, logit_err

TOL = 1e-4
LENGTHS = [5, 17, 30]          # left-padded, none a multiple of the block size
NEW = 12

MLA = dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=512,
           qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
           max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)
MOE = dict(moe_intermediate_size=128, n_routed_experts=8, num_experts_per_tok=2,
           n_shared_experts=1, n_group=1, topk_group=1)
# Mistral 4's query scale 1 + beta * log(1 + floor(pos / 8)) is not 1 past position 7
MISTRAL4_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                 "original_max_position_embeddings": 8, "mscale": 1.0, "mscale_all_dim": 1.0,
                 "beta_fast": 32.0, "beta_slow": 1.0, "llama_4_scaling_beta": 0.5}

# family: (config class, causal LM class, config kwargs past MLA)
FAMILIES = {
    "glm4_moe_lite": ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM",
                      dict(MOE, q_lora_rank=192, rope_interleave=True,
                           mlp_layer_types=["dense", "sparse"])),
    "glm4_moe_lite_no_q_lora": ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM",
                                dict(MOE, q_lora_rank=None, rope_interleave=False,
                                     mlp_layer_types=["dense", "sparse"])),
    "youtu": ("YoutuConfig", "YoutuForCausalLM", dict(q_lora_rank=192, rope_interleave=True)),
    "minicpm3": ("MiniCPM3Config", "MiniCPM3ForCausalLM",
                 dict(q_lora_rank=192, tie_word_embeddings=False)),
    "mistral4": ("Mistral4Config", "Mistral4ForCausalLM",
                 dict(MOE, q_lora_rank=192, rope_interleave=True, first_k_dense_replace=1,
                      rope_parameters=MISTRAL4_ROPE)),
}


def build(family, seed=0):
    """(HF model, deep copy to convert) of a tiny random config of the family's own class,
    weights scaled so attention is peaked."""
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
    return ref, copy.deepcopy(ref)


def generate(model, ids, mask, **kw):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                              output_logits=True, return_dict_in_generate=True, **kw)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_generate_matches_hf(family):
    ref, model = build(family)
    hf_attn = type(ref.model.layers[0].self_attn)
    H.convert(model)
    attn = model.model.layers[0].self_attn
    assert isinstance(attn, hf_attn) and attn.mla_converted
    assert attn.mla_family == family.replace("_no_q_lora", "")
    ids, mask = left_padded(LENGTHS)
    bs = 16
    cache = H.PagedMLACache(model.config, max_batch_size=3, max_cache_len=64, block_size=bs,
                            dtype=torch.float32)
    out = generate(model, ids, mask, **cache_kw(cache))
    exp = generate(ref, ids, mask)
    errs = [logit_err(a, b) for a, b in zip(out.logits, exp.logits)]
    assert max(errs) <= TOL, f"max logit error {max(errs):.2e}"
    assert torch.equal(out.sequences, exp.sequences)
    assert len(set(out.sequences[:, -NEW:].flatten().tolist())) > 4      # not a degenerate run
    assert cache.seq_lens() == [n + NEW - 1 for n in LENGTHS]            # the paged path ran


def test_mistral4_query_scale_matters():
    """The converted Mistral 4 applies the query scale: without it, logits move."""
    ref, model = build("mistral4")
    H.convert(model)
    ids, mask = left_padded(LENGTHS)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)

    def logits():
        cache = H.PagedMLACache(model.config, max_batch_size=3, max_cache_len=64,
                                block_size=16, dtype=torch.float32)
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=mask, position_ids=pos,
                         **cache_kw(cache)).logits[mask.bool()]
    with torch.no_grad():
        exp = ref(input_ids=ids, attention_mask=mask, position_ids=pos).logits[mask.bool()]
    assert logit_err(logits(), exp) <= TOL
    cls = type(model.model.layers[0].self_attn)
    saved = cls.mla_query_scale
    try:
        cls.mla_query_scale = None
        assert logit_err(logits(), exp) > 1e-3
    finally:
        cls.mla_query_scale = saved


@pytest.mark.parametrize("family", ["glm4_moe_lite", "minicpm3", "mistral4"])
def test_compiled_decode_fullgraph(family):
    """A compiled forward, fullgraph: prefill then 6 decode steps, one graph for all decode
    steps, no graph breaks, logits as HF's."""
    from transformers import DynamicCache
    ref, model = build(family, seed=2)
    H.convert(model)
    ids, mask = left_padded([9, 4], seed=5)
    cache = H.PagedMLACache(model.config, max_batch_size=2, max_cache_len=48, block_size=8)
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
        with torch.no_grad():
            got = fwd(input_ids=ids, attention_mask=mask, position_ids=pos,
                      **cache_kw(cache)).logits
            exp = ref(input_ids=ids, attention_mask=mask, position_ids=pos,
                      **cache_kw(rcache)).logits
            assert logit_err(got[mask.bool()], exp[mask.bool()]) <= TOL
            tok, p = exp[:, -1:].argmax(-1), pos[:, -1:]
            for step in range(6):
                p = p + 1
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
                got = fwd(input_ids=tok, position_ids=p, **cache_kw(cache)).logits
                exp = ref(input_ids=tok, attention_mask=mask, position_ids=p,
                          **cache_kw(rcache)).logits
                assert logit_err(got, exp) <= TOL, f"step {step}"
                tok = exp[:, -1:].argmax(-1)
        assert len(graphs) == 2, f"{len(graphs)} graphs: decode recompiled"
        assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
        assert cache.seq_lens() == [9 + 6, 4 + 6]
    finally:
        torch._dynamo.reset()


def test_unsupported_model_error_names_every_family():
    from transformers import LlamaConfig, LlamaForCausalLM
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(TypeError) as e:
        H.convert(model)
    for name in ("deepseek_v2", "deepseek_v3", "deepseek_v32", "glm4_moe_lite", "youtu",
                 "minicpm3", "mistral4"):
        assert name in str(e.value)
    assert not H.is_converted(model)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["glm4_moe_lite", "minicpm3", "mistral4"])
def test_generate_matches_hf_cuda(family):
    """On CUDA (the decode kernels the backend picks there): same greedy tokens as HF's model
    and logits within 1e-4, fp32."""
    ref, model = build(family)
    ref, model = ref.cuda(), H.convert(model).cuda()
    ids, mask = (t.cuda() for t in left_padded(LENGTHS))
    cache = H.PagedMLACache(model.config, max_batch_size=3, max_cache_len=64, block_size=16,
                            dtype=torch.float32, device="cuda")
    out = generate(model, ids, mask, **cache_kw(cache))
    exp = generate(ref, ids, mask)
    errs = [logit_err(a, b) for a, b in zip(out.logits, exp.logits)]
    assert max(errs) <= TOL, f"max logit error {max(errs):.2e}"
    assert torch.equal(out.sequences, exp.sequences)
