"""Sweep the Triton decode configs for an fp8 cache: each candidate timed against our BF16
decode and FlashMLA's fp8 kernel, the best per config-table key printed ready to paste.

    python benchmarks/sweep_fp8_cache_decode.py                     (H200: about 2 minutes)
    python benchmarks/sweep_fp8_cache_decode.py --query fp8 --shapes 128x16x4096
    python benchmarks/sweep_fp8_cache_decode.py --candidates fp8c-m16n32w4s2c2,stage1-n64w8s3c1

What a user gets from lowering.mla_decode(..., kv_cache_dtype="fp8") with a bf16 query
(--query bf16, config key kv_kind 1) or from lowering.mla_decode_fp8q (--query fp8, key
kv_kind 2) is the Triton route, whose config lowering.decode.triton_decode.CONFIGS keys
by (kv_kind, "narrow" (<= 32 query rows) | "wide", "gpu"). Each candidate is put in its
key's entry in turn and the route's op timed (CUDA-graph median, timing.graph_time_us:
every request at length S, page 64, shuffled pages); its output is checked against the
float32 torch reference on the dequantized values (relative error < 2e-2 for a bf16
query, 5e-2 for fp8) and a config that fails or does not compile is reported, not timed.

Baselines in the same run: our BF16 decode as "auto" picks it (lowering.mla_decode on a
bf16 cache: FlashMLA with its scheduler in the call where installed, else Gluon / Triton),
the Triton BF16 kernel alone, and FlashMLA's fp8 kernel (an fp8 query, its schedule
computed outside the timed call) where installed. GB/s counts the cache bytes of each
(1152 or 576 per key) plus q and the output.
"""
from __future__ import annotations

import argparse
import math
import time

import torch
import triton
from timing import graph_time_us      # benchmarks/timing.py, beside this script

import lowering
import lowering.decode.triton_decode as td
from lowering.decode.reference import mla_decode_reference
from lowering.decode.registry import route_unmet

L, R, PAGE = 512, 64, 64
SCALE = 192 ** -0.5
SHAPES = "128x16x4096,256x16x1024,64x16x8192,32x128x4096"
FLASHMLA_FP8 = "flashmla fp8q[kernel only]"


def fp8c(m, n, w, s, c, **extra):
    return dict(kernel="fp8_cache", BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s,
                ctas_per_sm=c, **extra)


def stage1(n, w, s, c, **extra):
    return dict(BLOCK_N=n, num_warps=w, num_stages=s, ctas_per_sm=c, **extra)


# name -> (table width it is a candidate for, config). "fp8c" runs
# triton_fp8_cache_kernel.py, "stage1" triton_decode_kernel.py (the former fp8 configs).
CANDIDATES = {
    "fp8c-m16n32w4s2c2": ("narrow", fp8c(16, 32, 4, 2, 2)),
    "fp8c-m16n32w4s2c4": ("narrow", fp8c(16, 32, 4, 2, 4)),
    "fp8c-m16n64w4s2c1": ("narrow", fp8c(16, 64, 4, 2, 1)),
    "fp8c-m16n64w4s2c2": ("narrow", fp8c(16, 64, 4, 2, 2)),
    "fp8c-m16n128w8s2c1": ("narrow", fp8c(16, 128, 8, 2, 1)),
    "fp8c-m16n32w4s2c2r": ("narrow", fp8c(16, 32, 4, 2, 2, RELOAD_V=True)),
    "fp8c-m16n32w4s3c2r": ("narrow", fp8c(16, 32, 4, 3, 2, RELOAD_V=True)),
    "stage1-n64w8s3c1": ("narrow", stage1(64, 8, 3, 1)),
    "stage1-wide-n64w8s3c1": ("wide", stage1(64, 8, 3, 1)),
    "fp8c-wide-m16n64w4s2c1": ("wide", fp8c(16, 64, 4, 2, 1)),
    "fp8c-wide-m32n32w4s2c1": ("wide", fp8c(32, 32, 4, 2, 1)),
}


