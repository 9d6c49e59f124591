"""GPU tests of the Gluon decode kernels (Hopper ping-pong) against the float64 reference:
the "gluon" backend (bf16) and lowering.mla_decode_fp8q's "gluon" route (fp8 q and cache,
against float64 on the dequantized values). Edge lengths, many and empty splits, the
direct path, s_q > 1 (causal or not), page sizes, NaN in unwritten cache rows, capability
errors and the routes "auto" takes, torch.compile and CUDA graphs, the MLA layer.

Skipped cleanly without a CUDA device, and where the backend cannot serve (not SM90, or
a triton without Gluon's Hopper API).
"""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

import lowering  # noqa: E402
from mla_reference import (check_compiled_and_graphed, decode_ref64, make_case,  # noqa: E402
                           misaligned_copy, poison_unwritten_rows, quantize_e4m3, rel_err)

L, R = 512, 64
SCALE = 192 ** -0.5


# (B, s_q, H, page, lengths, splits; 0: chosen from the shapes) for both kernels
CASES = [
    (4, 1, 128, 64, [3000, 2999, 1, 64], 0),       # length 1, a full page, odd lengths
    (3, 1, 64, 64, [1, 100, 777], 4),             # more splits than tiles: empty splits
    (2, 2, 128, 64, [1500, 33], 0),               # two query tokens, causal
    (1, 3, 64, 128, [700], 0),                    # page 128, three tokens
    (5, 1, 64, 32, [9000, 31, 32, 4097, 250], 0),  # page 32 (one tile per page)
    (2, 1, 128, 64, [5000, 40], 48),              # many splits, most of row 2's empty
    (2, 1, 128, 64, [4096, 33], 1),               # one split: the direct (unmerged) path
    (3, 1, 128, 64, [65, 128, 129], 1),           # last 64-key block odd, even; whole pair
]


@pytest.fixture(autouse=True)
def _needs_gluon():
    from lowering.decode.registry import route_unmet
    q = torch.empty(1, 1, 64, L + R, device="cuda", dtype=torch.bfloat16)
    kv = torch.empty(1, 64, L + R, device="cuda", dtype=torch.bfloat16)
    reason = route_unmet("gluon", q, kv)
    if reason is not None:
        pytest.skip(f"gluon backend cannot serve here: {reason}")


def _run(q, kv, bt, cl, causal=True, num_splits=0):
    """The op (mla::gluon_decode), so that compiled callers trace it as one node."""
    from lowering.decode.gluon_decode import gluon_decode_op
    return gluon_decode_op(q, kv, bt, cl, SCALE, causal, num_splits)


@pytest.mark.parametrize("kernel", ["pair where the page allows", "ring"])
@pytest.mark.parametrize("B,s_q,H,page,lens,splits", CASES)
def test_gluon_vs_fp64(B, s_q, H, page, lens, splits, kernel, monkeypatch):
    from lowering.decode import gluon_decode
    if kernel == "ring":       # the ring kernel for every page size
        from lowering.decode.gluon_ring_kernel import mla_decode_gluon_kernel
        monkeypatch.setattr(gluon_decode, "bf16_kernel",
                            lambda page, keys: (mla_decode_gluon_kernel, gluon_decode.CONFIG))
    elif page % 64:
        pytest.skip("pages of 32 take the ring kernel either way")
    q, kv, bt, cl = make_case(B, s_q, H, L, R, page, lens, "cuda", seed=B * 13 + H + page)
    ref, ref_lse = decode_ref64(q, kv, bt, cl, SCALE, True, L)
    out, lse = _run(q, poison_unwritten_rows(kv, bt, cl), bt, cl, num_splits=splits)
    assert out.dtype == torch.bfloat16 and out.shape == (B, s_q, H, L)
    assert lse.shape == (B, H, s_q) and lse.dtype == torch.float32
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < 1e-2
    assert (lse.double() - ref_lse).abs().max().item() < 2e-3


