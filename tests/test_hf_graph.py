"""mla_ops.hf.DecodeGraph: the compiled decode step captured in one CUDA graph (GPU) or
called directly (CPU): same tokens and logits as HF, room counted, bad input refused."""
import os

import pytest
import torch
import torch._dynamo

import mla_ops.hf as H
from hf_models import (build_pair, cache_kw, graph_and_generate_tokens, left_padded,
                       logit_err, tiny_config)
from mla_ops.cache import CacheFullError

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKEND = os.environ.get("MLA_HF_COMPILE_BACKEND", "inductor" if DEVICE == "cuda" else "aot_eager")
TOL = 1e-4


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


def prefilled(lengths, max_cache_len, block_size=16, seed=4, num_blocks=None, moe=False):
    cfg = tiny_config("v3")
    if not moe:     # HF's MoE reads routed-token counts on the host: not capturable
        cfg.first_k_dense_replace = cfg.num_hidden_layers
    ref, model = build_pair(cfg, seed=seed)
    ref, model = ref.to(DEVICE), H.convert(model).to(DEVICE)
    ids, mask = (t.to(DEVICE) for t in left_padded(lengths, seed=seed))
    cache = H.PagedMLACache(model.config, max_batch_size=len(lengths), max_cache_len=max_cache_len,
                            block_size=block_size, device=DEVICE, num_blocks=num_blocks)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        first = model(input_ids=ids, attention_mask=mask, position_ids=pos,
                      **cache_kw(cache)).logits[:, -1].argmax(-1)          # [B]
    return ref, model, cache, ids, mask, first


def test_greedy_matches_hf_generate():
    ref, model, cache, ids, mask, first = prefilled([5, 21, 12], max_cache_len=64)
    runner = H.DecodeGraph(model, cache, backend=BACKEND)
    assert cache.seq_lens() == [5, 21, 12]          # capture's warm-up steps were undone
    with torch.no_grad():
        exp = ref.generate(ids, attention_mask=mask, max_new_tokens=15, do_sample=False)
    got = runner.greedy(first, 14)                                      # [B, 14]
    assert torch.equal(first, exp[:, ids.shape[1]])
    assert torch.equal(got, exp[:, ids.shape[1] + 1:])
    assert cache.seq_lens() == [5 + 14, 21 + 14, 12 + 14]
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
    # graph: one capture, replays ever since; without: one compiled graph, no recompiles
    assert runner.graph_enabled == (DEVICE == "cuda")


def test_call_logits_match_hf_forward():
    from transformers import DynamicCache
    ref, model, cache, ids, mask, first = prefilled([9, 3], max_cache_len=48, block_size=8, seed=6)
    rcache = DynamicCache(config=ref.config)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    runner = H.DecodeGraph(model, cache, backend=BACKEND)
    with torch.no_grad():
        ref(input_ids=ids, attention_mask=mask, position_ids=pos, **cache_kw(rcache))
        tok, p = first[:, None], pos[:, -1:]
        for step in range(6):
            p = p + 1
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            exp = ref(input_ids=tok, attention_mask=mask, position_ids=p, **cache_kw(rcache)).logits
            got = runner(tok).clone()
            assert logit_err(got, exp) <= TOL, f"step {step}"
            tok = exp[:, -1:].argmax(-1)


def test_room_is_counted_before_running():
    # 2 rows at 20 and 7 of 24 tokens: 4 more steps fit (the padded length, 20, bounds them)
    ref, model, cache, ids, mask, first = prefilled([20, 7], max_cache_len=24, block_size=8)
    runner = H.DecodeGraph(model, cache, backend=BACKEND)
    assert runner.steps_left == 4
    with pytest.raises(CacheFullError, match="room for 4"):
        runner.greedy(first, 5)
    assert cache.seq_lens() == [20, 7]                  # refused before any step ran
    runner.greedy(first, 4)
    assert cache.seq_lens() == [24, 11] and runner.steps_left == 0
    with pytest.raises(CacheFullError):
        runner(first)
    cache.reset()                                       # host-side change: counted again
    assert runner.steps_left == 24


