"""The fp8-cache decode kernel (lowering/decode/triton_fp8_cache_kernel.py) vs an
independent float64 dense reference on the dequantized values.

Under the CPU interpreter (TRITON_INTERPRET=1, set by conftest.py) on small widths
(L + R = 64 + 16 or 64 + 32; the real 512 + 64 once). Inputs are random, never zeros;
the cache is e4m3 with a per-tensor k_scale far from 1. Each test checks which kernel
ran, so a config change that routes around the kernel fails here rather than passing
on the other kernel.
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
from mla_reference import (decode_ref64, make_case, poison_unwritten_rows,  # noqa: E402
                           quantize_e4m3, rel_err)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SCALE = 0.11


@pytest.fixture
def launches(monkeypatch):
    """Counts of stage-1 launches by kernel: {"fp8_cache": n, "stage1": n}."""
    counts = {"fp8_cache": 0, "stage1": 0}
    fp8_launch, stage1_launch = td.launch_fp8_cache_stage1, td.launch_stage1

    def fp8(*args):
        counts["fp8_cache"] += 1
        return fp8_launch(*args)

    def stage1(*args):
        counts["stage1"] += 1
        return stage1_launch(*args)
    monkeypatch.setattr(td, "launch_fp8_cache_stage1", fp8)
    monkeypatch.setattr(td, "launch_stage1", stage1)
    return counts


def every_config(monkeypatch, **values):
    """Set values in every config (the interpreter's and the GPU table's)."""
    for cfg in (td.CPU_CONFIG, td.CPU_FP8_CACHE_CONFIG, *td.CONFIGS.values()):
        for key, value in values.items():
            monkeypatch.setitem(cfg, key, value)


def use_splits(monkeypatch, splits, programs):
    """Cut each request into `splits` splits for a launch of `programs` programs per
    split (no short-split floor, an SM count of splits x programs); 0: the defaults."""
    if splits:
        every_config(monkeypatch, min_split_keys=1)
        monkeypatch.setattr(td, "device_sm_count", lambda device: splits * programs)


def fp8_case(B, s_q, H, L, R, page, lens, seed, dtype=torch.bfloat16):
    """(q, kv8, k_scale, bt, cl, kv_true): random q and an e4m3 cache whose largest value
    maps to 448 (so k_scale is ~0.01, nowhere near 1); kv_true its float64 values."""
    q, kv, bt, cl = make_case(B, s_q, H, L, R, page, lens, DEV, dtype=dtype, seed=seed)
    kv8, k_scale = quantize_e4m3(kv.float() * 3.0)
    return q, kv8, k_scale, bt, cl, kv8.double() * k_scale.double()


def check(out, lse, ref, ref_lse, tol=1e-2, lse_tol=2e-3):
    assert torch.isfinite(out.float()).all() and torch.isfinite(lse).all()
    assert rel_err(out, ref) < tol
    assert (lse.double() - ref_lse).abs().max().item() < lse_tol


def decode_fp8(q, kv8, k_scale, bt, cl, L, causal=True):
    return lowering.mla_decode(q, kv8, bt, cl, SCALE, causal=causal, kv_cache_dtype="fp8",
                               k_scale=k_scale, backend="triton", head_dim_v=L)


# (B, s_q, H, page, lengths, splits: 0 = chosen from the shapes)
CASES = [
    (3, 1, 16, 16, [1, 37, 16], 0),          # length 1; one not a multiple of the tile
    (2, 1, 16, 16, [100, 61], 5),            # several splits, uneven
    (2, 1, 16, 16, [300, 9], 21),            # more splits than a merge step; empty splits
    (2, 2, 16, 64, [70, 2], 3),              # s_q 2 (32 rows: two row blocks), length = s_q
    (1, 3, 4, 1, [23], 2),                   # page size 1, three tokens of 4 heads
    (2, 1, 5, 128, [150, 129], 1),           # one split (the direct path), odd head count
]


@pytest.mark.parametrize("B,s_q,H,page,lens,splits", CASES)
def test_fp8_cache_kernel_matches_fp64(monkeypatch, launches, B, s_q, H, page, lens, splits):
    L, R = 64, 16
    m_blocks = -(-s_q * H // 16)
    use_splits(monkeypatch, splits, B * m_blocks)
    q, kv8, k_scale, bt, cl, kv_true = fp8_case(B, s_q, H, L, R, page, lens, seed=B + page)
    out, lse = decode_fp8(q, kv8, k_scale, bt, cl, L)
    ref, ref_lse = decode_ref64(q, kv_true, bt, cl, SCALE, True, L)
    assert launches == {"fp8_cache": 1, "stage1": 0}
    assert out.shape == (B, s_q, H, L) and out.dtype == q.dtype
    assert lse.shape == (B, H, s_q) and lse.dtype == torch.float32
    check(out, lse, ref, ref_lse)


@pytest.mark.parametrize("B,s_q,H,page,lens,splits", [CASES[0], CASES[2], CASES[3]])
def test_values_read_again_for_pv(monkeypatch, launches, B, s_q, H, page, lens, splits):
    """RELOAD_V: the value chunks loaded a second time for P V (same results)."""
    L, R = 64, 16
    monkeypatch.setitem(td.CPU_FP8_CACHE_CONFIG, "RELOAD_V", True)
    use_splits(monkeypatch, splits, B * -(-s_q * H // 16))
    q, kv8, k_scale, bt, cl, kv_true = fp8_case(B, s_q, H, L, R, page, lens, seed=B + 2 * page)
    kv8 = poison_unwritten_rows(kv8, bt, cl)
    out, lse = decode_fp8(q, kv8, k_scale, bt, cl, L)
    ref, ref_lse = decode_ref64(q, torch.nan_to_num(kv8.double() * k_scale.double()), bt, cl,
                                SCALE, True, L)
    assert launches == {"fp8_cache": 1, "stage1": 0}
    check(out, lse, ref, ref_lse)


@pytest.mark.parametrize("kernel", ["fp8_cache", "stage1"])
@pytest.mark.parametrize("splits", [1, 4])
def test_128_heads_both_kernels(monkeypatch, launches, kernel, splits):
    """128 heads (wide): the table's kernel for it, and the fp8-cache kernel named there
    (eight 16-row blocks of one request reading the same tiles)."""
    L, R, H = 64, 16, 128
    every_config(monkeypatch, BLOCK_N=16)
    monkeypatch.setitem(td.CPU_CONFIG, "kernel", kernel)
    blocks = 8 if kernel == "fp8_cache" else 2
    use_splits(monkeypatch, splits, 2 * blocks)
    q, kv8, k_scale, bt, cl, kv_true = fp8_case(2, 1, H, L, R, 16, [45, 1], seed=31 + splits)
    out, lse = decode_fp8(q, kv8, k_scale, bt, cl, L)
    ref, ref_lse = decode_ref64(q, kv_true, bt, cl, SCALE, True, L)
    assert launches[kernel] == 1 and sum(launches.values()) == 1
    check(out, lse, ref, ref_lse)


@pytest.mark.parametrize("block_n", [16, 32])
def test_fp8_query_through_the_kernel(monkeypatch, launches, block_n):
    """mla_decode_fp8q (e4m3 q with q_scale) at 16 heads: the same kernel, q widened."""
    L, R = 64, 32
    every_config(monkeypatch, BLOCK_N=block_n)
    use_splits(monkeypatch, 3, 2)
    q, kv8, k_scale, bt, cl, kv_true = fp8_case(2, 1, 16, L, R, 16, [77, 33], seed=12)
    q8, q_scale = quantize_e4m3(q * 5.0)
    out, lse = lowering.mla_decode_fp8q(q8, kv8, bt, cl, SCALE, q_scale=q_scale,
                                        k_scale=k_scale, head_dim_v=L, backend="triton")
    ref, ref_lse = decode_ref64(q8.double() * q_scale.double(), kv_true, bt, cl, SCALE, True, L)
    assert launches == {"fp8_cache": 1, "stage1": 0}
    assert out.dtype == torch.bfloat16
    check(out, lse, ref, ref_lse)


def test_non_causal_fp16_query_and_unwritten_rows(monkeypatch, launches):
    """fp16 q, not causal, e4m3 NaN bytes in the unwritten rows of each last page."""
    L, R = 64, 16
    use_splits(monkeypatch, 2, 2)
    q, kv8, k_scale, bt, cl, _ = fp8_case(2, 2, 8, L, R, 16, [33, 9], seed=3,
                                          dtype=torch.float16)
    kv8 = poison_unwritten_rows(kv8, bt, cl)
    out, lse = decode_fp8(q, kv8, k_scale, bt, cl, L, causal=False)
    kv_true = kv8.double() * k_scale.double()
    ref, ref_lse = decode_ref64(q, torch.nan_to_num(kv_true), bt, cl, SCALE, False, L)
    assert out.dtype == torch.float16
    assert launches["fp8_cache"] == 1
    check(out, lse, ref, ref_lse)


def test_large_query_values_stay_finite(launches):
    """A bf16 query up to 1e5 (fp16's range is 65504: the kernel scales q by 1/16)."""
    L, R = 64, 16
    q, kv8, k_scale, bt, cl, kv_true = fp8_case(1, 1, 16, L, R, 16, [40], seed=8)
    q = (q.float() * 1e5 / q.float().abs().amax()).to(torch.bfloat16)
    out, lse = lowering.mla_decode(q, kv8, bt, cl, 1e-6, kv_cache_dtype="fp8", k_scale=k_scale,
                                   backend="triton", head_dim_v=L)
    ref, ref_lse = decode_ref64(q, kv_true, bt, cl, 1e-6, True, L)
    assert launches["fp8_cache"] == 1
    check(out, lse, ref, ref_lse)


def test_real_width_576(launches):
    L, R = 512, 64
    q, kv8, k_scale, bt, cl, kv_true = fp8_case(1, 1, 16, L, R, 64, [70], seed=7)
    out, lse = decode_fp8(q, kv8, k_scale, bt, cl, L)
    ref, ref_lse = decode_ref64(q, kv_true, bt, cl, SCALE, True, L)
    assert launches["fp8_cache"] == 1
    check(out, lse, ref, ref_lse)


def test_narrow_value_width_falls_back_to_stage1(launches):
    """L = 32: four chunks of 8 columns are too narrow for an MMA operand, so the
    general stage-1 kernel serves the call (same results)."""
    L, R = 32, 16
    q, kv8, k_scale, bt, cl, kv_true = fp8_case(2, 1, 16, L, R, 16, [20, 5], seed=4)
    out, lse = decode_fp8(q, kv8, k_scale, bt, cl, L)
    ref, ref_lse = decode_ref64(q, kv_true, bt, cl, SCALE, True, L)
    assert launches == {"fp8_cache": 0, "stage1": 1}
    check(out, lse, ref, ref_lse)


def test_batch_invariant_mode_is_bit_exact(monkeypatch, launches):
    monkeypatch.setattr(td, "INVARIANT_CHUNK", 32)
    L, R, H = 64, 16, 16
    lens = [90, 33, 64, 7]
    q, kv8, k_scale, bt, cl, kv_true = fp8_case(4, 1, H, L, R, 16, lens, seed=5)
    with config.patch(batch_invariant=True):
        full_o, full_l = decode_fp8(q, kv8, k_scale, bt, cl, L)
        for idx in ([0], [2, 0], [3, 1, 0, 0]):
            i = torch.tensor(idx, device=DEV)
            o, l = decode_fp8(q[i].contiguous(), kv8, k_scale, bt[i].contiguous(),
                              cl[i].contiguous(), L)
            for j, src in enumerate(idx):
                assert torch.equal(o[j], full_o[src]) and torch.equal(l[j], full_l[src])
        wide_bt = torch.cat([bt, torch.full_like(bt, -1)], dim=1)     # more, empty, splits
        o, l = decode_fp8(q, kv8, k_scale, wide_bt, cl, L)
    assert torch.equal(o, full_o) and torch.equal(l, full_l)
    assert launches["stage1"] == 0
    ref, ref_lse = decode_ref64(q, kv_true, bt, cl, SCALE, True, L)
    check(full_o, full_l, ref, ref_lse)


def test_kernel_bounds_unchecked_inputs(launches):
    """Bad lengths and page ids (what a captured graph might be handed): no out-of-bounds
    read (the interpreter raises on one), the result of the clamped inputs."""
    L, R = 64, 16
    q, kv8, k_scale, bt, cl, _ = fp8_case(3, 1, 16, L, R, 16, [40, 20, 33], seed=3)
    bad_bt = bt.clone()
    bad_bt[0, 1], bad_bt[1, 0] = 10_000, -5
    bad_cl = torch.tensor([10_000, 0, 33], dtype=torch.int32, device=DEV)
    good_bt, good_cl = lowering.bound_decode_inputs(kv8, bad_bt, bad_cl)

    def run(table, lens):
        call = DecodeCall(q, kv8, table, lens, SCALE, True, "fp8", k_scale, L)
        return run_decode(call, "bf16", "triton")
    out, lse = run(bad_bt, bad_cl)
    want, want_lse = run(good_bt, good_cl)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    assert torch.equal(out[2], run(bt, cl)[0][2])
    assert launches["stage1"] == 0


def test_config_table_and_split_sizing():
    """The GPU table names the fp8-cache kernel for fp8 caches at <= 32 query rows, and
    splits are sized for its two CTAs per SM on 132 SMs (the memory-bound shapes)."""
    for kind in (1, 2):
        cfg = td.pick_config(kind, 16, on_gpu=True)
        assert cfg.get("kernel") == "fp8_cache"
        assert td.pick_config(kind, 32, on_gpu=True) is cfg
        assert td.pick_config(kind, 128, on_gpu=True).get("kernel", "stage1") == "stage1"
        assert td.INVARIANT_CHUNK % cfg["BLOCK_N"] == 0
    assert td.pick_config(0, 16, on_gpu=True).get("kernel", "stage1") == "stage1"
    cfg = td.CONFIGS[(1, "narrow", "gpu")]
    splits = {B: td.choose_num_splits(B, 1, S, 132, cfg["ctas_per_sm"])
              for B, S in ((128, 4096), (256, 1024), (64, 8192), (8, 4096), (1, 4096))}
    assert splits == {128: 2, 256: 1, 64: 4, 8: 32, 1: 32}


def test_sweep_script_smoke_run():
    """benchmarks/sweep_fp8_cache_decode.py runs end to end (on the CPU interpreter: tiny
    shapes, two candidates) and prints a config entry to paste."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    if DEV != "cpu":
        pytest.skip("the smoke run is for the CPU interpreter")
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "benchmarks/sweep_fp8_cache_decode.py", "--device",
                          "cpu", "--shapes", "1x16x128", "--candidates",
                          "fp8c-m16n32w4s2c2,stage1-n64w8s3c1"], cwd=root, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "(1, 'narrow', 'gpu'): dict(" in run.stdout, run.stdout
    assert "WRONG" not in run.stdout and "FAILED" not in run.stdout, run.stdout
