"""The attention prologue ops (lowering/fused/prologue.py, q_rope.py) in a converted model
on a GPU: the DeepSeek-V3 / V2 / V2-Lite attention's use of them at the real attention
shapes, against HF's own modules (the kernels themselves: test_prologue.py)."""
import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("transformers")

from hf_models import cache_kw  # noqa: E402

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _rel(a, ref):
    return ((a.double().cpu() - ref).abs().max() / ref.abs().max()).item()


def _v3_attention_model(family="v3"):
    """A one-layer DeepseekV3ForCausalLM with DeepSeek-V3's attention shapes (hidden 7168,
    128 heads, q_lora 1536), a small dense MLP and vocabulary, bf16 on CUDA, weights
    N(0, 1 / fan_in) so activations stay O(1). family "v2-lite": a DeepseekV2ForCausalLM
    with DeepSeek-V2-Lite's attention (hidden 2048, 16 heads, no q_lora) instead."""
    from transformers import (DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config,
                              DeepseekV3ForCausalLM)
    common = dict(vocab_size=256, intermediate_size=256, num_hidden_layers=1,
                  kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                  first_k_dense_replace=1, max_position_embeddings=8192)
    if family == "v2-lite":
        cfg = DeepseekV2Config(hidden_size=2048, num_attention_heads=16, num_key_value_heads=16,
                               q_lora_rank=None, **common)
        cls = DeepseekV2ForCausalLM
    elif family == "v2":      # V2's architecture (complex RoPE) at V3's attention shapes
        cfg = DeepseekV2Config(hidden_size=7168, num_attention_heads=128, num_key_value_heads=128,
                               q_lora_rank=1536, **common)
        cls = DeepseekV2ForCausalLM
    else:
        cfg = DeepseekV3Config(hidden_size=7168, num_attention_heads=128, num_key_value_heads=128,
                               q_lora_rank=1536, rope_interleave=True, **common)
        cls = DeepseekV3ForCausalLM
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = cls(cfg).to(torch.bfloat16).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "embed" not in name:
                p.normal_(0.0, p.shape[-1] ** -0.5)
            elif "norm" in name:
                p.normal_(1.0, 0.2)
    return model


@gpu
@pytest.mark.parametrize("rows", [1, 32])
def test_v3_attention_prologue_matches_hf_modules(rows):
    """At DeepSeek-V3's attention shapes the converted layer takes the fused path (the pair
    GEMM's config splits K) and matches HF's modules on the same hidden states: the norms,
    the key's and the query's RoPE, and the absorbed decode query."""
    import mla_ops.hf
    from mla_ops.hf.linear import absorbed_decode_query, qkv_a_prologue
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m
    model = mla_ops.hf.convert(_v3_attention_model())
    attn = model.model.layers[0].self_attn
    x = torch.randn(rows, 1, 7168, device="cuda", dtype=torch.bfloat16)
    pos = torch.randint(0, 8000, (rows, 1), device="cuda")
    cos, sin = model.model.rotary_emb(x, pos)
    with torch.no_grad():
        fused = qkv_a_prologue(attn, x, (cos, sin))
        assert fused is not None, "V3 shapes should take the fused prologue"
        q_a, kv_row, q_a_quant = fused
        assert q_a_quant is None                     # (16-bit q_b)
        ref_q = attn.q_a_layernorm(attn.q_a_proj(x))
        kv = attn.kv_a_proj_with_mqa(x)
        k = kv[..., 512:].reshape(rows, 1, 1, 64)
        _, k_ref = m.apply_rotary_pos_emb_interleave(k, k, cos, sin)
        ref_kv = torch.cat([attn.kv_a_layernorm(kv[..., :512]), k_ref.reshape(rows, 1, 64)], -1)
        q = attn.q_b_proj(q_a).view(rows, 1, 128, 192)
        q_ours = torch.ops.mla.decode_q_rope(q, cos, sin, True)
        q_hf, _ = m.apply_rotary_pos_emb_interleave(q[..., 128:].transpose(1, 2), k, cos, sin)
        decode_q = absorbed_decode_query(attn, q_a, (cos, sin))             # [rows, 128, 576]
        assert decode_q is not None, "V3 decode rows should take the fused query"
    # the absorbed query against HF's q_b_proj and RoPE, absorbed in float64
    ref_nope = torch.einsum("tnp,npl->tnl", q[:, 0, :, :128].double(),
                            attn.mla_attn.W_UK_T.double())
    assert _rel(decode_q[..., :512], ref_nope.cpu()) < 2e-2
    assert _rel(decode_q[..., 512:], q_hf.transpose(1, 2)[:, 0].double().cpu()) < 2e-2
    assert q_a.shape == ref_q.shape and kv_row.shape == ref_kv.shape
    assert _rel(q_a, ref_q.double().cpu()) < 2e-2
    assert _rel(kv_row[..., :512], ref_kv[..., :512].double().cpu()) < 2e-2
    assert _rel(kv_row[..., 512:], ref_kv[..., 512:].double().cpu()) < 2e-2
    assert torch.equal(q_ours[..., :128], q[..., :128])
    # RoPE in fp32, rounded once (HF eager rounds each product): within a bf16 step
    assert _rel(q_ours[..., 128:], q_hf.transpose(1, 2).double().cpu()) < 1e-2


