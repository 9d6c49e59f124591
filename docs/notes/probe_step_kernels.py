"""The kernels of compiled DecodeGraph steps at bench_generate.py's MoE shapes (H200 probe,
not maintained): step time, kernels per step and their µs (totals by name, then one step
in launch order with the gap before each).

    python docs/notes/probe_step_kernels.py v3-moe:1:4096,v2-lite:1:4096   # shape:B:S,...
"""
import sys, collections, torch
sys.path.insert(0, "benchmarks")                    # run from the repository root
from types import SimpleNamespace
import mla_ops.hf
from bench_hf_decode import fill_paged_cache
from mla_ops.hf.models import build_model, make_config
from torch.profiler import profile, ProfilerActivity
dev, dtype = torch.device("cuda"), torch.bfloat16


def decode_graph(shape: str, B: int, S: int):
    """(model, cache, runner, ids): the converted model of bench_generate.py's `shape`, a
    paged cache of B rows at S cached tokens and its compiled DecodeGraph."""
    cfg = make_config(shape, None); cfg._attn_implementation = "sdpa"; cfg._experts_implementation = "grouped_mm"
    model = build_model(cfg, dev, dtype); mla_ops.hf.convert(model)
    opts = SimpleNamespace(kv_cache_dtype="auto", k_scale=1.0, per_layer_schedule=False)
    cache = fill_paged_cache(cfg, B, S, 200, dev, dtype, opts)
    ids = torch.randint(3, cfg.vocab_size, (B, 1), device=dev)
    torch._dynamo.reset()
    runner = mla_ops.hf.DecodeGraph(model, cache, batch_size=B, graph=True, compile=True)
    return model, cache, runner, ids


def replay_us(shape: str, B: int, S: int, n: int = 100) -> float:
    """µs a step of decode_graph(shape, B, S) from events over n replays (after 5), seed 0."""
    torch.manual_seed(0)
    model, cache, runner, ids = decode_graph(shape, B, S)
    for _ in range(5):
        runner(ids)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        runner(ids)
    b.record(); torch.cuda.synchronize()
    del model, cache, runner
    torch.cuda.empty_cache()
    return a.elapsed_time(b) / n * 1000


def main(spec):
    for shape, B, S in (r.split(":") for r in spec.split(",")):
        B, S = int(B), int(S)
        model, cache, runner, ids = decode_graph(shape, B, S)
        for _ in range(5): runner(ids)
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(20): runner(ids)
        b.record(); torch.cuda.synchronize()
        wall = a.elapsed_time(b) / 20 * 1000
        n = 10
        with profile(activities=[ProfilerActivity.CUDA]) as p:
            for _ in range(n): runner(ids)
            torch.cuda.synchronize()
        ev = [e for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        agg = collections.defaultdict(lambda: [0, 0.0])
        for e in ev:
            agg[e.name][0] += 1; agg[e.name][1] += e.device_time_total
        tot = sum(v[1] for v in agg.values()) / n
        cnt = sum(v[0] for v in agg.values()) / n
        print(f"\n== {shape} B{B} S{S}: step {wall:.1f} µs, {cnt:.0f} kernels/step, kernel sum {tot:.1f} µs/step", flush=True)
        for k, (c, us) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:60]:
            print(f"  {us/n:8.1f} µs  x{c/n:5.1f}  {k[:120]}")
        # the order of one step's kernels
        one = sorted(ev, key=lambda e: e.time_range.start)
        steps = len(one) // n
        print("  -- one step in order (name, µs, gap before µs):")
        prev = None
        for e in one[:steps]:
            gap = 0 if prev is None else (e.time_range.start - prev)
            prev = e.time_range.end
            print(f"    {e.device_time_total:7.1f} {gap:6.1f}  {e.name[:100]}")
        del model, cache, runner; torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1])
