"""A bf16 query over an fp8 cache at 64 and 128 heads: the pair kernel's FP8 mode (tiles
widened to bf16 in shared memory by a partition of their own) against the bf16 pair
kernel over a bf16 cache and the fp8 kernel's BF16Q mode (lab probe, not maintained).

Each variant is first checked against float64 on the dequantized cache (relative error
1e-2, LSE 2e-3: the bf16 kernel's bounds), then timed per shape in one run (CUDA-graph
replays after a read flush of the L2, µs); ratios are bf16 / variant.

    python docs/notes/probe_pair_fp8.py [--regs CONSUMER:WIDENER] [--shapes B:H:S,...]

--regs sets the FP8 mode's register split (warpgroup 1 and the widener, per thread; the
default partition gets what is left of 64 K) before anything compiles.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

from lowering.decode import gluon_decode as gd  # noqa: E402
from mla_reference import (decode_ref64, make_case, poison_unwritten_rows,  # noqa: E402
                           quantize_e4m3, rel_err)
from timing import graph_time_us  # noqa: E402

L, R, SCALE = 512, 64, 192 ** -0.5
SHAPES = "1:128:4096,8:128:4096,32:128:4096,64:128:8192,8:128:32768,32:64:4096,128:64:4096"
CHECKS = ((3, 1, 128, 64, [3000, 2999, 1], 0), (2, 2, 64, 64, [1500, 33], 0),
          (2, 1, 128, 64, [4100, 64], 1), (3, 1, 128, 64, [65, 128, 129], 1),
          (2, 1, 64, 128, [5000, 40], 40), (1, 1, 128, 64, [1], 0))


def bf16q_pick(page, keys):
    from lowering.decode.gluon_fp8_kernel import mla_decode_fp8_kernel
    return mla_decode_fp8_kernel, gd.BF16Q_CONFIG


def run(q, kv8, bt, cl, ks, splits=0, kernel="pair"):
    pick = gd.bf16q_kernel if kernel == "pair" else bf16q_pick
    return gd._launch(pick, q, kv8, bt, cl, (ks,), SCALE, True, splits, bf16q=True)


def check():
    ok = True
    for B, s_q, H, page, lens, splits in CHECKS:
        q, kv, bt, cl = make_case(B, s_q, H, L, R, page, lens, "cuda", seed=B + H + page)
        kv8, ks = quantize_e4m3(kv)
        ref, ref_lse = decode_ref64(q.double(), kv8.double() * ks.double(), bt, cl, SCALE,
                                    True, L)
        out, lse = run(q, poison_unwritten_rows(kv8, bt, cl), bt, cl, ks, splits)
        e = rel_err(out, ref)
        de = (lse.double() - ref_lse).abs().max().item()
        fine = e < 1e-2 and de < 2e-3 and bool(torch.isfinite(out).all())
        ok &= fine
        print(f"  check B={B} s_q={s_q} H={H} page={page} lens={lens} splits={splits}: "
              f"rel {e:.2e}, lse {de:.2e} {'ok' if fine else 'FAIL'}", flush=True)
    return ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--regs", default=None)
    ap.add_argument("--shapes", default=SHAPES)
    args = ap.parse_args()
    if args.regs:
        from triton.experimental.gluon import language as gl
        from lowering.decode import gluon_pair_kernel as gp
        c, w = (int(x) for x in args.regs.split(":"))
        gp.CONSUMER_REGS, gp.WIDEN_REGS = gl.constexpr(c), gl.constexpr(w)
    print(f"{torch.cuda.get_device_name()}; regs {args.regs or 'default'}", flush=True)
    if not check():
        print("the FP8 pair kernel FAILS its checks: not timed", flush=True)
        return
    for shape in args.shapes.split(","):
        B, H, S = (int(x) for x in shape.split(":"))
        q, kv, bt, cl = make_case(B, 1, H, L, R, 64, [S] * B, "cuda", seed=1, spare_blocks=0)
        kv8, ks = quantize_e4m3(kv)
        t = {"bf16 pair": graph_time_us(lambda: gd.gluon_decode(q, kv, bt, cl, SCALE, True)),
             "fp8 pair": graph_time_us(lambda: run(q, kv8, bt, cl, ks)),
             "fp8 BF16Q": graph_time_us(lambda: run(q, kv8, bt, cl, ks, kernel="bf16q"))}
        base = t["bf16 pair"]
        print(f"B={B} H={H} S={S}: " + ", ".join(f"{k} {v:.1f} ({base / v:.2f}x)"
                                                 for k, v in t.items()), flush=True)


if __name__ == "__main__":
    main()