def test_eager_steps_between_calls_are_seen():
    ref, model, cache, ids, mask, first = prefilled([6, 2], max_cache_len=16, block_size=4)
    runner = H.DecodeGraph(model, cache, backend=BACKEND)
    assert runner.steps_left == 10
    tok = runner.greedy(first, 3)[:, -1]
    assert runner.steps_left == 7
    with torch.no_grad():                               # an eager step on the same cache
        model(input_ids=tok[:, None], position_ids=torch.tensor([[9], [5]], device=DEVICE),
              **cache_kw(cache))
    assert cache.seq_lens() == [10, 6] and runner.steps_left == 6


def test_room_counts_free_blocks():
    # blocks of 4, 2 rows at 4 tokens (one full block each), 3 blocks in the pool:
    # one row can grow into the last free block, both cannot -> no step fits.
    ref, model, cache, ids, mask, first = prefilled([4, 4], max_cache_len=32, block_size=4,
                                                    num_blocks=3)
    if DEVICE == "cuda":    # capture's warm-up steps need room too
        with pytest.raises(CacheFullError, match="warmup"):
            H.DecodeGraph(model, cache, backend=BACKEND)
    runner = H.DecodeGraph(model, cache, backend=BACKEND, graph=False)
    assert runner.steps_left == 0
    with pytest.raises(CacheFullError, match="room for 0"):
        runner(first)
    assert cache.seq_lens() == [4, 4]


def test_bad_input():
    ref, model, cache, ids, mask, first = prefilled([3, 4], max_cache_len=16, block_size=4)
    with pytest.raises(TypeError, match="convert"):
        H.DecodeGraph(ref, cache)
    with pytest.raises(TypeError, match="PagedMLACache"):
        H.DecodeGraph(model, object())
    with pytest.raises(ValueError, match="batch_size"):
        H.DecodeGraph(model, cache, batch_size=3)
    with pytest.raises(ValueError, match="captures the step"):
        H.DecodeGraph(model, cache, mode="reduce-overhead")
    with pytest.raises(ValueError, match="triton.cudagraphs"):
        H.DecodeGraph(model, cache, options={"triton.cudagraphs": True})
    with pytest.raises(ValueError, match="mode=None"):
        H.DecodeGraph(model, cache, mode="default", options={"max_autotune": False})
    with pytest.raises(ValueError, match="snapshot"):
        cache.restore([torch.zeros(1)])
    runner = H.DecodeGraph(model, cache, backend=BACKEND)
    with pytest.raises(ValueError, match="input_ids"):
        runner(torch.zeros(2, 2, dtype=torch.long, device=DEVICE))
    with pytest.raises(TypeError, match="input_ids"):
        runner(torch.zeros(2, 1, device=DEVICE))
    with pytest.raises(ValueError, match="steps"):
        runner.greedy(first, -1)
    assert cache.seq_lens() == [3, 4]


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_uncapturable_model_says_why_and_leaves_the_cache():
    ref, model, cache, ids, mask, first = prefilled([5, 9], max_cache_len=32, moe=True)
    with pytest.raises(RuntimeError, match="graph=False"):
        H.DecodeGraph(model, cache, backend=BACKEND)
    assert cache.seq_lens() == [5, 9]
    runner = H.DecodeGraph(model, cache, backend=BACKEND, graph=False)
    with torch.no_grad():
        exp = ref.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    assert torch.equal(runner.greedy(first, 4), exp[:, ids.shape[1] + 1:])


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_capture_pauses_the_garbage_collector(monkeypatch):
    """The step is captured with Python's cyclic collector off (a collection inside a
    capture may run a destructor that makes a CUDA call the capture forbids), and the
    collector is back on afterwards; the warm-up steps run with it as it was."""
    import gc
    ref, model, cache, ids, mask, first = prefilled([5, 9], max_cache_len=32)
    seen = []                                   # (capturing, collector on) per step
    step = H.DecodeGraph._step

    def recording_step(self):
        seen.append((torch.cuda.is_current_stream_capturing(), gc.isenabled()))
        return step(self)

    monkeypatch.setattr(H.DecodeGraph, "_step", recording_step)
    assert gc.isenabled()
    runner = H.DecodeGraph(model, cache, backend=BACKEND)
    assert runner.graph_enabled and gc.isenabled()
    assert (True, False) in seen and (False, True) in seen
    assert all(not on for capturing, on in seen if capturing)
    with torch.no_grad():
        exp = ref.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    assert torch.equal(runner.greedy(first, 4), exp[:, ids.shape[1] + 1:])


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_uncapturable_step_names_its_host_read(monkeypatch):
    """A norm that reads a device value on the host inside the step: DecodeGraph refuses
    with an error naming that line (and the cache is as it was), and generate() warns with
    the same line and still gives HF's tokens from eager steps."""
    ref, model, cache, ids, mask, first = prefilled([5, 9], max_cache_len=32)
    norm_cls = type(model.model.norm)
    norm_forward = norm_cls.forward

    def reads_on_host(self, x):
        if x.abs().sum().item() < 0:            # a host read of a device value; never true
            x = -x
        return norm_forward(self, x)

    monkeypatch.setattr(norm_cls, "forward", reads_on_host)
    site = r"test_hf_graph\.py:\d+ in reads_on_host"
    with pytest.raises(RuntimeError, match=site):
        H.DecodeGraph(model, cache, compile=False)
    assert cache.seq_lens() == [5, 9]
    with torch.no_grad(), pytest.warns(RuntimeWarning, match=site):
        got = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        exp = ref.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert torch.equal(got, exp)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_bf16_page64_replays_match_compiled_generate(kv_cache_dtype):
    """bf16 with block 64 (bf16 cache: FlashMLA on SM90 when installed, else Triton; fp8
    cache: Triton): 41 replays with growing lengths give the tokens of generate() with the
    same compiled kernels."""
    cfg = tiny_config("v3")
    cfg.first_k_dense_replace = cfg.num_hidden_layers
    _, model = build_pair(cfg, seed=8, dtype=torch.bfloat16)
    model = H.convert(model).to(DEVICE)
    ids, mask = (t.to(DEVICE) for t in left_padded([30, 70, 5], seed=8))
    cache = H.PagedMLACache(model.config, max_batch_size=3, max_cache_len=128, device=DEVICE,
                            dtype=torch.bfloat16, kv_cache_dtype=kv_cache_dtype, k_scale=0.05)
    _, got, exp = graph_and_generate_tokens(model, ids, mask, cache, 42, backend=BACKEND)
    assert torch.equal(got, exp)


