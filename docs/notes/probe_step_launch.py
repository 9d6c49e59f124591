"""Where a DecodeGraph step's time goes beyond its kernels (H200 probe, not maintained):
bench_generate.py times each step alone (event, runner(ids), event, wait), which reads
~60 µs more than events over back-to-back replays. This splits that difference.

    python docs/notes/probe_step_launch.py v2-lite:32:1024,v2-lite:1:4096    # shape:B:S,...

Per shape, µs: back to back (events over 100 calls); one step alone as the benchmark
times it; the same with the bare graph replay (no input copy, no room bookkeeping); the
host time of runner(ids), of its input copy and of graph.replay(); the span of one
step's kernels (first start to last end, profiler) and its kernel count.
"""
import statistics, sys, time
import torch
sys.path.insert(0, "docs/notes")                    # run from the repository root
from probe_step_kernels import decode_graph
from torch.profiler import profile, ProfilerActivity


def alone_us(fn, n=50):
    """Median µs of event, fn(), event, wait: a step timed by itself."""
    out = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize()
        out.append(a.elapsed_time(b) * 1e3)
    return statistics.median(out)


def back_to_back_us(fn, n=100):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record(); b.synchronize()
    return a.elapsed_time(b) / n * 1e3


def host_us(fn, n=50):
    """Median host µs of fn() (the GPU drained before each call)."""
    out = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter(); fn(); out.append((time.perf_counter() - t) * 1e6)
    return statistics.median(out)


def kernel_span_us(fn, n=10):
    """Median µs from one step's first kernel start to its last kernel end, and kernels a step."""
    spans, counts = [], []
    for _ in range(n):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as p:
            fn(); torch.cuda.synchronize()
        ev = [e for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        spans.append(max(e.time_range.end for e in ev) - min(e.time_range.start for e in ev))
        counts.append(len(ev))
    return statistics.median(spans), statistics.median(counts)


def main(spec):
    for shape, B, S in (r.split(":") for r in spec.split(",")):
        torch.manual_seed(0)
        model, cache, runner, ids = decode_graph(shape, int(B), int(S))
        g = runner._graph

        def step():
            runner(ids)
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        # 5 + 50 + 30 + 20 + 10 steps through the runner and 50 bare replays: within the
        # 200 steps of room decode_graph's cache has past S. The profiler runs last: it
        # slows the host timings taken after it.
        print(f"== {shape} B{B} S{S}", flush=True)
        print(f"  back to back      {back_to_back_us(step, 50):8.1f} µs a step")
        print(f"  alone (bench)     {alone_us(step, 30):8.1f}")
        print(f"  host runner(ids)  {host_us(step, 20):8.1f}")
        print(f"  host input copy   {host_us(lambda: runner._set_ids(ids), 20):8.1f}")
        print(f"  alone, bare replay{alone_us(g.replay, 30):8.1f}")
        print(f"  host replay()     {host_us(g.replay, 20):8.1f}")
        span, count = kernel_span_us(step)
        print(f"  kernel span       {span:8.1f} ({count} kernels, profiler)", flush=True)
        del model, cache, runner, g
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1])
