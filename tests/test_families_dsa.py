"""convert() on GLM-5 (glm_moe_dsa): the shared layers' reuse of the previous layer's top-k;
the refused families (Mistral Large 4 and the others of REFUSED) and the unsupported-model
error naming every family of the table."""
import copy
from unittest import mock

import pytest
import torch

import mla_ops.hf as H
import mla_ops.hf.v32 as v32
from family_models import (LENGTHS, MLA, NEW, TOL, assert_matches, build,  # noqa: F401
                           flushed_denormals, generate, paged)
from hf_models import left_padded, logit_err


def test_glm_moe_dsa_shared_layer_reuses_the_selection():
    """GLM-5: the "shared" layer runs no indexer and reads the previous layer's slots; the
    selection matters (HF's model attending to every token decodes otherwise)."""
    ref, model = build("glm_moe_dsa")
    H.convert(model)
    assert model.model.layers[1].self_attn.indexer is None
    keys = paged(model).index_keys                # no indexer keys kept for the shared layer
    assert keys[1] is None and keys[0].shape == keys[2].shape == (12, 16, 128)
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
        out = generate(model, ids, mask, **H.cache_kwargs(model, paged(model)))
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
        model(input_ids=ids, attention_mask=mask, **H.cache_kwargs(model, paged(model)))


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
    assert {"longcat_flash", "kimi_linear", "glm_moe_dsa", "axk1", "axk2",
            "bailing_hybrid"} <= set(FAMILY_NAMES)
    for name in FAMILY_NAMES:
        assert name in str(e.value)


def test_every_refused_family_has_its_reason():
    """Each REFUSED row whose class this transformers has is recognised (an instance made
    without __init__ suffices for isinstance) and gets its own reason."""
    from mla_ops.hf.families import REFUSED, _named_classes, family_of, refusal_of
    found = _named_classes(REFUSED)
    assert found, "no refused family in this transformers"
    for why, cls in found:
        m = cls.__new__(cls)
        assert refusal_of(m) == why and family_of(m) is None


def test_an_attention_laid_out_otherwise_is_refused_before_any_change():
    """A family's module without the layout the converted forward reads (another
    transformers version's, here a V3 attention without q_b_proj) is refused with what is
    missing, and the model is left as it was."""
    from hf_models import build_pair, tiny_config
    _, model = build_pair(tiny_config("v3"))
    attn = model.model.layers[1].self_attn
    del attn.q_b_proj
    classes = [type(m) for m in model.modules()]
    with pytest.raises(TypeError, match=r"model.layers.1.self_attn .*has no q_b_proj.*upgrade"):
        H.convert(model)
    assert [type(m) for m in model.modules()] == classes
    assert not H.is_converted(model)
