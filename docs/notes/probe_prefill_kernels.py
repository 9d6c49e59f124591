"""The GPU kernels of one prefill forward, HF's against the converted model's (H200 probe,
not maintained): HF, the converted model eagerly and through PrefillGraph: wall ms, kernel-sum ms, kernel count, and the kernels' µs by name.

    python docs/notes/probe_prefill_kernels.py v3:1x8192,v2-lite:1x8192,v2-lite:multi-turn
"""
import collections, sys
import torch
sys.path.insert(0, "benchmarks")                    # run from the repository root
from torch.profiler import profile, ProfilerActivity
from bench_prefill import bench_ms, hf_step, ours_graph_step, ours_step, spec_models


def kernels(fn, n=3):
    fn(); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    agg = collections.defaultdict(lambda: [0, 0.0])
    for e in p.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            agg[e.name][0] += 1
            agg[e.name][1] += e.device_time_total
    return {k: (c / n, us / n) for k, (c, us) in agg.items()}


def show(tag, wall, agg, top=30):
    tot = sum(us for _, us in agg.values()); cnt = sum(c for c, _ in agg.values())
    print(f"  {tag}: wall {wall:.2f} ms, kernels {tot / 1e3:.2f} ms, {cnt:.0f} launches", flush=True)
    for k, (c, us) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"    {us:9.1f} µs x{c:5.0f}  {k[:110]}")


@torch.no_grad()
def main(spec):
    import mla_ops.hf
    for name, row, cfg, model, ids, ctx in spec_models(spec):
        print(f"== {name} {row}", flush=True)
        step = hf_step(model, cfg, ids, ctx)
        show("HF", bench_ms(step, 2, 5), kernels(step))
        mla_ops.hf.convert(model)
        step = ours_step(model, cfg, ids, ctx)
        show("ours", bench_ms(step, 2, 5), kernels(step))
        if ids.shape[0] * (ids.shape[1] - ctx) <= 2048:     # PrefillGraph's replay
            step, _ = ours_graph_step(model, cfg, ids, ctx, 2048)
            show("ours, captured", bench_ms(step, 2, 5), kernels(step))
        del model, step
        torch.cuda.empty_cache()

if __name__ == "__main__":
    main(sys.argv[1])
