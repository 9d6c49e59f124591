"""The GPU kernels of one prefill forward, HF's against the converted model's (H200 probe,
not maintained): wall ms, kernel-sum ms, kernel count, and the kernels' µs by name.

    python docs/notes/probe_prefill_kernels.py v3:1x8192,v2-lite:1x8192,v2-lite:multi-turn
"""
import collections, sys
import torch
sys.path.insert(0, "benchmarks")                    # run from the repository root
from torch.profiler import profile, ProfilerActivity
from bench_prefill import bench_ms, build, model_config, parse_row


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
    from transformers import DynamicCache
    import mla_ops.hf
    dtype = torch.bfloat16
    for item in spec.split(","):
        name, row = item.split(":")
        B, S, ctx = parse_row(row)
        cfg = model_config(name, 2048)
        model = build(cfg, dtype)
        ids = torch.randint(3, 2048, (B, S + ctx), device="cuda")
        base = DynamicCache(config=cfg)
        if ctx:
            model(ids[:, :ctx], past_key_values=base, use_cache=True)

        def hf_step():
            if ctx:
                extra = base.get_seq_length() - ctx
                if extra > 0:
                    base.crop(-extra)
                cache = base
            else:
                cache = DynamicCache(config=cfg)
            return model(ids[:, ctx:], past_key_values=cache, use_cache=True).logits
        print(f"== {name} B{B} S{S} context {ctx}", flush=True)
        show("HF", bench_ms(hf_step, 2, 5), kernels(hf_step))
        mla_ops.hf.convert(model)
        cache = mla_ops.hf.PagedMLACache(cfg, max_batch_size=B, max_cache_len=S + ctx,
                                         device="cuda", dtype=dtype)
        if ctx:
            model(ids[:, :ctx], past_key_values=cache, use_cache=True)
        saved = cache.snapshot()

        def ours_step():
            cache.restore(saved)
            return model(ids[:, ctx:], past_key_values=cache, use_cache=True).logits
        show("ours", bench_ms(ours_step, 2, 5), kernels(ours_step))
        del model, cache
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1])
