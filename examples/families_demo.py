"""Any MLA family convert() takes, by name, on a tiny random model of that family's own
HF class: generate() with and without conversion, the tokens compared, the times printed.

Nothing is downloaded: each family gets a small config of its class (the real MLA dims:
kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim 128; 2 to 4
layers, hidden size 256) with random weights.

    python examples/families_demo.py --list
    python examples/families_demo.py --family glm4_moe_lite               # CPU, seconds
    python examples/families_demo.py --family kimi_linear --device cuda --new 64
"""
from __future__ import annotations

import argparse
import copy
import sys
import time

import torch
import transformers

import mla_ops.hf
from mla_ops.hf.families import FAMILY_NAMES

MLA = dict(vocab_size=512, hidden_size=256, num_attention_heads=4, num_key_value_heads=4,
           kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
           max_position_embeddings=1024, pad_token_id=0, bos_token_id=1, eos_token_id=2)
MOE = dict(moe_intermediate_size=128, num_experts_per_tok=2)
DS = dict(MOE, intermediate_size=512, num_hidden_layers=2, q_lora_rank=192,
          n_routed_experts=8, n_group=2, topk_group=1, first_k_dense_replace=1)

# family (the HF module name, as convert() lists it): (config class, LM class, kwargs)
TINY = {
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(DS, rope_interleave=True)),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(DS, topk_method="greedy")),
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM",
                     dict(DS, index_topk=16, index_head_dim=128, index_n_heads=16)),
    "glm4_moe_lite": ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM",
                      dict(MOE, intermediate_size=512, num_hidden_layers=2, q_lora_rank=192,
                           n_routed_experts=8, n_shared_experts=1, n_group=1, topk_group=1,
                           rope_interleave=True, mlp_layer_types=["dense", "sparse"])),
    "youtu": ("YoutuConfig", "YoutuForCausalLM",
              dict(intermediate_size=512, num_hidden_layers=2, q_lora_rank=192,
                   rope_interleave=True)),
    "minicpm3": ("MiniCPM3Config", "MiniCPM3ForCausalLM",
                 dict(intermediate_size=512, num_hidden_layers=2, q_lora_rank=192,
                      tie_word_embeddings=False)),
    "mistral4": ("Mistral4Config", "Mistral4ForCausalLM",
                 dict(MOE, intermediate_size=512, num_hidden_layers=2, q_lora_rank=192,
                      n_routed_experts=8, n_shared_experts=1, n_group=1, topk_group=1,
                      rope_interleave=True, first_k_dense_replace=1,
                      rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0,
                                       "factor": 4.0, "original_max_position_embeddings": 256,
                                       "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32.0,
                                       "beta_slow": 1.0, "llama_4_scaling_beta": 0.1})),
    "longcat_flash": ("LongcatFlashConfig", "LongcatFlashForCausalLM",
                      dict(num_layers=2, q_lora_rank=192, ffn_hidden_size=512,
                           n_routed_experts=4, zero_expert_num=2, moe_topk=2,
                           expert_ffn_hidden_size=128)),
    "kimi_linear": ("KimiLinearConfig", "KimiLinearForCausalLM",
                    dict(MOE, intermediate_size=512, num_hidden_layers=4, num_experts=8,
                         layer_types=["linear_attention", "full_attention"] * 2,
                         linear_head_dim=32, linear_num_heads=4)),
    "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM",
                    dict(MOE, intermediate_size=512, num_hidden_layers=3, n_routed_experts=8,
                         q_lora_rank=192, first_k_dense_replace=1, index_topk=16,
                         index_head_dim=128, index_n_heads=16,
                         indexer_types=["full", "shared", "full"])),
    "axk1": ("AXK1Config", "AXK1ForCausalLM",
             dict(MOE, intermediate_size=512, num_hidden_layers=2, n_routed_experts=8,
                  q_lora_rank=192, n_group=1, topk_group=1)),
    "axk2": ("AXK2Config", "AXK2ForCausalLM",
             dict(DS, index_topk=16, index_head_dim=128, index_n_heads=16)),
    "bailing_hybrid": ("BailingHybridConfig", "BailingHybridForCausalLM",
                       dict(MOE, intermediate_size=512, num_hidden_layers=4, num_experts=8,
                            n_group=1, topk_group=1, layer_group_size=2,
                            first_k_dense_replace=1)),
}


