"""GPU tests of a bf16 query over an e4m3 cache past 32 query rows (64 and 128 heads): the
pair kernel's FP8 mode where a page holds whole 64-key blocks (gluon_pair_kernel.py: the
tiles widened to bf16 in shared memory beside the MMAs), and the fp8 Gluon kernel's BF16Q
mode (gluon_fp8_kernel.py), which writes the query as two e4m3 terms per element
(q_terms_kernel.py) and runs QK as fp8 MMAs over both: pages of 32, and any page where a
test asks for it. Against float64 on the dequantized cache: pages of 32, 64 and 128,
lengths at tile and block edges,
empty and many splits, the direct path, s_q > 1 causal or not, NaN in unwritten rows,
heads of very different scales, the route backend="auto" takes, torch.compile and CUDA
graphs.

Skipped cleanly without a CUDA device, and where the kernel cannot serve (not SM90, or a
triton without Gluon's Hopper API).
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
# LSE tolerance (absolute), as over the few-rows kernel's fp8 cache
# (test_gpu_gluon_rows.py): Hopper sums fp8 MMAs keeping ~14 bits per instruction, here
# over 18 MMAs (9 for each of q's terms) of a 576-wide row.
LSE_TOL = 1e-2
# Output tolerance (relative): the fp8 kernel rounds P to e4m3 for its P V MMA (as its
# fp8-query mode and the Triton fp8 path do; 1.2-1.7e-2 at these inputs on an H100),
# where the few-rows kernel keeps P in fp16 (1e-2 there).
OUT_TOL = 3e-2
# The pair kernel's FP8 mode multiplies the widened (exact) bf16 tiles as the bf16 kernel
# does, so it is held to the bf16 kernel's bounds (test_gpu_gluon.py).
PAIR_OUT_TOL, PAIR_LSE_TOL = 1e-2, 2e-3

# (B, s_q, H, page, lengths, splits; 0: chosen from the shapes)
CASES = [
    (3, 1, 128, 64, [3000, 2999, 1], 0),          # length 1, odd lengths
    (2, 1, 128, 64, [4100, 64], 1),               # one split (direct), a long one
    (2, 1, 64, 64, [1, 100], 6),                  # more splits than tiles: empty splits
    (2, 2, 64, 32, [1500, 33], 0),                # page 32, two tokens causal
    (4, 1, 128, 32, [65, 128, 129, 31], 3),       # tile edges
    (2, 1, 64, 128, [5000, 40], 40),              # many splits, most of row 2's empty
    (1, 2, 128, 64, [2049], 1),                   # direct, s_q 2
    (3, 1, 128, 64, [65, 128, 129], 1),           # last 64-key block odd, even; whole pair
    (2, 2, 128, 64, [1500, 33], 0),               # page 64, two tokens causal
]


@pytest.fixture(autouse=True)
def _needs_kernel():
    from lowering.decode.registry import route_unmet
    q = torch.empty(1, 1, 128, L + R, device="cuda", dtype=torch.bfloat16)
    kv = torch.empty(1, 64, L + R, device="cuda", dtype=torch.float8_e4m3fn)
    reason = route_unmet("gluon", q, kv, kind="fp8")
    if reason is not None:
        pytest.skip(f"the gluon fp8-cache kernel cannot serve here: {reason}")


def _case(B, s_q, H, page, lens, seed):
    """q bf16, the cache as e4m3 with its per-tensor scale, table, lengths."""
    q, kv, bt, cl = make_case(B, s_q, H, L, R, page, lens, "cuda", seed=seed)
    kv8, k_scale = quantize_e4m3(kv)
    return q, kv8, k_scale, bt, cl


def _ref(q, kv8, k_scale, bt, cl, causal=True):
    return decode_ref64(q.double(), kv8.double() * k_scale.double(), bt, cl, SCALE, causal, L)


def _run(q, kv8, bt, cl, k_scale, causal=True, num_splits=0):
    from lowering.decode.gluon_decode import gluon_decode_fp8_cache_op
    return gluon_decode_fp8_cache_op(q, kv8, bt, cl, k_scale, SCALE, causal, num_splits)


def _force_bf16q(monkeypatch):
    """The fp8 kernel's BF16Q mode for every page (the pair kernel takes pages of 64 keys)."""
    from lowering.decode import gluon_decode
    from lowering.decode.gluon_fp8_kernel import mla_decode_fp8_kernel
    monkeypatch.setattr(gluon_decode, "bf16q_kernel",
                        lambda page, keys: (mla_decode_fp8_kernel, gluon_decode.BF16Q_CONFIG))


