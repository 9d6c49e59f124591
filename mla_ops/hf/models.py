"""DeepSeek-V3-shaped HF models with random weights, for the example, the benchmarks and a
first try without a checkpoint: a config by name ("tiny": CPU-sized; "v3-shaped": V3's
attention and dense-layer shapes; "v2-lite" and "v3-moe": the released models' MoE shapes)
and a random-weight DeepseekV2/V3ForCausalLM. Nothing is downloaded."""
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
    if name in MOE_SHAPES:
        return moe_config(name, layers)
    # DeepSeek-V3's attention and dense-layer shapes; dense layers only, small vocab
    n = layers or 2
    return DeepseekV3Config(vocab_size=2048, hidden_size=7168, intermediate_size=18432,
                            moe_intermediate_size=2048, num_hidden_layers=n,
                            num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536,
                            n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
                            first_k_dense_replace=n, **mla)


# The released MoE models' shapes (first layer dense, the rest MoE), vocab 2048 (so the
# head is negligible; set cfg.vocab_size for the real one): DeepSeek-V2-Lite (16 heads, no
# q_lora, 64 experts top-6 greedy, 2 shared; 4 layers by default) and DeepSeek-V3 (128
# heads, 256 experts top-8 in 8 groups of which 4 are kept, 1 shared; 2 layers by default).
MOE_SHAPES = {
    "v2-lite": dict(family="v2", layers=4, hidden_size=2048, intermediate_size=10944,
                    moe_intermediate_size=1408, num_attention_heads=16, q_lora_rank=None,
                    n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2,
                    n_group=1, topk_group=1, topk_method="greedy", norm_topk_prob=False,
                    routed_scaling_factor=1.0),
    "v3-moe": dict(family="v3", layers=2, hidden_size=7168, intermediate_size=18432,
                   moe_intermediate_size=2048, num_attention_heads=128, q_lora_rank=1536,
                   n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1,
                   n_group=8, topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.5),
}


def moe_config(name: str, layers: int | None):
    """The DeepseekV2Config / DeepseekV3Config of MOE_SHAPES[name]."""
    from transformers import DeepseekV2Config, DeepseekV3Config
    kw = dict(MOE_SHAPES[name])
    family, n = kw.pop("family"), layers or kw.pop("layers")
    kw.pop("layers", None)
    kw.update(vocab_size=2048, num_hidden_layers=n, num_key_value_heads=kw["num_attention_heads"],
              kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
              first_k_dense_replace=1, max_position_embeddings=8192, hidden_act="silu",
              pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "v2":
        return DeepseekV2Config(**kw)
    return DeepseekV3Config(rope_interleave=True, **kw)


def build_model(cfg, device, dtype, seed=0):
    """Random weights scaled 1/sqrt(fan_in), so activations and attention stay O(1)."""
    from transformers import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
    torch.manual_seed(seed)
    cls = DeepseekV2ForCausalLM if cfg.model_type == "deepseek_v2" else DeepseekV3ForCausalLM
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)           # built in dtype: no fp32 copy of the experts
    try:
        with torch.device(device):
            model = cls(cfg).to(dtype).eval()
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "embed" not in name:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    return model
