"""GPU tests of the Gluon few-rows decode kernel (a bf16 query over an e4m3 cache with a
per-tensor scale, or over a bf16 cache, up to 32 query rows: gluon_rows_kernel.py)
against float64 on the (dequantized) cache: lengths at tile edges, empty and many splits,
the direct path, rows padded to 16 and 32, s_q > 1 causal or not, NaN in unwritten rows,
the route backend="auto" takes, refusals, torch.compile and CUDA graphs.

Skipped cleanly without a CUDA device, and where the kernel cannot serve (not SM90, or
a triton without Gluon's Hopper API).
"""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

import lowering  # noqa: E402
from mla_reference import (check_compiled_and_graphed, decode_ref64,  # noqa: E402
                           heads_of_any_scale, lse_rel_err, make_case, poison_unwritten_rows,
                           quantize_e4m3, refused_by_gluon_then_triton, rel_err)

L, R = 512, 64
SCALE = 192 ** -0.5
# LSE tolerance (absolute). Over an fp8 cache QK runs as fp8 MMAs, which Hopper sums
# keeping ~14 bits per instruction (truncated to the largest addend): over the 18 MMAs of
# a 576-wide row that is ~0.2 % of a score's spread, ~4e-3 at these inputs' ~1.7. The
# fp8 rounding of the cache itself moves the scores ~15x more (its ~3.6 % per element).
LSE_TOL = {True: 1e-2, False: 2e-3}

# (B, s_q, H, page, lengths, splits; 0: chosen from the shapes)
CASES = [
    (4, 1, 16, 64, [3000, 2999, 1, 64], 0),        # length 1, one full tile, odd lengths
    (3, 1, 16, 64, [1, 100, 777], 6),              # more splits than tiles: empty splits
    (2, 2, 16, 64, [1500, 33], 0),                 # 32 rows: two tokens, causal
    (1, 3, 8, 128, [700], 0),                      # page 128, 24 rows padded to 32
    (5, 1, 8, 64, [9000, 31, 32, 4097, 250], 0),   # 8 rows padded to 16
    (2, 1, 16, 64, [5000, 40], 48),                # many splits, most of row 2's empty
    (3, 1, 16, 64, [65, 128, 129], 1),             # one split: the direct path
    (2, 1, 32, 192, [4100, 191], 1),               # 32 heads, page 192, direct
]


@pytest.fixture(autouse=True)
def _needs_kernel():
    from lowering.decode.registry import route_unmet
    q = torch.empty(1, 1, 16, L + R, device="cuda", dtype=torch.bfloat16)
    kv = torch.empty(1, 64, L + R, device="cuda", dtype=torch.float8_e4m3fn)
    reason = route_unmet("gluon", q, kv, kind="fp8")
    if reason is not None:
        pytest.skip(f"the gluon fp8-cache kernel cannot serve here: {reason}")


def _case(B, s_q, H, page, lens, seed, fp8=True):
    """q, the cache (e4m3 where fp8, else bf16), its scale (None for bf16), table, lengths."""
    q, kv, bt, cl = make_case(B, s_q, H, L, R, page, lens, "cuda", seed=seed)
    if not fp8:
        return q, kv, None, bt, cl
    kv8, k_scale = quantize_e4m3(kv)
    return q, kv8, k_scale, bt, cl


def _ref(q, kv8, k_scale, bt, cl, causal=True):
    kv = kv8.double() if k_scale is None else kv8.double() * k_scale.double()
    return decode_ref64(q.double(), kv, bt, cl, SCALE, causal, L)


