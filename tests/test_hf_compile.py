"""Converted DeepSeek under torch.compile: one graph per step shape, no graph breaks,
no recompiles across decode steps, same tokens as the unconverted model.

The compiler backend defaults to aot_eager on CPU (functionalizes the cache writes like
inductor, without the C++ build time) and inductor on CUDA; MLA_HF_COMPILE_BACKEND
overrides it.
"""
import os
import re

import pytest
import torch
import torch._dynamo
from torch._dynamo.backends.registry import lookup_backend

import mla_ops.hf as H
from hf_models import cache_kw, build_pair, left_padded, logit_err, tiny_config

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKEND = os.environ.get("MLA_HF_COMPILE_BACKEND", "inductor" if DEVICE == "cuda" else "aot_eager")
TOL = 1e-4

_graphs: list = []   # one entry per graph handed to the backend (module level: CompileConfig deep-copies)


def counting_backend(gm, example_inputs, **kwargs):
    _graphs.append(len(gm.graph.nodes))
    return lookup_backend(BACKEND)(gm, example_inputs)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    _graphs.clear()
    yield
    torch._dynamo.reset()


def graph_breaks():
    return sum(torch._dynamo.utils.counters["graph_break"].values())


def test_generate_with_compile_config():
    from transformers.generation.configuration_utils import CompileConfig
    cfg = tiny_config("v3", yarn=True)
    ref, model = build_pair(cfg)
    ref, model = ref.to(DEVICE), H.convert(model).to(DEVICE)
    ids, mask = (t.to(DEVICE) for t in left_padded([6, 19, 13]))
    cc = CompileConfig(fullgraph=True, dynamic=False, backend=counting_backend, mode=None)
    cc._compile_all_devices = True          # CPU too
    cache = H.PagedMLACache(model.config, max_batch_size=3, max_cache_len=64, block_size=16,
                            device=DEVICE)
    kw = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, output_logits=True,
              return_dict_in_generate=True)
    with torch.no_grad():
        out = model.generate(ids, **cache_kw(cache), compile_config=cc, **kw)
        exp = ref.generate(ids, **kw)
    # prefill runs eagerly inside generate; the 23 decode steps share one graph
    assert len(_graphs) == 1, f"{len(_graphs)} graphs compiled"
    assert graph_breaks() == 0
    assert torch.equal(out.sequences, exp.sequences)
    assert max(logit_err(a, b) for a, b in zip(out.logits, exp.logits)) <= TOL
    # a second generate with a new cache of the same shape reuses the graph
    cache = H.PagedMLACache(model.config, max_batch_size=3, max_cache_len=64, block_size=16,
                            device=DEVICE)
    with torch.no_grad():
        again = model.generate(ids, **cache_kw(cache), compile_config=cc, **kw)
    assert len(_graphs) == 1, f"{len(_graphs)} graphs: a new cache recompiled"
    assert torch.equal(again.sequences, exp.sequences)


