"""The Triton MLA decode kernels vs an independent float64 dense reference.

On a CPU these run under TRITON_INTERPRET=1 (set by conftest.py before triton is
imported), on small shapes: general widths L + R = 64 + 16, and the real 512 + 64
once. Inputs are random (never zeros) and every comparison could fail.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import lowering  # noqa: E402
import lowering.decode.triton_decode as td  # noqa: E402
from lowering import config  # noqa: E402
from lowering.decode.entry import run_decode  # noqa: E402
from lowering.decode.registry import DecodeCall  # noqa: E402
from mla_reference import decode_ref64, make_case, quantize_e4m3, rel_err  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SCALE = 0.11


def run_triton(q, kv, bt, cl, L, causal=True):
    return lowering.mla_decode(q, kv, bt, cl, SCALE, causal=causal, backend="triton",
                               head_dim_v=L)


def run_fp8q(q8, kv8, bt, cl, q_scale, k_scale, L):
    return lowering.mla_decode_fp8q(q8, kv8, bt, cl, SCALE, q_scale=q_scale, k_scale=k_scale,
                                    head_dim_v=L, backend="triton")


def set_config(monkeypatch, **values):
    """Set values in every kernel config (the CPU interpreter's and the GPU ones)."""
    for cfg in (td.CPU_CONFIG, *td.CONFIGS.values()):
        for key, value in values.items():
            monkeypatch.setitem(cfg, key, value)


def use_splits(monkeypatch, splits, programs):
    """Make the split sizing cut each request into `splits` splits, for a launch of
    `programs` (batch x row blocks x value parts) programs per split: the configs as
    data (no short-split floor) and an SM count of splits x programs. 0: the defaults."""
    if splits:
        set_config(monkeypatch, min_split_keys=1)
        monkeypatch.setattr(td, "device_sm_count", lambda device: splits * programs)


def check(out, lse, ref, ref_lse, tol=1e-2, lse_tol=2e-3):
    assert torch.isfinite(out.float()).all() and torch.isfinite(lse).all()
    assert rel_err(out, ref) < tol
    assert (lse.double() - ref_lse).abs().max().item() < lse_tol


@pytest.mark.parametrize("B,s_q,H,page,lens,splits", [
    (2, 1, 4, 16, [1, 5], 0),            # seq_len 1
    (3, 1, 2, 16, [37, 70, 17], 0),      # lengths not multiples of the page
    (2, 1, 4, 16, [100, 61], 6),         # many splits, some shorter than others
    (2, 1, 2, 16, [300, 9], 21),         # more splits than one merge step reads, some empty
    (2, 2, 2, 16, [40, 2], 3),           # s_q 2, causal, a length equal to s_q
    (1, 3, 4, 1, [23], 2),               # page size 1
    (2, 4, 2, 64, [130, 70], 3),         # s_q 4, page 64
    (1, 2, 3, 128, [150], 2),            # page 128, odd head count
])
def test_triton_matches_fp64(monkeypatch, B, s_q, H, page, lens, splits):
    L, R = 64, 16
    use_splits(monkeypatch, splits, B)                 # s_q * H <= 16 rows: one row block
    q, kv, bt, cl = make_case(B, s_q, H, L, R, page, lens, DEV, seed=B * 100 + s_q + page)
    out, lse = run_triton(q, kv, bt, cl, L)
    ref, ref_lse = decode_ref64(q, kv, bt, cl, SCALE, True, L)
    assert out.shape == (B, s_q, H, L) and out.dtype == q.dtype
    assert lse.shape == (B, H, s_q) and lse.dtype == torch.float32
    check(out, lse, ref, ref_lse)


@pytest.mark.parametrize("split_block,part_l", [(4, 64), (16, 64), (4, 16), (16, 32)])
def test_merge_split_blocks_match_fp64(monkeypatch, split_block, part_l):
    # The merge reads the splits in blocks: several blocks, the last one partial; with
    # part_l < L each row is merged by L / part_l programs of part_l value columns.
    monkeypatch.setattr(td, "MERGE_SPLIT_BLOCK", split_block)
    monkeypatch.setattr(td, "MERGE_PART_L", part_l)
    assert td.merge_block_l(2, 4, 64, False) == min(part_l, 64)
    assert td.merge_block_l(2, 4, 64, True) == 64          # batch-invariant: whole rows
    use_splits(monkeypatch, 11, 2)
    L, R = 64, 16
    q, kv, bt, cl = make_case(2, 2, 2, L, R, 16, [200, 3], DEV, seed=11)
    out, lse = run_triton(q, kv, bt, cl, L)
    ref, ref_lse = decode_ref64(q, kv, bt, cl, SCALE, True, L)
    check(out, lse, ref, ref_lse)


def test_real_width_576_through_mla_decode():
    L, R = 512, 64
    q, kv, bt, cl = make_case(1, 2, 2, L, R, 16, [37], DEV, seed=7)
    out, lse = lowering.mla_decode(q, kv, bt, cl, SCALE, backend="triton")
    ref, ref_lse = decode_ref64(q, kv, bt, cl, SCALE, True, L)
    check(out, lse, ref, ref_lse)


def test_non_causal_and_fp16(monkeypatch):
    L, R = 64, 16
    use_splits(monkeypatch, 2, 2)
    q, kv, bt, cl = make_case(2, 2, 2, L, R, 16, [33, 9], DEV, dtype=torch.float16, seed=3)
    out, lse = run_triton(q, kv, bt, cl, L, causal=False)
    ref, ref_lse = decode_ref64(q, kv, bt, cl, SCALE, False, L)
    assert out.dtype == torch.float16
    check(out, lse, ref, ref_lse)


def test_fp8_kv_cache_vs_dequantized_reference():
    L, R = 64, 16
    q, kv, bt, cl = make_case(2, 2, 4, L, R, 16, [45, 20], DEV, seed=11)
    kv8, k_scale = quantize_e4m3(kv * 3.0)
    out, lse = lowering.mla_decode(q, kv8, bt, cl, SCALE, kv_cache_dtype="fp8", k_scale=k_scale,
                                   backend="triton", head_dim_v=L)
    ref, ref_lse = decode_ref64(q, kv8.double() * k_scale.double(), bt, cl, SCALE, True, L)
    check(out, lse, ref, ref_lse)


def test_fp8_query_and_cache_with_scales(monkeypatch):
    L, R = 64, 32      # fp8 tensor-core dots need a reduction width >= 32
    use_splits(monkeypatch, 2, 2)
    q, kv, bt, cl = make_case(2, 1, 4, L, R, 16, [50, 33], DEV, seed=12)
    kv8, k_scale = quantize_e4m3(kv)
    q8, q_scale = quantize_e4m3(q * 5.0)
    out, lse = run_fp8q(q8, kv8, bt, cl, q_scale, k_scale, L)
    ref, ref_lse = decode_ref64(q8.double() * q_scale.double(), kv8.double() * k_scale.double(),
                                bt, cl, SCALE, True, L)
    assert out.dtype == torch.bfloat16
    check(out, lse, ref, ref_lse)


@pytest.mark.parametrize("kind", ["bf16", "fp8-cache", "fp8-q"])
@pytest.mark.parametrize("splits", [1, 3])
def test_half_value_column_programs(monkeypatch, kind, splits):
    """V_PARTS=2: two programs per row block, each writing half of the L columns (and the
    first the lse); 3 row blocks of 16 rows for 40 (token, head) rows, a length of 1."""
    L, R, H, s_q = 64, 32, 20, 2
    use_splits(monkeypatch, splits, 2 * 3 * 2)
    set_config(monkeypatch, BLOCK_M=16, V_PARTS=2)
    q, kv, bt, cl = make_case(2, s_q, H, L, R, 16, [77, 2], DEV, seed=21 + splits)
    if kind == "bf16":
        q = q.to(torch.bfloat16)
        kv = kv.to(torch.bfloat16)
        out, lse = run_triton(q, kv, bt, cl, L)
        ref, ref_lse = decode_ref64(q, kv, bt, cl, SCALE, True, L)
    else:
        kv8, k_scale = quantize_e4m3(kv)
        kv_ref = kv8.double() * k_scale.double()
        if kind == "fp8-cache":
            out, lse = lowering.mla_decode(q, kv8, bt, cl, SCALE, kv_cache_dtype="fp8",
                                           k_scale=k_scale, backend="triton", head_dim_v=L)
            ref, ref_lse = decode_ref64(q, kv_ref, bt, cl, SCALE, True, L)
        else:
            q8, q_scale = quantize_e4m3(q * 5.0)
            out, lse = run_fp8q(q8, kv8, bt, cl, q_scale, k_scale, L)
            ref, ref_lse = decode_ref64(q8.double() * q_scale.double(), kv_ref, bt, cl, SCALE,
                                        True, L)
    assert out.shape == (2, s_q, H, L)
    check(out, lse, ref, ref_lse)


def test_fp8q_rejects_bad_scales():
    L, R = 64, 16
    q, kv, bt, cl = make_case(1, 1, 2, L, R, 16, [10], DEV)
    kv8, k_scale = quantize_e4m3(kv)
    q8, q_scale = quantize_e4m3(q)
    with pytest.raises(ValueError, match="q_scale"):
        run_fp8q(q8, kv8, bt, cl, q_scale.repeat(2), k_scale, L)
    with pytest.raises(TypeError, match="q"):
        run_fp8q(q, kv8, bt, cl, q_scale, k_scale, L)
    with pytest.raises(lowering.BackendUnavailable, match=">= 32"):   # R = 16 too narrow for fp8
        run_fp8q(q8, kv8, bt, cl, q_scale, k_scale, L)
    with pytest.raises(lowering.BackendUnavailable, match=">= 32"):   # and "auto" says why
        lowering.mla_decode_fp8q(q8, kv8, bt, cl, SCALE, q_scale=q_scale, k_scale=k_scale,
                                 head_dim_v=L)


@pytest.mark.parametrize("merge_block", [16, 2])
def test_batch_invariant_mode_is_bit_exact(monkeypatch, merge_block):
    # A small fixed split so requests span several splits on the interpreter; with a
    # merge step of 2 splits the wider table below adds whole merge steps.
    monkeypatch.setattr(td, "INVARIANT_CHUNK", 32)
    monkeypatch.setattr(td, "MERGE_SPLIT_BLOCK", merge_block)
    L, R, H = 64, 16, 2
    lens = [90, 33, 64, 7]
    q, kv, bt, cl = make_case(4, 1, H, L, R, 16, lens, DEV, seed=5)
    with config.patch(batch_invariant=True):
        full_o, full_l = run_triton(q, kv, bt, cl, L)
        for idx in ([0], [2, 0], [3, 1, 0, 0]):
            i = torch.tensor(idx, device=DEV)
            o, l = run_triton(q[i].contiguous(), kv, bt[i].contiguous(), cl[i].contiguous(), L)
            for j, src in enumerate(idx):
                assert torch.equal(o[j], full_o[src]), (idx, j)
                assert torch.equal(l[j], full_l[src]), (idx, j)
        # A wider block table (more, empty, splits) leaves the result unchanged too.
        wide_bt = torch.cat([bt, torch.full_like(bt, -1)], dim=1)
        o, l = run_triton(q, kv, wide_bt, cl, L)
    assert torch.equal(o, full_o) and torch.equal(l, full_l)
    ref, ref_lse = decode_ref64(q, kv, bt, cl, SCALE, True, L)
    check(full_o, full_l, ref, ref_lse)


def test_split_count_choice():
    assert td.choose_num_splits(64, 2, 8192, 132) == 1            # grid already full
    assert td.choose_num_splits(32, 2, 4096, 132) == 2
    assert td.choose_num_splits(1, 2, 4096, 132) == 32            # capped by MIN_SPLIT_KEYS
    assert td.choose_num_splits(1, 2, 100, 132) == 1              # short: one split
    assert 1 <= td.choose_num_splits(1, 1, 1 << 20, 132) <= td.MAX_SPLITS


def test_backend_choice_and_errors():
    L, R = 64, 16
    q, kv, bt, cl = make_case(1, 1, 2, L, R, 16, [10], DEV)
    if DEV == "cpu":
        assert lowering.select_backend(q, kv) == "reference"     # auto never picks the interpreter
        with pytest.raises(lowering.BackendUnavailable, match="CUDA"):
            lowering.mla_decode(q, kv, bt, cl, SCALE, backend="flashmla")
    assert lowering.select_backend(q, kv, backend="triton") == "triton"
    with pytest.raises(lowering.BackendUnavailable, match="power of two"):
        lowering.mla_decode(q, kv, bt, cl, SCALE, backend="triton", head_dim_v=48)
    with pytest.raises(lowering.BackendUnavailable, match="bfloat16 or float16"):
        lowering.mla_decode(q.float(), kv.float(), bt, cl, SCALE, backend="triton")


@pytest.mark.parametrize("fp8q", [False, True])
def test_kernel_bounds_unchecked_inputs(fp8q):
    # Without the value checks (CUDA with validation off, or a captured graph) nothing
    # checks lengths or page ids; the triton routes bound them inside the kernel (no
    # clamp kernels before it): no out-of-bounds access (the interpreter raises on one),
    # and the same result as inputs clamped the way bound_decode_inputs clamps them.
    L, R, page = 64, 32, 16
    q, kv, bt, cl = make_case(3, 1, 2, L, R, page, [40, 20, 33], DEV, seed=3)
    bad_bt = bt.clone()
    bad_bt[0, 1], bad_bt[1, 0] = 10_000, -5
    bad_cl = torch.tensor([10_000, 0, 33], dtype=torch.int32, device=DEV)
    good_bt, good_cl = lowering.bound_decode_inputs(kv, bad_bt, bad_cl)
    extra = {}
    if fp8q:
        kv, k_scale = quantize_e4m3(kv)
        q, q_scale = quantize_e4m3(q)
        extra = dict(q_scale=q_scale, out_dtype=torch.bfloat16)
    kind = "fp8" if fp8q else "auto"
    query = "fp8q" if fp8q else "bf16"
    k_scale = k_scale if fp8q else None

    def run(table, lens):
        call = DecodeCall(q, kv, table, lens, SCALE, True, kind, k_scale, L, **extra)
        return run_decode(call, query, "triton")

    out, lse = run(bad_bt, bad_cl)
    want, want_lse = run(good_bt, good_cl)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    assert torch.equal(out[2], run(bt, cl)[0][2])                    # the valid row untouched
    if DEV != "cpu":
        return
    with pytest.raises(ValueError, match="cache_seqlens"):              # checked on CPU
        if fp8q:
            lowering.mla_decode_fp8q(q, kv, bad_bt, bad_cl, SCALE, q_scale=extra["q_scale"],
                                     k_scale=k_scale, head_dim_v=L, backend="triton")
        else:
            lowering.mla_decode(q, kv, bad_bt, bad_cl, SCALE, backend="triton", head_dim_v=L)
