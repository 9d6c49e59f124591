"""generate() without compile replays its decode steps from a CUDA graph of the eager step
(convert(generate_graph=True), mla_ops/hf/generate_graph.py).

On CPU there is no CUDA graph: the tests let a CPU cache take the graphs object (its
runner then calls the eager step itself, DecodeGraph(graph=False)) to test the routing:
which forward calls it serves, the output generate() reads, that the call's graphs go when
generate() returns, and the fallbacks. The CUDA tests capture real graphs and compare the
tokens and logits with the eager steps'."""
import contextlib
import warnings

import pytest
import torch
import torch._dynamo

import mla_ops.hf as H
from hf_models import build_pair, left_padded, tiny_config
from mla_ops.hf import generate_graph as GG

LENGTHS = [5, 17, 30]
NEW = 10


@pytest.fixture
def cpu_graphs(monkeypatch):
    """Let CPU caches take generate()'s graphs; count the decode steps they serve."""
    monkeypatch.setattr(GG, "DEVICES", ("cuda", "cpu"))
    served = []
    step = GG.GenerateGraphs.step

    def counted(self, kwargs):
        out = step(self, kwargs)
        served.append(out is not None)
        return out
    monkeypatch.setattr(GG.GenerateGraphs, "step", counted)
    return served


@pytest.fixture
def captures(monkeypatch):
    """The runners GenerateGraphs captures, in order (None where a capture fell back)."""
    runners = []
    make = GG.GenerateGraphs._capture

    def spy(self, B):
        runners.append(make(self, B))
        return runners[-1]
    monkeypatch.setattr(GG.GenerateGraphs, "_capture", spy)
    return runners


def sizes(runners) -> list:
    return [r.batch_size for r in runners]


def gen(model, ids, mask, new=NEW, **kw):
    kw.setdefault("do_sample", False)
    kw.setdefault("disable_compile", True)
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=new, output_logits=True,
                              return_dict_in_generate=True, **kw)


def cache_of(out):
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def pair(family="v3", q_lora=192, layers=2, seed=0, dtype=torch.float32):
    _, model = build_pair(tiny_config(family, q_lora_rank=q_lora, layers=layers), seed=seed,
                          dtype=dtype)
    return model


@pytest.mark.parametrize("family,q_lora", [("v3", 192), ("v2", None)])
def test_decode_steps_served_and_tokens_equal_eager(cpu_graphs, family, q_lora):
    ids, mask = left_padded(LENGTHS)
    model = H.convert(pair(family, q_lora), generate_graph=False)
    exp = gen(model, ids, mask)
    assert cpu_graphs == []                          # off: never attached
    model.mla_generate_graph = True                  # as convert(generate_graph=True) sets
    got = gen(model, ids, mask)
    assert cpu_graphs == [True] * (NEW - 1)          # every decode step, none of the prefill
    assert torch.equal(got.sequences, exp.sequences)
    for a, b in zip(got.logits, exp.logits):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    cache = cache_of(got)
    assert getattr(cache, GG.ATTR) is None           # the call's graphs went with it
    assert cache.seq_lens() == [n + NEW - 1 for n in LENGTHS]


def test_sampling_and_a_users_cache(cpu_graphs):
    """Sampling reads the same logits; a PagedMLACache the user passes is served during the
    call and a forward of the user's afterwards runs eagerly."""
    ids, mask = left_padded(LENGTHS, seed=5)
    model = H.convert(pair(seed=3))
    caches = [H.PagedMLACache(model.config, max_batch_size=3, max_cache_len=64) for _ in range(2)]
    outs = []
    for cache, graph in zip(caches, (False, True)):
        model.mla_generate_graph = graph
        torch.manual_seed(7)
        outs.append(gen(model, ids, mask, do_sample=True, top_k=20, **H.cache_kwargs(model, cache)))
    assert cpu_graphs == [True] * (NEW - 1)
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert getattr(caches[1], GG.ATTR) is None
    n = len(cpu_graphs)
    with torch.no_grad():
        model(input_ids=outs[1].sequences[:, -1:], **H.cache_kwargs(model, caches[1]))
    assert len(cpu_graphs) == n                      # not routed: nothing attached now


def test_calls_it_does_not_serve(cpu_graphs):
    """Hidden states asked for, or a cache with no room for the warm-up step: the steps
    run eagerly with the same tokens, no warning for the room."""
    ids, mask = left_padded(LENGTHS, seed=8)
    model = H.convert(pair(seed=2))
    model.mla_generate_graph = False
    exp = gen(model, ids, mask, new=2)       # sizes the default cache: 1 decode step fits
    model.mla_generate_graph = True
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        got = gen(model, ids, mask, new=2)
    assert cpu_graphs == [False] and torch.equal(got.sequences, exp.sequences)
    model.mla_generate_graph = False
    exp = gen(model, ids, mask, new=4)
    model.mla_generate_graph = True
    got = gen(model, ids, mask, new=4, output_hidden_states=True)
    assert cpu_graphs == [False] and torch.equal(got.sequences, exp.sequences)