@pytest.mark.parametrize("page", [64, 32])
def test_gluon_not_causal(page):
    q, kv, bt, cl = make_case(2, 2, 128, L, R, page, [900, 130], "cuda", seed=3)
    ref, ref_lse = decode_ref64(q, kv, bt, cl, SCALE, False, L)
    out, lse = lowering.mla_decode(q, kv, bt, cl, SCALE, causal=False, backend="gluon")
    assert rel_err(out, ref) < 1e-2
    assert (lse.double() - ref_lse).abs().max().item() < 2e-3


def test_gluon_capability_errors_and_auto_choice():
    q, kv, bt, cl = make_case(2, 1, 48, L, R, 64, [100, 40], "cuda")   # 48 rows: not few
    with pytest.raises(lowering.BackendUnavailable, match="multiple of 64"):
        lowering.mla_decode(q, kv, bt, cl, SCALE, backend="gluon")
    q, kv, bt, cl = make_case(2, 1, 64, L, R, 16, [100, 40], "cuda")
    with pytest.raises(lowering.BackendUnavailable, match="block_size"):
        lowering.mla_decode(q, kv, bt, cl, SCALE, backend="gluon")
    with pytest.raises(lowering.BackendUnavailable, match="bfloat16"):
        lowering.mla_decode(q.half(), kv.half(), bt, cl, SCALE, backend="gluon")
    k_scale = torch.ones(1, device="cuda")
    with pytest.raises(lowering.BackendUnavailable, match="block_size to be a multiple of 32"):
        lowering.mla_decode(q, kv.to(torch.float8_e4m3fn), bt, cl, SCALE, kv_cache_dtype="fp8",
                            k_scale=k_scale, backend="gluon")
    # TMA needs 16-byte aligned tensors: an offset view is refused before any launch
    flat = torch.randn(2 * 64 * 576 + 8, device="cuda", dtype=torch.bfloat16)
    q_off = flat[1:1 + 2 * 64 * 576].view(2, 1, 64, 576)
    q, kv, bt, cl = make_case(2, 1, 64, L, R, 64, [100, 40], "cuda")
    with pytest.raises(ValueError, match="q must start at a 16-byte aligned"):
        lowering.mla_decode(q_off, kv, bt, cl, SCALE, backend="gluon")
    # auto: FlashMLA first where it serves, else this backend for 64-head multiples
    q, kv, bt, cl = make_case(2, 1, 128, L, R, 64, [100, 40], "cuda")
    flashmla = lowering.decode.registry.route_unmet("flashmla", q, kv) is None
    assert lowering.select_backend(q, kv) == ("flashmla" if flashmla else "gluon")
    q, kv, bt, cl = make_case(2, 1, 64, L, R, 32, [100, 40], "cuda")
    assert lowering.select_backend(q, kv) == "gluon"          # FlashMLA needs page 64


def test_gluon_under_compile_and_cuda_graphs():
    """fullgraph compile (the op is one opaque node) and a CUDA-graph replay with changing
    lengths both match eager (through the backend's entry, as the Triton test does)."""
    B, H = 4, 128
    q, kv, bt, cl = make_case(B, 1, H, L, R, 64, [1500] * B, "cuda", seed=21)
    check_compiled_and_graphed(_run, "gluon_decode", q, kv, bt, cl)


def test_layer_decode_rows_on_the_gluon_backend():
    """The MLA layer (64 heads, decode rows only) with backend="gluon" against float64."""
    from scenario import Dims, Step, make_layer
    d = Dims(N=64, P=128, R=64, V=128, L=512)
    layer, kv_b = make_layer(d, torch.bfloat16)
    layer.backend = "gluon"
    step = Step(d, [300, 64, 5, 1000], [1, 1, 1, 1], block_size=64, dtype=torch.bfloat16)
    ref = step.reference(kv_b, layer.softmax_scale)
    before = lowering.backend_choices["gluon"]
    out = step.run_on_cuda(layer)
    assert lowering.backend_choices["gluon"] > before
    err = ((out.double().cpu() - ref).norm() / ref.norm()).item()
    assert err < 2e-2, err