@gpu
@pytest.mark.parametrize("rows", [1, 32])
def test_v2_lite_attention_prologue_matches_hf_modules(rows):
    """At DeepSeek-V2-Lite's attention shapes (no q_lora) the converted layer takes the V2
    prologue (q_proj + kv_a partials, then mla::decode_q_kv_rope) and matches HF's modules
    and apply_rotary_emb on the same hidden states."""
    import mla_ops.hf
    from mla_ops.hf.linear import q_kv_rope_prologue
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as m
    model = mla_ops.hf.convert(_v3_attention_model("v2-lite"))
    attn = model.model.layers[0].self_attn
    x = torch.randn(rows, 1, 2048, device="cuda", dtype=torch.bfloat16)
    pos = torch.randint(0, 8000, (rows, 1), device="cuda")
    freqs = model.model.rotary_emb(x, pos)                                # [rows, 1, 32]
    with torch.no_grad():
        fused = q_kv_rope_prologue(attn, x, freqs)
        assert fused is not None, "V2-Lite shapes should take the fused prologue"
        q, kv_row, _ = fused
        q_hf = attn.q_proj(x).view(rows, 1, 16, 192).transpose(1, 2)
        kv = attn.kv_a_proj_with_mqa(x)
        k = kv[..., 512:].reshape(rows, 1, 1, 64)
        q_pe, k_pe = m.apply_rotary_emb(q_hf[..., 128:], k, freqs.freqs_cis)   # HF's form
        ref_kv = torch.cat([attn.kv_a_layernorm(kv[..., :512]), k_pe.reshape(rows, 1, 64)], -1)
    assert q.shape == (rows, 1, 16, 192) and kv_row.shape == ref_kv.shape
    assert _rel(q[..., :128], q_hf.transpose(1, 2)[..., :128].double().cpu()) < 2e-2
    assert _rel(q[..., 128:], q_pe.transpose(1, 2).double().cpu()) < 2e-2
    assert _rel(kv_row[..., :512], ref_kv[..., :512].double().cpu()) < 2e-2
    assert _rel(kv_row[..., 512:], ref_kv[..., 512:].double().cpu()) < 2e-2


