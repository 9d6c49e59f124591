"""Where the time of a bf16 query over an fp8 cache at 128 heads goes (the fp8 Gluon
kernel's BF16Q mode; lab probe, not maintained).

BF16Q differs from the fp8-query kernel in three ways: a small kernel first writes q's two
e4m3 terms (q_terms_kernel.py), QK runs 9 more fp8 MMAs (over lo), and the ring is
shorter (q's terms take 72 KB). This times, per shape, in one run:
  - bf16: the Gluon bf16 kernel (pair kernel, page 64), the pace BF16Q must not fall below;
  - fp8q at (BN, STAGES): the fp8-query kernel, whose per-tensor e4m3 query costs no terms;
  - fp8q with BF16Q's ring (same BN, fewer stages): the ring's share;
  - BF16Q at each (BN, STAGES) that fits;
  - the q-terms kernel alone.
Every BF16Q config is first checked against float64 on the dequantized cache (relative
error 3e-2: P is e4m3; LSE 1e-2), and its worst LSE error printed.

    python docs/notes/probe_fp8_bf16q.py            (H100 / H200; CUDA-graph medians, µs)
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

from lowering.decode import gluon_decode as gd  # noqa: E402
from lowering.decode.q_terms_kernel import q_terms  # noqa: E402
from mla_reference import decode_ref64, make_case, quantize_e4m3, rel_err  # noqa: E402
from timing import graph_time_us  # noqa: E402

L, R, SCALE = 512, 64, 192 ** -0.5
SHAPES = [(1, 128, 4096), (32, 128, 4096), (64, 128, 8192), (8, 128, 32768)]
BF16Q = [(32, 6), (64, 2)]
FP8Q = [(32, 8), (64, 3)]


def pick(bn, stages):
    from lowering.decode.gluon_fp8_kernel import mla_decode_fp8_kernel
    return lambda page, keys: (mla_decode_fp8_kernel, dict(BN=bn, STAGES=stages))


def check(bn, stages):
    worst = 0.0
    for B, s_q, H, lens, splits in ((3, 1, 128, [3000, 2999, 1], 0), (2, 2, 64, [1500, 33], 0),
                                    (2, 1, 128, [4100, 64], 1), (2, 1, 64, [5000, 40], 40)):
        q, kv, bt, cl = make_case(B, s_q, H, L, R, 64, lens, "cuda", seed=B + H)
        kv8, ks = quantize_e4m3(kv)
        ref, ref_lse = decode_ref64(q.double(), kv8.double() * ks.double(), bt, cl, SCALE, True, L)
        out, lse = gd._launch(pick(bn, stages), q, kv8, bt, cl, (ks,), SCALE, True, splits,
                              bf16q=True)
        e = rel_err(out, ref)
        de = (lse.double() - ref_lse).abs().max().item()
        worst = max(worst, de)
        if e > 3e-2 or de > 1e-2:
            print(f"  BF16Q {bn}x{stages} FAILS at B={B} s_q={s_q} H={H} lens={lens} "
                  f"splits={splits}: rel {e:.2e}, lse {de:.2e}", flush=True)
    return worst


def main():
    for bn, st in BF16Q:
        print(f"check BF16Q {bn}x{st}: worst LSE err {check(bn, st):.2e}", flush=True)
    for B, H, S in SHAPES:
        q, kv, bt, cl = make_case(B, 1, H, L, R, 64, [S] * B, "cuda", seed=1, spare_blocks=0)
        kv8, ks = quantize_e4m3(kv)
        qs = (q.float().abs().amax() / 448.0).reshape(1)
        q8 = (q.float() / qs).to(torch.float8_e4m3fn)
        t = {"bf16": graph_time_us(lambda: gd.gluon_decode(q, kv, bt, cl, SCALE, True))}
        for bn, st in FP8Q:
            t[f"fp8q {bn}x{st}"] = graph_time_us(lambda: gd._launch(
                pick(bn, st), q8, kv8, bt, cl, (qs, ks), SCALE, True, 0))
        for bn, st in BF16Q:
            t[f"bf16q {bn}x{st}"] = graph_time_us(lambda: gd._launch(
                pick(bn, st), q, kv8, bt, cl, (ks,), SCALE, True, 0, bf16q=True))
        q2 = q.view(-1, L + R)
        t["q terms alone"] = graph_time_us(lambda: q_terms(q2))
        base = t["bf16"]
        print(f"B={B} H={H} S={S}: " + ", ".join(f"{k} {v:.1f} ({base / v:.2f}x)"
                                                 for k, v in t.items()), flush=True)


if __name__ == "__main__":
    main()
