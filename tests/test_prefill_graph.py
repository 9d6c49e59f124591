"""mla_ops.hf.PrefillGraph: prefill chunks padded to shape buckets and replayed from CUDA
graphs (GPU) or run padded and eagerly (CPU). Against HF's own forward on a DynamicCache
and the converted model's unpadded forward: same logits, same cache state; the bucketed
prefill shape (bounds, not exact lengths) gives the exact shape's result; bad input and a
full cache are refused before anything is written."""
from __future__ import annotations

import warnings

import pytest
import torch

import mla_ops.hf as H
from hf_models import cache_kw, build_pair, left_padded, logit_err, tiny_config
from lowering.prefill import PrefillShape, mla_prefill, prefill_shape
from mla_ops.attention import check_prefill_shape
from mla_ops.cache import CacheFullError
from mla_ops.hf.prefill_graph import bucket
from mla_reference import rel_err
from prefill_cases import make_prefill_case

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 1e-4


def setup(family="v3", moe=True, lengths=(5, 21, 12), max_cache_len=96, seed=4,
          dtype=torch.float32):
    """HF's model on a DynamicCache and two converted copies' PagedMLACaches (one for the
    unpadded forward, one for PrefillGraph), all after the same left-padded first turn."""
    from transformers import DynamicCache
    cfg = tiny_config(family, q_lora_rank=None if family == "v2" else 192)
    if not moe:
        cfg.first_k_dense_replace = cfg.num_hidden_layers
    ref, model = build_pair(cfg, seed=seed)
    ref, model = ref.to(DEVICE, dtype), H.convert(model).to(DEVICE, dtype)
    ids, mask = (t.to(DEVICE) for t in left_padded(list(lengths), seed=seed))
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    hf_cache = DynamicCache(config=cfg)
    caches = [H.PagedMLACache(model.config, max_batch_size=len(lengths),
                              max_cache_len=max_cache_len, block_size=16, device=DEVICE,
                              dtype=dtype)
              for _ in range(2)]
    with torch.no_grad():
        ref(input_ids=ids, attention_mask=mask, position_ids=pos, **cache_kw(hf_cache))
        for c in caches:
            model(input_ids=ids, attention_mask=mask, position_ids=pos,
                  **H.cache_kwargs(model, c))
    return ref, model, hf_cache, caches, mask


def turn(ref, model, hf_cache, plain, mask, new_ids, new_mask=None):
    """The next chunk through HF and the converted model's unpadded forward ->
    (HF's last logits, ours, the full mask after it)."""
    B, S = new_ids.shape
    new_mask = torch.ones_like(new_ids) if new_mask is None else new_mask
    full = torch.cat((mask, new_mask), 1)                                # [B, K + S]
    pos = ((full.cumsum(-1) - 1).clamp(min=0))[:, -S:]
    with torch.no_grad():
        exp = ref(input_ids=new_ids, attention_mask=full, position_ids=pos,
                  **cache_kw(hf_cache)).logits[:, -1]
        got = model(input_ids=new_ids, attention_mask=full, position_ids=pos,
                    **H.cache_kwargs(model, plain)).logits[:, -1]
    return exp, got, full


def same_state(a, b, tol=1e-5):
    """Same bookkeeping, and the same cache rows (bf16: within a few roundings; the padded
    chunk's GEMMs have other shapes than the unpadded one's, e.g. 16 rows on cuBLAS against
    one token a row on the decode GEMM kernels, and the second layer's rows carry the
    first layer's differences)."""
    assert a.seq_lens() == b.seq_lens()
    assert int(a.seen) == int(b.seen) and int(a.num_used) == int(b.num_used)
    assert torch.equal(a.block_table, b.block_table)
    for la, lb in zip(a.pool.kv, b.pool.kv):
        assert torch.allclose(la.float(), lb.float(), atol=tol, rtol=tol)


# MoE models in bf16 on CUDA: there the converted block's prefill experts are our
# grouped path (capturable); fp32 MoE blocks run HF's experts (see the fallback test).
MOE_DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
CASES = [("v3", True, MOE_DTYPE), ("v3", False, torch.float32), ("v2", True, MOE_DTYPE)]


