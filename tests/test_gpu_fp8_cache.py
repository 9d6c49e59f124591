"""GPU tests of the fp8-cache decode kernel (triton_fp8_cache_kernel.py) at real MLA widths
against the float64 reference on the dequantized values: 16 heads through the config
table (bf16 and fp8 query), 128 heads with the kernel named in the table's wide entry,
edge lengths, many and empty splits, the direct path, s_q > 1, e4m3 NaN in unwritten
rows, torch.compile and CUDA graphs. Skipped cleanly without a CUDA device.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

import lowering  # noqa: E402
import lowering.decode.triton_decode as td  # noqa: E402
from mla_reference import (check_compiled_and_graphed, decode_ref64, make_case,  # noqa: E402
                           poison_unwritten_rows, quantize_e4m3, rel_err)

L, R = 512, 64
SCALE = 192 ** -0.5


def fp8_case(B, s_q, H, page, lens, seed):
    q, kv, bt, cl = make_case(B, s_q, H, L, R, page, lens, "cuda", seed=seed)
    kv8, k_scale = quantize_e4m3(kv)
    return q, poison_unwritten_rows(kv8, bt, cl), k_scale, bt, cl


def reference(q, kv8, k_scale, bt, cl, causal=True):
    kv_true = torch.nan_to_num(kv8.double() * k_scale.double())
    return decode_ref64(q, kv_true, bt, cl, SCALE, causal, L)


# (B, s_q, H, page, lengths, wide entry forced to the fp8-cache kernel)
CASES = [
    (5, 1, 16, 64, [4000, 1, 63, 64, 65], False),   # length 1, around a page and a tile
    (1, 1, 16, 64, [20000], False),                 # one request: many splits
    (3, 2, 16, 16, [1500, 2, 333], False),          # two tokens (32 rows), page 16
    (300, 1, 16, 64, [1000] * 299 + [7], False),    # more requests than CTAs: one split
    (4, 1, 128, 64, [3000, 1, 129, 4097], True),    # 128 heads: eight 16-row blocks
]


@pytest.mark.parametrize("B,s_q,H,page,lens,wide", CASES)
def test_fp8_cache_kernel_vs_fp64(monkeypatch, B, s_q, H, page, lens, wide):
    if wide:
        monkeypatch.setitem(td.CONFIGS, (1, "wide", "gpu"), td.CONFIGS[(1, "narrow", "gpu")])
    assert td.pick_config(1, s_q * H, True).get("kernel") == "fp8_cache"
    q, kv8, k_scale, bt, cl = fp8_case(B, s_q, H, page, lens, seed=B + H)
    out, lse = lowering.mla_decode(q, kv8, bt, cl, SCALE, kv_cache_dtype="fp8", k_scale=k_scale)
    ref, ref_lse = reference(q, kv8, k_scale, bt, cl)
    assert out.dtype == torch.bfloat16 and out.shape == (B, s_q, H, L)
    assert rel_err(out, ref) < 1e-2
    assert (lse.double() - ref_lse).abs().max().item() < 2e-3


def test_fp8_query_and_not_causal():
    B, H = 4, 16
    q, kv8, k_scale, bt, cl = fp8_case(B, 2, H, 64, [3000, 2, 900, 65], seed=5)
    q8, q_scale = quantize_e4m3(q)
    out, lse = lowering.mla_decode_fp8q(q8, kv8, bt, cl, SCALE, q_scale=q_scale,
                                        k_scale=k_scale, causal=False, backend="triton")
    ref, ref_lse = reference(q8.double() * q_scale.double(), kv8, k_scale, bt, cl, causal=False)
    assert rel_err(out, ref) < 1e-2          # P @ V in fp16 here (not e4m3)
    assert (lse.double() - ref_lse).abs().max().item() < 2e-3


def test_fp8_cache_kernel_under_inductor_and_cuda_graphs():
    B, H = 8, 16
    q, kv, bt, cl = make_case(B, 1, H, L, R, 64, [1500] * B, "cuda", seed=21)
    kv8, k_scale = quantize_e4m3(kv)

    def run(q, kv8, bt, cl):
        return lowering.mla_decode(q, kv8, bt, cl, SCALE, kv_cache_dtype="fp8", k_scale=k_scale)
    check_compiled_and_graphed(run, "mla_decode_fp8_cache_kernel", q, kv8, bt, cl)


def test_compiled_decode_does_not_recompile_as_lengths_change():
    from torch._dynamo.utils import counters
    B, H = 4, 16
    q, kv, bt, cl = make_case(B, 1, H, L, R, 64, [900] * B, "cuda", seed=22)
    kv8, k_scale = quantize_e4m3(kv)

    def run(q, kv8, bt, cl):
        return lowering.mla_decode(q, kv8, bt, cl, SCALE, kv_cache_dtype="fp8", k_scale=k_scale)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(run, fullgraph=True)
    for n in (900, 17, 1, 640):
        cl.fill_(n)
        out, _ = compiled(q, kv8, bt, cl)
        ref, _ = decode_ref64(q, kv8.double() * k_scale.double(), bt, cl, SCALE, True, L)
        assert rel_err(out, ref) < 1e-2
    assert counters["stats"]["unique_graphs"] == 1