def _flashmla_prefilled():
    """A bf16 tiny V3 (dense layers) converted on the GPU, its block-64 cache prefilled
    with three left-padded prompts: (cfg, model, cache, pos [B, S], next ids [B, 1]).
    Skips where the flashmla backend cannot serve the cache."""
    cfg = tiny_config("v3")
    cfg.first_k_dense_replace = cfg.num_hidden_layers
    _, model = build_pair(cfg, seed=9, dtype=torch.bfloat16)
    model = H.convert(model).to(DEVICE)
    cache = H.PagedMLACache(model.config, max_batch_size=3, max_cache_len=256, device=DEVICE,
                            dtype=torch.bfloat16)
    if cache._flashmla_backends != {"auto", "flashmla"}:
        pytest.skip("the flashmla backend cannot serve this cache here")
    ids, mask = (t.to(DEVICE) for t in left_padded([30, 100, 7], seed=9))
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        nxt = model(input_ids=ids, attention_mask=mask, position_ids=pos,
                    **cache_kw(cache)).logits[:, -1:].argmax(-1)          # [B, 1]
    return cfg, model, cache, pos, nxt


@pytest.mark.skipif(DEVICE != "cuda", reason="FlashMLA needs a GPU")
def test_flashmla_schedule_computed_once_per_step(flashmla_at_every_size):
    """bf16 cache with block 64 on an SM90 GPU with flash_mla: a decode step runs FlashMLA's
    scheduler kernel once (the step plan's), not once per layer, and gives the same logits
    bit for bit as the step where every layer schedules itself."""
    from torch.profiler import ProfilerActivity, profile
    cfg, model, cache, pos, nxt = _flashmla_prefilled()
    assert cfg.num_hidden_layers >= 2
    saved = cache.snapshot()

    def step():
        with torch.no_grad():
            return model(input_ids=nxt, position_ids=pos[:, -1:] + 1,
                         **cache_kw(cache)).logits
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        once = step()
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    assert sum("get_mla_metadata" in k for k in kernels) == 1
    assert sum("flash_fwd_splitkv_mla" in k for k in kernels) == cfg.num_hidden_layers
    cache.restore(saved)
    cache._flashmla_backends = frozenset()           # every layer schedules itself
    per_layer = step()
    assert torch.equal(once, per_layer)


