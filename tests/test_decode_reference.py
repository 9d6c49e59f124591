"""lowering.mla_decode (reference backend) vs the float64 dense reference; contract and errors."""
import pytest
import torch

import lowering
from mla_reference import decode_ref64


def paged_problem(B, s_q, H, L, R, lens, bs, dtype=torch.float32, fp8=False, seed=0):
    """Random q and a paged cache holding each request's rows in shuffled blocks.

    Returns q, cache, block_table, cache_seqlens, k_scale and the dequantized cache."""
    g = torch.Generator().manual_seed(seed)
    D = L + R
    need = [-(-n // bs) for n in lens]
    nb = sum(need) + 2
    perm = torch.randperm(nb, generator=g)
    table = torch.full((B, max(need)), -1, dtype=torch.int32)
    k_scale = torch.tensor([0.03])
    raw = torch.randn(nb, bs, D, generator=g) * 2
    cache = ((raw / 0.03).clamp(-448, 448).to(torch.float8_e4m3fn) if fp8 else raw.to(dtype))
    deq = cache.float() * 0.03 if fp8 else cache.float()
    used = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[used:used + n].int()
        used += n
    q = torch.randn(B, s_q, H, D, generator=g).to(dtype)
    return q, cache, table, torch.tensor(lens, dtype=torch.int32), k_scale, deq


@pytest.mark.parametrize("lens,s_q,bs", [
    ([1], 1, 4),              # seq_len 1
    ([7, 13, 1], 1, 4),       # not multiples of block size
    ([5, 9], 3, 4),           # multi-token causal
    ([64, 65], 1, 64),
    ([20, 3], 2, 1),          # block size 1
])
def test_reference_decode_matches_dense(lens, s_q, bs):
    q, cache, table, seqlens, _, deq = paged_problem(len(lens), s_q, 3, 32, 16, lens, bs)
    out, lse = lowering.mla_decode(q, cache, table, seqlens, 0.2, backend="reference", head_dim_v=32)
    ref_out, ref_lse = decode_ref64(q, deq, table, seqlens, 0.2, True, 32)
    assert out.shape == (len(lens), s_q, 3, 32) and lse.shape == (len(lens), 3, s_q)
    assert lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)


def test_non_causal_and_default_head_dim_v():
    q, cache, table, seqlens, _, deq = paged_problem(2, 2, 2, 64, 64, [6, 9], 4)
    out, lse = lowering.mla_decode(q, cache, table, seqlens, 0.1, causal=False)
    ref_out, ref_lse = decode_ref64(q, deq, table, seqlens, 0.1, False, 64)
    assert out.shape[-1] == 64     # default head_dim_v = D - 64
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)


def test_fp8_cache_vs_dequantized_reference():
    q, cache, table, seqlens, k_scale, deq = paged_problem(2, 1, 4, 32, 16, [11, 4], 4, fp8=True)
    out, lse = lowering.mla_decode(q, cache, table, seqlens, 0.2, kv_cache_dtype="fp8",
                                   k_scale=k_scale, head_dim_v=32)
    ref_out, ref_lse = decode_ref64(q, deq, table, seqlens, 0.2, True, 32)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)


def test_auto_on_cpu_is_reference_and_recorded():
    q, cache, table, seqlens, _, _ = paged_problem(1, 1, 2, 32, 16, [5], 4)
    before = lowering.backend_choices["reference"]
    lowering.mla_decode(q, cache, table, seqlens, 0.2, head_dim_v=32)
    assert lowering.backend_choices["reference"] == before + 1
    assert lowering.select_backend(q, cache) == "reference"


