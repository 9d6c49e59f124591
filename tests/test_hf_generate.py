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
    """On CUDA the default cache has FlashMLA's 64-token page and the model's bf16; with
    a compile_config HF compiles the decode step (CUDA graphs): the eager step's tokens
    (disable_compile=True), and the same cache passed by hand gives them too."""
    from transformers.generation.configuration_utils import CompileConfig
    torch._dynamo.reset()
    _, model = build_pair(tiny_config("v3"), seed=11)
    model = H.convert(model).to("cuda", torch.bfloat16)
    ids, mask = (t.cuda() for t in left_padded([5, 33, 70], seed=4))
    try:
        eager = run(model, ids, mask, max_new_tokens=24, disable_compile=True)
        cache = cache_of(eager)
        assert (cache.block_size, cache.dtype, cache.device.type) == (64, torch.bfloat16, "cuda")
        compiled = run(model, ids, mask, max_new_tokens=24, compile_config=CompileConfig())
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


HOST_READS = ("item", "tolist", "__int__", "__bool__", "__float__", "__index__")


def count_host_reads(monkeypatch):
    """Patch torch.Tensor's host reads to count the calls made from mla_ops / lowering code
    (not HF's); the value checks that always run on CPU tensors (only with
    lowering.config.validate on CUDA ones) are turned off, as on CUDA by default."""
    import collections
    import traceback
    import mla_ops.attention
    import mla_ops.ops
    from lowering.decode import entry
    for mod in (mla_ops.attention, mla_ops.ops, entry):
        monkeypatch.setattr(mod, "wants_value_checks", lambda *a, **k: False)
    seen = collections.Counter()
    for name in HOST_READS:
        orig = getattr(torch.Tensor, name)

        def counted(self, *a, _orig=orig, _name=name, **k):
            frame = traceback.extract_stack(limit=2)[0]
            if (f"{os.sep}mla_ops{os.sep}" in frame.filename
                    or f"{os.sep}lowering{os.sep}" in frame.filename):
                seen[f"{_name} at {os.path.basename(frame.filename)}:{frame.lineno}"] += 1
            return _orig(self, *a, **k)
        monkeypatch.setattr(torch.Tensor, name, counted)
    return seen


@pytest.mark.parametrize("family", ["v3", "v2"])
def test_eager_decode_steps_read_nothing_on_the_host(monkeypatch, family):
    """An eager generate(): the converted model's decode steps make no host reads (no
    device syncs on CUDA) after the first, which counts the room left once; HF's own
    per-step reads (stopping criteria) are not ours and not counted. Tokens as HF's."""
    ref, model = build_pair(tiny_config(family, q_lora_rank=192 if family == "v3" else None,
                                        layers=3))
    H.convert(model)
    ids, mask = left_padded(LENGTHS)
    exp = {n: run(ref, ids, mask, max_new_tokens=n).sequences for n in (3, 12)}
    seen = count_host_reads(monkeypatch)
    reads = {}
    for n in (3, 12):                          # the same prefill and first decode step
        seen.clear()
        out = run(model, ids, mask, max_new_tokens=n)
        assert torch.equal(out.sequences, exp[n])
        reads[n] = dict(seen)
    assert sum(reads[12].values()) == sum(reads[3].values()), (reads[3], reads[12])


def test_decode_room_counted_down_and_refused_when_full():
    """The host's count of decode steps that fit: eager decode steps past it raise
    CacheFullError / ValueError before writing, as the synced check did."""
    _, model = build_pair(tiny_config("v3"))
    H.convert(model)
    cache = H.PagedMLACache(model.config, max_batch_size=2, max_cache_len=10, block_size=4,
                            num_blocks=5)
    ids = torch.randint(3, 256, (2, 5))
    kw = H.cache_kwargs(model, cache)
    with torch.no_grad():
        model(input_ids=ids, **kw)                          # 5 tokens: 2 blocks per row
        assert cache.host_room is None                      # a prefill counts nothing
        nxt = torch.randint(3, 256, (2, 1))
        for left in (2, 1, 0):              # 6, 7, 8 tokens fit the rows' second blocks
            model(input_ids=nxt, position_ids=cache.lens[:2, None].long(), **kw)
            assert cache.host_room[1:] == (2, left)
        with pytest.raises(H.CacheFullError):   # 9: 1 free block, 2 rows need one each
            model(input_ids=nxt, position_ids=cache.lens[:2, None].long(), **kw)
    assert cache.seq_lens() == [8, 8] and cache.blocks_in_use() == 4
    cache = H.PagedMLACache(model.config, max_batch_size=2, max_cache_len=10, block_size=4)
    kw = H.cache_kwargs(model, cache)
    with torch.no_grad():
        model(input_ids=ids[:, :3], **kw)
        for n in range(4, 11):                              # max_cache_len 10 bounds it
            model(input_ids=nxt, position_ids=cache.lens[:2, None].long(), **kw)
            assert cache.seq_lens() == [n, n]
        with pytest.raises(ValueError, match="max_cache_len"):
            model(input_ids=nxt, position_ids=cache.lens[:2, None].long(), **kw)
    assert cache.seq_lens() == [10, 10]