@pytest.mark.parametrize("fp8_query", [False, True])
def test_plan_bounds_the_flashmla_decode_inputs_once(fp8_query, monkeypatch,
                                                    flashmla_at_every_size):
    """With FlashMLA serving the layers, the step plan hands them a block table and lengths
    already clamped into the cache (so no call launches clamp kernels under capture),
    while the cache keeps its own table (-1 for no block); the schedule is of the kind
    the layers' query runs on (fp8_query: FlashMLA's fp8 kernel's)."""
    import lowering
    _, model, cache, ids, mask, first = prefilled([9, 3], max_cache_len=48, block_size=8, seed=6)
    seen = []
    monkeypatch.setattr(lowering, "decode_schedule",
                        lambda kv, bt, lens, num_heads, **kw: seen.append((bt, lens, kw)))
    served = frozenset({"auto"})
    cache._flashmla_backends, cache._flashmla_fp8q_backends = ((frozenset(), served) if fp8_query
                                                               else (served, frozenset()))
    assert cache.prepare(0, 2, 1, None, cache.dtype, cache.device,
                         fp8_query=not fp8_query).meta.decode_schedule is None
    cache._step = None
    assert not seen
    step = cache.prepare(0, 2, 1, None, cache.dtype, cache.device, fp8_query=fp8_query)
    table = step.table
    assert int(table.min()) == -1                         # the cache's view: unused columns
    assert torch.equal(step.meta.block_table, table.clamp(0, cache.num_blocks - 1))
    assert torch.equal(step.meta.seq_lens, torch.tensor([10, 4], dtype=torch.int32,
                                                        device=cache.device))
    assert seen and seen[0][0] is step.meta.block_table and seen[0][1] is step.meta.seq_lens
    assert seen[0][2] == {"bounded": True, "fp8q": fp8_query}
    cache.commit(step, 2, 1)
    assert torch.equal(cache.block_table[:2], table)      # committed unclamped


def test_auto_leaves_small_few_head_steps_to_triton(monkeypatch):
    """Below 64 heads, backend="auto" hands a decode step to FlashMLA only past
    SMALL_DECODE_POSITIONS positions (batch x table width): a tiny 4-head cache's step
    plans no FlashMLA schedule under "auto", one under "flashmla" or with the threshold
    lowered; the registry's auto route agrees on the same shapes."""
    import lowering
    from lowering.decode import registry
    assert lowering.flashmla_pays(128, 5, 64) and lowering.flashmla_pays(16, 8, 4096)
    assert not lowering.flashmla_pays(128, 4, 1 << 20)   # 128 heads, few requests: Gluon
    assert lowering.flashmla_pays(128, 1, 4096, torch.float16)   # which takes bf16 only
    assert not lowering.flashmla_pays(16, 1, 4096) and not lowering.flashmla_pays(16, 4, 4096)
    _, model, cache, ids, mask, first = prefilled([9, 3], max_cache_len=48, block_size=8, seed=6)
    seen = []
    monkeypatch.setattr(lowering, "decode_schedule",
                        lambda kv, bt, lens, num_heads, **kw: seen.append(bt.shape) or ("s",))
    cache._flashmla_backends = frozenset({"auto", "flashmla"})
    plans = {}
    for backend, threshold in (("auto", None), ("flashmla", None), ("auto", 0)):
        if threshold is not None:
            monkeypatch.setattr(registry, "SMALL_DECODE_POSITIONS", threshold)
        cache._step = None
        step = cache.prepare(0, 2, 1, None, cache.dtype, cache.device, backend=backend)
        plans[backend, threshold] = step.meta.decode_schedule is not None
    assert plans == {("auto", None): False, ("flashmla", None): True, ("auto", 0): True}
    assert seen == [(2, cache.max_blocks)] * 2
    # from 64 heads: no schedule for a bf16 step of up to FEW_REQUESTS requests (the
    # Gluon pair kernel's), one past them and for fp16 (shapes and dtype only)
    monkeypatch.setattr(cache, "num_heads", 128)
    plans = {}
    for few, dtype in ((2, torch.bfloat16), (1, torch.bfloat16), (2, torch.float16)):
        monkeypatch.setattr(registry, "FEW_REQUESTS", few)
        monkeypatch.setattr(cache, "dtype", dtype)
        cache._step = None
        step = cache.prepare(0, 2, 1, None, dtype, cache.device, backend="auto")
        plans[few, dtype] = step.meta.decode_schedule is not None
    assert plans == {(2, torch.bfloat16): False, (1, torch.bfloat16): True,
                     (2, torch.float16): True}
    q = torch.empty(2, 1, 4, 576, dtype=torch.bfloat16)
    call = registry.DecodeCall(q, torch.empty(6, 8, 576, dtype=torch.bfloat16),
                               torch.zeros(2, 6, dtype=torch.int32), None, 1.0, True, "auto",
                               None, 512)
    monkeypatch.setattr(registry, "SMALL_DECODE_POSITIONS", 16384)
    monkeypatch.setattr(registry, "hopper_unmet", lambda q, what: None)     # as on an H100
    monkeypatch.setattr(registry, "_flashmla_check", lambda: lambda call: None)
    assert "triton kernel is faster" in registry._flashmla_unmet(call, True)
    assert registry._flashmla_unmet(call, False) is None                    # asked by name
    big = call._replace(block_table=torch.zeros(2, 4096, dtype=torch.int32))  # 2 x 32768
    assert registry._flashmla_unmet(big, True) is None
    with pytest.raises(ValueError, match="block_table must have 2 dims"):
        lowering.select_backend(q, call.kv_cache, block_table=torch.zeros(6, dtype=torch.int32))
    # an eager call's remembered choice is per size class too
    assert registry.call_class(call, "bf16", "auto") != registry.call_class(big, "bf16", "auto")
    # and per query-token count (a route may serve only so many rows: s_q x heads)
    three = call._replace(q=torch.empty(2, 3, 4, 576, dtype=torch.bfloat16))
    assert registry.call_class(call, "bf16", "gluon") != registry.call_class(three, "bf16", "gluon")