# ---- fp8 q x fp8 cache (gluon_fp8_decode_kernel.py) ------------------------------------

def _fp8_case(B, s_q, H, page, lens, seed):
    q, kv, bt, cl = make_case(B, s_q, H, L, R, page, lens, "cuda", seed=seed)
    q8, q_scale = quantize_e4m3(q)
    kv8, k_scale = quantize_e4m3(kv)
    return q8, q_scale, kv8, k_scale, bt, cl


def _ref(q8, q_scale, kv8, k_scale, bt, cl, causal=True):
    return decode_ref64(q8.double() * q_scale.double(), kv8.double() * k_scale.double(), bt, cl,
                        SCALE, causal, L)


def _gluon(q8, kv8, bt, cl, q_scale, k_scale, causal=True, num_splits=0):
    from lowering.decode.gluon_decode import gluon_decode_fp8q_op
    return gluon_decode_fp8q_op(q8, kv8, bt, cl, q_scale, k_scale, SCALE, causal, num_splits)


@pytest.mark.parametrize("tiles", ["64-key where the page allows", "32-key"])
@pytest.mark.parametrize("B,s_q,H,page,lens,splits", CASES)
def test_gluon_fp8_vs_fp64(B, s_q, H, page, lens, splits, tiles, monkeypatch):
    from lowering.decode import gluon_decode
    # fp8_config takes 64-key tiles from FP8_LONG_SPLIT keys per split: force each way
    monkeypatch.setattr(gluon_decode, "FP8_LONG_SPLIT", 0 if tiles.startswith("64") else 1 << 40)
    q8, q_scale, kv8, k_scale, bt, cl = _fp8_case(B, s_q, H, page, lens, B * 13 + H + page)
    ref, ref_lse = _ref(q8, q_scale, kv8, k_scale, bt, cl)
    out, lse = _gluon(q8, poison_unwritten_rows(kv8, bt, cl), bt, cl, q_scale, k_scale,
                      num_splits=splits)
    assert out.dtype == torch.bfloat16 and out.shape == (B, s_q, H, L)
    assert lse.shape == (B, H, s_q) and lse.dtype == torch.float32
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < 5e-2          # P @ V with P in e4m3, as the Triton fp8 path
    assert (lse.double() - ref_lse).abs().max().item() < 1e-2


def test_gluon_fp8_not_causal():
    q8, q_scale, kv8, k_scale, bt, cl = _fp8_case(2, 2, 128, 64, [900, 130], seed=3)
    ref, ref_lse = _ref(q8, q_scale, kv8, k_scale, bt, cl, causal=False)
    out, lse = lowering.mla_decode_fp8q(q8, kv8, bt, cl, SCALE, q_scale=q_scale,
                                        k_scale=k_scale, causal=False, backend="gluon")
    assert rel_err(out, ref) < 5e-2
    assert (lse.double() - ref_lse).abs().max().item() < 1e-2