def test_bad_input():
    q, cache, table, seqlens, k_scale, _ = paged_problem(2, 1, 2, 32, 16, [5, 3], 4)
    def dec(*a, **k):
        return lowering.mla_decode(*a, head_dim_v=32, **k)

    cases = [
        (lambda: dec(q[0], cache, table, seqlens, 0.2), ValueError, "q must have 4 dims"),
        (lambda: dec(q[..., :-1], cache, table, seqlens, 0.2), ValueError, "head size"),
        (lambda: dec(q, cache, table.long(), seqlens, 0.2), TypeError, "block_table"),
        (lambda: dec(q, cache, table, seqlens.long(), 0.2), TypeError, "cache_seqlens"),
        (lambda: dec(q, cache, table[:1], seqlens, 0.2), ValueError, "block_table"),
        (lambda: dec(q, cache, table, seqlens + 100, 0.2), ValueError, "exceeds the blocks"),
        (lambda: dec(q, cache, table + 50, seqlens, 0.2), ValueError, "block ids"),
        (lambda: dec(q, cache.half(), table, seqlens, 0.2), TypeError, "kv_cache dtype"),
        (lambda: dec(q, cache, table, seqlens, -1.0), ValueError, "softmax_scale"),
        (lambda: dec(q, cache, table, seqlens, 0.2, kv_cache_dtype="fp8"), TypeError, "float8"),
        (lambda: dec(q, cache.transpose(0, 1), table, seqlens, 0.2), ValueError, "contiguous"),
        (lambda: dec(q, cache, table, seqlens, 0.2, backend="nope"), ValueError, "backend"),
        (lambda: lowering.mla_decode(q, cache, table, seqlens, 0.2), ValueError, "head_dim_v"),
        (lambda: dec(q[:, :1].expand(2, 6, 2, 48), cache, table, seqlens, 0.2), ValueError, "s_q"),
    ]
    for fn, exc, match in cases:
        with pytest.raises(exc, match=match):
            fn()
    sched = lambda *a, **k: lowering.decode_schedule(*a, **k)                # noqa: E731
    for fn, exc, match in [
        (lambda: sched(cache, table.long(), seqlens, num_heads=2), TypeError, "block_table"),
        (lambda: sched(cache, table, seqlens[:1], num_heads=2), ValueError, "cache_seqlens"),
        (lambda: sched(cache[0], table, seqlens, num_heads=2), ValueError, "kv_cache"),
        (lambda: sched(cache, table, seqlens, num_heads=0), ValueError, "num_heads"),
    ]:
        with pytest.raises(exc, match=match):
            fn()
    assert not lowering.uses_flashmla(q.device, q.dtype, 2, 48, 4)   # CPU: never FlashMLA
    assert not lowering.uses_flashmla(q.device, torch.float8_e4m3fn, 2, 48, 4,
                                      kv_cache_dtype="fp8")
    if "flashmla" in lowering.BACKENDS and not torch.cuda.is_available():
        with pytest.raises(lowering.BackendUnavailable, match="flashmla"):
            dec(q, cache, table, seqlens, 0.2, backend="flashmla")


def test_unchecked_values_are_bounded_not_read_out_of_range():
    """Without the value checks (a CUDA call with validation off, or under capture) bad
    lengths and block ids reach the route: the reference's inputs are clamped into the
    cache first, so a bad value gives the rows of the clamped inputs, never an error or
    a read outside the cache."""
    from lowering.decode.entry import clamp_decode_inputs, run_decode
    from lowering.decode.registry import DecodeCall
    q, cache, table, seqlens, _, _ = paged_problem(2, 1, 2, 32, 16, [5, 3], 4)
    bad_table, bad_lens = table - 100, seqlens + 1000
    bt, lens = clamp_decode_inputs(cache, bad_table, bad_lens)
    assert int(bt.min()) >= 0 and int(bt.max()) < cache.shape[0]
    assert int(lens.max()) <= table.shape[1] * cache.shape[1]
    got = run_decode(DecodeCall(q, cache, bad_table, bad_lens, 0.2, True, "auto", None, 32),
                     "bf16", "reference")
    want = lowering.mla_decode(q, cache, bt, lens, 0.2, backend="reference", head_dim_v=32)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.isfinite(got[0]).all()


def test_value_checks_on_cpu_always_run():
    """validate=False (or the setting off) skips the host value checks of CUDA inputs
    only: CPU inputs are checked without a device sync, so they always are."""
    from lowering import config
    from lowering.checks import wants_value_checks
    q, cache, table, seqlens, _, _ = paged_problem(2, 1, 2, 32, 16, [5, 3], 4)
    for validate in (None, False, True):
        assert wants_value_checks(q, validate)
        with pytest.raises(ValueError, match="exceeds the blocks"):
            lowering.mla_decode(q, cache, table, seqlens + 100, 0.2, head_dim_v=32,
                                validate=validate)
    with config.patch(validate=False):
        with pytest.raises(ValueError, match="block ids"):
            lowering.mla_decode(q, cache, table + 50, seqlens, 0.2, head_dim_v=32)
    assert not wants_value_checks(q.to("meta"), False)
    with config.patch(validate=True):
        assert wants_value_checks(q.to("meta"))
    assert wants_value_checks(q.to("meta"), True) and not wants_value_checks(q.to("meta"))


