"""DeepSeek-V3-shaped HF models with random weights, for the example, the benchmarks and a
first try without a checkpoint: a config by name ("tiny": CPU-sized; "v3-shaped": V3's
attention and dense-layer shapes) and a random-weight DeepseekV3ForCausalLM. Nothing is
downloaded."""
from __future__ import annotations

import torch


def make_config(name: str, layers: int | None):
    """A DeepseekV3Config with the real MLA dims (L 512, R 64, P 128, V 128): "tiny" (hidden
    256, 4 heads, one dense and one MoE layer by default) or "v3-shaped" (V3's attention and
    dense-layer shapes, all layers dense, vocab 2048); `layers` overrides the layer count."""
    from transformers import DeepseekV3Config
    mla = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
               rope_interleave=True, max_position_embeddings=8192, pad_token_id=0,
               bos_token_id=1, eos_token_id=2)
    if name == "tiny":     # CPU-sized: 2 layers (one dense, one MoE), 4 heads
        return DeepseekV3Config(vocab_size=256, hidden_size=256, intermediate_size=512,
                                moe_intermediate_size=128, num_hidden_layers=layers or 2,
                                num_attention_heads=4, num_key_value_heads=4, q_lora_rank=192,
                                n_routed_experts=8, num_experts_per_tok=2, n_group=2,
                                topk_group=1, first_k_dense_replace=1, **mla)
    # DeepSeek-V3's attention and dense-layer shapes; dense layers only, small vocab
    n = layers or 2
    return DeepseekV3Config(vocab_size=2048, hidden_size=7168, intermediate_size=18432,
                            moe_intermediate_size=2048, num_hidden_layers=n,
                            num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536,
                            n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
                            first_k_dense_replace=n, **mla)


def build_model(cfg, device, dtype, seed=0):
    """Random weights scaled 1/sqrt(fan_in), so activations and attention stay O(1)."""
    from transformers import DeepseekV3ForCausalLM
    torch.manual_seed(seed)
    with torch.device(device):
        model = DeepseekV3ForCausalLM(cfg).to(dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "embed" not in name:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    return model