def make_inputs(B, H, S, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    blocks = B * S // PAGE
    kv = torch.randn(blocks, PAGE, L + R, device=device, dtype=torch.bfloat16, generator=g)
    q = torch.randn(B, 1, H, L + R, device=device, dtype=torch.bfloat16, generator=g)
    bt = torch.randperm(blocks, device=device, generator=g).int().reshape(B, S // PAGE)
    lens = torch.full((B,), S, dtype=torch.int32, device=device)
    return q, kv, bt, lens


def time_us(fn, device):
    """CUDA-graph median on a GPU; one wall-clock call elsewhere (a smoke run)."""
    if device == "cuda":
        return graph_time_us(fn)
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e6


def quantize(x):
    scale = (x.float().abs().amax() / 448.0).reshape(1)
    return (x.float() / scale).to(torch.float8_e4m3fn), scale


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def sweep_shape(B, H, S, args, log):
    q, kv, bt, lens = make_inputs(B, H, S, args.device)
    kv8, k_scale = quantize(kv)
    q8, q_scale = quantize(q)
    fp8q = args.query == "fp8"
    kind = 2 if fp8q else 1
    io = B * H * (L + R) * (1 if fp8q else 2) + B * H * L * 2
    gb = {"bf16": (B * S * (L + R) * 2 + io) / 1e9, "fp8": (B * S * (L + R) + io) / 1e9}
    q_true = q8.float() * q_scale if fp8q else q
    ref, _ = mla_decode_reference(q_true, kv8, bt, lens, SCALE, causal=True, kind="fp8",
                                  k_scale=k_scale, head_dim_v=L)
    tol = 5e-2 if fp8q else 2e-2
    width = "wide" if td.block_m_for(H) >= 64 else "narrow"
    key = (kind, width, "gpu")
    times = {}

    def timed(name, fn, bytes_kind):
        us = time_us(fn, args.device)
        times[name] = us
        log(f"  {name:26s} {us:8.1f} us  {gb[bytes_kind] / us * 1e6:6.0f} GB/s")
        return us

    bf16_auto = timed("bf16 auto", lambda: lowering.mla_decode(q, kv, bt, lens, SCALE), "bf16")
    bf16_triton = timed("bf16 triton", lambda: td.triton_decode_op(
        q, kv, bt, lens, None, None, SCALE, True, L, 0, False, torch.bfloat16), "bf16")
    if route_unmet("flashmla-fp8q", q8, kv8) is None:
        import lowering.decode.flashmla as fm
        sched = fm.flashmla_schedule(bt, lens, PAGE, H, fp8=True)
        timed(FLASHMLA_FP8, lambda: fm.flashmla_decode_fp8q_op(
            q8, kv8, bt, lens, q_scale, k_scale, SCALE, True, *sched), "fp8")
    else:
        log(f"  flashmla fp8q: {route_unmet('flashmla-fp8q', q8, kv8)}")

    if fp8q:
        def call():
            return td.triton_decode_op(q8, kv8, bt, lens, q_scale, k_scale, SCALE, True, L, 2,
                                       False, torch.bfloat16)
    else:
        def call():
            return td.triton_decode_op(q, kv8, bt, lens, None, k_scale, SCALE, True, L, 1,
                                       False, torch.bfloat16)
    saved = td.CONFIGS[key]
    results = {}
    try:
        for name in args.candidates:
            cand_width, cfg = CANDIDATES[name]
            if cand_width != width:
                continue
            td.CONFIGS[key] = cfg
            try:
                out, _ = call()
                err = rel_err(out, ref)
                if not err < tol:
                    log(f"  {name:26s} WRONG: relative error {err:.2e} >= {tol}")
                    continue
                us = time_us(call, args.device)
            except Exception as exc:          # a config that does not compile: reported
                log(f"  {name:26s} FAILED {type(exc).__name__}: {str(exc)[:140]}")
                continue
            results[name] = us
            vs_flashmla = (f"  x{times[FLASHMLA_FP8] / us:4.2f} flashmla fp8"
                           if FLASHMLA_FP8 in times else "")
            log(f"  {name:26s} {us:8.1f} us  {gb['fp8'] / us * 1e6:6.0f} GB/s  "
                f"x{bf16_auto / us:4.2f} bf16 auto  x{bf16_triton / us:4.2f} bf16 triton"
                f"{vs_flashmla}  err {err:.1e}")
    finally:
        td.CONFIGS[key] = saved
    if results:
        best = min(results, key=results.get)
        log(f"  best: {best} {results[best]:.1f} us (x{bf16_auto / results[best]:.2f} bf16 auto,"
            f" x{bf16_triton / results[best]:.2f} bf16 triton)")
    return key, results


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=SHAPES, help=f"BxHxS,... (default {SHAPES})")
    ap.add_argument("--query", choices=("bf16", "fp8"), default="bf16",
                    help="bf16: mla_decode over an fp8 cache; fp8: mla_decode_fp8q")
    ap.add_argument("--candidates", default="all",
                    help="'all' or names of CANDIDATES, comma-separated: " + ", ".join(CANDIDATES))
    ap.add_argument("--device", default="cuda",
                    help="cuda; cpu only for a smoke run of the script under TRITON_INTERPRET=1 "
                         "(the GPU table is then not what runs)")
    args = ap.parse_args()
    args.candidates = (list(CANDIDATES) if args.candidates == "all"
                       else args.candidates.split(","))
    for name in args.candidates:
        if name not in CANDIDATES:
            ap.error(f"no candidate {name!r}")
    log = lambda msg: print(msg, flush=True)       # noqa: E731
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    log(f"{gpu}  torch {torch.__version__}  triton {triton.__version__}"
        f"  query {args.query}")
    start = time.time()
    by_key = {}
    for shape in args.shapes.split(","):
        B, H, S = (int(x) for x in shape.split("x"))
        log(f"B={B} H={H} S={S}")
        key, results = sweep_shape(B, H, S, args, log)
        by_key.setdefault(key, []).append(results)
        if args.device == "cuda":
            torch.cuda.empty_cache()
    log(f"({time.time() - start:.0f} s)\nBest per table key (geometric mean over its shapes of "
        "each candidate's time; only candidates that ran at every one):")
    for key, runs in by_key.items():
        names = [n for n in args.candidates if all(n in r for r in runs)]
        if not names:
            log(f"    {key!r}: no candidate ran at every shape")
            continue
        gm = {n: math.exp(sum(math.log(r[n]) for r in runs) / len(runs)) for n in names}
        best = min(gm, key=gm.get)
        body = ", ".join(f"{k}={v!r}" for k, v in CANDIDATES[best][1].items())
        log(f"    {key!r}: dict({body}),   # {best}, geomean {gm[best]:.1f} us")


if __name__ == "__main__":
    main()
