"""16-head decode (H200 probe, not maintained): FlashMLA against the Triton kernel's
configs over a bf16 cache at small batches, and the fp8-cache (bf16 query) kernel's configs.

Each candidate is captured in a CUDA graph and timed by the profiler's kernel span
(benchmarks/timing.py), checked against the shipped config's output. FlashMLA is timed
with its schedule computed outside the call ("kernels") and inside it.

    python docs/notes/probe_decode16.py
"""
import sys, itertools, torch
sys.path.insert(0, "benchmarks")                    # run from the repository root
from timing import capture, kernel_time_us
import lowering
import lowering.decode.triton_decode as td
from mla_ops.hf.eager import set_wrap_triton_enabled
L, R, PAGE, H = 512, 64, 64, 16
scale = 192 ** -0.5

def inputs(B, S):
    q = torch.randn(B, 1, H, L + R, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(B * S // PAGE, PAGE, L + R, device="cuda", dtype=torch.bfloat16)
    bt = torch.randperm(B * S // PAGE, device="cuda").int().reshape(B, S // PAGE)
    lens = torch.full((B,), S, dtype=torch.int32, device="cuda")
    return q, kv, bt, lens

def t_graph(fn):
    g = capture(fn, 2)
    return kernel_time_us(g.replay, reps=20)

def sweep(kind, shapes, grid):
    key = (kind, "narrow", "gpu")
    base = dict(td.CONFIGS[key])
    for B, S in shapes:
        q, kv, bt, lens = inputs(B, S)
        ks = None
        if kind == 1:
            kv = (kv * 0.25).to(torch.float8_e4m3fn); ks = torch.tensor([4.0], device="cuda")
        with set_wrap_triton_enabled(False):
            ref = td.triton_decode(q, kv, bt, lens, None, ks, scale, True, L, kind, False, torch.bfloat16)[0].float()
        if kind == 0:
            sched = lowering.decode_schedule(kv, bt, lens, num_heads=H)
            fm = lambda: lowering.mla_decode(q, kv, bt, lens, scale, backend="flashmla", schedule=sched, bounded=True)
            fm_s = lambda: lowering.mla_decode(q, kv, bt, lens, scale, backend="flashmla", schedule=lowering.decode_schedule(kv, bt, lens, num_heads=H), bounded=True)
            err = (fm()[0].float() - ref).abs().max().item()
            print(f"B{B} S{S}: flashmla kernels {t_graph(fm):.1f} µs, with schedule {t_graph(fm_s):.1f} µs (err vs triton {err:.1e})", flush=True)
        res = []
        for vals in itertools.product(*grid.values()):
            cfg = dict(zip(grid, vals))
            td.CONFIGS[key] = dict(base, **cfg)
            def run():
                with set_wrap_triton_enabled(False):
                    return td.triton_decode(q, kv, bt, lens, None, ks, scale, True, L, kind, False, torch.bfloat16)
            try:
                out = run()[0].float()
                err = (out - ref).abs().max().item()
                us = t_graph(run)
                res.append((us, cfg, err))
            except Exception as e:
                print(f"   {cfg}: {type(e).__name__} {str(e)[:80]}")
        td.CONFIGS[key] = base
        res.sort(key=lambda r: r[0])
        nbytes = B * S * (L + R) * (1 if kind == 1 else 2)
        with set_wrap_triton_enabled(False):
            shipped = t_graph(lambda: td.triton_decode(q, kv, bt, lens, None, ks, scale, True, L, kind, False, torch.bfloat16))
        print(f"B{B} S{S} kind{kind}: shipped {shipped:.1f} µs ({nbytes/shipped/1e3:.0f} GB/s)", flush=True)
        for us, cfg, err in res[:6]:
            print(f"   {us:7.1f} µs ({nbytes/us/1e3:5.0f} GB/s) err {err:.1e} {cfg}", flush=True)
        del q, kv; torch.cuda.empty_cache()

sweep(0, [(1, 4096), (4, 4096), (8, 2048), (32, 1024), (128, 4096)],
      dict(BLOCK_N=(64, 128), num_warps=(4, 8), num_stages=(2, 3), ctas_per_sm=(1, 2, 4)))
sweep(1, [(128, 4096), (256, 1024), (64, 8192), (32, 4096)],
      dict(BLOCK_N=(32, 64), num_warps=(4, 8), num_stages=(1, 2), ctas_per_sm=(1, 2, 4, 8)))
