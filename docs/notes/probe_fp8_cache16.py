"""fp8 cache at 16 heads (H200 probe, not maintained): the Gluon fp8-cache kernel
(gluon_rows_kernel.py) at ring depths 2, 3 and 4 against our bf16 decode (FlashMLA's
kernels with the schedule outside the call, and the Triton kernel), the Triton fp8-cache
kernel and FlashMLA's fp8 kernel (fp8 query), each call captured in a CUDA graph and
timed by the profiler's kernel span (benchmarks/timing.py); the fp8 outputs checked
against the dequantized cache's float64 attention. "gluon bf16" is the same kernel over
the bf16 cache (our best bf16 decode at 16 heads). --baseline FILE times a saved copy of
gluon_rows_kernel.py beside the current one (an A/B of a kernel change in one run).
--pool N draws every block table entry from N pages, so the cache the calls read stays in
the L2 and a kernel's per-tile chain, not DRAM, bounds it (a chain change shows on a GPU
whose DRAM would otherwise hide it). --splits A,B,... also times the current kernel (ring of
2) at each of those split counts (the launcher's own choice is the s2 row).

    python docs/notes/probe_fp8_cache16.py [B:H:S,...] [--baseline FILE] [--pool N] [--splits A,B]
"""
import importlib.util
import sys

import torch

sys.path.insert(0, "benchmarks")                    # run from the repository root
from timing import capture, kernel_time_us

import lowering.decode.gluon_decode as gd
import lowering.decode.triton_decode as td
from lowering.decode.reference import mla_decode_reference
from lowering.decode.registry import route_unmet
from mla_ops.hf.eager import set_wrap_triton_enabled

L, R, PAGE = 512, 64, 64
SCALE = 192 ** -0.5
SHAPES = ("128:16:4096,256:16:1024,64:16:8192,32:16:4096,1:16:4096,4:16:4096,"
          "8:16:4096,16:16:2048")


def t_graph(fn):
    g = capture(fn, 2)
    return kernel_time_us(g.replay, reps=20)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def load_baseline(path):
    spec = importlib.util.spec_from_file_location("baseline_rows_kernel", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.mla_decode_rows_kernel


def main():
    args = sys.argv[1:]
    baseline = None
    if "--baseline" in args:
        i = args.index("--baseline")
        baseline = load_baseline(args[i + 1])
        del args[i:i + 2]
    pool = None
    if "--pool" in args:
        i = args.index("--pool")
        pool = int(args[i + 1])
        del args[i:i + 2]
    splits = []
    if "--splits" in args:
        i = args.index("--splits")
        splits = [int(x) for x in args[i + 1].split(",")]
        del args[i:i + 2]
    shapes = args[0] if args else SHAPES
    import lowering.decode.gluon_rows_kernel as rk
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for spec in shapes.split(","):
        B, H, S = (int(x) for x in spec.split(":"))
        g = torch.Generator(device="cuda").manual_seed(B + S)
        blocks = B * S // PAGE
        q = torch.randn(B, 1, H, L + R, device="cuda", dtype=torch.bfloat16, generator=g)
        kv = torch.randn(blocks, PAGE, L + R, device="cuda", dtype=torch.bfloat16, generator=g)
        if pool:
            bt = torch.randint(0, min(pool, blocks), (B, S // PAGE), device="cuda",
                               generator=g, dtype=torch.int32)
        else:
            bt = torch.randperm(blocks, device="cuda", generator=g).int().reshape(B, S // PAGE)
        lens = torch.full((B,), S, dtype=torch.int32, device="cuda")
        ks = (kv.float().abs().amax() / 448.0).reshape(1)
        kv8 = (kv.float() / ks).to(torch.float8_e4m3fn)
        row = {}
        with set_wrap_triton_enabled(False):
            ref8 = None
            if B * S <= 64 * 4096:
                ref8 = mla_decode_reference(q.double(), kv8.double() * ks.double(), bt, lens,
                                            SCALE, causal=True, kind="auto", k_scale=None,
                                            head_dim_v=L)[0]
            if route_unmet("flashmla", q, kv) is None:
                import lowering.decode.flashmla as fm
                sched = fm.flashmla_schedule(bt, lens, PAGE, H)
                row["flashmla bf16"] = t_graph(lambda: fm.flashmla_decode_op(
                    q, kv, bt, lens, SCALE, True, L, *sched))
            row["triton bf16"] = t_graph(lambda: td.triton_decode(
                q, kv, bt, lens, None, None, SCALE, True, L, 0, False, torch.bfloat16))
            row["gluon bf16"] = t_graph(lambda: gd.gluon_decode(q, kv, bt, lens, SCALE, True))
            row["triton fp8kv"] = t_graph(lambda: td.triton_decode(
                q, kv8, bt, lens, None, ks, SCALE, True, L, 1, False, torch.bfloat16))
            base = dict(gd.FP8_CACHE_CONFIGS[16])
            current = rk.mla_decode_rows_kernel
            kernels = [("", current)] + ([(" baseline", baseline)] if baseline else [])
            for name, kernel in kernels:
                rk.mla_decode_rows_kernel = kernel
                for stages in (2, 3, 4):
                    gd.FP8_CACHE_CONFIGS[16] = dict(base, STAGES=stages)
                    run = lambda: gd.gluon_decode_fp8_cache(q, kv8, bt, lens, ks, SCALE, True)
                    key = f"gluon fp8kv{name} s{stages}"
                    try:
                        out, lse = run()
                        err = rel(out, ref8) if ref8 is not None else float("nan")
                        row[key] = t_graph(run)
                        row[key + " err"] = err
                    except Exception as exc:
                        print(f"  {key} FAILED {type(exc).__name__}: {str(exc)[:300]}")
            rk.mla_decode_rows_kernel = current
            gd.FP8_CACHE_CONFIGS[16] = base
            for n in splits:
                run = lambda: gd.gluon_decode_fp8_cache(q, kv8, bt, lens, ks, SCALE, True, n)
                row[f"gluon fp8kv splits {n}"] = t_graph(run)
            qs = (q.float().abs().amax() / 448.0).reshape(1)
            q8 = (q.float() / qs).to(torch.float8_e4m3fn)
            if route_unmet("flashmla-fp8q", q8, kv8) is None:
                import lowering.decode.flashmla as fm
                s8 = fm.flashmla_schedule(bt, lens, PAGE, H, fp8=True)
                row["flashmla fp8q"] = t_graph(lambda: fm.flashmla_decode_fp8q_op(
                    q8, kv8, bt, lens, qs, ks, SCALE, True, *s8))
        bf16 = min(v for k, v in row.items() if k.endswith("bf16"))   # our best bf16 decode
        fp8_gb = B * S * 576 / 1e3
        print(f"B={B} H={H} S={S}  (best bf16 {bf16:.1f} us)")
        for k, v in row.items():
            if k.endswith("err"):
                continue
            extra = f" err {row[k + ' err']:.1e}" if k + " err" in row else ""
            print(f"  {k:20s} {v:8.1f} us  bf16/this {bf16 / v:5.2f}x  "
                  f"fp8 bytes {fp8_gb / v:6.0f} GB/s{extra}")
        del q, kv, kv8, bt
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
