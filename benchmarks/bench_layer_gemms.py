"""The weight GEMMs of one DeepSeek-V3-shaped decode layer, one by one, at decode batch sizes.

A decode step streams every weight once; at M <= 32 rows each GEMM is a weight read, so its
time against the copy ceiling says how close the layer can get to the bandwidth floor. Also
times the fused variants (q_a + kv_a in one GEMM, gate + up in one GEMM), and with
--skinny the one-pass Triton kernel of skinny_gemm.py (best of SKINNY_CONFIGS, each
checked against cuBLAS first).

    python benchmarks/bench_layer_gemms.py --skinny    # H200: V3 dims, M = 1 and 32
"""
from __future__ import annotations

import argparse

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import graph_time_us  # noqa: E402

# (name, in_features, out_features) of V3's attention + dense MLP weights
GEMMS = [
    ("q_a_proj", 7168, 1536),
    ("kv_a_proj_with_mqa", 7168, 576),
    ("q_b_proj", 1536, 128 * 192),
    ("o_proj", 128 * 128, 7168),
    ("gate_proj", 7168, 18432),
    ("up_proj", 7168, 18432),
    ("down_proj", 18432, 7168),
]
FUSED = [
    ("q_a+kv_a (fused)", 7168, 1536 + 576),
    ("gate+up (fused)", 7168, 2 * 18432),
]


def copy_ceiling(nbytes=1 << 30):
    from triton.testing import do_bench
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    ms = do_bench(lambda: b.copy_(a), warmup=50, rep=200)
    return 2 * nbytes / (ms * 1e-3)


# skinny_gemm.py configs swept: (block_n, block_k, num_warps, num_stages)
SKINNY_CONFIGS = [
    (16, 256, 4, 4), (16, 512, 4, 4), (16, 512, 4, 6), (32, 128, 4, 8), (32, 256, 4, 4),
    (32, 256, 4, 6), (32, 512, 4, 3), (32, 512, 8, 4), (64, 128, 4, 6), (64, 256, 4, 4),
    (64, 256, 8, 4), (128, 128, 8, 4),
]


def best_skinny(x, w, out, ref):
    """(µs, config) of the fastest correct skinny_gemm config."""
    from skinny_gemm import skinny_gemm
    best = (float("inf"), None)
    for cfg in SKINNY_CONFIGS:
        bn, bk, nw, ns = cfg
        try:
            skinny_gemm(x, w, out, block_n=bn, block_k=bk, num_warps=nw, num_stages=ns)
        except Exception as e:       # e.g. out of shared memory
            print(f"    {cfg}: {type(e).__name__}", flush=True)
            continue
        err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        if err > 2e-2:
            print(f"    {cfg}: wrong (rel err {err:.2e})", flush=True)
            continue
        us = graph_time_us(lambda: skinny_gemm(x, w, out, block_n=bn, block_k=bk,
                                               num_warps=nw, num_stages=ns))
        best = min(best, (us, cfg))
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,32")
    ap.add_argument("--skinny", action="store_true", help="also sweep the Triton kernel of skinny_gemm.py")
    args = ap.parse_args()
    dev = torch.device("cuda")
    ceil = copy_ceiling()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; copy ceiling "
          f"{ceil / 1e12:.2f} TB/s")
    for M in (int(m) for m in args.rows.split(",")):
        print(f"\nM = {M}\n| GEMM | weight MB | µs | TB/s | of ceiling | skinny µs (config) | skinny of ceiling |"
              "\n|---|---|---|---|---|---|---|", flush=True)
        total_us = total_b = total_sk = 0.0
        for name, k, n in GEMMS + FUSED:
            w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
            x = torch.randn(M, k, device=dev, dtype=torch.bfloat16)
            out = torch.empty(M, n, device=dev, dtype=torch.bfloat16)
            ms = graph_time_us(lambda: torch.mm(x, w.t(), out=out)) / 1e3
            nbytes = w.numel() * 2 + x.numel() * 2 + out.numel() * 2
            bw = nbytes / (ms * 1e-3)
            if "fused" not in name:
                total_us += ms * 1e3
                total_b += nbytes
            sk = ""
            if args.skinny:
                ref = torch.mm(x, w.t())
                us, cfg = best_skinny(x, w, out, ref)
                sk = f" {us:.1f} {cfg} | {nbytes / (us * 1e-6) / ceil:.2f} |"
                if "fused" not in name:
                    total_sk += us
            print(f"| {name} | {w.numel() * 2 / 1e6:.1f} | {ms * 1e3:.1f} | {bw / 1e12:.2f} | "
                  f"{bw / ceil:.2f} |" + sk, flush=True)
            del w
        print(f"| all unfused | {total_b / 1e6:.0f} | {total_us:.1f} | "
              f"{total_b / total_us / 1e6:.2f} | {total_b / total_us / 1e6 / (ceil / 1e12):.2f} |"
              + (f" {total_sk:.1f} | {total_b / total_sk / 1e6 / (ceil / 1e12):.2f} |" if total_sk else ""))


if __name__ == "__main__":
    main()
