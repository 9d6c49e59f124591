"""Tiny random DeepSeek V2 / V3 models with the real MLA dims (L 512, R 64, P 128, V 128)
and left-padded batches, shared by the HF integration tests."""
from __future__ import annotations

import copy

import torch

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 128, "mscale": 1.0, "mscale_all_dim": 1.0,
        "beta_fast": 32.0, "beta_slow": 1.0}


def cache_kw(cache) -> dict:
    """{name: cache} for an HF model's forward / generate, by mla_ops.hf.cache_kwargs (the
    tests' families all follow the installed transformers' name)."""
    from transformers import DeepseekV3ForCausalLM
    from mla_ops.hf import cache_kwargs
    return cache_kwargs(DeepseekV3ForCausalLM, cache)


def tiny_config(family="v3", q_lora_rank=192, rope_interleave=True, yarn=False, layers=2):
    from transformers import DeepseekV2Config, DeepseekV3Config
    kw = dict(vocab_size=256, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
              num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
              q_lora_rank=q_lora_rank, kv_lora_rank=512, qk_rope_head_dim=64,
              qk_nope_head_dim=128, v_head_dim=128, n_routed_experts=8, num_experts_per_tok=2,
              n_group=2, topk_group=1, first_k_dense_replace=1, max_position_embeddings=512,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if yarn:
        kw["rope_parameters"] = dict(YARN)
    if family == "v3":
        return DeepseekV3Config(rope_interleave=rope_interleave, **kw)
    return DeepseekV2Config(topk_method="greedy", **kw)


def build_pair(cfg, seed=0, dtype=torch.float32):
    """(reference HF model, deep copy to convert), with weights scaled so attention is peaked."""
    from transformers import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
    torch.manual_seed(seed)
    cls = DeepseekV3ForCausalLM if cfg.model_type == "deepseek_v3" else DeepseekV2ForCausalLM
    ref = cls(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if p.dim() >= 2 and "embed" not in name:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    ref = ref.to(dtype)
    return ref, copy.deepcopy(ref)


def left_padded(lengths, vocab=256, seed=3):
    """input_ids [B, S] (pad id 0 on the left) and attention_mask [B, S] for these prompt lengths."""
    g = torch.Generator().manual_seed(seed)
    B, S = len(lengths), max(lengths)
    ids = torch.randint(3, vocab, (B, S), generator=g)
    mask = torch.zeros(B, S, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, S - n:] = 1
        ids[b, :S - n] = 0
    return ids, mask


def logit_err(a, b):
    """max |a - b| relative to max(1, |b|max)."""
    return ((a.float() - b.float()).abs().max() / max(1.0, b.float().abs().max().item())).item()


def graph_and_generate_tokens(model, ids, mask, cache, new_tokens, backend="inductor"):
    """(runner, DecodeGraph's greedy tokens, compiled generate()'s new tokens) after the
    same prefill into `cache`: generate() first, then the cache is reset, prefilled by
    one forward and replayed new_tokens - 1 times."""
    from transformers.generation.configuration_utils import CompileConfig
    import mla_ops.hf as H
    kw = dict(attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)
    cc = CompileConfig(fullgraph=True, dynamic=False, backend=backend, mode=None)
    with torch.no_grad():
        exp = model.generate(ids, **cache_kw(cache), compile_config=cc, **kw)
    cache.reset()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        first = model(input_ids=ids, attention_mask=mask, position_ids=pos,
                      **cache_kw(cache)).logits[:, -1].argmax(-1)
    runner = H.DecodeGraph(model, cache, backend=backend)
    got = torch.cat([first[:, None], runner.greedy(first, new_tokens - 1)], 1)
    return runner, got, exp[:, ids.shape[1]:]
