"""generate() as users call it on a converted model: no cache argument runs on a
PagedMLACache sized from the call; cache= / past_key_values= are used as is; compile_config
works with the default cache; strategies the paged cache cannot serve are refused."""
import os
import sys
import warnings

import pytest
import torch
import torch._dynamo
from torch._dynamo.backends.registry import lookup_backend

import lowering
import mla_ops.hf as H
from hf_models import build_pair, left_padded, logit_err, tiny_config
from mla_ops.hf import generate as G

TOL = 1e-4
LENGTHS = [5, 17, 30]          # left-padded
NEW = 12
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(model, ids, mask, **kw):
    kw.setdefault("max_new_tokens", NEW)
    kw.setdefault("do_sample", False)
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, output_logits=True,
                              return_dict_in_generate=True, **kw)


def cache_of(out):
    """The cache generate() returned: cache_of(out) from transformers 5.24, else
    out.past_key_values."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def cache_arg(model, cache) -> dict:
    """The keyword this transformers takes a cache under (cache= from 5.24)."""
    return H.cache_kwargs(model, cache)


def mla_calls() -> int:
    return sum(lowering.backend_choices.values())


@pytest.mark.parametrize("family,q_lora", [("v3", 192), ("v2", None)])
def test_no_cache_argument_runs_paged_cache(family, q_lora):
    ref, model = build_pair(tiny_config(family, q_lora_rank=q_lora))
    H.convert(model)
    ids, mask = left_padded(LENGTHS)
    before = mla_calls()
    out = run(model, ids, mask)
    exp = run(ref, ids, mask)
    cache = cache_of(out)
    assert isinstance(cache, H.PagedMLACache)
    assert (cache.max_batch_size, cache.max_cache_len) == (3, ids.shape[1] + NEW - 1)
    assert cache.block_size == G.DEFAULT_BLOCK_SIZE and cache.dtype == torch.float32
    assert cache.kv_cache_dtype == "auto" and cache.device.type == "cpu"
    assert cache.seq_lens() == [n + NEW - 1 for n in LENGTHS]    # pads take no room
    # the MLA decode ran in every layer of every step after the prefill
    assert mla_calls() - before == (NEW - 1) * model.config.num_hidden_layers
    assert torch.equal(out.sequences, exp.sequences)
    assert max(logit_err(a, b) for a, b in zip(out.logits, exp.logits)) <= TOL


def test_sized_from_max_length_and_return_sequences():
    ref, model = build_pair(tiny_config("v3"))
    H.convert(model)
    ids, mask = left_padded(LENGTHS)
    S = ids.shape[1]
    out = run(model, ids, mask, max_new_tokens=None, max_length=S + 7)
    exp = run(ref, ids, mask, max_new_tokens=None, max_length=S + 7)
    assert torch.equal(out.sequences, exp.sequences)
    assert cache_of(out).max_cache_len == S + 6 and cache_of(out).max_batch_size == 3
    # sampling with two sequences per prompt: 6 rows; never smaller than the previous call's
    torch.manual_seed(0)
    out = run(model, ids, mask, max_new_tokens=4, do_sample=True, num_return_sequences=2)
    assert out.sequences.shape == (6, S + 4)
    assert (cache_of(out).max_batch_size, cache_of(out).max_cache_len) == (6, S + 6)
    assert model.mla_default_cache_shape == (6, S + 6)


@pytest.mark.parametrize("name", ["cache", "past_key_values"])
def test_user_cache_is_used_as_is(name):
    ref, model = build_pair(tiny_config("v3"))
    H.convert(model)
    if name == "cache" and "cache" not in cache_arg(model, None):
        pytest.skip("this transformers takes no cache= (before 5.24)")
    ids, mask = left_padded(LENGTHS)
    cache = H.PagedMLACache(model.config, max_batch_size=4, max_cache_len=64, block_size=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)    # past_key_values, transformers >= 5.24
        out = run(model, ids, mask, **{name: cache})
    exp = run(ref, ids, mask)
    assert cache_of(out) is cache and cache.seq_lens()[:3] == [n + NEW - 1 for n in LENGTHS]
    assert torch.equal(out.sequences, exp.sequences)


def test_cache_implementation_and_use_cache_false_run_hf():
    from transformers import DynamicCache
    ref, model = build_pair(tiny_config("v3"))
    H.convert(model)
    ids, mask = left_padded(LENGTHS)
    exp = run(ref, ids, mask)
    out = run(model, ids, mask, cache_implementation="dynamic")
    assert type(cache_of(out)) is DynamicCache and torch.equal(out.sequences, exp.sequences)
    before = mla_calls()
    out = run(model, ids, mask, use_cache=False)
    assert mla_calls() == before and torch.equal(out.sequences, exp.sequences)


def test_beam_search_refused_with_what_to_do():
    from transformers import DynamicCache
    ref, model = build_pair(tiny_config("v3"))
    H.convert(model)
    ids, mask = left_padded(LENGTHS)
    kw = dict(max_new_tokens=4, num_beams=2)
    with pytest.raises(ValueError, match="beam_search.*use_cache=False.*DynamicCache"):
        run(model, ids, mask, **kw)
    paged = H.PagedMLACache(model.config, max_batch_size=6, max_cache_len=64, block_size=4)
    with pytest.raises(ValueError, match="beam_search"):
        run(model, ids, mask, **cache_arg(model, paged), **kw)
    assert paged.blocks_in_use() == 0                          # refused before any step
    # what the message says works: HF's cache runs HF's attention
    out = run(model, ids, mask, **cache_arg(model, DynamicCache(config=model.config)), **kw)
    assert torch.equal(out.sequences, run(ref, ids, mask, **kw).sequences)


def test_cache_options():
    ref, model = build_pair(tiny_config("v3"))
    with pytest.raises(TypeError, match="max_batch_size"):
        H.convert(model, cache_options=dict(max_batch_size=4))
    with pytest.raises(TypeError, match="dict"):
        H.convert(model, cache_options=[("block_size", 4)])
    assert not H.is_converted(model)                           # a failure changes nothing
    H.convert(model, cache_options=dict(kv_cache_dtype="fp8", k_scale=0.05, block_size=8))
    ids, mask = left_padded(LENGTHS)
    out = run(model, ids, mask, max_new_tokens=3)
    assert cache_of(out).kv(0).dtype == torch.float8_e4m3fn and cache_of(out).block_size == 8
    H.convert(model)                                           # converting again keeps them
    assert cache_of(run(model, ids, mask, max_new_tokens=2)).block_size == 8
    _, fp8q = build_pair(tiny_config("v3"))
    H.convert(fp8q, fp8_decode_query=0.05)
    with pytest.raises(ValueError, match="fp8 cache"):
        run(fp8q, ids, mask, max_new_tokens=3)


def test_class_keeps_its_name_and_converting_twice():
    _, model = build_pair(tiny_config("v2"))
    cls = type(model)
    H.convert(model)
    assert type(model).__name__ == cls.__name__ and isinstance(model, cls)
    first = type(model)
    H.convert(model)
    assert type(model) is first
    _, other = build_pair(tiny_config("v2"))
    assert type(H.convert(other)) is first                      # one subclass per HF class


def test_unrecognised_hook_raises_instead_of_running_hf():
    class Model:                                               # a transformers without the hook
        def generate(self, *args, **kwargs):
            return "generated"

    m = G.generation_class(Model)()
    with pytest.raises(RuntimeError, match="cache=mla_ops.hf.PagedMLACache"):
        m.generate([1])
    assert m.generate([1], cache=object()) == "generated"
    assert m.generate([1], use_cache=False) == "generated"


_graphs: list = []


def counting_backend(gm, example_inputs, **kwargs):
    _graphs.append(len(gm.graph.nodes))
    return lookup_backend("aot_eager")(gm, example_inputs)


def test_compile_config_with_default_cache():
    from transformers.generation.configuration_utils import CompileConfig
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    _graphs.clear()
    ref, model = build_pair(tiny_config("v3", yarn=True))
    H.convert(model)
    ids, mask = left_padded([6, 19, 13])
    cc = CompileConfig(fullgraph=True, dynamic=False, backend=counting_backend, mode=None)
    cc._compile_all_devices = True          # CPU too
    try:
        out = run(model, ids, mask, compile_config=cc)
        exp = run(ref, ids, mask)
        assert isinstance(cache_of(out), H.PagedMLACache)
        assert len(_graphs) == 1, f"{len(_graphs)} graphs compiled"   # the decode step
        assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
        assert torch.equal(out.sequences, exp.sequences)
        assert max(logit_err(a, b) for a, b in zip(out.logits, exp.logits)) <= TOL
        again = run(model, ids, mask, compile_config=cc)      # a new default cache, same shapes
        assert len(_graphs) == 1, "the second call recompiled"
        assert cache_of(again) is not cache_of(out) and torch.equal(again.sequences, exp.sequences)
    finally:
        torch._dynamo.reset()


def test_example_has_no_deprecation_warnings(monkeypatch):
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        import deepseek_demo
    finally:
        sys.path.pop(0)
    monkeypatch.setattr(sys, "argv", ["deepseek_demo.py", "--no-compile", "--new-tokens", "4",
                                      "--prompt-lens", "3,9"])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        deepseek_demo.main()
    deprecated = [str(w.message) for w in seen
                  if issubclass(w.category, (FutureWarning, DeprecationWarning))
                  and "deprecat" in str(w.message).lower()]
    assert not deprecated, deprecated


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_default_cache_on_cuda_bf16():
    """On CUDA the default cache has FlashMLA's 64-token page and the model's bf16; HF
    auto-compiles the decode step for a compileable cache (CUDA graphs): same tokens as
    with disable_compile=True, and as with the same cache passed by hand."""
    torch._dynamo.reset()
    _, model = build_pair(tiny_config("v3"), seed=11)
    model = H.convert(model).to("cuda", torch.bfloat16)
    ids, mask = (t.cuda() for t in left_padded([5, 33, 70], seed=4))
    try:
        eager = run(model, ids, mask, max_new_tokens=24, disable_compile=True)
        cache = cache_of(eager)
        assert (cache.block_size, cache.dtype, cache.device.type) == (64, torch.bfloat16, "cuda")
        compiled = run(model, ids, mask, max_new_tokens=24)
        assert isinstance(cache_of(compiled), H.PagedMLACache)
        # Compiled and eager bf16 round differently, so a random tiny model's greedy tokens
        # may part after a near-tie: compare the first decode steps' logits (the first one
        # comes from the prefill, the next ones from the compiled step), not 24 tokens.
        n = ids.shape[1]
        assert torch.equal(compiled.sequences[:, n], eager.sequences[:, n])   # same prefill
        for step in range(1, 4):
            a, b = compiled.logits[step].float(), eager.logits[step].float()
            assert (a - b).abs().max() <= 3e-2 * b.abs().max(), step
            if not torch.equal(compiled.sequences[:, n + step], eager.sequences[:, n + step]):
                break                     # a near-tie went the other way: inputs differ now
        mine = H.PagedMLACache(model.config, max_batch_size=3, max_cache_len=70 + 23,
                               block_size=64, device="cuda", dtype=torch.bfloat16)
        given = run(model, ids, mask, max_new_tokens=24, disable_compile=True,
                    **cache_arg(model, mine))
        assert torch.equal(given.sequences, eager.sequences)
    finally:
        torch._dynamo.reset()