@pytest.mark.skipif(DEVICE != "cuda", reason="FlashMLA needs a GPU")
def test_captured_flashmla_step_launches_no_clamp_kernels(flashmla_at_every_size):
    """Captured with FlashMLA, the step's decode calls read the plan's bounded inputs: no
    eager clamp kernels in the replay, one scheduler kernel (on its side stream), and the
    eager step's logits (bf16 tolerance: Inductor fuses the norms differently)."""
    from torch.profiler import ProfilerActivity, profile
    cfg, model, cache, pos, first = _flashmla_prefilled()
    runner = H.DecodeGraph(model, cache, backend=BACKEND)
    saved = cache.snapshot()
    with torch.no_grad():
        eager = model(input_ids=first, position_ids=pos[:, -1:] + 1,
                      **cache_kw(cache)).logits
    cache.restore(saved)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        got = runner(first).clone()
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    assert sum("flash_fwd_splitkv_mla" in k for k in kernels) == cfg.num_hidden_layers
    assert sum("get_mla_metadata" in k for k in kernels) == 1
    assert not [k for k in kernels if "launch_clamp" in k]
    assert logit_err(got, eager) < 2e-2
    assert cache.seq_lens() == [31, 101, 8]


@pytest.mark.skipif(DEVICE != "cuda", reason="FlashMLA needs a GPU")
def test_fp8_query_steps_take_flashmla_fp8_schedule_once_per_step():
    """A 16-head bf16 tiny V3 converted with an fp8 decode query over an fp8 block-64 cache,
    on an SM90 GPU with flash_mla: a decode step runs FlashMLA's fp8 kernel in every layer
    with the plan's one schedule (one scheduler kernel fewer per layer after the first than
    when each layer schedules itself, and the same logits bit for bit); so do 40 captured
    DecodeGraph replays whose lengths cross a block boundary (the same tokens and logits).

    (Against generate() compiled, the tokens of one row part after 14 steps, with or
    without the plan's schedule: the two graphs round the query before its fp8
    quantization differently, which this random model amplifies.)"""
    from collections import Counter

    import lowering
    from torch.profiler import ProfilerActivity, profile
    cfg = tiny_config("v3")
    cfg.first_k_dense_replace = cfg.num_hidden_layers
    cfg.num_attention_heads = cfg.num_key_value_heads = 16
    _, model = build_pair(cfg, seed=12, dtype=torch.bfloat16)
    model = H.convert(model, fp8_decode_query=0.05).to(DEVICE)
    ids, mask = (t.to(DEVICE) for t in left_padded([30, 70, 5], seed=12))
    pos = (mask.cumsum(-1) - 1).clamp(min=0)

    def prefilled_cache(planned):
        cache = H.PagedMLACache(model.config, max_batch_size=3, max_cache_len=128,
                                device=DEVICE, dtype=torch.bfloat16, kv_cache_dtype="fp8",
                                k_scale=0.05)
        if cache._flashmla_fp8q_backends != {"auto", "flashmla"}:
            pytest.skip("FlashMLA's fp8 kernel cannot serve this cache here")
        assert not cache._flashmla_backends               # no 16-bit schedule for an fp8 cache
        if not planned:
            cache._flashmla_fp8q_backends = frozenset()     # every layer schedules itself
        with torch.no_grad():
            first = model(input_ids=ids, attention_mask=mask, position_ids=pos,
                          **cache_kw(cache)).logits[:, -1:].argmax(-1)    # [B, 1]
        return cache, first

    def step(cache, first):
        with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
            out = model(input_ids=first, position_ids=pos[:, -1:] + 1,
                        **cache_kw(cache)).logits
            torch.cuda.synchronize()
        return out, Counter(e.name for e in prof.events() if e.device_type.name == "CUDA")
    before = lowering.backend_choices["flashmla-fp8q"]
    planned, n_planned = step(*prefilled_cache(True))
    assert lowering.backend_choices["flashmla-fp8q"] - before == cfg.num_hidden_layers
    self_scheduled, n_self = step(*prefilled_cache(False))
    extra = n_self - n_planned                           # kernel names -> count, where more
    sched = sum(n for k, n in extra.items() if "metadata" in k)
    clamps = sum(n for k, n in extra.items() if "clamp" in k)
    # self-scheduling layers: one scheduler kernel each (the first layer's replaces the
    # plan's), and their unbounded inputs clamped into the cache (table and lengths)
    assert sched == cfg.num_hidden_layers - 1, extra
    assert clamps == 2 * cfg.num_hidden_layers and sched + clamps == sum(extra.values()), extra
    assert not n_planned - n_self, n_planned - n_self
    assert torch.equal(planned, self_scheduled)

    runs = []
    for planned in (True, False):
        torch._dynamo.reset()
        cache, first = prefilled_cache(planned)
        runner = H.DecodeGraph(model, cache, backend=BACKEND)
        runs.append((runner.greedy(first, 40), runner(runner.next_tokens).clone()))
        assert cache.seq_lens() == [30 + 41, 70 + 41, 5 + 41]
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


