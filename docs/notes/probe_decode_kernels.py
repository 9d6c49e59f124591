"""The kernels of one V2-Lite DecodeGraph step (H200 probe, not maintained): names,
launches and µs per step under the profiler, compiled and eager-captured, at 1 x 4096 and
32 x 1024 (bench_generate.py's model: 4 layers, 1 dense + 3 MoE).

    python docs/notes/probe_decode_kernels.py
"""
import sys, collections, torch
sys.path.insert(0, "benchmarks")                    # run from the repository root
from types import SimpleNamespace
import mla_ops.hf
from bench_hf_decode import fill_paged_cache
from mla_ops.hf.models import build_model, make_config
from torch.profiler import profile, ProfilerActivity
dev, dtype = torch.device("cuda"), torch.bfloat16
for shape, B, S in (("v2-lite", 1, 4096), ("v2-lite", 32, 1024)):
    cfg = make_config(shape, None); cfg._attn_implementation = "sdpa"; cfg._experts_implementation = "grouped_mm"
    model = build_model(cfg, dev, dtype); mla_ops.hf.convert(model)
    opts = SimpleNamespace(kv_cache_dtype="auto", k_scale=1.0, per_layer_schedule=False)
    cache = fill_paged_cache(cfg, B, S, 200, dev, dtype, opts)
    ids = torch.randint(3, cfg.vocab_size, (B, 1), device=dev)
    for compile_ in (True, False):
        torch._dynamo.reset()
        runner = mla_ops.hf.DecodeGraph(model, cache, batch_size=B, graph=True, compile=compile_)
        for _ in range(5): runner(ids)
        torch.cuda.synchronize()
        n = 10
        with profile(activities=[ProfilerActivity.CUDA]) as p:
            for _ in range(n): runner(ids)
            torch.cuda.synchronize()
        ev = [e for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        agg = collections.defaultdict(lambda: [0, 0.0])
        for e in ev:
            agg[e.name][0] += 1; agg[e.name][1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        tot = sum(v[1] for v in agg.values()) / n
        cnt = sum(v[0] for v in agg.values()) / n
        t0 = min(e.time_range.start for e in ev); t1 = max(e.time_range.end for e in ev)
        print(f"\n== {shape} B{B} S{S} compile={compile_}: {cnt:.0f} kernels/step, kernel sum {tot:.1f} µs/step, span {(t1-t0)/n:.1f} µs/step", flush=True)
        for k, (c, us) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:45]:
            print(f"  {us/n:8.1f} µs  x{c/n:5.1f}  {k[:110]}")
    del model, cache; torch.cuda.empty_cache()
