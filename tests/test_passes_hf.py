"""Real use: a tiny converted DeepSeek-V3 whose o_proj is an FP8 block-quantized linear.

Pass B must fire on every layer's decode step, and greedy tokens must equal those of the
same model compiled without the passes.
"""
import pytest
import torch
from torch._inductor import config as inductor_config

import passes
from passes.fp8_linear import Fp8BlockLinear
from hf_models import cache_kw

transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("mla_ops.hf")

B, PROMPT, NEW = 2, 5, 4


def tiny_model(fp8_decode_query=None):
    cfg = transformers.DeepseekV3Config(
        vocab_size=256, hidden_size=256, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=192,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
        first_k_dense_replace=2, max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(cfg).to(torch.bfloat16).eval()
    hf.convert(model, fp8_decode_query=fp8_decode_query)
    n = 0
    for mod in model.modules():
        if hasattr(mod, "o_proj") and isinstance(mod.o_proj, torch.nn.Linear):
            mod.o_proj = Fp8BlockLinear.from_linear(mod.o_proj)       # 128x128 blocks, act g128
            n += 1
    assert n == cfg.num_hidden_layers
    return model


def greedy(model, step_fn, ids):
    cache = hf.PagedMLACache(model.config, max_batch_size=B, max_cache_len=64, block_size=16,
                             dtype=torch.bfloat16, kv_cache_dtype="fp8", k_scale=0.05)
    for t in cache.pool.kv:          # the reference decode backend reads whole pages
        t.zero_()
    toks, logits = [], []
    with torch.no_grad():
        lg = model(input_ids=ids, **cache_kw(cache), attention_mask=torch.ones_like(ids)).logits
        tok = lg[:, -1:].argmax(-1)
        for i in range(NEW):
            toks.append(tok)
            lg = step_fn(tok, cache, torch.tensor([PROMPT + i]))
            logits.append(lg)
            tok = lg[:, -1:].argmax(-1)
    return torch.cat(toks, 1), torch.cat(logits, 1)


def decode_step(model):
    def step(tok, cache, pos):
        return model(input_ids=tok, **cache_kw(cache), cache_position=pos).logits
    return step


def fused_vs_unfused(model, ids):
    """Greedy decode compiled with and without the passes; checks tokens and logits agree.

    Returns the fused run's logits and its fusion record."""
    results = {}
    with inductor_config.patch(fx_graph_cache=False):
        for fused in (True, False):
            torch._dynamo.reset()
            compiled = passes.compile_with_passes(decode_step(model), pass_a_on=fused,
                                                  pass_b_on=fused)
            results[fused] = greedy(model, compiled, ids), compiled.fusion
    (tok_f, lg_f), fusion = results[True]
    (tok_u, lg_u), _ = results[False]
    assert lg_f.isfinite().all()
    assert torch.equal(tok_f, tok_u)
    assert torch.allclose(lg_f.float(), lg_u.float(), atol=1e-2, rtol=0)
    return lg_f, fusion


def matched_layers(fusion, name):
    return sorted(r["layer"] for r in fusion.records if r["pass_"] == name and r["matched"])


def test_pass_b_fires_on_every_layer_and_tokens_match_unfused():
    model = tiny_model()
    ids = torch.randint(0, 256, (B, PROMPT), generator=torch.Generator().manual_seed(1))
    lg_f, fusion = fused_vs_unfused(model, ids)
    assert matched_layers(fusion, "B") == [0, 1]
    assert {r["pattern"] for r in fusion.records if r["pass_"] == "B"} == {"fp8_dynamic_group128"}
    assert fusion.ops_before["mla::quant_fp8_group"] == 2
    assert fusion.ops_after["mla::quant_fp8_group"] == 0
    assert fusion.ops_after["mla::kv_cache_update"] == 2
    # and the fused model stays close to eager without compile
    tok_e, lg_e = greedy(model, decode_step(model), ids)
    assert (lg_f.float() - lg_e.float()).abs().max() < 0.1


def test_pass_a_and_b_fire_on_every_layer_with_fp8_decode_query():
    """convert(fp8_decode_query=...) puts the decode query's cat + fp8 quant in the graph:
    Pass A fuses it on every layer, Pass B the output quant; tokens equal the unfused run."""
    model = tiny_model(fp8_decode_query=0.05)
    ids = torch.randint(0, 256, (B, PROMPT), generator=torch.Generator().manual_seed(2))
    _, fusion = fused_vs_unfused(model, ids)
    assert matched_layers(fusion, "A") == [0, 1]
    assert matched_layers(fusion, "B") == [0, 1]
    assert fusion.ops_before["mla::quant_fp8_static"] == 2
    assert fusion.ops_after["mla::quant_fp8_static"] == 0
    assert fusion.ops_after["mla::concat_quant_fp8_static"] == 2
    assert fusion.ops_after["mla::kv_cache_update"] == 2


def test_fp8_decode_query_needs_fp8_cache():
    model = tiny_model(fp8_decode_query=0.05)
    cache = hf.PagedMLACache(model.config, max_batch_size=1, max_cache_len=16, block_size=16,
                             dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="fp8 KV cache"):
        model(input_ids=torch.tensor([[3, 4]]), **cache_kw(cache))
