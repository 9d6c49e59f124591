"""DeepSeek-V3.2 (DSA) through convert(): parity with HF's DeepseekV32ForCausalLM (fp32, CPU),
the indexer's selection, mla::sparse_decode against a float64 reference, compile hygiene."""
import copy
import os
from unittest import mock

import pytest
import torch

import mla_ops.hf as H
import mla_ops.hf.v32 as v32
from hf_models import left_padded, logit_err
from lowering.decode.sparse import mla_sparse_decode
from mla_ops.hf.dsa import select_slots
from v32_models import build_v32_pair, tiny_v32_config

TOL = 1e-4
LENGTHS = [5, 17, 30]          # left-padded; top-k 8 below all but the shortest prompt
NEW = 26


def generate(model, ids, mask, **kw):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                              output_logits=True, return_dict_in_generate=True, **kw)


def counting(fn):
    calls = []

    def wrapped(*a, **k):
        calls.append(1)
        return fn(*a, **k)
    return wrapped, calls


@pytest.mark.parametrize("yarn", [False, True])
def test_generate_matches_hf(yarn):
    cfg = tiny_v32_config(index_topk=8, yarn=yarn)
    ref, model = build_v32_pair(cfg)
    H.convert(model)
    ids, mask = left_padded(LENGTHS)
    cache = H.PagedMLACache(model.config, max_batch_size=4, max_cache_len=64, block_size=16,
                            dtype=torch.float32)
    wrapped, calls = counting(v32.sparse_attention)
    with mock.patch.object(v32, "sparse_attention", wrapped):
        out = generate(model, ids, mask, **H.cache_kwargs(model, cache))
    exp = generate(ref, ids, mask)
    errs = [logit_err(a, b) for a, b in zip(out.logits, exp.logits)]
    assert max(errs) <= TOL, f"max logit error {max(errs):.2e}"
    assert torch.equal(out.sequences, exp.sequences)
    assert len(set(out.sequences[:, -NEW:].flatten().tolist())) > 8      # not a degenerate run
    assert len(calls) == 2 * NEW          # every step of both layers read the selection
    kept = [n + NEW - 1 for n in LENGTHS]
    assert cache.seq_lens()[:3] == kept
    # the selection matters: HF's own model attending to every token decodes otherwise
    dense = copy.deepcopy(ref)
    for layer in dense.model.layers:
        layer.self_attn.indexer.index_topk = 10 ** 6
    full = generate(dense, ids, mask)
    assert max(logit_err(a, b) for a, b in zip(full.logits, exp.logits)) > 100 * TOL


def test_default_cache_generate_matches_hf():
    """generate() with no cache argument builds a PagedMLACache with the indexer's pool."""
    ref, model = build_v32_pair(tiny_v32_config(index_topk=8), seed=4)
    H.convert(model)
    ids, mask = left_padded([12, 25], seed=6)
    out, exp = generate(model, ids, mask), generate(ref, ids, mask)
    assert torch.equal(out.sequences, exp.sequences)
    assert max(logit_err(a, b) for a, b in zip(out.logits, exp.logits)) <= TOL


def test_fused_layers_mlps_and_experts_match_hf():
    """convert()'s V3 fusions apply to V3.2's decoder layers, norms, MLPs and MoE blocks."""
    ref, model = build_v32_pair(tiny_v32_config(index_topk=8), seed=8)
    H.convert(model, fuse_experts=True)
    layers = model.model.layers
    assert all(type(l).__name__.startswith("Fused") for l in layers)
    assert getattr(layers[0].mlp, "mla_converted", False)                 # dense SiLU MLP
    assert getattr(layers[1].mlp, "mla_fuse_experts", False)              # the MoE block
    ids, mask = left_padded([9, 21], seed=9)
    out, exp = generate(model, ids, mask), generate(ref, ids, mask)
    assert torch.equal(out.sequences, exp.sequences)
    assert max(logit_err(a, b) for a, b in zip(out.logits, exp.logits)) <= TOL


