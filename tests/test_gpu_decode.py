"""GPU tests of the decode backends: Triton at real MLA widths, FlashMLA, CUDA graphs, FP8.

Every check compares with the float64 dense reference in decode_ref.py on random data.
Skipped cleanly without CUDA.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

import lowering  # noqa: E402
from mla_reference import (check_compiled_and_graphed, decode_ref64, make_case,  # noqa: E402
                           misaligned_copy, quantize_e4m3, rel_err)

L, R = 512, 64
SCALE = 192 ** -0.5


def _lens(B, S, seed):
    g = torch.Generator().manual_seed(seed)
    return [int(x) for x in torch.randint(S // 2, S, (B,), generator=g)]


def _skip_without_flashmla_fp8(H=128):
    from lowering.decode.registry import route_unmet
    fp8 = torch.float8_e4m3fn
    reason = route_unmet("flashmla-fp8q", torch.empty(1, 1, H, L + R, device="cuda", dtype=fp8),
                         torch.empty(1, 64, L + R, device="cuda", dtype=fp8))
    if reason is not None:
        pytest.skip(f"flashmla fp8 route cannot serve here: {reason}")


def _flashmla_ok():
    q = torch.empty(1, 1, 128, L + R, device="cuda", dtype=torch.bfloat16)
    kv = torch.empty(1, 64, L + R, device="cuda", dtype=torch.bfloat16)
    return lowering.decode.registry.route_unmet("flashmla", q, kv) is None


@pytest.mark.parametrize("B,s_q,H,page,S", [
    (4, 1, 128, 64, 3000), (3, 1, 16, 64, 2500), (2, 2, 128, 64, 1500), (3, 4, 16, 16, 700),
    (2, 1, 128, 1, 300), (2, 3, 16, 128, 1100), (1, 1, 128, 64, 1), (5, 1, 64, 64, 9000)])
def test_triton_real_width_vs_fp64(B, s_q, H, page, S):
    lens = [max(s_q, x) for x in _lens(B, S + 1, seed=B * 7 + H)]
    q, kv, bt, cl = make_case(B, s_q, H, L, R, page, lens, "cuda", seed=H + page)
    out, lse = lowering.mla_decode(q, kv, bt, cl, SCALE, backend="triton")
    ref, ref_lse = decode_ref64(q, kv, bt, cl, SCALE, True, L)
    assert out.dtype == torch.bfloat16 and out.shape == (B, s_q, H, L)
    assert rel_err(out, ref) < 1e-2
    assert (lse.double() - ref_lse).abs().max().item() < 2e-3


@pytest.mark.parametrize("s_q", [1, 2])
def test_flashmla_vs_fp64(s_q):
    if not _flashmla_ok():
        pytest.skip("flashmla backend cannot serve on this machine")
    B, H = 4, 128
    lens = [max(s_q, x) for x in _lens(B, 4000, seed=s_q)]
    q, kv, bt, cl = make_case(B, s_q, H, L, R, 64, lens, "cuda", seed=11)
    out, lse = lowering.mla_decode(q, kv, bt, cl, SCALE, backend="flashmla")
    ref, ref_lse = decode_ref64(q, kv, bt, cl, SCALE, True, L)
    assert rel_err(out, ref) < 1e-2
    assert (lse.double() - ref_lse).abs().max().item() < 2e-3
    assert lowering.select_backend(q, kv) == "flashmla"


def test_auto_choice_and_flashmla_block_size_error():
    q, kv, bt, cl = make_case(2, 1, 16, L, R, 16, [100, 40], "cuda")
    assert lowering.select_backend(q, kv) == "triton"
    if _flashmla_ok():
        with pytest.raises(lowering.BackendUnavailable, match="block_size 64"):
            lowering.mla_decode(q, kv, bt, cl, SCALE, backend="flashmla")


@pytest.mark.parametrize("backend", ["triton", "flashmla", "gluon", "reference"])
def test_value_checks_are_opt_in_and_kernels_bound_the_rest(backend):
    """On CUDA the length and block-id checks run with validate=True or the setting
    (lowering.config.validate); without them a bad length or block id gives the rows of
    the clamped inputs (bound_decode_inputs), no error and no read outside the cache."""
    from lowering import config
    from lowering.decode.registry import route_unmet
    q, kv, bt, cl = make_case(2, 1, 128, L, R, 64, [300, 40], "cuda", seed=9)
    reason = route_unmet(backend, q, kv)
    if reason is not None:
        pytest.skip(f"{backend} cannot serve here: {reason}")
    bad_cl, bad_bt = cl.clone(), bt.clone()
    bad_cl[0] = 100_000
    bad_bt[1, 0] = 10 ** 6
    with pytest.raises(ValueError, match="exceeds the blocks"):
        lowering.mla_decode(q, kv, bt, bad_cl, SCALE, backend=backend, validate=True)
    with config.patch(validate=True):
        with pytest.raises(ValueError, match="block ids"):
            lowering.mla_decode(q, kv, bad_bt, cl, SCALE, backend=backend)
    out, lse = lowering.mla_decode(q, kv, bad_bt, bad_cl, SCALE, backend=backend)
    good_bt, good_cl = lowering.bound_decode_inputs(kv, bad_bt, bad_cl)
    want, want_lse = lowering.mla_decode(q, kv, good_bt, good_cl, SCALE, backend=backend)
    torch.cuda.synchronize()
    assert torch.isfinite(out.float()).all()
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


def test_batch_invariance_gpu():
    from lowering import config
    H = 128
    lens = [2500, 700, 3333, 64, 1]
    q, kv, bt, cl = make_case(5, 1, H, L, R, 64, lens, "cuda", seed=3)
    run = lambda qq, bb, ll: lowering.mla_decode(qq, kv, bb, ll, SCALE, backend="triton")  # noqa: E731
    with config.patch(batch_invariant=True):
        full_o, full_l = run(q, bt, cl)
        for idx in ([0], [0, 2], [2, 0, 4], [0, 1, 2, 3, 4, 0, 0]):
            i = torch.tensor(idx, device="cuda")
            o, l = run(q[i].contiguous(), bt[i].contiguous(), cl[i].contiguous())
            for j, src in enumerate(idx):
                assert torch.equal(o[j], full_o[src]) and torch.equal(l[j], full_l[src])
    ref, _ = decode_ref64(q, kv, bt, cl, SCALE, True, L)
    assert rel_err(full_o, ref) < 1e-2


@pytest.mark.parametrize("B,H,S", [(1, 128, 4000), (7, 128, 3000), (5, 16, 2000), (3, 64, 700)])
def test_flashmla_schedule_once_per_step(B, H, S):
    """decode_schedule() computed once and passed to the call gives the bitwise result of
    the call scheduling itself; compiled, its fake shapes are the real ones; a schedule
    of another batch is refused before the kernel runs."""
    if not _flashmla_ok():
        pytest.skip("flashmla backend cannot serve on this machine")
    from lowering.decode.flashmla import schedule_rows
    lens = _lens(B, S + 1, seed=B + H)
    q, kv, bt, cl = make_case(B, 1, H, L, R, 64, lens, "cuda", seed=B * H)
    # up to 32 query rows "auto" takes the Gluon few-rows kernel where it serves
    few = H <= 32 and lowering.decode.registry.route_unmet("gluon", q, kv) is None
    assert lowering.uses_flashmla(q.device, q.dtype, H, L + R, 64) == (not few)
    assert lowering.uses_flashmla(q.device, q.dtype, H, L + R, 64, backend="flashmla")
    assert not lowering.uses_flashmla(q.device, q.dtype, H, L + R, 64, backend="triton")
    assert not lowering.uses_flashmla(q.device, q.dtype, H, L + R, 16)
    sched = lowering.decode_schedule(kv, bt, cl, num_heads=H)
    assert sched[0].shape == (schedule_rows(q.device, H), 8) and sched[1].shape == (B + 1,)
    own = lowering.mla_decode(q, kv, bt, cl, SCALE, backend="flashmla")
    given = lowering.mla_decode(q, kv, bt, cl, SCALE, backend="flashmla", schedule=sched)
    assert torch.equal(own[0], given[0]) and torch.equal(own[1], given[1])
    ref, _ = decode_ref64(q, kv, bt, cl, SCALE, True, L)
    assert rel_err(given[0], ref) < 1e-2
    compiled = torch.compile(lambda b, c: lowering.decode_schedule(kv, b, c, num_heads=H),
                             fullgraph=True)
    table, splits = compiled(bt, cl)
    # the table is written on the scheduler's side stream, which only the decode calls
    # join: read here, wait for it first (without, a busy GPU showed the race)
    torch.cuda.synchronize()
    # FlashMLA fills 5 of each row's 8 ints (begin/end request and key, first split);
    # the rest is padding it never writes or reads
    assert torch.equal(table[:, :5], sched[0][:, :5]) and torch.equal(splits, sched[1])
    other = lowering.decode_schedule(kv, bt[:1], cl[:1], num_heads=H) if B > 1 else \
        lowering.decode_schedule(kv, bt.repeat(2, 1), cl.repeat(2), num_heads=H)
    with pytest.raises(ValueError, match="decode_schedule"):
        lowering.mla_decode(q, kv, bt, cl, SCALE, backend="flashmla", schedule=other)


def test_flashmla_schedule_on_its_side_stream_sees_the_callers_lengths():
    """The scheduler kernel runs on a side stream: it must wait for lengths the caller's
    stream writes just before (behind a long kernel), and the decode must wait for it."""
    if not _flashmla_ok():
        pytest.skip("flashmla backend cannot serve on this machine")
    from lowering.decode import flashmla
    B, H, S = 6, 128, 3000
    q, kv, bt, cl = make_case(B, 1, H, L, R, 64, _lens(B, S, seed=4), "cuda", seed=4)
    lens = torch.full_like(cl, 1)
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)                 # keep the caller's stream busy (~30 ms)
    lens.copy_(cl)                                # the real lengths land only after that
    sched = lowering.decode_schedule(kv, bt, lens, num_heads=H)
    out, _ = lowering.mla_decode(q, kv, bt, lens, SCALE, backend="flashmla", schedule=sched)
    torch.cuda.synchronize()
    inline = flashmla.compute_schedule(cl, H, H)      # after the lengths landed
    torch.cuda.synchronize()
    # columns 5-7 of a table row are unused (left uninitialized by flash_mla)
    assert torch.equal(sched[0][:, :5], inline[0][:, :5]) and torch.equal(sched[1], inline[1])
    ref, _ = decode_ref64(q, kv, bt, cl, SCALE, True, L)
    assert rel_err(out, ref) < 1e-2
    # a schedule made outside a capture serves captured calls (no wait on the side stream
    # is captured: it would invalidate the capture)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, _ = lowering.mla_decode(q, kv, bt, lens, SCALE, backend="flashmla",
                                       schedule=sched)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(g_out, out)


@pytest.mark.parametrize("backend", ["flashmla", "flashmla-schedule", "flashmla-fp8q",
                                     "flashmla-fp8q-schedule", "triton", "gluon"])
def test_cuda_graph_replay_500_steps(backend):
    """500 replays of one captured decode with changing lengths == eager each step
    ("-schedule": the schedule computed by a separate graph op, as a model's step plan
    does once for all layers; "flashmla-fp8q": FlashMLA's fp8 kernel and its own
    scheduler, fp8 q and cache)."""
    schedule = backend.endswith("-schedule")
    fp8 = backend.startswith("flashmla-fp8q")
    backend = "flashmla" if backend.startswith("flashmla") else backend
    if fp8:
        _skip_without_flashmla_fp8()
    elif backend == "flashmla" and not _flashmla_ok():
        pytest.skip("flashmla backend cannot serve on this machine")
    B, H, S = 8, 128, 2048
    if backend == "gluon":
        probe = torch.empty(1, 1, H, L + R, device="cuda", dtype=torch.bfloat16)
        kv_probe = torch.empty(1, 64, L + R, device="cuda", dtype=torch.bfloat16)
        reason = lowering.decode.registry.route_unmet("gluon", probe, kv_probe)
        if reason is not None:
            pytest.skip(f"gluon backend cannot serve here: {reason}")
    q, kv, bt, cl = make_case(B, 1, H, L, R, 64, [S] * B, "cuda", seed=5)
    static_q, static_len = q.clone(), cl.clone()
    if fp8:
        kv, k_scale = quantize_e4m3(kv)
        q8_scale = torch.tensor([0.02], device="cuda")   # q ~ N(0, 1): e4m3 up to 9

    def decode():
        sched = lowering.decode_schedule(kv, bt, static_len, num_heads=H,
                                         fp8q=fp8) if schedule else None
        if fp8:
            q8 = (static_q.float() / q8_scale).to(torch.float8_e4m3fn)
            return lowering.mla_decode_fp8q(q8, kv, bt, static_len, SCALE, q_scale=q8_scale,
                                            k_scale=k_scale, backend="flashmla", schedule=sched)
        return lowering.mla_decode(static_q, kv, bt, static_len, SCALE, backend=backend,
                                   schedule=sched)
    decode()  # warm up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_lse = decode()
    gen = torch.Generator(device="cuda").manual_seed(0)
    worst = 0.0
    for step in range(500):
        new_len = torch.randint(1, S + 1, (B,), device="cuda", generator=gen, dtype=torch.int32)
        if step % 50 == 0:
            new_len[0] = S  # keep the longest length in play
        static_len.copy_(new_len)
        static_q.normal_(generator=gen)
        graph.replay()
        e_out, e_lse = decode()
        worst = max(worst, rel_err(g_out, e_out))
        assert torch.allclose(g_lse, e_lse, atol=1e-4, rtol=0), f"step {step}"
    assert worst < 1e-3
    if fp8:
        q_true = (static_q.float() / q8_scale).to(torch.float8_e4m3fn).double() * q8_scale
        ref, _ = decode_ref64(q_true, kv.double() * k_scale.double(), bt, static_len, SCALE,
                              True, L)
        assert rel_err(g_out, ref) < 5e-2
    else:
        ref, _ = decode_ref64(static_q, kv, bt, static_len, SCALE, True, L)
        assert rel_err(g_out, ref) < 1e-2


def test_fp8_kv_and_fp8_q_accuracy():
    B, H = 4, 128
    lens = _lens(B, 3000, seed=9)
    q, kv, bt, cl = make_case(B, 1, H, L, R, 64, lens, "cuda", seed=9)
    k_scale = (kv.float().abs().amax() / 448.0).reshape(1)
    kv8 = (kv.float() / k_scale).to(torch.float8_e4m3fn)
    kv_true = kv8.double() * k_scale.double()
    out, lse = lowering.mla_decode(q, kv8, bt, cl, SCALE, kv_cache_dtype="fp8", k_scale=k_scale,
                                   backend="triton")
    ref, ref_lse = decode_ref64(q, kv_true, bt, cl, SCALE, True, L)
    assert rel_err(out, ref) < 1e-2
    assert (lse.double() - ref_lse).abs().max().item() < 2e-3
    q_scale = (q.float().abs().amax() / 448.0).reshape(1)
    q8 = (q.float() / q_scale).to(torch.float8_e4m3fn)
    out, lse = lowering.mla_decode_fp8q(q8, kv8, bt, cl, SCALE, q_scale=q_scale,
                                        k_scale=k_scale, backend="triton")
    ref, ref_lse = decode_ref64(q8.double() * q_scale.double(), kv_true, bt, cl, SCALE, True, L)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, ref) < 5e-2          # P @ V with P in e4m3: ~2-3% expected
    assert (lse.double() - ref_lse).abs().max().item() < 1e-2


def test_triton_op_under_inductor_and_cuda_graphs():
    B, H = 4, 128
    q, kv, bt, cl = make_case(B, 1, H, L, R, 64, [1500] * B, "cuda", seed=21)

    def run(q, kv, bt, cl):
        return lowering.mla_decode(q, kv, bt, cl, SCALE, backend="triton")
    check_compiled_and_graphed(run, "mla_decode_stage1_kernel", q, kv, bt, cl)


# (B, s_q, H, lengths, causal) for FlashMLA's dense fp8 kernel
FP8_CASES = [
    (4, 1, 128, [3000, 2999, 1, 64], True),       # length 1, a full page, odd lengths
    (3, 1, 64, [1, 100, 777], True),              # 64 heads
    (2, 2, 128, [1500, 33], True),                # two query tokens, causal
    (2, 2, 64, [900, 130], False),                # two query tokens, not causal
    (3, 1, 128, [65, 128, 129], True),            # one key past a page, two pages, one more
    (2, 1, 128, [20000, 70], True),               # many splits on one request
    (5, 1, 16, [4000, 1, 63, 64, 65], True),      # 16 heads (128 over 8 GPUs)
    (2, 3, 32, [333, 3], True),                   # 32 heads, three query tokens
    (2, 1, 96, [1000, 2000], True),               # 96 heads
]


@pytest.mark.parametrize("B,s_q,H,lens,causal", FP8_CASES)
def test_flashmla_fp8q_vs_fp64(B, s_q, H, lens, causal):
    """mla_decode_fp8q's "flashmla" route against float64 on the dequantized values, with
    NaN in every cache row no request has written."""
    from mla_reference import poison_unwritten_rows
    _skip_without_flashmla_fp8(H)
    q, kv, bt, cl = make_case(B, s_q, H, L, R, 64, lens, "cuda", seed=B * 5 + H + s_q)
    q8, q_scale = quantize_e4m3(q)
    kv8, k_scale = quantize_e4m3(kv)
    ref, ref_lse = decode_ref64(q8.double() * q_scale.double(), kv8.double() * k_scale.double(),
                                bt, cl, SCALE, causal, L)
    out, lse = lowering.mla_decode_fp8q(q8, poison_unwritten_rows(kv8, bt, cl), bt, cl, SCALE,
                                        q_scale=q_scale, k_scale=k_scale, causal=causal,
                                        backend="flashmla")
    assert out.dtype == torch.bfloat16 and out.shape == (B, s_q, H, L)
    assert lse.dtype == torch.float32 and lse.shape == (B, H, s_q)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < 5e-2          # P @ V with P in e4m3, as our fp8 kernels
    assert (lse.double() - ref_lse).abs().max().item() < 1e-2


def test_flashmla_fp8q_route_choice_errors_and_compile():
    """auto takes FlashMLA's fp8 kernel when handed its schedule or when the Gluon kernel
    cannot serve, else ours; a schedule made for the other kernel is refused; an explicit
    "flashmla" names what it lacks; under torch.compile and CUDA graphs it matches eager."""
    from lowering.decode.registry import route_unmet
    _skip_without_flashmla_fp8()
    q, kv, bt, cl = make_case(2, 1, 128, L, R, 64, [700, 90], "cuda", seed=4)
    q8, q_scale = quantize_e4m3(q)
    kv8, k_scale = quantize_e4m3(kv)
    ref, _ = decode_ref64(q8.double() * q_scale.double(), kv8.double() * k_scale.double(),
                          bt, cl, SCALE, True, L)
    fp8 = torch.float8_e4m3fn
    assert lowering.uses_flashmla(q8.device, fp8, 128, L + R, 64, kv_cache_dtype="fp8")
    for kw in (dict(kv_cache_dtype="fp8", backend="gluon"), dict(kv_cache_dtype="auto")):
        assert not lowering.uses_flashmla(q8.device, fp8, 128, L + R, 64, **kw)
    assert not lowering.uses_flashmla(q8.device, fp8, 128, L + R, 16, kv_cache_dtype="fp8")
    sched8 = lowering.decode_schedule(kv8, bt, cl, num_heads=128, fp8q=True)
    without = "gluon" if route_unmet("gluon-fp8q", q8, kv8) is None else "flashmla"
    for schedule, route in ((None, without), (sched8, "flashmla")):
        before = lowering.backend_choices[f"{route}-fp8q"]
        out, _ = lowering.mla_decode_fp8q(q8, kv8, bt, cl, SCALE, q_scale=q_scale,
                                          k_scale=k_scale, schedule=schedule)
        assert lowering.backend_choices[f"{route}-fp8q"] == before + 1
        assert rel_err(out, ref) < 5e-2
    with pytest.raises(TypeError, match=r"needs one from decode_schedule\(\.\.\., fp8q=True"):
        lowering.mla_decode_fp8q(q8, kv8, bt, cl, SCALE, q_scale=q_scale, k_scale=k_scale,
                                 schedule=lowering.decode_schedule(kv8, bt, cl, num_heads=128))
    if _flashmla_ok():
        qb, kvb = q8.to(torch.bfloat16), kv8.to(torch.bfloat16)
        with pytest.raises(TypeError,
                           match=r"needs one from decode_schedule\(\.\.\., fp8q=False"):
            lowering.mla_decode(qb, kvb, bt, cl, SCALE, backend="flashmla", schedule=sched8)
    for H in (16, 32):        # no Gluon fp8 kernel for these: FlashMLA's, scheduling itself
        q, kv, bt, cl = make_case(2, 1, H, L, R, 64, [300, 7], "cuda", seed=H)
        q8b, qs = quantize_e4m3(q)
        kv8b, ks = quantize_e4m3(kv)
        before = lowering.backend_choices["flashmla-fp8q"]
        lowering.mla_decode_fp8q(q8b, kv8b, bt, cl, SCALE, q_scale=qs, k_scale=ks)
        assert lowering.backend_choices["flashmla-fp8q"] == before + 1
    for H, page, out_dtype, match in ((8, 64, torch.bfloat16, "heads"),
                                      (128, 16, torch.bfloat16, "block_size 64"),
                                      (128, 64, torch.float16, "bfloat16")):
        q, kv, bt, cl = make_case(2, 1, H, L, R, page, [100, 40], "cuda", seed=7)
        q8b, qs = quantize_e4m3(q)
        kv8b, ks = quantize_e4m3(kv)
        with pytest.raises(lowering.BackendUnavailable, match=match):
            lowering.mla_decode_fp8q(q8b, kv8b, bt, cl, SCALE, q_scale=qs, k_scale=ks,
                                     out_dtype=out_dtype, backend="flashmla")
        n = lowering.backend_choices["flashmla-fp8q"]
        out, _ = lowering.mla_decode_fp8q(q8b, kv8b, bt, cl, SCALE, q_scale=qs, k_scale=ks,
                                          out_dtype=out_dtype)
        assert lowering.backend_choices["flashmla-fp8q"] == n and out.dtype == out_dtype
    q, kv, bt, cl = make_case(2, 1, 128, L, R, 64, [300, 7], "cuda", seed=8)
    q8, q_scale = quantize_e4m3(q)
    kv8, k_scale = quantize_e4m3(kv)
    q_off = misaligned_copy(q8)
    with pytest.raises(ValueError, match="q must start at a 16-byte aligned"):
        lowering.mla_decode_fp8q(q_off, kv8, bt, cl, SCALE, q_scale=q_scale, k_scale=k_scale,
                                 backend="flashmla")
    q, kv, bt, cl = make_case(4, 1, 128, L, R, 64, [1500] * 4, "cuda", seed=21)
    q8, q_scale = quantize_e4m3(q)
    kv8, k_scale = quantize_e4m3(kv)

    def run(q, kv, bt, cl):          # the schedule a graph op in the compiled graph too
        sched = lowering.decode_schedule(kv, bt, cl, num_heads=128, fp8q=True)
        return lowering.mla_decode_fp8q(q.to(torch.float8_e4m3fn), kv, bt, cl, SCALE,
                                        q_scale=q_scale, k_scale=k_scale, schedule=sched)
    check_compiled_and_graphed(run, "flashmla_decode_fp8q", q8.float(), kv8, bt, cl)
