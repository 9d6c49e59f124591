"""The fp8-dots decode kernel (lowering/decode/triton_fp8_dots_kernel.py) at 16 heads
(H200 probe, not maintained): its configs against the shipped fp8-cache stage-1 entry and
the bf16 Triton kernel over the same cache in bf16, bf16 and fp8 queries.

Each candidate is captured in a CUDA graph and timed by the profiler's kernel span
(benchmarks/timing.py); its error is against a float64 attention over the dequantized
cache, relative to the output's largest magnitude, beside the stage-1 kernel's.

    python docs/notes/probe_fp8_dots.py [B:S,...]
"""
import sys, itertools, torch
sys.path[:0] = [".", "benchmarks"]                  # run from the repository root
from timing import capture, kernel_time_us
import lowering.decode.triton_decode as td
from mla_ops.hf.eager import set_wrap_triton_enabled
L, R, PAGE, H = 512, 64, 64, 16
scale = 192 ** -0.5
shapes = [tuple(int(v) for v in s.split(":")) for s in
          (sys.argv[1] if len(sys.argv) > 1 else "128:4096,256:1024,64:8192,32:4096,1:4096").split(",")]
grid = dict(BLOCK_N=(32, 64, 128), num_warps=(4, 8), num_stages=(2, 3, 4), ctas_per_sm=(1, 2, 4))


def t_graph(fn):
    g = capture(fn, 2)
    return kernel_time_us(g.replay, reps=20)


def ref64(q, kv, bt, lens):            # [B, H, L] float64, every request at full length
    B = q.shape[0]
    k = kv[bt.long()].reshape(B, -1, L + R).double()           # [B, S, 576]
    s = torch.einsum("bhd,bsd->bhs", q[:, 0].double(), k) * scale
    return torch.einsum("bhs,bsl->bhl", s.softmax(-1), k[..., :L])


def call(q, kv, bt, lens, qs, ks, kind):
    with set_wrap_triton_enabled(False):
        return td.triton_decode(q, kv, bt, lens, qs, ks, scale, True, L, kind, False,
                                torch.bfloat16)[0]


for B, S in shapes:
    nb = B * S // PAGE
    q = torch.randn(B, 1, H, L + R, device="cuda", dtype=torch.bfloat16)
    kv16 = torch.randn(nb, PAGE, L + R, device="cuda", dtype=torch.bfloat16)
    bt = torch.randperm(nb, device="cuda").int().reshape(B, S // PAGE)
    lens = torch.full((B,), S, dtype=torch.int32, device="cuda")
    kv8 = (kv16.float() * 0.25).to(torch.float8_e4m3fn)
    ks = torch.tensor([4.0], device="cuda")
    q8 = (q.float() * 0.5).to(torch.float8_e4m3fn)
    qs = torch.tensor([2.0], device="cuda")
    kv_deq = kv8.float() * 4.0
    sub = slice(0, min(B, 8))                                     # reference on a few requests
    ref_b = ref64(q[sub], kv_deq, bt[sub], lens[sub])
    ref_q8 = ref64((q8.float() * 2.0)[sub], kv_deq, bt[sub], lens[sub])
    err = lambda o, r: ((o[sub, 0].double() - r).abs().max() / r.abs().max()).item()
    nbytes8 = B * S * (L + R)
    kv_b = kv_deq.bfloat16()
    t16 = t_graph(lambda: call(q, kv_b, bt, lens, None, None, 0))
    key = (1, "narrow", "gpu")
    base1, base2 = dict(td.CONFIGS[key]), dict(td.CONFIGS[(2, "narrow", "gpu")])
    t1 = t_graph(lambda: call(q, kv8, bt, lens, None, ks, 1))
    e1 = err(call(q, kv8, bt, lens, None, ks, 1), ref_b)
    t2 = t_graph(lambda: call(q8, kv8, bt, lens, qs, ks, 2))
    print(f"B{B} S{S} H{H}: bf16 Triton {t16:.1f} µs ({2 * nbytes8 / t16 / 1e3:.0f} GB/s); "
          f"fp8 stage-1 bf16 q {t1:.1f} µs (err {e1:.1e}), fp8 q {t2:.1f} µs", flush=True)
    for kind, qq, qsc, ref in ((1, q, None, ref_b), (2, q8, qs, ref_q8)):
        k = (kind, "narrow", "gpu")
        base = dict(td.CONFIGS[k])
        res = []
        for vals in itertools.product(*grid.values()):
            td.CONFIGS[k] = dict(base, kernel="fp8_dots", **dict(zip(grid, vals)))
            try:
                e = err(call(qq, kv8, bt, lens, qsc, ks, kind), ref)
                us = t_graph(lambda: call(qq, kv8, bt, lens, qsc, ks, kind))
                res.append((us, dict(zip(grid, vals)), e))
            except Exception as ex:
                print(f"   {dict(zip(grid, vals))}: {type(ex).__name__} {str(ex)[:120]}", flush=True)
        td.CONFIGS[k] = base
        res.sort(key=lambda r: r[0])
        for us, cfg, e in res[:5]:
            print(f"   kind {kind} fp8-dots {us:7.1f} µs ({nbytes8 / us / 1e3:5.0f} GB/s) "
                  f"x{t16 / us:.2f} of bf16, err {e:.1e} {cfg}", flush=True)
    del q, kv16, kv8, kv_deq, kv_b
    torch.cuda.empty_cache()