@pytest.mark.parametrize("kernel", ["pair where the page allows", "bf16q"])
@pytest.mark.parametrize("B,s_q,H,page,lens,splits", CASES)
def test_bf16q_over_fp8_cache_vs_fp64(B, s_q, H, page, lens, splits, kernel, monkeypatch):
    pair = kernel.startswith("pair")
    if pair and page % 64:
        pytest.skip("pages of 32 take the BF16Q mode either way")
    if not pair:
        _force_bf16q(monkeypatch)
    q, kv8, k_scale, bt, cl = _case(B, s_q, H, page, lens, B * 17 + H + page)
    ref, ref_lse = _ref(q, kv8, k_scale, bt, cl)
    out, lse = _run(q, poison_unwritten_rows(kv8, bt, cl), bt, cl, k_scale, num_splits=splits)
    assert out.dtype == torch.bfloat16 and out.shape == (B, s_q, H, L)
    assert lse.shape == (B, H, s_q) and lse.dtype == torch.float32
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < (PAIR_OUT_TOL if pair else OUT_TOL)
    assert (lse.double() - ref_lse).abs().max().item() < (PAIR_LSE_TOL if pair else LSE_TOL)


def test_pair_fp8_scale_reaches_scores_and_values():
    """The cache's scale multiplies the scores and the output (not the operands): a scale
    of 8 and of 1/64 over the same e4m3 values give the float64 results of those caches."""
    q, kv8, k_scale, bt, cl = _case(2, 1, 128, 64, [1000, 130], seed=9)
    for s in (8.0, 1.0 / 64):
        ks = k_scale * s
        ref, ref_lse = _ref(q, kv8, ks, bt, cl)
        out, lse = _run(q, kv8, bt, cl, ks)
        assert rel_err(out, ref) < PAIR_OUT_TOL
        assert (lse.double() - ref_lse).abs().max().item() < PAIR_LSE_TOL


def test_bf16q_not_causal():
    q, kv8, k_scale, bt, cl = _case(2, 2, 64, 64, [900, 130], seed=3)
    ref, ref_lse = _ref(q, kv8, k_scale, bt, cl, causal=False)
    out, lse = lowering.mla_decode(q, kv8, bt, cl, SCALE, causal=False, kv_cache_dtype="fp8",
                                   k_scale=k_scale, backend="gluon")
    assert rel_err(out, ref) < OUT_TOL
    assert (lse.double() - ref_lse).abs().max().item() < LSE_TOL


def test_bf16q_heads_of_any_scale():
    """Each query row is held as two e4m3 terms scaled by its own power of two: heads of
    very different magnitudes (x 1e4, x 1e-4, an all-zero head, one large entry among
    small ones, x 10 in the second 64-row block) keep a bf16 query's scores, on pages
    of 64 (the pair kernel, which needs no such care) and 32. (The fp8 MMAs sum with ~2^-13 of the scores' magnitude: a head scaled so that
    its scores span ~1e3 cannot resolve keys whose scores tie to within ~1, as one x 1e3
    head of this seed did; such a head's LSE stays within its relative bound.)"""
    for page, splits in ((64, 1), (32, 0)):
        q, kv8, k_scale, bt, cl = _case(2, 1, 128, page, [2100, 700], seed=11)
        q = heads_of_any_scale(q, far_head=70)        # 70: in the second 64-row block
        ref, ref_lse = _ref(q, kv8, k_scale, bt, cl)
        out, lse = _run(q, kv8, bt, cl, k_scale, num_splits=splits)
        assert torch.isfinite(out).all() and torch.isfinite(lse).all()
        assert rel_err(out, ref) < OUT_TOL
        assert lse_rel_err(lse, ref_lse) < 2e-3


def test_auto_takes_the_kernel_at_128_heads_and_names_what_it_cannot_serve():
    q, kv8, k_scale, bt, cl = _case(2, 1, 128, 64, [700, 90], seed=5)
    ref, _ = _ref(q, kv8, k_scale, bt, cl)
    before = lowering.backend_choices["gluon"]
    out, _ = lowering.mla_decode(q, kv8, bt, cl, SCALE, kv_cache_dtype="fp8", k_scale=k_scale)
    assert lowering.backend_choices["gluon"] == before + 1
    assert rel_err(out, ref) < OUT_TOL
    # what it cannot serve: named for backend="gluon", the Triton kernel for "auto"
    for s_q, H, page, match in ((1, 48, 64, "head count that is a multiple of 64"),
                                (1, 64, 16, "block_size to be a multiple of 32")):
        q, kv8, k_scale, bt, cl = _case(2, s_q, H, page, [300, 40], seed=7)
        refused_by_gluon_then_triton(q, kv8, k_scale, bt, cl, SCALE, match,
                                     _ref(q, kv8, k_scale, bt, cl)[0], 2e-2)


def test_bf16q_under_compile_and_cuda_graphs():
    q, kv8, k_scale, bt, cl = _case(4, 1, 128, 64, [1500] * 4, seed=21)
    check_compiled_and_graphed(lambda q, kv, bt, cl: _run(q, kv, bt, cl, k_scale),
                               "gluon_decode_fp8_cache", q, kv8, bt, cl)