@pytest.mark.parametrize("attn", ["sdpa", "eager"])      # bool and additive float masks
def test_forward_dense_prefill_then_sparse_chunks_match_hf(attn):
    """A prompt within top-k (dense, as HF), then chunks with cached context past it
    (sparse prefill rows) and decode steps."""
    from transformers import DynamicCache
    cfg = tiny_v32_config(index_topk=12)
    ref, model = build_v32_pair(cfg, seed=5)
    for m in (ref, model):
        m.set_attn_implementation(attn)
    H.convert(model)
    ids, mask = left_padded([3, 11, 8], seed=7)
    cache = H.PagedMLACache(model.config, max_batch_size=3, max_cache_len=48, block_size=4)
    rcache = DynamicCache(config=cfg)
    real = mask.bool()
    wrapped, calls = counting(v32.sparse_attention)
    with torch.no_grad(), mock.patch.object(v32, "sparse_attention", wrapped):
        got = model(ids, attention_mask=mask, **H.cache_kwargs(model, cache)).logits
        exp = ref(ids, attention_mask=mask, **H.cache_kwargs(ref, rcache)).logits
        assert logit_err(got[real], exp[real]) <= TOL
        assert not calls                                  # 11 keys <= top-k 12: dense
        for n in (5, 1, 1, 7, 1):
            more = torch.randint(3, 256, (3, n))
            mask = torch.cat([mask, torch.ones(3, n, dtype=mask.dtype)], 1)
            got = model(more, attention_mask=mask, **H.cache_kwargs(model, cache)).logits
            exp = ref(more, attention_mask=mask, **H.cache_kwargs(ref, rcache)).logits
            assert logit_err(got, exp) <= TOL
    assert len(calls) == 2 * 5
    assert cache.seq_lens() == [3 + 15, 11 + 15, 8 + 15]


def test_cache_within_top_k_runs_dense():
    """A cache no longer than index_topk: every prefix is selected whole, so every step
    (decode included) runs the dense V3 path, with HF's results."""
    ref, model = build_v32_pair(tiny_v32_config(index_topk=64), seed=10)
    H.convert(model)
    ids, mask = left_padded([7, 20], seed=11)
    cache = H.PagedMLACache(model.config, max_batch_size=2, max_cache_len=64, block_size=16)
    wrapped, calls = counting(v32.sparse_attention)
    with mock.patch.object(v32, "sparse_attention", wrapped):
        out = generate(model, ids, mask, **H.cache_kwargs(model, cache))
    exp = generate(ref, ids, mask)
    assert not calls
    assert torch.equal(out.sequences, exp.sequences)
    assert max(logit_err(a, b) for a, b in zip(out.logits, exp.logits)) <= TOL