@pytest.mark.parametrize("family,moe,dtype", CASES)
def test_chunks_match_hf_and_the_unpadded_forward(family, moe, dtype):
    tol = TOL if dtype == torch.float32 else 3e-2
    ref, model, hf_cache, (plain, cache), mask = setup(family, moe, dtype=dtype)
    runner = H.PrefillGraph(model, cache)
    g = torch.Generator().manual_seed(7)
    B = mask.shape[0]
    # turn 2: 7 new tokens a row (bucket 16); turn 3: 12 with left pads (same bucket);
    # turn 4: 1 token a row (bucket 16 again, context bucket grown past 32)
    steps = [(7, None), (12, [0, 3, 11]), (1, None), (20, [2, 0, 0])]
    for S, pads in steps:
        new = torch.randint(3, 256, (B, S), generator=g).to(DEVICE)
        new_mask = None
        if pads is not None:
            new_mask = torch.ones(B, S, dtype=torch.long, device=DEVICE)
            for b, p in enumerate(pads):
                new_mask[b, :p] = 0
                new[b, :p] = 0
        exp, got, full = turn(ref, model, hf_cache, plain, mask, new, new_mask)
        with torch.no_grad():
            out = runner(new, full if new_mask is not None else None)   # [B, 1, V]
        assert out.shape == (B, 1, exp.shape[-1])
        assert logit_err(out[:, -1], got) < tol
        assert logit_err(out[:, -1], exp) < tol
        same_state(cache, plain, tol=1e-5 if dtype == torch.float32 else 6e-2)
        mask = full
    # contexts 21..41 are bounded by max_cache_len (96); new tokens by 16 and 32
    assert set(runner.chunks) == {(B, 16, 96), (B, 32, 96)}
    for chunk in runner.chunks.values():
        assert (chunk.graph is not None) == (DEVICE == "cuda") and not chunk.eager


def test_replay_serves_later_calls_of_a_bucket():
    ref, model, hf_cache, (plain, cache), mask = setup("v3", False, lengths=(9, 4))
    runner = H.PrefillGraph(model, cache)
    g = torch.Generator().manual_seed(3)
    for S in (5, 11, 16, 9):                          # one bucket of 16 new tokens
        new = torch.randint(3, 256, (2, S), generator=g).to(DEVICE)
        exp, got, mask = turn(ref, model, hf_cache, plain, mask, new)
        with torch.no_grad():
            out = runner(new).clone()
        assert logit_err(out[:, -1], exp) < TOL
        same_state(cache, plain)
    # new tokens 5..16 and contexts 9..41 all round up to one bucket: one capture
    assert list(runner.chunks) == [(2, 16, 96)]


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs")
def test_uncapturable_chunk_warns_and_runs_eagerly():
    # fp32 MoE blocks run HF's experts, which copy from the host inside the forward
    ref, model, hf_cache, (plain, cache), mask = setup("v3", True, lengths=(6, 2))
    runner = H.PrefillGraph(model, cache)
    g = torch.Generator().manual_seed(2)
    for S, warns in ((5, True), (8, False)):          # one bucket: one warning
        new = torch.randint(3, 256, (2, S), generator=g).to(DEVICE)
        exp, got, mask = turn(ref, model, hf_cache, plain, mask, new)
        if warns:
            with pytest.warns(RuntimeWarning, match="cannot be captured"):
                out = runner(new)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                out = runner(new)
        assert logit_err(out[:, -1], exp) < TOL
        same_state(cache, plain)
    (chunk,) = runner.chunks.values()
    assert chunk.eager and chunk.graph is None


def test_long_chunks_run_eagerly_unpadded():
    ref, model, hf_cache, (plain, cache), mask = setup("v3", False, lengths=(3,))
    runner = H.PrefillGraph(model, cache, max_tokens=16)
    new = torch.randint(3, 256, (1, 17), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    exp, got, _ = turn(ref, model, hf_cache, plain, mask, new)
    with torch.no_grad():
        out = runner(new)
    assert logit_err(out[:, -1], exp) < TOL and not runner.chunks
    same_state(cache, plain)


def test_bad_input_and_full_cache_refused_before_writing():
    ref, model, hf_cache, (plain, cache), mask = setup("v3", False, lengths=(5, 7),
                                                       max_cache_len=40)
    runner = H.PrefillGraph(model, cache)
    before = [t.clone() for t in cache.state()]
    ids = torch.randint(3, 256, (2, 4), device=DEVICE)
    with pytest.raises(TypeError, match="input_ids must be int64"):
        runner(ids.float())
    with pytest.raises(ValueError, match=r"\[B, S\]"):
        runner(ids[0])
    with pytest.raises(ValueError, match="max_batch_size=2"):
        runner(torch.randint(3, 256, (3, 4), device=DEVICE))
    with pytest.raises(ValueError, match="no real token"):
        runner(ids, torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0]], device=DEVICE))
    with pytest.raises(ValueError, match="attention_mask"):
        runner(ids, torch.ones(2, 3, device=DEVICE))
    with pytest.raises(ValueError, match="max_cache_len=40"):
        runner(torch.randint(3, 256, (2, 34), device=DEVICE))
    for t, b in zip(cache.state(), before):
        assert torch.equal(t, b)
    with pytest.raises(TypeError, match="converted"):
        H.PrefillGraph(ref, cache)
    with pytest.raises(ValueError, match="max_tokens"):
        H.PrefillGraph(model, cache, max_tokens=4)