def test_a_users_cache_keeps_its_graphs(cpu_graphs, captures):
    """The user's cache keeps the step graphs for its next generate() call (one capture for
    two calls, the same tokens); a compile_config gets a runner of its own; new parameter
    tensors get new graphs; generate()'s default cache captures in every call."""
    from transformers.generation.configuration_utils import CompileConfig
    ids, mask = left_padded(LENGTHS, seed=9)
    model = H.convert(pair(seed=4))
    cache = H.PagedMLACache(model.config, max_batch_size=3, max_cache_len=64)
    outs = []
    for _ in range(2):
        cache.reset()
        outs.append(gen(model, ids, mask, **H.cache_kwargs(model, cache)))
    assert sizes(captures) == [3] and cpu_graphs == [True] * (2 * (NEW - 1))
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert getattr(cache, GG.ATTR) is None                  # detached between calls
    kept = getattr(cache, GG.KEPT)
    assert list(kept.runners) == [(3, None)]
    cc = CompileConfig(backend="eager", mode="reduce-overhead")
    cc._compile_all_devices = True
    for _ in range(2):
        cache.reset()
        outs.append(gen(model, ids, mask, compile_config=cc, disable_compile=None,
                        **H.cache_kwargs(model, cache)))
    assert sizes(captures) == [3, 3] and list(kept.runners) == [(3, None),
                                                   (3, ("eager", None, "None"))]
    w = model.lm_head.weight
    w.data = w.data.clone()                                  # a new tensor: new graphs
    cache.reset()
    outs.append(gen(model, ids, mask, **H.cache_kwargs(model, cache)))
    assert sizes(captures) == [3, 3, 3] and getattr(cache, GG.KEPT) is not kept
    for out in outs[1:]:
        assert torch.equal(out.sequences, outs[0].sequences)
    captures.clear()
    gen(model, ids, mask)
    gen(model, ids, mask)
    assert sizes(captures) == [3, 3]           # a default cache handed out: per call


def test_default_cache_kept_when_never_handed_out(cpu_graphs, captures):
    """generate() returning sequences only keeps its default cache for the next call of the
    same shape (reset in place, its step graph replayed: one capture for two calls, the
    same tokens as eager steps); a call that returns its cache takes it and leaves it to
    the caller; another shape, or mla_default_cache = None, gets a new cache."""
    ids, mask = left_padded(LENGTHS, seed=12)
    model = H.convert(pair("v2", None, seed=8))

    def plain(new=NEW):
        with torch.no_grad():
            return model.generate(ids, attention_mask=mask, max_new_tokens=new,
                                  do_sample=False, disable_compile=True)
    model.mla_generate_graph = False
    exp = plain()
    model.mla_default_cache = None                  # (the eager call's kept cache)
    model.mla_generate_graph = True
    first = plain()
    kept = model.mla_default_cache
    assert isinstance(kept, H.PagedMLACache) and sizes(captures) == [3]
    second = plain()
    assert model.mla_default_cache is kept and sizes(captures) == [3]     # not captured
    assert torch.equal(first, exp) and torch.equal(second, exp)
    handed = gen(model, ids, mask)                  # return_dict_in_generate: the caller's
    assert cache_of(handed) is kept and model.mla_default_cache is None
    assert torch.equal(handed.sequences, exp)
    assert sizes(captures) == [3]                   # it took the kept graphs with it
    third = plain()
    assert model.mla_default_cache is not kept and sizes(captures) == [3, 3]
    assert torch.equal(third, exp)
    plain(new=NEW + 5)                              # a longer call: a new, larger cache
    assert model.mla_default_cache.max_cache_len > kept.max_cache_len
    model.mla_default_cache = None
    assert torch.equal(plain(new=NEW + 5), plain(new=NEW + 5))


def test_serves_only_one_token_per_row():
    model = H.convert(pair())
    cache = H.PagedMLACache(model.config, max_batch_size=2, max_cache_len=32)
    g = GG.GenerateGraphs(model, cache, graph=False)
    ids = torch.ones(2, 1, dtype=torch.long)
    assert g.serves((), dict(input_ids=ids))
    assert not g.serves((ids,), {})                                  # positional: HF's path
    assert not g.serves((), dict(input_ids=torch.ones(2, 3, dtype=torch.long)))
    assert not g.serves((), dict(input_ids=torch.ones(3, 1, dtype=torch.long)))  # > rows
    assert not g.serves((), dict(input_ids=ids, output_attentions=True))
    assert not g.serves((), dict(input_ids=ids, use_cache=False))
    assert not g.serves((), dict(inputs_embeds=torch.ones(2, 1, 8)))


