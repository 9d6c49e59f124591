"""The fp8 Gluon decode kernel at several (tile keys, ring stages): each checked against
float64 on edge cases, then timed beside FlashMLA's kernels and the Gluon BF16 kernel
(the pair kernel at page 64).

    python docs/notes/sweep_gluon_fp8.py 64x3 32x8 64x2      (H200, flash_mla on the path)

Checks: length 1, odd lengths, many and empty splits, the direct path, s_q > 1, e4m3 NaN in
unwritten cache rows; relative error < 5e-2 and LSE error < 1e-2 on the dequantized values
(P is e4m3). Timing: CUDA-graph medians (timing.graph_time_us), every request at length S,
page 64, two rounds per config. The library picks its config with
lowering.decode.gluon_decode.fp8_config; this forces each in turn.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

# A probe kept as it ran: the float64 reference and cases are the tests' and the timing
# is the benchmarks' (lowering is the installed package).
ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

import lowering  # noqa: E402
from lowering.decode import gluon_decode as gd  # noqa: E402
from mla_reference import decode_ref64, make_case, poison_unwritten_rows, rel_err  # noqa: E402
from timing import graph_time_us  # noqa: E402

L, R, SCALE = 512, 64, 192 ** -0.5
CHECKS = [(4, 1, 128, [3000, 2999, 1, 64], 0), (3, 1, 64, [1, 100, 777], 4),
          (2, 2, 128, [1500, 33], 0), (2, 1, 128, [5000, 40], 48), (2, 1, 128, [4096, 33], 1),
          (1, 3, 64, [700], 0), (3, 1, 128, [65, 128, 129], 1)]
SHAPES = [(1, 128, 4096), (32, 128, 4096), (64, 128, 8192), (8, 128, 32768)]


def quantize(x):
    scale = (x.float().abs().amax() / 448.0).reshape(1)
    return (x.float() / scale).to(torch.float8_e4m3fn), scale


def run(config, q8, kv8, bt, cl, qs, ks, splits=0):
    from lowering.decode.gluon_fp8_kernel import mla_decode_fp8_kernel
    return gd._launch(lambda page, keys: (mla_decode_fp8_kernel, config), q8, kv8, bt, cl,
                      (qs, ks), SCALE, True, splits)


def name(config):
    return f"{config['BN']}x{config['STAGES']}"


def main(configs):
    for B, s_q, H, lens, splits in CHECKS:
        q, kv, bt, cl = make_case(B, s_q, H, L, R, 64, lens, "cuda", seed=B + H)
        q8, qs = quantize(q)
        kv8, ks = quantize(kv)
        ref, ref_lse = decode_ref64(q8.double() * qs.double(), kv8.double() * ks.double(), bt,
                                    cl, SCALE, True, L)
        msg = f"check B={B} s_q={s_q} H={H} lengths={lens} splits={splits}:"
        for c in configs:
            out, lse = run(c, q8, poison_unwritten_rows(kv8, bt, cl), bt, cl, qs, ks, splits)
            err, lerr = rel_err(out, ref), (lse.double() - ref_lse).abs().max().item()
            ok = err < 5e-2 and lerr < 1e-2 and bool(torch.isfinite(out).all())
            msg += f" [{name(c)}: {err:.1e} {lerr:.1e} {'OK' if ok else 'WRONG'}]"
        print(msg, flush=True)
    for B, H, S in SHAPES:
        q, kv, bt, cl = make_case(B, 1, H, L, R, 64, [S] * B, "cuda", seed=1)
        q8, qs = quantize(q)
        kv8, ks = quantize(kv)
        sched = lowering.decode_schedule(kv, bt, cl, num_heads=H)
        fm = graph_time_us(lambda: lowering.mla_decode(q, kv, bt, cl, SCALE, backend="flashmla",
                                                       schedule=sched))
        gb = graph_time_us(lambda: lowering.mla_decode(q, kv, bt, cl, SCALE, backend="gluon"))
        msg = f"B={B} H={H} S={S}: FlashMLA kernels {fm:.1f} µs, Gluon BF16 {gb:.1f};"
        for _ in range(2):
            for c in configs:
                us = graph_time_us(lambda: run(c, q8, kv8, bt, cl, qs, ks))
                msg += f" [{name(c)}] {us:.1f} ({gb / us:.2f}x BF16)"
        print(msg, flush=True)


if __name__ == "__main__":
    args = sys.argv[1:] or ["64x3", "32x8"]
    main([dict(BN=int(a.split("x")[0]), STAGES=int(a.split("x")[1])) for a in args])