def available() -> dict:
    """{family: (config class, LM class, kwargs)} for the table rows this transformers has."""
    out = {}
    for name in FAMILY_NAMES:
        cfg, lm, kw = TINY[name]
        if hasattr(transformers, cfg) and hasattr(transformers, lm):
            out[name] = (getattr(transformers, cfg), getattr(transformers, lm), kw)
    return out


def build(family: str, dtype: torch.dtype, device: str, seed: int = 0):
    """(HF model, converted copy): random weights scaled by 1 / sqrt(fan_in), so attention
    is peaked and greedy decoding does not repeat one token."""
    cfg_cls, lm_cls, kw = available()[family]
    torch.manual_seed(seed)
    ref = lm_cls(cfg_cls(**MLA, **kw)).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if p.dim() >= 2 and "embed" not in name:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        ref.model.embed_tokens.weight[0].normal_(0.0, 0.02, generator=g)   # the pad row
    ref = ref.to(device=device, dtype=dtype)
    return ref, mla_ops.hf.convert(copy.deepcopy(ref))


def left_padded(lengths, vocab: int, device: str, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    B, S = len(lengths), max(lengths)
    ids = torch.randint(3, vocab, (B, S), generator=g)
    mask = torch.zeros(B, S, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, S - n:] = 1
        ids[b, :S - n] = 0
    return ids.to(device), mask.to(device)


def timed_generate(model, ids, mask, new: int, device: str):
    """(new tokens [B, new], seconds); generate() builds its default cache (a PagedMLACache
    for the converted model, HF's for the other)."""
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new,
                             min_new_tokens=new, do_sample=False)
    if device == "cuda":
        torch.cuda.synchronize()
    return out[:, ids.shape[1]:], time.perf_counter() - t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--list", action="store_true", help="list the families and exit")
    ap.add_argument("--family", help="a family name from --list")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--new", type=int, default=24, help="tokens to generate per row")
    ap.add_argument("--lengths", default="5,17,30", help="prompt lengths (left-padded batch)")
    args = ap.parse_args(argv)
    fams = available()
    if args.list:
        for name in FAMILY_NAMES:
            cfg_cls = TINY[name][0]
            print(f"{name:16s} {cfg_cls}" + ("" if name in fams else
                                            "  (not in this transformers)"))
        return 0
    if args.family not in fams:
        ap.error(f"--family must be one of {sorted(fams)}, got {args.family!r}")
    if args.new < 1:
        ap.error(f"--new must be a positive int, got {args.new}")
    lengths = [int(n) for n in args.lengths.split(",")]
    dtype = getattr(torch, args.dtype)
    # random tiny models produce subnormal floats, which CPUs compute on many times slower;
    # flushed to zero (both runs alike) so the times compare the two paths, not that
    torch.set_flush_denormal(args.device == "cpu")
    ref, model = build(args.family, dtype, args.device)
    ids, mask = left_padded(lengths, MLA["vocab_size"], args.device)
    converted = sum(getattr(m, "mla_converted", False) and hasattr(m, "mla_attn")
                    for m in model.modules())
    print(f"{args.family}: {type(model).__name__}, {converted} MLA attention modules "
          f"converted, batch {lengths}, {args.new} new tokens, {args.dtype} on {args.device}")
    timed_generate(model, ids, mask, 2, args.device)                  # warm-up (Triton, etc.)
    timed_generate(ref, ids, mask, 2, args.device)
    got, t_ours = timed_generate(model, ids, mask, args.new, args.device)
    exp, t_hf = timed_generate(ref, ids, mask, args.new, args.device)
    same = torch.equal(got, exp)
    rows = ", ".join(f"{int((a != b).sum())}" for a, b in zip(got, exp))
    print(f"tokens match: {same}" + ("" if same else f" (differing tokens per row: {rows})"))
    n = got.numel()
    print(f"converted: {t_ours:.3f} s ({n / t_ours:.1f} tokens/s)   "
          f"HF: {t_hf:.3f} s ({n / t_hf:.1f} tokens/s)")
    return 0 if same or dtype != torch.float32 else 1


if __name__ == "__main__":
    sys.exit(main())
