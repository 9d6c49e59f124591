"""The kernels of the V3-shaped decode step of bench_fp8_weights.py, bf16 and fp8 weights
(H200 probe, not maintained): step µs from events over replays, then per kernel name the
µs a step, and one step in launch order with the gap before each kernel.

    python docs/notes/probe_fp8_step.py [B] [S]        # default 1 4096
"""
import sys, collections, argparse, torch
sys.path.insert(0, "benchmarks")                    # run from the repository root
import mla_ops.hf
from mla_ops.hf.fp8_models import quantize_fp8
from mla_ops.hf.models import build_model
from bench_fp8_weights import v3_moe_config, fill_cache
from torch.profiler import profile, ProfilerActivity


def main():
    B = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    S = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
    args = argparse.Namespace(layers=2, dense_layers=1, experts=256, top_k=8)
    dev = torch.device("cuda")
    cfg = v3_moe_config(args)
    torch.manual_seed(0)
    bf16 = build_model(cfg, dev, torch.bfloat16)
    fp8 = quantize_fp8(bf16)
    models = {"bf16": mla_ops.hf.convert(bf16, fuse_experts=True),
              "fp8": mla_ops.hf.convert(fp8, fuse_experts=True)}
    for name, model in models.items():
        torch._dynamo.reset()
        cache = fill_cache(cfg, B, S, 400, dev)
        runner = mla_ops.hf.DecodeGraph(model, cache, batch_size=B, compile=True)
        ids = torch.zeros(B, 1, dtype=torch.long, device=dev)
        runner.greedy(ids, 3); torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); runner.greedy(ids, 50); b.record(); b.synchronize()
        wall = a.elapsed_time(b) / 50 * 1000
        n = 10
        with profile(activities=[ProfilerActivity.CUDA]) as p:
            runner.greedy(ids, n); torch.cuda.synchronize()
        ev = [e for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        agg = collections.defaultdict(lambda: [0, 0.0])
        for e in ev:
            agg[e.name][0] += 1; agg[e.name][1] += e.device_time_total
        tot = sum(v[1] for v in agg.values()) / n
        cnt = sum(v[0] for v in agg.values()) / n
        print(f"\n== {name} B{B} S{S}: step {wall:.1f} µs (greedy loop), {cnt:.0f} kernels/step, "
              f"kernel sum {tot:.1f} µs/step", flush=True)
        for k, (c, us) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:50]:
            print(f"  {us/n:8.1f} µs  x{c/n:5.1f}  {k[:110]}")
        one = sorted(ev, key=lambda e: e.time_range.start)
        steps = len(one) // n
        print("  -- one step in order (µs, gap before µs, name):")
        prev = None
        for e in one[steps:2 * steps]:
            gap = 0 if prev is None else (e.time_range.start - prev)
            prev = e.time_range.end
            print(f"    {e.device_time_total:7.1f} {gap:6.1f}  {e.name[:100]}")
        del runner, cache; torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