def test_auto_compile_yields_to_the_graphs(monkeypatch):
    """HF's automatic compile of the decode step is skipped where generate() attached its
    step graphs: without compile_config the graphs serve the eager step; with one that HF
    would honour, they compile the step (its backend, its mode less CUDA graphs); with
    one HF would not (disable_compile), the eager step."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import CompileConfig
    model = H.convert(pair())
    base = type(model).__mro__[1]
    hf_says = [True]
    monkeypatch.setattr(base, "_valid_auto_compile_criteria", lambda self, kw, gc: hf_says[0])
    cache = H.PagedMLACache(model.config, max_batch_size=2, max_cache_len=32)
    kw = H.cache_kwargs(model, cache)
    assert model._valid_auto_compile_criteria(kw, GenerationConfig())       # none attached
    graphs = GG.GenerateGraphs(model, cache, graph=False)
    setattr(cache, GG.ATTR, graphs)
    assert not model._valid_auto_compile_criteria(kw, GenerationConfig())
    assert graphs.compile is None
    hf_says[0] = False                                   # e.g. disable_compile=True
    assert not model._valid_auto_compile_criteria(
        kw, GenerationConfig(compile_config=CompileConfig()))
    assert graphs.compile is None
    hf_says[0] = True
    for mode, want in [("reduce-overhead", None), ("max-autotune", "max-autotune-no-cudagraphs"),
                       ("default", "default"), (None, None)]:
        cc = CompileConfig(backend="eager", mode=mode)
        assert not model._valid_auto_compile_criteria(kw, GenerationConfig(compile_config=cc))
        assert graphs.compile == dict(compile=True, backend="eager", mode=want, options=None)
    cc = CompileConfig(backend="inductor", mode="max-autotune",
                       options={"triton.cudagraphs": True, "max_autotune": True})
    assert not model._valid_auto_compile_criteria(kw, GenerationConfig(compile_config=cc))
    assert graphs.compile == dict(compile=True, backend="inductor", mode=None,
                                  options={"max_autotune": True})


def test_compile_config_compiles_the_graphs_step(cpu_graphs):
    """generate(compile_config=...) with the step graphs attached: every decode step is
    served by the runner, whose step is compiled (one graph for both calls: a second
    call compiles nothing), HF compiles nothing, and the tokens are the eager call's."""
    from transformers.generation.configuration_utils import CompileConfig
    compiled = []

    def backend(gm, example_inputs, **kwargs):
        compiled.append(sum(n.op == "call_function" and "mla." in str(n.target)
                            for n in gm.graph.nodes))
        return gm.forward

    ids, mask = left_padded(LENGTHS, seed=4)
    model = H.convert(pair("v2", None, seed=6))
    exp = gen(model, ids, mask)
    assert cpu_graphs == [True] * (NEW - 1) and compiled == []
    cc = CompileConfig(fullgraph=False, dynamic=True, backend=backend, mode="reduce-overhead")
    cc._compile_all_devices = True                   # (HF compiles on CUDA only otherwise)
    torch._dynamo.reset()
    try:
        got = [gen(model, ids, mask, compile_config=cc, disable_compile=None)
               for _ in range(2)]
    finally:
        torch._dynamo.reset()
    assert cpu_graphs == [True] * (3 * (NEW - 1))
    assert len(compiled) == 1 and compiled[0] > 0, compiled    # DecodeGraph's step, once
    for out in got:
        assert torch.equal(out.sequences, exp.sequences)
        for a, b in zip(out.logits, exp.logits):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-4)


def test_convert_checks_the_setting():
    with pytest.raises(TypeError, match="generate_graph must be a bool"):
        H.convert(pair(), generate_graph="yes")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family,q_lora", [("v3", 192), ("v2", None)])
