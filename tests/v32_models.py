"""Tiny random DeepSeek-V3.2 models (DSA indexer, real MLA dims) for the V3.2 tests."""
from __future__ import annotations

import copy

import pytest
import torch


def v32_classes():
    """(DeepseekV32Config, DeepseekV32ForCausalLM), or skip where transformers lacks them."""
    try:
        from transformers import DeepseekV32Config, DeepseekV32ForCausalLM
    except ImportError:
        pytest.skip("this transformers has no deepseek_v32 (added after 5.23)")
    return DeepseekV32Config, DeepseekV32ForCausalLM


def tiny_v32_config(index_topk=8, layers=2, index_n_heads=16, yarn=False, moe=True):
    """index_topk below the test contexts, so the selection matters. 16 indexer heads keep
    exact ties between index scores (a key's every head clipped to 0 by the ReLU) rare.
    moe=False: dense MLPs only (HF's MoE reads routed-token counts on the host: a CUDA
    graph cannot capture it)."""
    cfg_cls, _ = v32_classes()
    kw = dict(vocab_size=256, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
              num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
              q_lora_rank=192, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
              v_head_dim=128, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
              topk_group=1, first_k_dense_replace=1 if moe else layers,
              max_position_embeddings=512,
              index_topk=index_topk, index_head_dim=128, index_n_heads=index_n_heads,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if yarn:
        from hf_models import YARN
        kw["rope_parameters"] = dict(YARN)
    return cfg_cls(**kw)


def build_v32_pair(cfg, seed=0, dtype=torch.float32):
    """(reference HF DeepseekV32ForCausalLM, deep copy to convert), weights scaled by
    1/sqrt(fan_in) so attention and the index scores are peaked, not flat."""
    _, model_cls = v32_classes()
    torch.manual_seed(seed)
    ref = model_cls(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if p.dim() >= 2 and "embed" not in name:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        # HF zeroes the pad token's embedding row; a generated pad token would then score
        # every key 0 in the indexer (q = 0), a tie that torch.topk breaks in an unspecified
        # order (HF's own dynamic and static caches break it differently too)
        ref.model.embed_tokens.weight[cfg.pad_token_id].normal_(0.0, 0.02, generator=g)
    ref = ref.to(dtype)
    return ref, copy.deepcopy(ref)