def test_batch_smaller_than_the_cache():
    cfg = tiny_config("v3")
    cfg.first_k_dense_replace = cfg.num_hidden_layers
    ref, model = build_pair(cfg, seed=11)
    ref, model = ref.to(DEVICE), H.convert(model).to(DEVICE)
    ids, mask = (t.to(DEVICE) for t in left_padded([7, 3], seed=11))
    cache = H.PagedMLACache(model.config, max_batch_size=4, max_cache_len=32, block_size=8,
                            device=DEVICE)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        first = model(input_ids=ids, attention_mask=mask, position_ids=pos,
                      **cache_kw(cache)).logits[:, -1].argmax(-1)
        exp = ref.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    runner = H.DecodeGraph(model, cache, batch_size=2, backend=BACKEND)
    assert runner.steps_left == 32 - 7
    logits = runner(first)
    assert logits.shape == (2, 1, cfg.vocab_size)
    assert torch.equal(logits[:, -1].argmax(-1), exp[:, ids.shape[1] + 1])
    assert torch.equal(runner.greedy(runner.next_tokens, 4), exp[:, ids.shape[1] + 2:])
    assert cache.seq_lens() == [7 + 5, 3 + 5, 0, 0]


def test_snapshot_restore_undoes_steps():
    ref, model, cache, ids, mask, first = prefilled([6, 2], max_cache_len=24, block_size=4)
    saved, used = cache.snapshot(), cache.blocks_in_use()
    with torch.no_grad():
        for p in range(3):          # row 1 crosses into a new block
            model(input_ids=first[:, None], **cache_kw(cache),
                  position_ids=torch.tensor([[6 + p], [2 + p]], device=DEVICE))
    assert cache.seq_lens() == [9, 5] and cache.blocks_in_use() > used
    v = cache.version
    cache.restore(saved)
    assert cache.seq_lens() == [6, 2] and cache.blocks_in_use() == used
    assert cache.version > v
