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


_FLUSH: dict = {}


def flush_l2() -> None:
    """Evict the L2 by reading 256 MB, which leaves it holding clean lines. Zeroing a
    buffer (triton.testing.do_bench's flush) leaves dirty lines instead, written back
    while the next kernel reads: 2-10 µs of a memory-bound kernel on an H100
    (docs/notes/NOTES-fp8-checkpoints.md, "How the L2 is flushed matters")."""
    dev = torch.cuda.current_device()
    if dev not in _FLUSH:
        _FLUSH[dev] = torch.ones(256 << 20, dtype=torch.uint8, device="cuda")
    _FLUSH[dev].sum(dtype=torch.int32)


def graph_time_us(fn, warmup_calls: int = 3, reps: int = 100) -> float:
    """Capture fn once in a CUDA graph (after warm-up calls on a side stream) and return
    the median µs of its replays, each after flush_l2 (whose ~0.1 ms also hides the
    replay's launch from the events around it)."""
    graph = capture(fn, warmup_calls)
    for _ in range(5):
        graph.replay()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for a, b in zip(starts, ends):
        flush_l2()
        a.record()
        graph.replay()
        b.record()
    torch.cuda.synchronize()
    times = sorted(a.elapsed_time(b) for a, b in zip(starts, ends))
    return times[len(times) // 2] * 1e3


def kernel_time_us(fn, reps: int = 30) -> float:
    """Median µs from the start of fn's first GPU kernel to the end of its last, each
    call after flush_l2, from the profiler's kernel records: no event or launch
    overhead, which dominates event timings for kernels of a few µs."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    def gpu_events(prof):
        return sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA),
                      key=lambda e: e.time_range.start)
    for _ in range(3):
        fn()
    flush_l2()                  # its buffer made before the profile names the flush's kernels
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        flush_l2()
        torch.cuda.synchronize()
    flush_names = {e.name for e in gpu_events(prof)}
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flush_l2()
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
                    help="graph: events around graph replays; kernel: the profiler's kernel "
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