def test_compiled_generate_decode_step_is_decode_graphs(monkeypatch):
    """generate() with compile_config (fp32, CPU): the compiled decode forward gets no
    attention mask (the inputs DecodeGraph's step passes), one graph for every step and a
    second call, no graph breaks, the eager call's tokens."""
    from transformers.generation.configuration_utils import CompileConfig
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    inputs = []

    def backend(gm, example_inputs, **kwargs):
        inputs.append([n.name for n in gm.graph.nodes if n.op == "placeholder"])
        return gm.forward

    _, model = build_pair(tiny_config("v2", q_lora_rank=None, layers=3))
    H.convert(model)
    ids, mask = left_padded([4, 21, 9])
    cc = CompileConfig(fullgraph=True, dynamic=False, backend=backend, mode=None)
    cc._compile_all_devices = True
    try:
        eager = run(model, ids, mask, max_new_tokens=10)
        compiled = run(model, ids, mask, max_new_tokens=10, compile_config=cc)
        again = run(model, ids, mask, max_new_tokens=10, compile_config=cc)
        assert len(inputs) == 1, f"{len(inputs)} graphs compiled"
        assert not any("mask" in name for name in inputs[0]), inputs[0]
        assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
        assert torch.equal(compiled.sequences, eager.sequences)
        assert torch.equal(again.sequences, eager.sequences)
        assert max(logit_err(a, b) for a, b in zip(compiled.logits, eager.logits)) <= TOL
    finally:
        torch._dynamo.reset()


def test_eager_forward_launches_triton_kernels_directly():
    """A converted model's eager forward runs its layers with wrap_triton's higher-order-op
    dispatch off (direct kernel launches), restores the switch afterwards, keeps HF's
    signature, and leaves a compiled forward's tracing as it was (the switch on)."""
    from mla_ops.hf.eager import set_wrap_triton_enabled
    if set_wrap_triton_enabled is None:
        pytest.skip("this torch has no set_wrap_triton_enabled")
    from torch._library.triton import is_wrap_triton_enabled
    ref, model = build_pair(tiny_config("v3"))
    H.convert(model)
    assert "cache" in cache_arg(model, None) or "past_key_values" in cache_arg(model, None)
    import inspect
    assert inspect.signature(model.forward).parameters.keys() == \
        inspect.signature(ref.forward).parameters.keys()
    flags = []
    hook = model.model.layers[1].register_forward_hook(
        lambda *a: flags.append(is_wrap_triton_enabled()))
    ids, mask = left_padded([3, 7])
    with torch.no_grad():
        a = model(ids, attention_mask=mask).logits
    assert flags == [False] and is_wrap_triton_enabled()
    assert logit_err(a, ref(ids, attention_mask=mask).logits) <= TOL
    hook.remove()
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model.forward, fullgraph=True, backend="eager")
        with torch.no_grad():
            b = compiled(ids, attention_mask=mask).logits
        assert torch.allclose(a, b, atol=1e-5, rtol=0)
    finally:
        torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_eager_decode_steps_do_not_sync_on_cuda():
    """bf16 on CUDA, an MoE layer included: after the first eager decode step (which reads
    the room left once), eager decode steps of the converted model make no device sync
    (torch.cuda.set_sync_debug_mode('error') raises on one), and their tokens are those
    of eager generate()."""
    _, model = build_pair(tiny_config("v3", layers=3), seed=5, dtype=torch.bfloat16)
    model = H.convert(model).to("cuda")
    ids, mask = (t.cuda() for t in left_padded([5, 33, 20], seed=2))
    new = 8
    with torch.no_grad():
        exp = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                             disable_compile=True)[:, ids.shape[1]:]
    cache = H.PagedMLACache(model.config, max_batch_size=3, max_cache_len=64, device="cuda",
                            dtype=torch.bfloat16)
    kw = H.cache_kwargs(model, cache)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    got = []
    with torch.no_grad():
        nxt = model(input_ids=ids, attention_mask=mask, position_ids=pos,
                    **kw).logits[:, -1].argmax(-1, keepdim=True)
        got.append(nxt)
        nxt = model(input_ids=nxt, position_ids=cache.lens[:3, None].long(),
                    **kw).logits[:, -1].argmax(-1, keepdim=True)      # counts the room
        got.append(nxt)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(new - 2):
                nxt = model(input_ids=nxt, position_ids=cache.lens[:3, None].long(),
                            **kw).logits[:, -1].argmax(-1, keepdim=True)
                got.append(nxt)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(torch.cat(got, 1), exp)


def test_compiled_generate_runs_decode_graphs_ops(monkeypatch):
    """The decode step generate() compiles (compile_config) and the one DecodeGraph
    compiles call the same MLA ops in the same order (CPU, fp32)."""
    from transformers.generation.configuration_utils import CompileConfig
    graphs = []

    def backend(gm, example_inputs, **kwargs):
        graphs.append([str(n.target) for n in gm.graph.nodes
                       if n.op == "call_function" and "mla." in str(n.target)])
        return gm.forward

    _, model = build_pair(tiny_config("v3", layers=3))
    H.convert(model)
    ids, mask = left_padded([4, 9])
    cc = CompileConfig(fullgraph=True, dynamic=False, backend=backend, mode=None)
    cc._compile_all_devices = True
    torch._dynamo.reset()
    try:
        run(model, ids, mask, max_new_tokens=4, compile_config=cc)
        cache = H.PagedMLACache(model.config, max_batch_size=2, max_cache_len=32, block_size=16)
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask,
                  position_ids=(mask.cumsum(-1) - 1).clamp(min=0), **cache_arg(model, cache))
        H.DecodeGraph(model, cache, backend=backend, graph=False)(ids[:, -1])
    finally:
        torch._dynamo.reset()
    assert len(graphs) == 2 and graphs[0], graphs
    assert graphs[0] == graphs[1]