def test_compiled_forward_fullgraph_decode_loop():
    from transformers import DynamicCache
    cfg = tiny_config("v2", q_lora_rank=None)
    ref, model = build_pair(cfg, seed=2)
    ref, model = ref.to(DEVICE), H.convert(model).to(DEVICE)
    ids, mask = (t.to(DEVICE) for t in left_padded([9, 4], seed=5))
    cache = H.PagedMLACache(model.config, max_batch_size=2, max_cache_len=48, block_size=8,
                            device=DEVICE)
    rcache = DynamicCache(config=cfg)
    fwd = torch.compile(model.forward, fullgraph=True, dynamic=False, backend=counting_backend)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        got = fwd(input_ids=ids, attention_mask=mask, position_ids=pos, **cache_kw(cache)).logits
        exp = ref(input_ids=ids, attention_mask=mask, position_ids=pos, **cache_kw(rcache)).logits
        assert logit_err(got[mask.bool()], exp[mask.bool()]) <= TOL
        assert len(_graphs) == 1
        tok, p = exp[:, -1:].argmax(-1), pos[:, -1:]
        for step in range(12):
            p = p + 1
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            # the paged cache knows each row's padding: decode needs no mask (fixed shapes)
            got = fwd(input_ids=tok, position_ids=p, **cache_kw(cache)).logits
            exp = ref(input_ids=tok, attention_mask=mask, position_ids=p, **cache_kw(rcache)).logits
            assert logit_err(got, exp) <= TOL, f"step {step}"
            tok = exp[:, -1:].argmax(-1)
    assert len(_graphs) == 2, f"{len(_graphs)} graphs: decode recompiled"
    assert graph_breaks() == 0
    assert cache.seq_lens() == [9 + 12, 4 + 12]


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_generate_cuda_graphs_long():
    """inductor + CUDA graphs (HF's default compile mode), 64 decode steps: the per-step
    metadata lives in the graph's static buffers, so late steps must not read stale state."""
    from transformers.generation.configuration_utils import CompileConfig
    cfg = tiny_config("v3")
    ref, model = build_pair(cfg, seed=9)
    ref, model = ref.to(DEVICE), H.convert(model).to(DEVICE)
    ids, mask = (t.to(DEVICE) for t in left_padded([3, 40, 17, 64], seed=2))
    cache = H.PagedMLACache(model.config, max_batch_size=4, max_cache_len=128, block_size=64,
                            device=DEVICE)
    kw = dict(attention_mask=mask, max_new_tokens=64, do_sample=False, output_logits=True,
              return_dict_in_generate=True)
    with torch.no_grad():
        out = model.generate(ids, **cache_kw(cache),
                             compile_config=CompileConfig(fullgraph=True, dynamic=False), **kw)
        exp = ref.generate(ids, **kw)
    errs = [logit_err(a, b) for a, b in zip(out.logits, exp.logits)]
    print(f"CUDA graphs, 64 steps: max logit error {max(errs):.2e}")
    assert max(errs) <= 1e-3
    assert torch.equal(out.sequences, exp.sequences)
    assert graph_breaks() == 0


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_generate_bf16_cuda_graphs_flashmla_first_call_compiled(flashmla_at_every_size):
    """bf16 on an SM90 GPU picks FlashMLA; its first call happens inside the compiled,
    CUDA-graphed decode step (no eager warm-up), which must work: every step's logits
    match HF's float32 model run over the same tokens (teacher-forced, so a near-tie that
    flips a greedy token of this random model cannot hide or fake an error). Dense layers
    only: a MoE router's near-tie would flip an expert between bf16 and fp32 (one such
    flip read 0.35 here), which is the router's business, not the attention's."""
    import lowering
    from transformers.generation.configuration_utils import CompileConfig
    cfg = tiny_config("v3")
    cfg.first_k_dense_replace = cfg.num_hidden_layers
    ref, model = build_pair(cfg, seed=11)
    ref = ref.to(DEVICE)
    model = H.convert(model).to(DEVICE, torch.bfloat16)
    ids, mask = (t.to(DEVICE) for t in left_padded([5, 33, 70], seed=4))
    kw = dict(attention_mask=mask, max_new_tokens=40, do_sample=False, output_logits=True,
              return_dict_in_generate=True)
    before = lowering.backend_choices["flashmla"]
    with torch.no_grad():
        cache = H.PagedMLACache(model.config, max_batch_size=3, max_cache_len=128,
                                block_size=64, device=DEVICE, dtype=torch.bfloat16)
        out = model.generate(ids, **cache_kw(cache),
                             compile_config=CompileConfig(fullgraph=True, dynamic=False), **kw)
    if lowering.select_backend(torch.empty(1, 1, 4, 576, device=DEVICE, dtype=torch.bfloat16),
                               torch.empty(1, 64, 576, device=DEVICE, dtype=torch.bfloat16)) == "flashmla":
        assert lowering.backend_choices["flashmla"] > before
    S, new = ids.shape[1], len(out.logits)
    full = torch.cat([mask, torch.ones(mask.shape[0], new, dtype=mask.dtype, device=DEVICE)], 1)
    pos = (full.cumsum(-1) - 1).masked_fill(full == 0, 1)              # as generate() sets them
    with torch.no_grad():
        exp = ref(input_ids=out.sequences, attention_mask=full, position_ids=pos).logits
    errs = [logit_err(out.logits[i].float(), exp[:, S - 1 + i]) for i in range(new)]
    rows = [[logit_err(out.logits[i][b].float(), exp[b, S - 1 + i]) for i in range(new)]
            for b in range(ids.shape[0])]
    print("per-row max logit error:", [f"{max(r):.3f} at step {r.index(max(r))}" for r in rows])
    assert max(errs) <= 5e-2, max(errs)          # bf16 against fp32, 40 steps
    assert torch.isfinite(torch.stack(out.logits)).all()


