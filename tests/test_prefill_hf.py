"""The converted model's prefill through lowering.prefill vs HF's own forward.

On the CPU the op keeps the torch reference, so here the layer's prefill is sent through
mla_prefill (the CUDA path: padded dense op on its reference route, Triton gather and
merge kernels under the interpreter) to check it in place: left-padded prompts, then
chunks with cached context of unequal lengths, decode steps between. On a GPU the real
path (cuDNN) runs in bf16 against HF in bf16.
"""
from __future__ import annotations

import pytest
import torch

import mla_ops.attention as attention_mod
import mla_ops.hf as H
from hf_models import build_pair, left_padded, logit_err, tiny_config
from lowering.prefill import mla_prefill, prefill_shape

pytest.importorskip("triton")


def forward_chunks(model, ref, cfg, device, tol, block_size=4):
    from transformers import DynamicCache
    ids, mask = left_padded([3, 11, 8], seed=7)
    ids, mask = ids.to(device), mask.to(device)
    cache = H.PagedMLACache(model.config, max_batch_size=3, max_cache_len=48,
                            block_size=block_size, device=device, dtype=model.dtype)
    rcache = DynamicCache(config=cfg)
    real = mask.bool()
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        got = model(ids, attention_mask=mask, past_key_values=cache).logits
        exp = ref(ids, attention_mask=mask, past_key_values=rcache).logits
        assert logit_err(got[real], exp[real]) <= tol
        for n in (5, 1, 7, 1, 3):   # chunks over cached context, decode steps between
            more = torch.randint(3, 256, (3, n), generator=g).to(device)
            mask = torch.cat([mask, torch.ones(3, n, dtype=mask.dtype, device=device)], 1)
            got = model(more, attention_mask=mask, past_key_values=cache).logits
            exp = ref(more, attention_mask=mask, past_key_values=rcache).logits
            assert logit_err(got, exp) <= tol


@pytest.mark.parametrize("family,kernels", [("v3", "triton"), ("v2", "torch")])
def test_hf_prefill_through_the_cuda_path_on_cpu(family, kernels, monkeypatch):
    calls = []

    def via_step(q, kv_c, k_pe, kv_cache, W_UK_T, W_UV, bt, lens, qsl, nd, scale, kind,
                 k_scale, workspace_rows):
        calls.append(q.shape[0] - nd)
        shape = prefill_shape(qsl, lens, nd)
        return mla_prefill(q, kv_c, k_pe, kv_cache, W_UK_T, W_UV, bt, lens, qsl, nd, scale,
                           kind, k_scale, 6, shape, route="reference", kernels=kernels)

    monkeypatch.setattr(attention_mod, "prefill_attention", via_step)
    cfg = tiny_config(family, q_lora_rank=192 if family == "v3" else None)
    ref, model = build_pair(cfg, seed=5)
    H.convert(model)
    forward_chunks(model, ref, cfg, "cpu", 1e-4)
    assert len(calls) == 4 * cfg.num_hidden_layers     # the prompt and three chunks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", ["v3", "v2"])
def test_hf_prefill_on_gpu_bf16(family):
    cfg = tiny_config(family, q_lora_rank=192 if family == "v3" else None)
    ref, model = build_pair(cfg, seed=5, dtype=torch.bfloat16)
    ref, model = ref.cuda(), model.cuda()
    H.convert(model)
    forward_chunks(model, ref, cfg, "cuda", 5e-2, block_size=16)
