"""The converted model's prefill through lowering.prefill vs HF's own forward.

On the CPU the op keeps the torch reference, so here the layer's prefill is sent through
mla_prefill (the CUDA path: padded dense op on its reference route, Triton gather and
merge kernels under the interpreter) to check it in place: left-padded prompts, then
chunks with cached context of unequal lengths, decode steps between. On a GPU the real
path (cuDNN) runs in bf16 against HF in bf16.
"""
from __future__ import annotations

import os

import pytest
import torch

import mla_ops.attention as attention_mod
import mla_ops.hf as H
from hf_models import cache_kw, build_pair, left_padded, logit_err, tiny_config
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
        got = model(ids, attention_mask=mask, **cache_kw(cache)).logits
        exp = ref(ids, attention_mask=mask, **cache_kw(rcache)).logits
        assert logit_err(got[real], exp[real]) <= tol
        for n in (5, 1, 7, 1, 3):   # chunks over cached context, decode steps between
            more = torch.randint(3, 256, (3, n), generator=g).to(device)
            mask = torch.cat([mask, torch.ones(3, n, dtype=mask.dtype, device=device)], 1)
            got = model(more, attention_mask=mask, **cache_kw(cache)).logits
            exp = ref(more, attention_mask=mask, **cache_kw(rcache)).logits
            assert logit_err(got, exp) <= tol


@pytest.mark.parametrize("family,kernels", [("v3", "triton"), ("v2", "torch")])
def test_hf_prefill_through_the_cuda_path_on_cpu(family, kernels, monkeypatch):
    if kernels == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton kernels on CPU tensors need TRITON_INTERPRET=1")
    calls = []

    def via_step(q, kv_c, k_pe, kv_cache, W_UK_T, W_UV, bt, lens, qsl, nd, scale, kind,
                 k_scale, workspace_rows, shape=None):
        calls.append(q.shape[0] - nd)
        # the cache's plan hands the op the prefill rows' host ints (no device read per
        # layer): the same ones the tensors give
        assert shape == prefill_shape(qsl, lens, nd)
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
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-3), (torch.bfloat16, 0.15)],
                         ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", ["v3", "v2"])
def test_hf_prefill_on_gpu(family, dtype, tol):
    """The CUDA prefill path (gather and merge kernels; cuDNN in bf16, the reference
    attention in fp32) against HF's forward over a prompt and chunks on cached context.
    fp32 is the tight check of the path; in bf16 the tiny MoE models' routing can pick
    other experts on rounding differences of either implementation, so its bound only
    catches gross errors (the bf16 logits of the real shapes are in BENCHMARKS.md)."""
    cfg = tiny_config(family, q_lora_rank=192 if family == "v3" else None)
    ref, model = build_pair(cfg, seed=5, dtype=dtype)
    ref, model = ref.cuda(), model.cuda()
    H.convert(model)
    forward_chunks(model, ref, cfg, "cuda", tol, block_size=16)


def test_prefill_steps_compile_fullgraph():
    """A converted model's prefill steps (left-padded prompt, then a chunk over cached
    context) trace with fullgraph=True (no graph break: the attention op is one node and
    reads its prefill shape at run time) and give the eager model's logits."""
    import torch._dynamo.testing
    cfg = tiny_config("v3")
    _, model = build_pair(cfg, seed=5)
    H.convert(model)
    ids, mask = left_padded([3, 11, 8], seed=7)

    def cache():
        return H.PagedMLACache(model.config, max_batch_size=3, max_cache_len=48, block_size=4)

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    eager_cache, compiled_cache = cache(), cache()
    more = torch.randint(3, 200, (3, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        for step_ids, step_mask in ((ids, mask), (more, torch.cat([mask, torch.ones_like(more)], 1))):
            want = model(step_ids, attention_mask=step_mask, **cache_kw(eager_cache)).logits
            got = compiled(step_ids, attention_mask=step_mask,
                           **cache_kw(compiled_cache)).logits
            real = step_mask[:, -step_ids.shape[1]:].bool()
            assert logit_err(got[real], want[real]) <= 1e-5
    assert counter.frame_count >= 1
    torch._dynamo.reset()