def test_auto_route_and_errors():
    q8, q_scale, kv8, k_scale, bt, cl = _fp8_case(2, 1, 128, 64, [700, 90], seed=5)
    ref, _ = _ref(q8, q_scale, kv8, k_scale, bt, cl)
    before = dict(lowering.backend_choices)
    out_a, _ = lowering.mla_decode_fp8q(q8, kv8, bt, cl, SCALE, q_scale=q_scale, k_scale=k_scale,
                                        backend="gluon")
    assert lowering.backend_choices["gluon-fp8q"] == before.get("gluon-fp8q", 0) + 1
    out_t, _ = lowering.mla_decode_fp8q(q8, kv8, bt, cl, SCALE, q_scale=q_scale, k_scale=k_scale,
                                        backend="triton")
    assert lowering.backend_choices["triton-fp8q"] == before.get("triton-fp8q", 0) + 1
    assert rel_err(out_a, ref) < 5e-2 and rel_err(out_t, ref) < 5e-2
    # what the kernel cannot serve: named for backend="gluon", the Triton kernel for "auto"
    # (FlashMLA's fp8 kernel cannot serve these either: block_size 64 and bf16 out only)
    for H, page, out_dtype, match in ((16, 16, torch.bfloat16, "multiple of 64"),
                                      (64, 16, torch.bfloat16, "block_size"),
                                      (64, 64, torch.float16, "bfloat16")):
        q8, q_scale, kv8, k_scale, bt, cl = _fp8_case(2, 1, H, page, [100, 40], seed=7)
        with pytest.raises(lowering.BackendUnavailable, match=match):
            lowering.mla_decode_fp8q(q8, kv8, bt, cl, SCALE, q_scale=q_scale, k_scale=k_scale,
                                     out_dtype=out_dtype, backend="gluon")
        n = lowering.backend_choices["triton-fp8q"]
        out, _ = lowering.mla_decode_fp8q(q8, kv8, bt, cl, SCALE, q_scale=q_scale,
                                          k_scale=k_scale, out_dtype=out_dtype)
        assert lowering.backend_choices["triton-fp8q"] == n + 1 and out.dtype == out_dtype
    # bad scales and misaligned tensors: errors before any launch
    q8, q_scale, kv8, k_scale, bt, cl = _fp8_case(2, 1, 64, 64, [100, 40], seed=8)
    with pytest.raises(ValueError, match="q_scale must hold one value"):
        lowering.mla_decode_fp8q(q8, kv8, bt, cl, SCALE, q_scale=q_scale.repeat(2),
                                 k_scale=k_scale, backend="gluon")
    q_off = misaligned_copy(q8)
    with pytest.raises(ValueError, match="q must start at a 16-byte aligned"):
        lowering.mla_decode_fp8q(q_off, kv8, bt, cl, SCALE, q_scale=q_scale, k_scale=k_scale,
                                 backend="gluon")


def test_gluon_fp8_under_compile_and_cuda_graphs():
    q8, q_scale, kv8, k_scale, bt, cl = _fp8_case(4, 1, 128, 64, [1500] * 4, seed=21)

    def run(q, kv, bt, cl):
        return _gluon(q.to(torch.float8_e4m3fn), kv, bt, cl, q_scale, k_scale)
    check_compiled_and_graphed(run, "gluon_decode_fp8q", q8.float(), kv8, bt, cl)


@pytest.mark.parametrize("route", ["gluon", "flashmla"])
def test_layer_fp8_decode_takes_the_fp8_kernel(route):
    """The MLA layer with an fp8 cache and an fp8 decode query (64 heads) on the GPU: the
    fp8 x fp8 call goes to the route's kernel, and the output matches float64."""
    from mla_ops.attention import build_decode_query
    from scenario import Dims, Step, make_layer
    d = Dims(N=64, P=128, R=64, V=128, L=512)
    if route == "flashmla":
        from lowering.decode.registry import route_unmet
        fp8 = torch.float8_e4m3fn
        reason = route_unmet("flashmla-fp8q", torch.empty(1, 1, d.N, 576, device="cuda", dtype=fp8),
                             torch.empty(1, 64, 576, device="cuda", dtype=fp8))
        if reason is not None:
            pytest.skip(f"flashmla fp8 route cannot serve here: {reason}")
    layer, kv_b = make_layer(d, torch.bfloat16, kv_cache_dtype="fp8")
    layer.backend = route
    step = Step(d, [300, 64, 5, 1000], [1, 1, 1, 1], block_size=64, dtype=torch.bfloat16,
                kv_cache_dtype="fp8")
    q_mqa = build_decode_query(step.inputs()[0], layer.W_UK_T)           # [4, N, 576]
    layer.enable_fp8_decode_query(q_mqa.float().abs().amax() / 448.0)
    ref = step.reference(kv_b, layer.softmax_scale)     # the unquantized query: ~2 % off
    before = lowering.backend_choices[f"{route}-fp8q"]
    out = step.run_on_cuda(layer)
    assert lowering.backend_choices[f"{route}-fp8q"] > before
    err = ((out.double().cpu() - ref).norm() / ref.norm()).item()
    assert err < 6e-2, err