def test_cache_holds_the_indexer_keys_beside_the_latent():
    cfg = tiny_v32_config(index_topk=8)
    _, model = build_v32_pair(cfg, seed=1)
    H.convert(model)
    cache = H.PagedMLACache(model.config, max_batch_size=2, max_cache_len=40, block_size=8)
    assert len(cache.index_keys) == cfg.num_hidden_layers
    assert cache.index_keys[0].shape == (cache.num_blocks, 8, cfg.index_head_dim)
    ids, mask = left_padded([4, 13], seed=2)
    with torch.no_grad():
        model(ids, attention_mask=mask, **H.cache_kwargs(model, cache))
    # every real token's slot holds a key (LayerNorm'd: never all zeros), no other slot does
    table, lens = cache.block_table, cache.seq_lens()
    for b, n in enumerate(lens):
        slots = [int(table[b, j // 8]) * 8 + j % 8 for j in range(n)]
        rows = cache.index_keys[1].view(-1, cfg.index_head_dim)
        assert bool((rows[slots].abs().sum(-1) > 0).all())
    assert int((cache.index_keys[1].abs().sum(-1) > 0).sum()) == sum(lens)


# ------------------------------------------------------------------ the indexer's choice


@pytest.mark.parametrize("chunked", [False, True])
def test_select_slots_matches_a_float64_brute_force(chunked, monkeypatch):
    import mla_ops.hf.dsa as dsa
    if chunked:                                   # one query token per chunk of scores
        monkeypatch.setattr(dsa, "SCORE_ELEMENTS", 1)
    g = torch.Generator().manual_seed(0)
    B, S, Hi, Di, bs, M, nb, topk = 3, 4, 5, 32, 4, 6, 20, 7
    q = torch.randn(B, S, Hi, Di, generator=g)
    w = torch.randn(B, S, Hi, generator=g)
    pool = torch.randn(nb, bs, Di, generator=g)
    table = torch.randperm(nb, generator=g)[:B * M].view(B, M).to(torch.int32)
    table[2, 3:] = -1                                       # a short row: no blocks past 3
    lens_new = torch.tensor([17, 1, 9])                     # row 1: one token, length 1
    seq_lens = torch.tensor([17, 4, 11], dtype=torch.int32)  # row 1, 2: trailing pads
    got = select_slots(q, w, pool, table, seq_lens, lens_new, topk, Di ** -0.5)
    assert got.shape == (B * S, topk) and got.dtype == torch.int32
    for b in range(B):
        for i in range(S):
            pos = int(seq_lens[b]) - S + i
            n = min(pos, int(lens_new[b]) - 1) + 1
            slots = [int(table[b, j // bs]) * bs + j % bs for j in range(max(n, 0))]
            keys = pool.double().view(-1, Di)[slots]                        # [n, Di]
            s = torch.relu(q[b, i].double() @ keys.T * Di ** -0.5)          # [Hi, n]
            score = w[b, i].double() @ s                                    # [n]
            want = {slots[j] for j in score.argsort(descending=True)[:topk].tolist()}
            row = got[b * S + i].tolist()
            assert {x for x in row if x >= 0} == want, (b, i)
            assert row.count(-1) == topk - len(want)


# ------------------------------------------------------------------ the sparse op


def sparse_reference64(q, kv, idx, scale, L, k_scale=1.0):
    """float64: per row, softmax over the listed cache rows (-1: none); empty -> 0, -inf."""
    flat = kv.double().reshape(-1, kv.shape[-1]) * k_scale
    T, Hh, _ = q.shape
    out = torch.zeros(T, Hh, L, dtype=torch.float64)
    lse = torch.full((T, Hh), float("-inf"), dtype=torch.float64)
    for t in range(T):
        rows = [int(i) for i in idx[t] if i >= 0]
        if not rows:
            continue
        k = flat[rows]                                                       # [n, D]
        s = q[t].double() @ k.T * scale                                      # [H, n]
        lse[t] = torch.logsumexp(s, -1)
        out[t] = torch.softmax(s, -1) @ k[:, :L]
    return out, lse


def random_indices(g, T, K, n):
    idx = torch.stack([torch.randperm(n, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    idx[torch.rand(T, K, generator=g) < 0.3] = -1            # holes anywhere in the list
    idx[0, :] = -1                                           # no token at all
    idx[1, :] = -1
    idx[1, K // 2] = 5                                       # a context of one token
    return idx


# CPU tensors through the Triton kernels: the interpreter, which conftest turns on only
# where there is no CUDA device (on a GPU machine the bf16 kernel runs on CUDA in
# test_gpu_sparse_decode_triton_matches_reference_at_scale)
INTERPRETER = pytest.mark.skipif(
    torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="CPU tensors through the Triton interpreter, off on a CUDA machine")


@pytest.mark.parametrize("backend,dtype,kind", [
    ("reference", torch.float32, "auto"),
    pytest.param("triton", torch.bfloat16, "auto", marks=INTERPRETER),
    pytest.param("triton", torch.bfloat16, "fp8", marks=INTERPRETER),
])
def test_sparse_decode_matches_float64(backend, dtype, kind):
    g = torch.Generator().manual_seed(1)
    T, Hh, L, R, nb, bs, K = 6, 16, 512, 64, 7, 5, 19          # K, bs: no block multiples
    q = torch.randn(T, Hh, L + R, generator=g).to(dtype)
    kv = torch.randn(nb, bs, L + R, generator=g)
    k_scale = None
    if kind == "fp8":
        k_scale = torch.tensor([0.02])
        kv = (kv / 0.02).clamp(-448, 448).to(torch.float8_e4m3fn)
    else:
        kv = kv.to(dtype)
    idx = random_indices(g, T, K, nb * bs)
    scale = (128 + 64) ** -0.5
    out, lse = mla_sparse_decode(q, kv, idx, scale, kv_cache_dtype=kind, k_scale=k_scale,
                                 head_dim_v=L, backend=backend)
    exp, exp_lse = sparse_reference64(q, kv.float(), idx, scale, L,
                                      0.02 if kind == "fp8" else 1.0)
    assert out.shape == (T, Hh, L) and out.dtype == dtype and lse.shape == (T, Hh)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert (out.double() - exp).abs().max() <= tol * max(1.0, exp.abs().max().item())
    assert torch.equal(out[0], torch.zeros_like(out[0]))                   # empty row
    assert torch.isinf(lse[0]).all() and torch.isinf(exp_lse[0]).all()
    fin = torch.isfinite(exp_lse)
    assert (lse.double()[fin] - exp_lse[fin]).abs().max() <= 1e-3
    assert fin[2:].all() and (out[1].double() - exp[1]).abs().max() <= tol * 10


def test_sparse_decode_rejects_bad_arguments():
    q = torch.randn(2, 4, 576)
    kv = torch.randn(3, 4, 576)
    idx = torch.zeros(2, 5, dtype=torch.int32)
    with pytest.raises(ValueError, match="indices"):
        mla_sparse_decode(q, kv, idx[:1], 0.1)
    with pytest.raises(TypeError, match="indices"):
        mla_sparse_decode(q, kv, idx.float(), 0.1)
    with pytest.raises(ValueError, match="row width"):
        mla_sparse_decode(q, kv[..., :512].contiguous(), idx, 0.1)
    with pytest.raises(ValueError, match="softmax_scale"):
        mla_sparse_decode(q, kv, idx, -1.0)
    with pytest.raises(ValueError, match="backend"):
        mla_sparse_decode(q, kv, idx, 0.1, backend="flashmla")
    with pytest.raises(ValueError, match="triton"):          # fp32 query: no Triton route
        mla_sparse_decode(q, kv, idx, 0.1, backend="triton")
    with pytest.raises(TypeError, match="kv_cache"):
        mla_sparse_decode(q, kv.bfloat16(), idx, 0.1)


def test_convert_refusals():
    ref, model = build_v32_pair(tiny_v32_config(), seed=2)
    with pytest.raises(ValueError, match="fp8_decode_query"):
        H.convert(model, fp8_decode_query=1.0)
    assert not H.is_converted(model)
    with pytest.raises(TypeError, match="deepseek_v32"):
        H.convert(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    # a cache built from a config without the indexer cannot serve the converted model
    from hf_models import tiny_config
    H.convert(model)
    cache = H.PagedMLACache(tiny_config("v3"), max_batch_size=1, max_cache_len=16)
    with pytest.raises(ValueError, match="indexer"), torch.no_grad():
        model(torch.tensor([[5, 6, 7]]), **H.cache_kwargs(model, cache))


# ------------------------------------------------------------------ torch.compile


def test_compiled_decode_fullgraph_one_graph_no_breaks():
    from torch._dynamo.backends.registry import lookup_backend
    from transformers.generation.configuration_utils import CompileConfig
    graphs = []

    def backend(gm, example_inputs, **kw):
        graphs.append(gm)
        return lookup_backend("aot_eager")(gm, example_inputs)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    ref, model = build_v32_pair(tiny_v32_config(index_topk=8), seed=3)
    H.convert(model)
    ids, mask = left_padded([6, 19, 13])
    cc = CompileConfig(fullgraph=True, dynamic=False, backend=backend, mode=None)
    cc._compile_all_devices = True                    # CPU too
    cache = H.PagedMLACache(model.config, max_batch_size=3, max_cache_len=64, block_size=16)
    kw = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, output_logits=True,
              return_dict_in_generate=True)
    try:
        with torch.no_grad():
            out = model.generate(ids, compile_config=cc, **H.cache_kwargs(model, cache), **kw)
            exp = ref.generate(ids, **kw)
        assert len(graphs) == 1, f"{len(graphs)} graphs: the decode step recompiled"
        assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
        ops = {str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"}
        assert any("sparse_decode" in o for o in ops)
        assert torch.equal(out.sequences, exp.sequences)
        assert max(logit_err(a, b) for a, b in zip(out.logits, exp.logits)) <= TOL
    finally:
        torch._dynamo.reset()


# ------------------------------------------------------------------ DecodeGraph

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKEND = os.environ.get("MLA_HF_COMPILE_BACKEND", "inductor" if DEVICE == "cuda" else "aot_eager")


def test_decode_graph_matches_hf_generate():
    """DecodeGraph's compiled step (captured in a CUDA graph on a GPU; fp32, so the sparse
    op's reference route) gives HF's greedy tokens."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    ref, model = build_v32_pair(tiny_v32_config(index_topk=8, moe=False), seed=4)
    ref, model = ref.to(DEVICE), H.convert(model).to(DEVICE)
    ids, mask = (t.to(DEVICE) for t in left_padded([5, 21, 12], seed=4))
    cache = H.PagedMLACache(model.config, max_batch_size=3, max_cache_len=64, block_size=16,
                            device=DEVICE)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    try:
        with torch.no_grad():
            first = model(input_ids=ids, attention_mask=mask, position_ids=pos,
                          **H.cache_kwargs(model, cache)).logits[:, -1].argmax(-1)  # [B]
            exp = ref.generate(ids, attention_mask=mask, max_new_tokens=25, do_sample=False)
        runner = H.DecodeGraph(model, cache, backend=BACKEND)
        got = runner.greedy(first, 24)                                          # [B, 24]
        assert runner.graph_enabled == (DEVICE == "cuda")
        assert torch.equal(first, exp[:, ids.shape[1]])
        assert torch.equal(got, exp[:, ids.shape[1] + 1:])
        assert cache.seq_lens() == [5 + 24, 21 + 24, 12 + 24]
        assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
    finally:
        torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_bf16_decode_graph_matches_compiled_generate():
    """bf16, pages of 64: the sparse op's Triton route inside the captured step; its
    replays give the tokens of compiled generate(). The two are separate compilations, and
    the indexer's weighted-ReLU scores tie exactly (at 0) for many keys, so a bf16 rounding
    difference may flip a tie late in the run: the first steps must agree exactly, and
    most tokens overall."""
    from hf_models import graph_and_generate_tokens
    _, model = build_v32_pair(tiny_v32_config(index_topk=8, moe=False), seed=0,
                              dtype=torch.bfloat16)
    model = H.convert(model).cuda()
    ids, mask = (t.cuda() for t in left_padded(LENGTHS))
    cache = H.PagedMLACache(model.config, max_batch_size=3, max_cache_len=96, block_size=64,
                            device="cuda", dtype=torch.bfloat16)
    assert v32.selects(cache, 1, 8)                    # decode steps take the sparse branch
    _, got, exp = graph_and_generate_tokens(model, ids, mask, cache, 24)
    assert torch.equal(got[:, :4], exp[:, :4])
    assert (got == exp).float().mean().item() >= 0.75


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_sparse_decode_triton_matches_reference_at_scale():
    g = torch.Generator(device="cuda").manual_seed(0)
    T, Hh, K, nb, bs = 8, 128, 2048, 600, 64
    q = torch.randn(T, Hh, 576, device="cuda", generator=g).bfloat16()
    kv = torch.randn(nb, bs, 576, device="cuda", generator=g).bfloat16()
    idx = torch.randint(0, nb * bs, (T, K), device="cuda", generator=g, dtype=torch.int32)
    idx[:, K - 100:] = -1
    idx[0, 1:] = -1
    a, la = mla_sparse_decode(q, kv, idx, 0.07, head_dim_v=512, backend="triton")
    b, lb = mla_sparse_decode(q, kv, idx, 0.07, head_dim_v=512, backend="reference")
    assert (a.float() - b.float()).abs().max() <= 2e-2
    assert (la - lb).abs().max() <= 1e-3


@INTERPRETER
def test_sparse_decode_benchmark_runs_on_cpu():
    """The benchmark's rows at a tiny shape (a plain timer instead of CUDA graphs), so the
    GPU run finds no error in its own code; the sparse rows agree with the reference."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_sparse_decode.py"
    spec = importlib.util.spec_from_file_location("bench_sparse_decode", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.bench_shape(2, 16, 256, 48, True, lambda msg: None, device="cpu",
                             timer=lambda fn: 1.0)
    by = {r["impl"]: r for r in rows}
    assert set(by) == {"dense triton", "sparse", "sparse[kernel only]", "indexer (torch)",
                       "indexer (ours)", "indexer[kernel only]"}
    assert by["indexer (ours)"]["same"] >= 0.99
    assert by["sparse"]["rel_err"] <= 2e-2 and by["sparse[kernel only]"]["rel_err"] <= 2e-2
    assert by["sparse"]["bytes"] == 2 * 48 * (576 * 2 + 4)
    assert by["dense triton"]["bytes"] == 2 * 256 * 576 * 2
