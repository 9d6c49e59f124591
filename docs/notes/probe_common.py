"""What the 2026-12-07 GPU probes share (not maintained): a one-row V3 fp8 decode GEMM
case and its shipped launch, the V3-shaped step's time, and a CUDA-graph timer with the
write flush those probes' recorded numbers used. Run the probes from the repository root."""
import os
import statistics
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "benchmarks"))
from lowering.gemm import fp8_launch  # noqa: E402
from lowering.gemm.fp8_act_quant import quantize_rows_torch  # noqa: E402


def graph_us_write_flush(fn, n=40):
    """Median µs of fn's CUDA-graph replay after a 256 MB zeroing (events): the flush the
    numbers of probe_fp8_absorbed.py and probe_q_absorb_scaling.py were taken with."""
    fn(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    ts = []
    for _ in range(n):
        flush.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b) * 1000)
    return statistics.median(ts)


def step_ms(model, cfg, B, S, dev, iters=30, rounds=5, tokens=0):
    """Median ms of one decode step of the converted model (DecodeGraph, compiled) over a
    bf16 cache of S random rows per request (seeded, so every call sees the same cache);
    with tokens, also that many greedy tokens [B, tokens] after the timing."""
    import mla_ops.hf
    from bench_fp8_weights import fill_cache, time_steps
    torch._dynamo.reset()
    torch.manual_seed(1)
    cache = fill_cache(cfg, B, S, 400, dev)
    runner = mla_ops.hf.DecodeGraph(model, cache, batch_size=B, compile=True)
    ms = time_steps(runner, B, dev, iters, rounds)
    ids = torch.zeros(B, 1, dtype=torch.long, device=dev)
    toks = runner.greedy(ids, tokens) if tokens else None
    del runner, cache
    torch.cuda.empty_cache()
    return ms, toks


# DeepSeek-V3's one-row fp8 decode GEMMs: name -> (N, K, the shipped config at one row)
# (the dense gate + up stood in for by one weight of both matrices' rows)
V3_FP8_SHAPES = {
    "q_a+kv_a": (2112, 7168, (64, 4, 3, 8)),
    "q_b": (24576, 1536, (64, 4, 3, 1)),
    "o_proj": (7168, 16384, (128, 4, 4, 4)),
    "gate+up": (36864, 7168, (64, 4, 4, 1)),
    "down": (7168, 18432, (128, 4, 4, 4)),
    "shared g+u": (4096, 7168, (128, 4, 3, 8)),
    "shared down": (7168, 2048, (128, 4, 3, 4)),
}


def graph_us_do_bench(fn):
    """Median µs of fn's CUDA-graph replays under triton's do_bench (its write flush)."""
    import triton.testing
    from timing import capture
    g = capture(fn, 2)
    return triton.testing.do_bench(g.replay, warmup=10, rep=60, return_mode="median") * 1e3


def fp8_gemm_case(N, K, M, cfg, dev):
    """A one-weight fp8 decode GEMM at [N x K] and M rows: (w e4m3, s, xq, xs, shipped, y)
    with random weights and scales, x quantized once, and shipped() running the shipped
    launcher at cfg = (BLOCK_N, warps, stages, SPLIT_K) into y (split-K partials reduced
    by the shipped reduce)."""
    w = (torch.randn(N, K, device=dev) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.rand(triton.cdiv(N, 128), triton.cdiv(K, 128), device=dev) * 1e-2
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    xq, xs = quantize_rows_torch(x, 128)
    xq, xs = xq.contiguous(), xs.contiguous()
    sk = cfg[3]
    y = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
    parts = torch.empty(sk, M, N, device=dev, dtype=torch.float32)

    def shipped():
        if sk > 1:
            fp8_launch.launch(x, w, s, None, None, 0, parts, None, 128, 128, cfg,
                              x_quant=(xq, xs))
            fp8_launch.reduce_partials(parts, y)
        else:
            fp8_launch.launch(x, w, s, None, None, 0, y, None, 128, 128, cfg[:3],
                              x_quant=(xq, xs))
    return w, s, xq, xs, shipped, y


def fp8_gemm_cases(shapes, M, title):
    """Print the card, versions and title; then for each shape of shapes (name -> (N, K,
    cfg)), seeded alike: (label, N, K, cfg, case, floor, ref) with case fp8_gemm_case's
    tuple, floor the weight's bytes' µs at the card's bandwidth (4.3 TB/s on an H200,
    3.35 on an H100) and ref the shipped launch's output (fp32)."""
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name()
    bw = 4.3e12 if "H200" in name else 3.35e12
    print(f"{name} {torch.__version__} {triton.__version__}, rows {M}; {title} (bytes' "
          f"time fraction at {bw / 1e12:.2f} TB/s)", flush=True)
    for label, (N, K, cfg) in shapes.items():
        torch.manual_seed(0)
        case = fp8_gemm_case(N, K, M, cfg, dev)
        case[4]()                                             # the shipped launch
        yield label, N, K, cfg, case, N * K / bw * 1e6, case[5].float().clone()


@triton.jit
def split_tile(M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               SPLIT_K):
    """The probes' GEMM kernels' program: (split, g0, g1, offs_n, offs_m, offs_k, n_ok,
    m_ok) for BLOCK_N weight rows (program_id 0) and the scale groups [g0, g1) of K split
    program_id(1) covers (sizes differing by at most one group)."""
    split = tl.program_id(1)
    groups = tl.cdiv(K, BLOCK_K)
    g0 = split * groups // SPLIT_K
    g1 = (split + 1) * groups // SPLIT_K
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    return split, g0, g1, offs_n, offs_m, offs_k, offs_n < N, offs_m < M
