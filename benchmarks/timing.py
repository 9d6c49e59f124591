"""Shared timing for the GPU benchmarks: median µs of one CUDA-graph replay of fn."""
from __future__ import annotations

import torch
import triton.testing


def graph_time_us(fn, warmup_calls: int = 3) -> float:
    """Capture fn once in a CUDA graph (after warm-up calls on a side stream) and return
    the median µs of triton.testing.do_bench over replays (launch overhead excluded;
    do_bench flushes the L2 between replays)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup_calls):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median") * 1e3
