"""Decode attention alone: our Gluon (Hopper: BF16, FP8 cache with a bf16 query, FP8
q+cache) and Triton (BF16, FP8 cache, FP8 q+cache) kernels, FlashMLA (BF16, and its dense
FP8 q+cache kernel), pure torch.

    python benchmarks/bench_decode.py --json results.json [--shapes 0,1] [--budget-s 400]

BF16 latent cache [num_blocks, 64, 576], every request at length S, random page order.
Each implementation is captured in a CUDA graph and timed as the median of its replays,
each after an L2 flush (timing.graph_time_us), so launch overhead is out of every number
alike.
The ceilings are measured in the same run: device copy bandwidth (bytes read + written)
and a bf16 8192^3 GEMM; the roofline time of a shape is max(FLOPs / GEMM rate,
bytes / copy bandwidth) and each result is reported as that time over the measured one.
The kernel configs themselves were chosen by sweeps recorded in the decode notes.
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
from timing import graph_time_us      # benchmarks/timing.py, beside this script

import lowering.decode.triton_decode as td
from lowering.decode.reference import mla_decode_reference
from lowering.decode.registry import route_unmet

SHAPES = [(1, 128, 4096), (32, 128, 4096), (64, 128, 8192), (128, 16, 4096),
          (8, 128, 32768), (256, 16, 1024), (64, 16, 8192), (32, 16, 4096), (1, 16, 4096),
          (32, 16, 1024), (8, 16, 4096),
          # small 128-head calls: where the fp8 cache's Gluon and Triton kernels cross
          (2, 128, 4096), (4, 128, 4096)]
FLASHMLA_NOTES = {(1, 128, 4096): 24.6, (32, 128, 4096): 74.9, (64, 128, 8192): 238.0,
                  (128, 16, 4096): 165.5}
L, R, PAGE = 512, 64, 64


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

    if route_unmet("flashmla", q, kv) is None:
        import lowering.decode.flashmla as fm
        record("flashmla", lambda: fm.flashmla_decode_op(q, kv, bt, lens, scale, True, L), "bf16")
        # the scheduler table computed once outside the timed call, as a model's step
        # plan does for all its layers: FlashMLA's decode kernels alone
        sched = fm.flashmla_schedule(bt, lens, PAGE, H)
        record("flashmla[kernel only]", lambda: fm.flashmla_decode_op(
            q, kv, bt, lens, scale, True, L, *sched), "bf16")
    else:
        log(f"  flashmla: {route_unmet('flashmla', q, kv)}")
    reason = route_unmet("gluon", q, kv)
    if reason is None:
        from lowering.decode.gluon_decode import gluon_decode_op
        # up to 32 query rows the few-rows kernel, else the pair kernel (pages of 64)
        record("gluon_bf16", lambda: gluon_decode_op(q, kv, bt, lens, scale, True), "bf16")
        if H >= 64:
            # the ring kernel, which pages of 32 take: the same cache seen as pages of 32
            kv32 = kv.view(-1, PAGE // 2, L + R)                         # [2 * blocks, 32, 576]
            bt32 = torch.stack([2 * bt, 2 * bt + 1], dim=-1).reshape(B, -1).contiguous()
            record("gluon_bf16[ring]", lambda: gluon_decode_op(q, kv32, bt32, lens, scale, True),
                   "bf16")
    else:
        log(f"  gluon: {reason}")
    reason = route_unmet("gluon", q, kv8, kind="fp8")
    if reason is None:
        from lowering.decode.gluon_decode import gluon_decode_fp8_cache_op
        # up to 32 query rows the few-rows kernel, else the fp8 kernel's BF16Q mode (q's
        # two e4m3 terms written by a small kernel first, timed with it)
        record("gluon_fp8kv", lambda: gluon_decode_fp8_cache_op(q, kv8, bt, lens, k_scale, scale,
                                                                True), "fp8")
    else:
        log(f"  gluon fp8 cache: {reason}")
    reason = route_unmet("gluon-fp8q", q8, kv8)
    if reason is None:
        from lowering.decode.gluon_decode import gluon_decode_fp8q_op
        record("gluon_fp8q", lambda: gluon_decode_fp8q_op(q8, kv8, bt, lens, q_scale, k_scale,
                                                          scale, True), "fp8")
    else:
        log(f"  gluon fp8: {reason}")
    reason = route_unmet("flashmla-fp8q", q8, kv8)
    if reason is None:
        import lowering.decode.flashmla as fm
        # as the bf16 rows: FlashMLA's scheduler in the call, no clamp kernels
        record("flashmla_fp8q", lambda: fm.flashmla_decode_fp8q_op(
            q8, kv8, bt, lens, q_scale, k_scale, scale, True), "fp8")
        # its scheduler table computed once outside the timed call (a model's step
        # computes it once for all layers)
        sched8 = fm.flashmla_schedule(bt, lens, PAGE, H, fp8=True)
        record("flashmla_fp8q[kernel only]", lambda: fm.flashmla_decode_fp8q_op(
            q8, kv8, bt, lens, q_scale, k_scale, scale, True, *sched8), "fp8")
    else:
        log(f"  flashmla fp8: {reason}")
    if not args.no_reference:
        record("reference", lambda: mla_decode_reference(q, kv, bt, lens, scale, causal=True,
                                                         kind="auto", k_scale=None, head_dim_v=L),
               "bf16")
    record("triton_bf16[default]", lambda: td.triton_decode_op(
        q, kv, bt, lens, None, None, scale, True, L, 0, False, torch.bfloat16),
        "bf16", dict(cfg="default"))
    record("triton_fp8kv[default]", lambda: td.triton_decode_op(
        q, kv8, bt, lens, None, k_scale, scale, True, L, 1, False, torch.bfloat16),
        "fp8", dict(cfg="default"))
    record("triton_fp8q[default]", lambda: td.triton_decode_op(
        q8, kv8, bt, lens, q_scale, k_scale, scale, True, L, 2, False, torch.bfloat16),
        "fp8", dict(cfg="default"))
    record("triton_bf16[invariant]", lambda: td.triton_decode_op(
        q, kv, bt, lens, None, None, scale, True, L, 0, True, torch.bfloat16), "bf16")
    del q, kv, bt, lens, kv8, q8
    torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default="decode_results.json")
    ap.add_argument("--shapes", default="all", help="'all' or indices like 0,1,3")
    ap.add_argument("--budget-s", type=float, default=480,
                    help="stop starting new shapes after this many seconds")
    ap.add_argument("--cubin-dir", default=None)
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
        if time.time() > args.deadline:
            log("(time budget reached, skipping the remaining shapes)")
            break
        log(f"B={B} H={H} S={S}")
        results["rows"] += bench_shape(B, H, S, args, (copy_bw, gemm), log)
        Path(args.json).write_text(json.dumps(results, indent=1))
    results["kernels"] = kernel_stats(args.cubin_dir)
    for st in results["kernels"]:
        log(str(st))
    Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