def test_cuda_graph_replays_equal_eager_steps(captures, family, q_lora):
    """bf16 on CUDA with an MoE layer: generate(disable_compile=True) captures the step
    once and replays it; tokens equal and logits equal to the eager steps' (the same
    kernels)."""
    model = H.convert(pair(family, q_lora, layers=3, seed=5)).to("cuda", torch.bfloat16)
    ids, mask = (t.cuda() for t in left_padded([5, 70, 33], seed=2))
    model.mla_generate_graph = False
    exp = gen(model, ids, mask, new=24)
    model.mla_generate_graph = True
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)               # captured, not eager
        got = gen(model, ids, mask, new=24)
    assert len(captures) == 1 and captures[0]._graph is not None
    assert torch.equal(got.sequences, exp.sequences)
    for a, b in zip(got.logits, exp.logits):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # a second call, plain (no disable_compile): HF would compile the step; the call's
    # graph serves instead (nothing compiled), same tokens
    torch._dynamo.reset()
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    again = gen(model, ids, mask, new=24, disable_compile=None)
    assert torch.equal(again.sequences, exp.sequences)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_compile_config_replays_the_compiled_step(captures):
    """bf16 on CUDA with an MoE layer: generate(compile_config=...) captures DecodeGraph's
    compiled step once and replays it; the tokens are those of HF's own compile of the
    same forward (generate_graph off), the logits within bf16 rounding of them."""
    from transformers.generation.configuration_utils import CompileConfig
    model = H.convert(pair("v3", 192, layers=3, seed=5)).to("cuda", torch.bfloat16)
    ids, mask = (t.cuda() for t in left_padded([5, 70, 33], seed=2))
    cc = CompileConfig(fullgraph=True, dynamic=False)
    torch._dynamo.reset()
    try:
        model.mla_generate_graph = False
        exp = gen(model, ids, mask, new=24, compile_config=cc, disable_compile=None)
        model.mla_generate_graph = True
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)           # captured, not eager
            got = gen(model, ids, mask, new=24, compile_config=cc, disable_compile=None)
    finally:
        torch._dynamo.reset()
    assert len(captures) == 1 and captures[0]._graph is not None
    assert getattr(captures[0]._fwd, "_torchdynamo_orig_callable", None) is not None  # compiled
    assert torch.equal(got.sequences, exp.sequences)
    for a, b in zip(got.logits, exp.logits):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_kept_graphs_serve_the_next_call(captures):
    """bf16 on CUDA: the user's cache keeps the step graph captured in one generate() call;
    the next call on it (other prompts, the cache reset) replays it without capturing and
    gives the eager steps' tokens and logits bit for bit."""
    model = H.convert(pair("v2", None, layers=3, seed=7)).to("cuda", torch.bfloat16)
    cache = H.PagedMLACache(model.config, max_batch_size=3, max_cache_len=160,
                            device="cuda", dtype=torch.bfloat16)
    for seed, lengths in [(1, [9, 40, 23]), (2, [64, 3, 17])]:
        ids, mask = (t.cuda() for t in left_padded(lengths, seed=seed))
        model.mla_generate_graph = False
        cache.reset()
        exp = gen(model, ids, mask, new=16, **H.cache_kwargs(model, cache))
        model.mla_generate_graph = True
        cache.reset()
        got = gen(model, ids, mask, new=16, **H.cache_kwargs(model, cache))
        assert torch.equal(got.sequences, exp.sequences)
        for a, b in zip(got.logits, exp.logits):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert sizes(captures) == [3]


@contextlib.contextmanager
def flush_denormal():
    torch.set_flush_denormal(True)          # (tiny random models make subnormals: slow CPU)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


def converted_family(family):
    """(HF's model, a converted copy) of a tiny model of the family; skipped where this
    transformers lays the family out otherwise."""
    from family_models import build
    ref, model = build(family)
    try:
        H.convert(model)
    except TypeError as exc:
        pytest.skip(str(exc))
    return ref, model


@pytest.mark.parametrize("family", ["kimi_linear", "bailing_hybrid"])
def test_kept_default_cache_resets_linear_states(cpu_graphs, family):
    """A hybrid family's default cache, kept for the next call (sequences only), starts
    that call with its linear-attention states reset: the same tokens as the first call
    and as HF."""
    from family_models import LENGTHS as FL, NEW as FN
    with flush_denormal():
        ref, model = converted_family(family)
        ids, mask = left_padded(FL)
        with torch.no_grad():
            exp = ref.generate(ids, attention_mask=mask, max_new_tokens=FN, do_sample=False)
            outs = [model.generate(ids, attention_mask=mask, max_new_tokens=FN,
                                   do_sample=False, disable_compile=True) for _ in range(2)]
    assert model.mla_default_cache is not None
    assert torch.equal(outs[0], exp) and torch.equal(outs[1], exp)


@pytest.mark.parametrize("family", ["kimi_linear", "glm_moe_dsa", "bailing_hybrid",
                                    "longcat_flash"])
def test_step_runner_serves_other_families(cpu_graphs, family):
    """The step graphs' runner (here without a graph: the CPU) serves every decode step of
    the hybrid (KDA state beside the paged cache), DSA and two-blocks-per-layer families
    with HF's tokens and logits."""
    from family_models import LENGTHS as FL, NEW as FN, assert_matches
    from family_models import generate as fgen
    with flush_denormal():
        ref, model = converted_family(family)
        ids, mask = left_padded(FL)
        exp = fgen(ref, ids, mask)
        got = fgen(model, ids, mask, disable_compile=True)
    assert cpu_graphs == [True] * (FN - 1)
    assert_matches(got, exp)