def test_compiled_forward_with_grad_enabled():
    """Users call model(...) without no_grad: the compiled converted forward still runs
    (its GEMMs then take the modules' own differentiable calls) and matches HF; a
    backward pass through it is a clear error."""
    cfg = tiny_config("v3")
    ref, model = build_pair(cfg, seed=4)
    ref, model = ref.to(DEVICE), H.convert(model).to(DEVICE)
    ids, mask = (t.to(DEVICE) for t in left_padded([7, 5], seed=6))
    cache = H.PagedMLACache(model.config, max_batch_size=2, max_cache_len=32, block_size=8,
                            device=DEVICE)
    fwd = torch.compile(model.forward, fullgraph=True, dynamic=False, backend=counting_backend)
    got = fwd(input_ids=ids, attention_mask=mask, **cache_kw(cache)).logits
    assert got.requires_grad
    with torch.no_grad():
        exp = ref(input_ids=ids, attention_mask=mask).logits
    assert logit_err(got.detach()[mask.bool()], exp[mask.bool()]) <= TOL
    assert graph_breaks() == 0
    # the attention has no backward: a backward pass says so instead of silently
    # leaving every weight before it without gradients
    with pytest.raises(RuntimeError, match="has no backward"):
        got.sum().backward()


def _op_args(code: str, op: str) -> list[list[str]]:
    """The top-level argument strings of each call of op in generated code."""
    calls = []
    for part in code.split(op + "(")[1:]:
        args, depth, cur = [], 0, ""
        for ch in part:
            if ch == ")" and depth == 0:
                break
            depth += (ch in "([") - (ch in ")]")
            if ch == "," and depth == 0:
                args.append(cur.strip())
                cur = ""
            else:
                cur += ch
        calls.append(args + [cur.strip()])
    return calls


def test_inductor_computes_the_step_plan_once():
    """Compiled by inductor, every layer's attention reads the same block table, lengths
    and query offsets (views of one buffer the plan writes once per step), not a copy
    recomputed for each layer's call (a small kernel or two per layer on a GPU); and a
    layer's cache write and attention read the same normed latent and k_pe (views of the
    layer's cache-row buffer), not one materialization each."""
    from torch._inductor.utils import run_and_get_code
    cfg = tiny_config("v3", layers=3)
    _, model = build_pair(cfg, seed=8)
    model = H.convert(model).to(DEVICE)
    ids, mask = (t.to(DEVICE) for t in left_padded([5, 3], seed=9))
    cache = H.PagedMLACache(model.config, max_batch_size=2, max_cache_len=16, block_size=8,
                            device=DEVICE)
    with torch.no_grad():
        tok = model(input_ids=ids, attention_mask=mask, **cache_kw(cache)).logits[:, -1:].argmax(-1)
        fwd = torch.compile(model.forward, fullgraph=True, dynamic=False, backend="inductor")
        _, codes = run_and_get_code(fwd, input_ids=tok, **cache_kw(cache))
    calls = _op_args("\n".join(codes), "torch.ops.mla.attention_with_output.default")
    assert len(calls) == 3
    meta = {tuple(c[6:9]) for c in calls}      # block_table, seq_lens, query_start_loc
    assert len(meta) == 1, meta
    writes = _op_args("\n".join(codes), "torch.ops.mla.kv_cache_update.default")
    assert len(writes) == 3
    for w, c in zip(writes, calls):            # (kv_c_normed, k_pe) of each layer
        assert w[:2] == c[1:3], (w[:2], c[1:3])
    assert len({re.search(r"buf\d+", w[0]).group() for w in writes}) == 3   # one per layer
