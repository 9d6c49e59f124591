"""Decode attention alone: our Gluon (Hopper: BF16, FP8 q+cache) and Triton (BF16, FP8 cache,
FP8 q+cache) kernels, FlashMLA (BF16, and its dense FP8 q+cache kernel), pure torch.

    python benchmarks/bench_decode.py --json results.json [--sweep] [--budget-s 400]

BF16 latent cache [num_blocks, 64, 576], every request at length S, random page order.
Each implementation is captured in a CUDA graph and timed with triton.testing.do_bench
(median of the graph's replays), so launch overhead is out of every number alike.
The ceilings are measured in the same run: device copy bandwidth (bytes read + written)
and a bf16 8192^3 GEMM; the roofline time of a shape is max(FLOPs / GEMM rate,
bytes / copy bandwidth) and each result is reported as that time over the measured one.
With --sweep, several kernel configs are timed per shape and the best is reported
(all are written to the JSON).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import triton
import triton.testing

import lowering.decode.triton_decode as td
from lowering.decode.reference import mla_decode_reference
from timing import graph_time_us

SHAPES = [(1, 128, 4096), (32, 128, 4096), (64, 128, 8192), (128, 16, 4096),
          (8, 128, 32768), (256, 16, 1024)]
FLASHMLA_NOTES = {(1, 128, 4096): 24.6, (32, 128, 4096): 74.9, (64, 128, 8192): 238.0,
                  (128, 16, 4096): 165.5}
L, R, PAGE = 512, 64, 64
# Kernel variants tried with --sweep: (tag, kinds, overrides of the CONFIGS defaults).
SWEEP = {
    "wide": [
        ("lazy", ("bf16", "fp8kv", "fp8q"), dict(lazy_rescale=1)),
        ("ws", ("bf16",), dict(warp_specialize=True)),
        ("w16", ("bf16",), dict(num_warps=16)),
        ("lazy_s3", ("bf16", "fp8kv", "fp8q"), dict(lazy_rescale=1, num_stages=3)),
        ("n32_lazy", ("fp8kv", "fp8q"), dict(lazy_rescale=1, block_n=32, num_stages=3)),
        ("n128s2", ("fp8q",), dict(block_n=128, num_stages=2)),
        ("n128s1", ("bf16", "fp8q"), dict(block_n=128, num_stages=1)),
        ("n64s3", ("bf16",), dict(num_stages=3)),
        # two programs per row block, each half of the value columns (see the kernel)
        ("m128v2", ("bf16", "fp8kv", "fp8q"), dict(block_m=128, v_parts=2)),
        ("m128v2n32", ("bf16", "fp8kv", "fp8q"), dict(block_m=128, v_parts=2, block_n=32,
                                                      num_stages=2)),
        ("m128v2s2", ("fp8q",), dict(block_m=128, v_parts=2, num_stages=2)),
        ("m64v2w4", ("bf16", "fp8q"), dict(v_parts=2, num_warps=4)),
        ("m64v2w4n32", ("bf16", "fp8q"), dict(v_parts=2, num_warps=4, block_n=32)),
        ("m128v2n32s1", ("bf16", "fp8kv"), dict(block_m=128, v_parts=2, block_n=32,
                                                num_stages=1)),
        ("m128v2n16", ("bf16",), dict(block_m=128, v_parts=2, block_n=16, num_stages=2)),
    ],
    "narrow": [
        ("splits1", ("bf16",), dict(num_splits=1)),
        ("splits4", ("bf16",), dict(num_splits=4)),
        ("lazy", ("bf16", "fp8kv", "fp8q"), dict(lazy_rescale=1)),
        ("n64w4s3", ("bf16", "fp8kv", "fp8q"), dict(block_n=64, num_warps=4, num_stages=3)),
        ("n128w8s3", ("bf16", "fp8kv", "fp8q"), dict(block_n=128, num_warps=8, num_stages=3)),
        ("n64w8s3", ("fp8kv", "fp8q"), dict(block_n=64, num_warps=8, num_stages=3)),
        ("n128w4s3", ("fp8kv", "fp8q"), dict(block_n=128, num_warps=4, num_stages=3)),
    ],
}


def measure_ceilings():
    x = torch.empty(1 << 29, dtype=torch.float32, device="cuda").uniform_()  # 2 GiB
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=50, rep=300, return_mode="median")
    copy_bw = 2 * x.numel() * 4 / (ms * 1e-3)
    del x, y
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    gemm = 2 * 8192 ** 3 / (ms * 1e-3)
    return copy_bw, gemm


def make_inputs(B, H, S, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    blocks = B * S // PAGE
    kv = torch.randn(blocks, PAGE, L + R, device="cuda", dtype=torch.bfloat16, generator=g)
    q = torch.randn(B, 1, H, L + R, device="cuda", dtype=torch.bfloat16, generator=g)
    bt = torch.randperm(blocks, device="cuda", generator=g).int().reshape(B, S // PAGE)
    lens = torch.full((B,), S, dtype=torch.int32, device="cuda")
    return q, kv, bt, lens


def kernel_stats(cubin_dir=None):
    """Registers, spills, shared memory and MMA instructions of each compiled stage-1 kernel.

    With cubin_dir, the first few cubins are written there for disassembly.
    """
    from lowering.decode.triton_decode_kernel import mla_decode_stage1_kernel as k
    stats = []
    try:
        for cache in k.device_caches.values():
            for i, (key, ck) in enumerate(cache[0].items()):
                if cubin_dir and i < 4 and "cubin" in ck.asm:
                    Path(cubin_dir, f"stage1_{i}.cubin").write_bytes(ck.asm["cubin"])
                ptx = ck.asm.get("ptx", "")
                stats.append(dict(n_regs=ck.n_regs, n_spills=ck.n_spills,
                                  shared=getattr(ck.metadata, "shared", None),
                                  num_warps=getattr(ck.metadata, "num_warps", None),
                                  num_stages=getattr(ck.metadata, "num_stages", None),
                                  wgmma=ptx.count("wgmma.mma_async"), mma=ptx.count("mma.sync"),
                                  cp_async=ptx.count("cp.async")))
    except Exception as exc:  # the cache layout differs between Triton versions
        stats.append(dict(error=repr(exc)))
    return stats


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def bench_shape(B, H, S, args, ceilings, log):
    copy_bw, gemm = ceilings
    scale = 192 ** -0.5
    q, kv, bt, lens = make_inputs(B, H, S)
    flops = 2 * B * H * S * (L + R + L)
    kv_bytes = {"bf16": B * S * (L + R) * 2, "fp8": B * S * (L + R)}
    io_bytes = B * H * (L + R) * 2 + B * H * L * 2
    ref_out, ref_lse = mla_decode_reference(q, kv, bt, lens, scale, causal=True, kind="auto",
                                            k_scale=None, head_dim_v=L)
    k_scale = (kv.float().abs().amax() / 448.0).reshape(1)
    kv8 = (kv.float() / k_scale).to(torch.float8_e4m3fn)
    q_scale = (q.float().abs().amax() / 448.0).reshape(1)
    q8 = (q.float() / q_scale).to(torch.float8_e4m3fn)
    rows = []

    def record(name, fn, kvtype, extra=None):
        try:
            out, lse = fn()
            err = rel_err(out, ref_out)
            us = graph_time_us(fn)
        except Exception as exc:  # a config that does not compile (shared memory) is skipped
            log(f"  {name:28s} FAILED {type(exc).__name__}: {str(exc)[:160]}")
            return None
        byts = kv_bytes[kvtype] + io_bytes
        floor_us = max(flops / gemm, byts / copy_bw) * 1e6
        row = dict(B=B, H=H, S=S, impl=name, us=us, tflops=flops / us * 1e-6,
                   gbps=byts / us * 1e-3, roofline_frac=floor_us / us, rel_err=err, **(extra or {}))
        log(f"  {name:28s} {us:9.1f} us {row['tflops']:7.1f} TFLOP/s {row['gbps']:7.0f} GB/s "
            f"roof {row['roofline_frac']:.2f} err {err:.1e}")
        rows.append(row)
        return row

    try:
        import lowering.decode.flashmla as fm
        fm_fn = lambda: fm.flashmla_decode_op(q, kv, bt, lens, scale, True, L)  # noqa: E731
        record("flashmla", fm_fn, "bf16")
        # the scheduler table computed once outside the timed call, as a model's step
        # plan does for all its layers: FlashMLA's decode kernels alone
        if fm.flashmla_unmet(q, kv, "auto") is None:
            sched = fm.flashmla_schedule(bt, lens, PAGE, H)
            record("flashmla[kernel only]", lambda: fm.flashmla_decode_op(
                q, kv, bt, lens, scale, True, L, *sched), "bf16")
    except ImportError as exc:
        log(f"  flashmla unavailable: {exc}")
    from lowering.decode.gluon_decode import (gluon_decode_fp8q_op, gluon_decode_op, gluon_fp8q_unmet,
                                       gluon_unmet)
    reason = gluon_unmet(q, kv, "auto")
    if reason is None:
        import lowering.decode.gluon_decode as gd
        record("gluon_bf16", lambda: gluon_decode_op(q, kv, bt, lens, scale, True), "bf16")

        def ring():                       # the kernel pages of 32 take, at page 64 here
            gd.PAIR_KERNEL = False
            try:
                return gluon_decode_op(q, kv, bt, lens, scale, True)
            finally:
                gd.PAIR_KERNEL = True
        record("gluon_bf16[ring]", ring, "bf16")
    else:
        log(f"  gluon: {reason}")
    reason = gluon_fp8q_unmet(q8, kv8, L, torch.bfloat16)
    if reason is None:
        record("gluon_fp8q", lambda: gluon_decode_fp8q_op(q8, kv8, bt, lens, q_scale, k_scale,
                                                          scale, True), "fp8")
    else:
        log(f"  gluon fp8: {reason}")
    try:
        import lowering.decode.flashmla as fm
        reason = fm.flashmla_fp8q_unmet(q8, kv8, L, torch.bfloat16)
    except ImportError as exc:
        reason = str(exc)
    if reason is None:
        # as the bf16 rows: FlashMLA's scheduler in the call, no clamp kernels
        record("flashmla_fp8q", lambda: fm.flashmla_fp8q_decode(
            q8, kv8, bt, lens, scale, q_scale=q_scale, k_scale=k_scale, causal=True,
            bounded=True), "fp8")
        # its scheduler table computed once outside the timed call (a model's step
        # computes it once for all layers)
        sched8 = fm.flashmla_schedule(bt, lens, PAGE, H, fp8=True)
        record("flashmla_fp8q[kernel only]", lambda: fm.flashmla_fp8q_decode(
            q8, kv8, bt, lens, scale, q_scale=q_scale, k_scale=k_scale, causal=True,
            schedule=sched8, bounded=True), "fp8")
    else:
        log(f"  flashmla fp8: {reason}")
    if not args.no_reference:
        record("reference", lambda: mla_decode_reference(q, kv, bt, lens, scale, causal=True,
                                                         kind="auto", k_scale=None, head_dim_v=L),
               "bf16")
    wide = "wide" if H >= 64 else "narrow"
    variants = [("default", ("bf16", "fp8kv", "fp8q"), {})]
    if args.sweep:
        variants += [v for v in SWEEP[wide] if not args.variants or v[0] in args.variants]
    for tag, kinds, tune in variants:
        if time.time() > args.deadline:
            log("  (time budget reached, skipping variants)")
            break
        if "bf16" in kinds:
            record(f"triton_bf16[{tag}]", lambda: td.triton_decode_op(
                q, kv, bt, lens, None, None, scale, True, L, 0, False, torch.bfloat16, **tune),
                "bf16", dict(cfg=tag))
        if "fp8kv" in kinds:
            record(f"triton_fp8kv[{tag}]", lambda: td.triton_decode_op(
                q, kv8, bt, lens, None, k_scale, scale, True, L, 1, False, torch.bfloat16, **tune),
                "fp8", dict(cfg=tag))
        if "fp8q" in kinds:
            record(f"triton_fp8q[{tag}]", lambda: td.triton_decode_op(
                q8, kv8, bt, lens, q_scale, k_scale, scale, True, L, 2, False, torch.bfloat16,
                **tune), "fp8", dict(cfg=tag))
    record("triton_bf16[invariant]", lambda: td.triton_decode_op(
        q, kv, bt, lens, None, None, scale, True, L, 0, True, torch.bfloat16), "bf16")
    if args.splits and H >= 64:
        for ns in args.splits:
            record(f"triton_bf16[splits{ns}]", lambda: td.triton_decode_op(
                q, kv, bt, lens, None, None, scale, True, L, 0, False, torch.bfloat16, num_splits=ns),
                "bf16", dict(cfg=f"splits{ns}"))
    del q, kv, bt, lens, kv8, q8
    torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default="decode_results.json")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--splits", type=int, nargs="*", default=[])
    ap.add_argument("--shapes", default="all", help="'all' or indices like 0,1,3")
    ap.add_argument("--budget-s", type=float, default=480)
    ap.add_argument("--cubin-dir", default=None)
    ap.add_argument("--variants", nargs="*", default=[], help="sweep only these tags")
    ap.add_argument("--no-reference", action="store_true")
    args = ap.parse_args()
    args.deadline = time.time() + args.budget_s
    lines = []

    def log(msg):
        print(msg, flush=True)
        lines.append(msg)

    copy_bw, gemm = measure_ceilings()
    log(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    log(f"ceilings: copy {copy_bw / 1e12:.2f} TB/s, bf16 GEMM {gemm / 1e12:.0f} TFLOP/s")
    shapes = SHAPES if args.shapes == "all" else [SHAPES[int(i)] for i in args.shapes.split(",")]
    results = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                   triton=triton.__version__, copy_bw=copy_bw, gemm=gemm,
                   command=" ".join(sys.argv), rows=[])
    for B, H, S in shapes:
        log(f"B={B} H={H} S={S}")
        results["rows"] += bench_shape(B, H, S, args, (copy_bw, gemm), log)
        Path(args.json).write_text(json.dumps(results, indent=1))
    results["kernels"] = kernel_stats(args.cubin_dir)
    for st in results["kernels"]:
        log(str(st))
    Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
