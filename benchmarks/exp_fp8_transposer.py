"""Experiment: the fp8 Gluon kernel with its value transposes in a 4-warp partition that
also loads the tiles (lowering/gluon_fp8_tw_decode_kernel.py) against the landed fp8
kernel at the same tile config, the bf16 pair kernel and FlashMLA's fp8 kernel (schedule
computed outside). Each argument is BN x STAGES x LAG (the feeder refills tile i - LAG's
stage after transposing tile i):

    python benchmarks/exp_fp8_transposer.py 32x8x2 64x3x1      (H200, flash_mla on the path)

Checks as sweep_gluon_fp8.py (float64 on the dequantized values, edge cases), then
CUDA-graph medians at the 128-head shapes, two rounds.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

import lowering  # noqa: E402
from lowering import gluon_decode as gd  # noqa: E402
from mla_reference import decode_ref64, make_case, poison_unwritten_rows, rel_err  # noqa: E402
from sweep_gluon_fp8 import CHECKS, SHAPES, quantize  # noqa: E402
from timing import graph_time_us  # noqa: E402

L, R, SCALE = 512, 64, 192 ** -0.5


def variants(configs):
    from lowering.gluon_fp8_decode_kernel import mla_decode_fp8_kernel
    from lowering.gluon_fp8_tw_decode_kernel import mla_decode_fp8_tw_kernel
    out = []
    for c in configs:
        tw = dict(c, FEED_REGS=24)
        out.append((f"feeder {c['BN']}x{c['STAGES']}x{c['LAG']}",
                    lambda page, keys, c=tw: (mla_decode_fp8_tw_kernel, c)))
    for bn, st in sorted({(c["BN"], c["STAGES"]) for c in configs}):
        out.append((f"landed {bn}x{st}",
                    lambda page, keys, c=dict(BN=bn, STAGES=st): (mla_decode_fp8_kernel, c)))
    return out


def main(configs):
    picks = variants(configs)
    wrong = 0
    for B, s_q, H, lens, splits in CHECKS + [(2, 1, 64, [1, 31], 0)]:
        q, kv, bt, cl = make_case(B, s_q, H, L, R, 64, lens, "cuda", seed=B + H)
        q8, qs = quantize(q)
        kv8, ks = quantize(kv)
        ref, ref_lse = decode_ref64(q8.double() * qs.double(), kv8.double() * ks.double(), bt,
                                    cl, SCALE, True, L)
        msg = f"check B={B} s_q={s_q} H={H} lengths={lens} splits={splits}:"
        for name, pick in picks:
            out, lse = gd._launch(pick, q8, poison_unwritten_rows(kv8, bt, cl), bt, cl, (qs, ks),
                                  SCALE, True, splits)
            err, lerr = rel_err(out, ref), (lse.double() - ref_lse).abs().max().item()
            ok = err < 5e-2 and lerr < 1e-2 and bool(torch.isfinite(out).all())
            wrong += not ok
            msg += f" [{name}: {err:.1e} {lerr:.1e} {'OK' if ok else 'WRONG'}]"
        print(msg, flush=True)
    print(f"checks wrong: {wrong}", flush=True)
    for B, H, S in SHAPES:
        q, kv, bt, cl = make_case(B, 1, H, L, R, 64, [S] * B, "cuda", seed=1)
        q8, qs = quantize(q)
        kv8, ks = quantize(kv)
        gb = graph_time_us(lambda: lowering.mla_decode(q, kv, bt, cl, SCALE, backend="gluon"))
        sched = lowering.decode_schedule(kv8, bt, cl, num_heads=H, fp8q=True)
        f8 = graph_time_us(lambda: lowering.mla_decode_fp8q(
            q8, kv8, bt, cl, SCALE, q_scale=qs, k_scale=ks, backend="flashmla", schedule=sched))
        msg = f"B={B} H={H} S={S}: bf16 pair {gb:.1f} µs; FlashMLA fp8 {f8:.1f} ({gb / f8:.2f}x);"
        for _ in range(2):
            for name, pick in picks:
                us = graph_time_us(lambda: gd._launch(pick, q8, kv8, bt, cl, (qs, ks), SCALE,
                                                      True, 0))
                msg += f" [{name}] {us:.1f} ({gb / us:.2f}x)"
        print(msg, flush=True)


if __name__ == "__main__":
    main([dict(zip(("BN", "STAGES", "LAG"), map(int, a.split("x")))) for a in sys.argv[1:]])