def test_bounded_inputs_skip_the_per_call_clamps(monkeypatch):
    """bound_decode_inputs clamps; a call told its inputs are bounded (bounded=True)
    launches no clamps of its own, with the same result; any other call to a route
    whose kernels do not bound their inputs clamps them."""
    import lowering.decode.entry
    q, cache, table, seqlens, _, _ = paged_problem(2, 1, 2, 32, 16, [5, 3], 4)
    bt, lens = lowering.bound_decode_inputs(cache, table - 100, seqlens + 1000)
    assert int(bt.min()) == 0 and int(bt.max()) < cache.shape[0]
    assert int(lens.max()) == table.shape[1] * cache.shape[1]
    assert int(table.min()) == -1                     # no block past row 1's first
    bt, lens = lowering.bound_decode_inputs(cache, table, seqlens)
    assert torch.equal(lens, seqlens) and int(bt.min()) == 0
    want = lowering.mla_decode(q, cache, bt, lens, 0.2, backend="reference", head_dim_v=32)
    monkeypatch.setattr(lowering.decode.entry, "clamp_decode_inputs",
                        lambda *a: pytest.fail("a bounded call clamped its inputs again"))
    got = lowering.mla_decode(q, cache, bt, lens, 0.2, backend="reference", bounded=True,
                             head_dim_v=32)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(pytest.fail.Exception, match="clamped"):
        lowering.mla_decode(q, cache, bt, lens, 0.2, backend="reference", head_dim_v=32)
    bound = lowering.bound_decode_inputs
    for fn, exc, match in [
        (lambda: bound(cache, table.long(), seqlens), TypeError, "block_table"),
        (lambda: bound(cache, table, seqlens[:1]), ValueError, "cache_seqlens"),
        (lambda: bound(cache[0], table, seqlens), ValueError, "kv_cache"),
        (lambda: bound(cache, table, seqlens.tolist()), TypeError, "cache_seqlens"),
    ]:
        with pytest.raises(exc, match=match):
            fn()


def test_mla_decode_compiles_fullgraph():
    """mla_decode inside torch.compile(fullgraph=True): no graph break (the host value
    checks give way to in-graph clamps while tracing), the eager result, and one
    compilation across changing lengths."""
    q, cache, table, seqlens, _, deq = paged_problem(3, 2, 4, 32, 16, [9, 5, 14], 4)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()

    def step(q, cache, table, seqlens):
        out, lse = lowering.mla_decode(q * 1.0, cache, table, seqlens, 0.2, head_dim_v=32)
        return out.sum(-1), lse

    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    for lens in ([9, 5, 14], [8, 2, 13], [2, 2, 3]):
        seqlens.copy_(torch.tensor(lens, dtype=torch.int32))
        got, want = compiled(q, cache, table, seqlens), step(q, cache, table, seqlens)
        torch.testing.assert_close(got, want)
        ref, ref_lse = decode_ref64(q, deq, table, seqlens, 0.2, True, 32)
        torch.testing.assert_close(got[1].double(), ref_lse, rtol=0, atol=1e-5)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert not torch._dynamo.utils.counters["graph_break"]


def test_route_table():
    """One table for both entries: explicit priorities, auto order as documented, one
    unmet() per route; an unknown backend is a ValueError naming the choices."""
    from lowering import config
    from lowering.decode.registry import ROUTES, TABLE, DecodeCall, choose_route, route_unmet
    assert lowering.BACKENDS == ("flashmla", "gluon", "triton", "reference")
    assert lowering.FP8Q_BACKENDS == ("flashmla", "gluon", "triton")
    assert [r.name for r in ROUTES] == ["flashmla", "gluon", "triton", "reference",
                                        "flashmla-fp8q", "gluon-fp8q", "triton-fp8q"]
    for query, routes in TABLE.items():
        priorities = [r.priority for r in routes.values()]
        assert priorities == sorted(set(priorities))
    q, cache, table, seqlens, _, _ = paged_problem(1, 1, 2, 32, 16, [5], 4)
    call = DecodeCall(q, cache, table, seqlens, 0.2, True, "auto", None, 32)
    assert choose_route(call, "bf16", "auto").name == "reference"
    with config.patch(batch_invariant=True):
        assert choose_route(call, "bf16", "auto").name == "reference"
    with pytest.raises(ValueError, match="'auto', 'flashmla', 'gluon', 'triton' or 'reference'"):
        choose_route(call, "bf16", "cuda")
    assert "CUDA" in route_unmet("flashmla", q, cache)
    assert "CUDA" in route_unmet("gluon-fp8q", q.to(torch.float8_e4m3fn),
                                 cache.to(torch.float8_e4m3fn))
    assert route_unmet("reference", q, cache) is None
    with pytest.raises(ValueError, match="no decode route"):
        route_unmet("nope", q, cache)