def _run(q, kv8, bt, cl, k_scale, causal=True, num_splits=0):
    """The op (mla::gluon_decode_fp8_cache; over a bf16 cache mla::gluon_decode, which
    takes the same kernel at up to 32 rows), as compiled callers see it."""
    from lowering.decode.gluon_decode import gluon_decode_fp8_cache_op, gluon_decode_op
    if k_scale is None:
        return gluon_decode_op(q, kv8, bt, cl, SCALE, causal, num_splits)
    return gluon_decode_fp8_cache_op(q, kv8, bt, cl, k_scale, SCALE, causal, num_splits)


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
@pytest.mark.parametrize("B,s_q,H,page,lens,splits", CASES)
def test_few_rows_vs_fp64(B, s_q, H, page, lens, splits, fp8):
    q, kv8, k_scale, bt, cl = _case(B, s_q, H, page, lens, B * 13 + H + page, fp8)
    ref, ref_lse = _ref(q, kv8, k_scale, bt, cl)
    out, lse = _run(q, poison_unwritten_rows(kv8, bt, cl), bt, cl, k_scale, num_splits=splits)
    assert out.dtype == torch.bfloat16 and out.shape == (B, s_q, H, L)
    assert lse.shape == (B, H, s_q) and lse.dtype == torch.float32
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < 1e-2
    assert (lse.double() - ref_lse).abs().max().item() < LSE_TOL[fp8]


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
def test_few_rows_not_causal(fp8):
    q, kv8, k_scale, bt, cl = _case(2, 2, 16, 64, [900, 130], seed=3, fp8=fp8)
    ref, ref_lse = _ref(q, kv8, k_scale, bt, cl, causal=False)
    out, lse = lowering.mla_decode(q, kv8, bt, cl, SCALE, causal=False,
                                   kv_cache_dtype="fp8" if fp8 else "auto", k_scale=k_scale,
                                   backend="gluon")
    assert rel_err(out, ref) < 1e-2
    assert (lse.double() - ref_lse).abs().max().item() < LSE_TOL[fp8]


def test_fp8_cache_query_heads_of_any_scale():
    """Over an fp8 cache each query row is held as two e4m3 terms scaled per row: heads
    of very different magnitudes (x 1e4, x 1e-4, an all-zero head, one with a single
    large entry among small ones) keep a bf16 query's scores."""
    q, kv8, k_scale, bt, cl = _case(3, 2, 16, 64, [2100, 700, 65], seed=11)
    q = heads_of_any_scale(q)
    ref, ref_lse = _ref(q, kv8, k_scale, bt, cl)
    for splits in (0, 1):
        out, lse = _run(q, kv8, bt, cl, k_scale, num_splits=splits)
        assert torch.isfinite(out).all() and torch.isfinite(lse).all()
        assert rel_err(out, ref) < 1e-2
        assert lse_rel_err(lse, ref_lse) < 2e-3


def test_auto_takes_the_kernel_at_16_heads_and_names_what_it_cannot_serve():
    q, kv8, k_scale, bt, cl = _case(2, 1, 16, 64, [700, 90], seed=5)
    ref, _ = _ref(q, kv8, k_scale, bt, cl)
    before = lowering.backend_choices["gluon"]
    out, _ = lowering.mla_decode(q, kv8, bt, cl, SCALE, kv_cache_dtype="fp8", k_scale=k_scale)
    assert lowering.backend_choices["gluon"] == before + 1
    assert rel_err(out, ref) < 1e-2
    # what it cannot serve: named for backend="gluon", the Triton kernel for "auto"
    # (64 heads and more: the fp8 kernel's BF16Q mode, test_gpu_gluon_fp8_cache.py)
    for s_q, H, page, dtype, match in ((3, 16, 64, torch.bfloat16, "multiple of 64"),
                                       (1, 16, 32, torch.bfloat16, "multiple of 64"),
                                       (1, 16, 64, torch.float16, "bfloat16")):
        q, kv8, k_scale, bt, cl = _case(2, s_q, H, page, [300, 40], seed=7)
        q = q.to(dtype)
        refused_by_gluon_then_triton(q, kv8, k_scale, bt, cl, SCALE, match,
                                     _ref(q, kv8, k_scale, bt, cl)[0], 2e-2)


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
def test_few_rows_under_compile_and_cuda_graphs(fp8):
    q, kv8, k_scale, bt, cl = _case(4, 1, 16, 64, [1500] * 4, seed=21, fp8=fp8)
    check_compiled_and_graphed(lambda q, kv, bt, cl: _run(q, kv, bt, cl, k_scale),
                               "gluon_decode_fp8_cache" if fp8 else "gluon_decode",
                               q, kv8, bt, cl)
