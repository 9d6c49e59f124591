"""Shared timing for the GPU benchmarks: median µs of one CUDA-graph replay of fn."""
from __future__ import annotations

import torch
import triton.testing


def capture(fn, warmup_calls: int = 1) -> torch.cuda.CUDAGraph:
    """fn captured once in a CUDA graph, after warm-up calls on a side stream (with the
    garbage collector paused during the capture, as DecodeGraph captures)."""
    from mla_ops.hf.graph import capturing
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup_calls):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with capturing(graph):
        fn()
    return graph


def graph_time_us(fn, warmup_calls: int = 3) -> float:
    """Capture fn once in a CUDA graph (after warm-up calls on a side stream) and return
    the median µs of triton.testing.do_bench over replays (launch overhead excluded;
    do_bench flushes the L2 between replays)."""
    graph = capture(fn, warmup_calls)
    return triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median") * 1e3


def kernel_time_us(fn, reps: int = 30) -> float:
    """Median µs from the start of fn's first GPU kernel to the end of its last, each
    call after an L2 flush, from the profiler's kernel records: no event or launch
    overhead, which dominates do_bench's numbers for kernels of a few µs."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")

    def gpu_events(prof):
        return sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA),
                      key=lambda e: e.time_range.start)
    for _ in range(3):
        fn()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        flush.zero_()
        torch.cuda.synchronize()
    flush_names = {e.name for e in gpu_events(prof)}
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flush.zero_()
            fn()
        torch.cuda.synchronize()
    spans, cur = [], []
    for e in gpu_events(prof) + [None]:
        if e is None or e.name in flush_names:
            if cur:
                spans.append(max(x.time_range.end for x in cur) - cur[0].time_range.start)
            cur = []
        else:
            cur.append(e)
    spans.sort()
    return float(spans[len(spans) // 2])


def add_timer_args(ap):
    """The config sweeps' --timer and --show options (chosen_timer reads --timer)."""
    ap.add_argument("--timer", choices=["graph", "kernel"], default="graph",
                    help="graph: do_bench over graph replays; kernel: the profiler's kernel "
                         "span (what the kernels take inside a model step)")
    ap.add_argument("--show", action="store_true", help="print every config's time")


def chosen_timer(args):
    return kernel_time_us if args.timer == "kernel" else graph_time_us


def best_config(configs, make_run, ref, tol=2e-2, timer=None, show=False):
    """(µs, config) of the fastest config whose output matches ref.

    make_run(cfg) -> (run, output): run launches the config, output() returns what it
    wrote. Each config runs once and is checked (relative max error < tol) before it is
    timed; configs that fail to launch (e.g. out of shared memory) or are wrong are
    reported and skipped. timer: graph_time_us (default) or kernel_time_us; show: print
    every config's time."""
    best = (float("inf"), None)
    for cfg in configs:
        run, output = make_run(cfg)
        try:
            run()
            torch.cuda.synchronize()
        except Exception as e:
            print(f"    {cfg}: {type(e).__name__}", flush=True)
            continue
        got = output().float()
        # equal infinities (masked scores) count as exact; any other mismatch as wrong
        diff = torch.where(got == ref, 0.0, (got - ref).abs())
        err = (diff.max() / ref[ref.isfinite()].abs().max()).item()
        if not err < tol:
            print(f"    {cfg}: wrong (rel err {err:.2e})", flush=True)
            continue
        us = (timer or graph_time_us)(run)
        if show:
            print(f"    {cfg}: {us:.1f} µs", flush=True)
        best = min(best, (us, cfg))
    return best


def copy_ceiling(nbytes=1 << 30):
    """Device copy bandwidth, bytes read + written per second (do_bench median)."""
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=50, rep=200)
    return 2 * nbytes / (ms * 1e-3)


def announce_ceiling():
    """Print the GPU, torch version and measured copy ceiling; return the ceiling (B/s)."""
    ceil = copy_ceiling()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; copy ceiling "
          f"{ceil / 1e12:.2f} TB/s")
    return ceil


def gemm_header(title, mb_col, b_col):
    """The markdown header gemm_row's rows go under, after a blank line and the title."""
    print(f"\n{title}\n| GEMM | {mb_col} | cuBLAS µs (of ceiling) | {b_col} µs (of ceiling) | "
          "config |\n|---|---|---|---|---|", flush=True)


def gemm_row(name, mb, nbytes, a_us, b_us, ceil, cfg=""):
    """One markdown row: name | MB | a µs (of ceiling) | b µs (of ceiling) | cfg."""
    def cell(us):
        return f"{us:.1f} ({nbytes / us / 1e6 / (ceil / 1e12):.2f})"
    return f"| {name} | {mb} | {cell(a_us)} | {cell(b_us)} | {cfg} |"


def print_configs(where, configs):
    print(f"\n{where} entries:")
    for key, cfg in configs.items():
        print(f"    {key}: {cfg},")
