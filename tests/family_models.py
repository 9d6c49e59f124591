"""Tiny random models of the MLA families past DeepSeek that the family tests share (real
MLA dims: L 512, R 64, P 128, V 128; hidden 256, 2 to 4 layers), built from each family's own
HF classes; the helpers to run them against HF's."""
from __future__ import annotations

import copy

import pytest
import torch

import mla_ops.hf as H
from hf_models import logit_err

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
    "axk2": ("AXK2Config", "AXK2ForCausalLM",
             dict(MOE, intermediate_size=512, num_hidden_layers=2, n_routed_experts=8,
                  q_lora_rank=192, n_group=1, topk_group=1, first_k_dense_replace=1,
                  index_topk=8, index_head_dim=128, index_n_heads=16)),
    # layers 1 and 3 MLA (every layer_group_size-th), 0 and 2 KDA
    "bailing_hybrid": ("BailingHybridConfig", "BailingHybridForCausalLM",
                       dict(MOE, intermediate_size=512, num_hidden_layers=4, num_experts=8,
                            n_group=1, topk_group=1, q_lora_rank=None, layer_group_size=2,
                            first_k_dense_replace=1)),
}


@pytest.fixture(autouse=True)
def flushed_denormals():
    """(autouse in the test modules that import it) Subnormal floats flushed to zero while
    a test runs: A.X K2's tiny random model produces some, which the CPU computes on ~20x
    slower. Both models under comparison run under the same setting."""
    torch.set_flush_denormal(True)
    yield
    torch.set_flush_denormal(False)                   # torch's default


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
    from mla_ops.hf.families import family_of, layout_unmet
    for m in ref.modules():
        fam = family_of(m)
        why = layout_unmet(m, fam) if fam is not None else None
        if why is not None:               # convert() refuses it (tested in test_families_dsa)
            pytest.skip(f"transformers {transformers.__version__}'s {type(m).__name__} {why}")
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