def test_full_pool_raises_cache_full():
    cfg = tiny_config("v3")
    cfg.first_k_dense_replace = cfg.num_hidden_layers
    _, model = build_pair(cfg, seed=1)
    model = H.convert(model).to(DEVICE)
    cache = H.PagedMLACache(model.config, max_batch_size=2, max_cache_len=64, block_size=16,
                            num_blocks=3, device=DEVICE)
    runner = H.PrefillGraph(model, cache)
    with pytest.raises(CacheFullError, match="num_blocks"):
        runner(torch.randint(3, 256, (2, 20), device=DEVICE))
    assert cache.seq_lens() == [0, 0] and int(cache.num_used) == 0


def test_bucket():
    assert [bucket(n, 16, 1000) for n in (0, 1, 16, 17, 500, 513, 999)] == \
        [0, 16, 16, 32, 512, 1000, 1000]


# -- the bounded prefill shape (lowering) ------------------------------------------------

@pytest.mark.parametrize("q_lens,ctx_lens,ws", [([7, 13, 2], [30, 0, 17], 12),
                                                ([5, 5], [24, 24], 16), ([9], [0], 8)])
def test_bounded_shape_gives_the_exact_shapes_result(q_lens, ctx_lens, ws):
    c = make_prefill_case(q_lens, ctx_lens, dtype=torch.float32, seed=5)
    exact = prefill_shape(c.query_start_loc, c.seq_lens, 0)
    bound = PrefillShape(exact.num_requests, exact.max_query_len + 5,
                         exact.max_context_len + 19, 0)
    a = mla_prefill(*c.args(ws), exact, route="reference", kernels="torch")
    b = mla_prefill(*c.args(ws), bound, route="reference", kernels="torch")
    assert rel_err(b, a) < 1e-5


def test_prefill_shape_check_takes_bounds_and_refuses_less():
    c = make_prefill_case([7, 13, 2], [30, 0, 17], dtype=torch.float32, seed=2)
    args = (c.q, c.seq_lens, c.query_start_loc, 0)
    check_prefill_shape([3, 13, 30, 0], *args)
    check_prefill_shape([3, 32, 64, 0], *args)
    for bad in ([2, 13, 30, 0], [3, 12, 30, 0], [3, 13, 29, 0], [3, 13, 30, 1]):
        with pytest.raises(ValueError, match="does not fit"):
            check_prefill_shape(bad, *args)


# -- generate() on a cache with a PrefillGraph -------------------------------------------

def test_generate_runs_its_prefill_through_the_caches_runner(monkeypatch):
    """Two turns of a chat with generate() on a user's cache: with a PrefillGraph on the
    cache both prefills go through it (on CPU: generate()'s graphs let in on CPU caches,
    the runner padded and eager), with the same tokens and logits as without."""
    from mla_ops.hf import generate_graph as GG
    from mla_ops.hf.prefill_graph import PrefillGraph
    monkeypatch.setattr(GG, "DEVICES", ("cuda", "cpu"))
    calls = []
    run = PrefillGraph.__call__

    def counted(self, ids, mask=None):
        calls.append(tuple(ids.shape))
        return run(self, ids, mask)
    monkeypatch.setattr(PrefillGraph, "__call__", counted)
    cfg = tiny_config("v3")
    cfg.first_k_dense_replace = cfg.num_hidden_layers
    _, model = build_pair(cfg, seed=2)
    model = H.convert(model).to(DEVICE)
    ids, mask = (t.to(DEVICE) for t in left_padded([6, 11], seed=8))
    caches = [H.PagedMLACache(model.config, max_batch_size=2, max_cache_len=64, block_size=16,
                              device=DEVICE) for _ in range(2)]
    PrefillGraph(model, caches[1])
    outs = []
    for cache in caches:
        seqs, m, logits = ids, mask, []
        for turn_len in (None, 5):                      # the prompt, then a next turn
            if turn_len is not None:
                more = torch.randint(3, 256, (2, turn_len), generator=torch.Generator()
                                     .manual_seed(turn_len)).to(DEVICE)
                seqs = torch.cat((seqs, more), 1)
                m = torch.cat((m, torch.ones_like(more)), 1)
            with torch.no_grad():
                out = model.generate(seqs, attention_mask=m, max_new_tokens=4, do_sample=False,
                                     disable_compile=True, output_logits=True,
                                     return_dict_in_generate=True, **H.cache_kwargs(model, cache))
            m = torch.cat((m, torch.ones_like(out.sequences[:, seqs.shape[1]:])), 1)
            seqs = out.sequences
            logits += list(out.logits)
        outs.append((seqs, logits, cache.seq_lens()))
    assert calls == [(2, 11), (2, 6)]      # both prefills: the prompt; last token + 5 new
    assert torch.equal(outs[0][0], outs[1][0]) and outs[0][2] == outs[1][2]
    for a, b in zip(outs[0][1], outs[1][1]):
        assert logit_err(a, b) < TOL
