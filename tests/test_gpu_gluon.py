"""GPU tests of the "gluon" decode backend (Hopper ping-pong kernel) against the float64
reference: edge lengths, many and empty splits, s_q > 1 (causal or not), page sizes,
NaN in unwritten cache rows, capability errors, torch.compile and CUDA graphs.

Skipped cleanly without a CUDA device, and where the backend cannot serve (not SM90, or
a triton without Gluon's Hopper API).
"""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

import lowering  # noqa: E402
from mla_reference import check_compiled_and_graphed, decode_ref64, make_case, rel_err  # noqa: E402

L, R = 512, 64
SCALE = 192 ** -0.5


@pytest.fixture(autouse=True)
def _needs_gluon():
    from lowering.gluon_decode import gluon_unmet
    q = torch.empty(1, 1, 64, L + R, device="cuda", dtype=torch.bfloat16)
    kv = torch.empty(1, 64, L + R, device="cuda", dtype=torch.bfloat16)
    reason = gluon_unmet(q, kv, "auto")
    if reason is not None:
        pytest.skip(f"gluon backend cannot serve here: {reason}")


def _run(q, kv, bt, cl, causal=True, num_splits=0):
    from lowering.gluon_decode import gluon_mla_decode
    return gluon_mla_decode(q, kv, bt, cl, SCALE, causal=causal, kind="auto", k_scale=None,
                            head_dim_v=L, num_splits=num_splits)


def _poison_unwritten_rows(kv, bt, cl):
    """NaN in every cache row past a request's length in its last page (what an
    unwritten or freed slot may hold): the kernel must not let it reach P @ V."""
    page = kv.shape[1]
    kv = kv.clone()
    for b, n in enumerate(cl.tolist()):
        if n % page:
            kv[int(bt[b, n // page]), n % page:] = float("nan")
    return kv


@pytest.mark.parametrize("B,s_q,H,page,lens,splits", [
    (4, 1, 128, 64, [3000, 2999, 1, 64], 0),       # length 1, a full page, odd lengths
    (3, 1, 64, 64, [1, 100, 777], 4),             # more splits than tiles: empty splits
    (2, 2, 128, 64, [1500, 33], 0),               # two query tokens, causal
    (1, 3, 64, 128, [700], 0),                    # page 128, three tokens
    (5, 1, 64, 32, [9000, 31, 32, 4097, 250], 0),  # page 32 (one tile per page)
    (2, 1, 128, 64, [5000, 40], 48),              # many splits, most of row 2's empty
    (1, 1, 128, 64, [4096], 1),                   # one split: the direct (unmerged) path
])
def test_gluon_vs_fp64(B, s_q, H, page, lens, splits):
    q, kv, bt, cl = make_case(B, s_q, H, L, R, page, lens, "cuda", seed=B * 13 + H + page)
    ref, ref_lse = decode_ref64(q, kv, bt, cl, SCALE, True, L)
    out, lse = _run(q, _poison_unwritten_rows(kv, bt, cl), bt, cl, num_splits=splits)
    assert out.dtype == torch.bfloat16 and out.shape == (B, s_q, H, L)
    assert lse.shape == (B, H, s_q) and lse.dtype == torch.float32
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < 1e-2
    assert (lse.double() - ref_lse).abs().max().item() < 2e-3


def test_gluon_not_causal():
    q, kv, bt, cl = make_case(2, 2, 128, L, R, 64, [900, 130], "cuda", seed=3)
    ref, ref_lse = decode_ref64(q, kv, bt, cl, SCALE, False, L)
    out, lse = lowering.mla_decode(q, kv, bt, cl, SCALE, causal=False, backend="gluon")
    assert rel_err(out, ref) < 1e-2
    assert (lse.double() - ref_lse).abs().max().item() < 2e-3


def test_gluon_capability_errors_and_auto_choice():
    q, kv, bt, cl = make_case(2, 1, 16, L, R, 64, [100, 40], "cuda")
    with pytest.raises(lowering.BackendUnavailable, match="multiple of 64"):
        lowering.mla_decode(q, kv, bt, cl, SCALE, backend="gluon")
    q, kv, bt, cl = make_case(2, 1, 64, L, R, 16, [100, 40], "cuda")
    with pytest.raises(lowering.BackendUnavailable, match="block_size"):
        lowering.mla_decode(q, kv, bt, cl, SCALE, backend="gluon")
    with pytest.raises(lowering.BackendUnavailable, match="bfloat16"):
        lowering.mla_decode(q.half(), kv.half(), bt, cl, SCALE, backend="gluon")
    k_scale = torch.ones(1, device="cuda")
    with pytest.raises(lowering.BackendUnavailable, match="bf16 cache"):
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
    flashmla = lowering.backends.unmet_condition("flashmla", q, kv, "auto") is None
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
    from mla_ops import MLAMetadata
    from scenario import Dims, Step, make_layer
    d = Dims(N=64, P=128, R=64, V=128, L=512)
    layer, kv_b = make_layer(d, torch.bfloat16)
    layer.backend = "gluon"
    step = Step(d, [300, 64, 5, 1000], [1, 1, 1, 1], block_size=64, dtype=torch.bfloat16)
    ref = step.reference(kv_b, layer.softmax_scale)
    step.cache.kv[0] = step.cache.kv[0].cuda()
    step.cache.k_scale = step.cache.k_scale.cuda()
    layer.cuda()
    m = step.meta
    meta = MLAMetadata(m.slot_mapping.cuda(), m.block_table.cuda(), m.seq_lens.cuda(),
                       m.query_start_loc.cuda(), m.num_decode_tokens)
    before = lowering.backend_choices["gluon"]
    q, kv_c, k_pe = (t.cuda() for t in step.inputs())
    out = layer(q, kv_c, k_pe, step.cache.kv[0], step.cache.k_scale, meta)
    assert lowering.backend_choices["gluon"] > before
    err = ((out.double().cpu() - ref).norm() / ref.norm()).item()
    assert err < 2e-2, err