@gpu
@pytest.mark.parametrize("family", ["v3", "v2-lite"])
def test_prefill_rows_take_the_prologue_ops(family):
    """A prefill's rows (more than the decode GEMM kernels take) at V3's and V2-Lite's
    attention shapes: cuBLAS's two outputs, then the prologue op (and for V3 q_b and the
    query's RoPE kernel), against HF's modules on the same hidden states."""
    import mla_ops.hf
    from mla_ops.hf.linear import q_kv_rope_prologue, qkv_a_prologue, rope_angles, rope_query
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as m2
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m3
    model = mla_ops.hf.convert(_v3_attention_model(family))
    attn = model.model.layers[0].self_attn
    H, rows = model.config.hidden_size, 200
    x = torch.randn(1, rows, H, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(rows, device="cuda")[None] + 37
    pe = model.model.rotary_emb(x, pos)
    with torch.no_grad():
        kv = attn.kv_a_proj_with_mqa(x)
        k = kv[..., 512:].reshape(1, 1, rows, 64)
        if family == "v3":
            fused = qkv_a_prologue(attn, x, pe)
            assert fused is not None, "V3's prefill rows should take the prologue op"
            q_a, kv_row, q_a_quant = fused
            assert q_a_quant is None                 # (16-bit q_b)
            q = attn.q_b_proj(q_a).view(1, rows, 128, 192)
            q = rope_query(q, *rope_angles(attn, pe))
            ref_q_a = attn.q_a_layernorm(attn.q_a_proj(x))
            q_hf = attn.q_b_proj(ref_q_a).view(1, rows, 128, 192).transpose(1, 2)
            q_pe, k_pe = m3.apply_rotary_pos_emb_interleave(q_hf[..., 128:], k, *pe)
            assert _rel(q_a, ref_q_a.double().cpu()) < 2e-2
        else:
            fused = q_kv_rope_prologue(attn, x, pe)
            assert fused is not None, "V2-Lite's prefill rows should take the prologue op"
            q, kv_row, _ = fused
            q_hf = attn.q_proj(x).view(1, rows, 16, 192).transpose(1, 2)
            q_pe, k_pe = m2.apply_rotary_emb(q_hf[..., 128:], k, pe.freqs_cis)
        ref_kv = torch.cat([attn.kv_a_layernorm(kv[..., :512]), k_pe.reshape(1, rows, 64)], -1)
    assert _rel(q[..., :128], q_hf.transpose(1, 2)[..., :128].double().cpu()) < 2e-2
    assert _rel(q[..., 128:], q_pe.transpose(1, 2).double().cpu()) < 2e-2
    assert _rel(kv_row, ref_kv.double().cpu()) < 2e-2


@gpu
@pytest.mark.parametrize("family", ["v3", "v2-lite", "v2"])
def test_v3_shaped_decode_graph_logits_match_hf(family):
    """End to end at V3's (V2-Lite's) attention shapes: a prefill (24 rows, fused too) and
    captured DecodeGraph steps (each family with its absorbed query in one op: V2-Lite's
    with its cache row too), teacher-forced, against the unconverted model with a
    DynamicCache."""
    import copy
    import mla_ops.hf as H
    from hf_models import logit_err
    from mla_ops.hf.linear import absorbed_decode_query, q_kv_rope_prologue, qkv_a_prologue
    from transformers import DynamicCache
    ref = _v3_attention_model(family)
    model = H.convert(copy.deepcopy(ref))
    B, S0 = 4, 6
    attn = model.model.layers[0].self_attn
    x = torch.zeros(B, 1, ref.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    pe = model.model.rotary_emb(x, torch.zeros(B, 1, dtype=torch.long, device="cuda"))
    with torch.no_grad():
        if family in ("v3", "v2"):       # V2 with q_lora: the same ops, complex RoPE
            fused = qkv_a_prologue(attn, x, pe)
            assert fused is not None
            assert absorbed_decode_query(attn, fused[0], pe) is not None
        else:                            # decode rows: the query absorbed in that launch
            q, kv_row, decode_q = q_kv_rope_prologue(attn, x, pe, decode=True)
            assert q is None and tuple(decode_q.shape) == (B, 16, 576)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 256, (B, S0), generator=g).cuda()
    pos = torch.arange(S0, device="cuda").expand(B, S0)
    cache = H.PagedMLACache(model.config, max_batch_size=B, max_cache_len=64, device="cuda",
                            dtype=torch.bfloat16)
    rcache = DynamicCache(config=ref.config)
    with torch.no_grad():
        # no position ids: HF's rotary rows then have batch 1, expanded for the fused ops
        first = model(input_ids=ids, **cache_kw(cache)).logits
        exp = ref(input_ids=ids, **cache_kw(rcache)).logits
        assert logit_err(first[:, -1], exp[:, -1]) < 3e-2
        runner = H.DecodeGraph(model, cache)
        tok, p = exp[:, -1:].argmax(-1), pos[:, -1:]
        for step in range(4):
            p = p + 1
            exp = ref(input_ids=tok, position_ids=p, **cache_kw(rcache)).logits
            got = runner(tok).clone()
            assert logit_err(got, exp) < 3e-2, f"step {step}"
            tok = exp[:, -1:].argmax(-1)
