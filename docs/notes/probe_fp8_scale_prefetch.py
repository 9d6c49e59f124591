"""The fp8 decode GEMM with each K step's scales loaded one step ahead (GPU probe, not
maintained).

In fp8_linear_kernel.py's K loop the weight and x tiles are pipelined (cp.async, num_stages)
but the two scale loads of a step (the weight block's scale_inv and x's group scale) are
plain global loads issued in that step and read right after its wgmma: the SM90 PTX of
the shipped o_proj config shows them between the cp.async wait and the wgmma, so each
step waits a load's latency. Here the same W8A8 numbers (mode 0, x quantized once
outside the timed call, split-K partials summed by the shipped reduce) with the scales
of step k + 1 loaded during step k ("ahead") against the same kernel loading them in the
step ("in step") and the shipped launcher, at DeepSeek-V3's one-row shapes with their
shipped tile and split; CUDA graphs, timing.graph_time_us (read flush), outputs checked.

    python docs/notes/probe_fp8_scale_prefetch.py [rows]
"""
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "benchmarks"))
from timing import graph_time_us  # noqa: E402
from lowering.gemm import fp8_launch  # noqa: E402
from probe_common import V3_FP8_SHAPES, fp8_gemm_cases, split_tile  # noqa: E402


@triton.jit
def scaled_kernel(x_ptr, xs_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_xs, stride_sn,
                  stride_ys, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, AHEAD: tl.constexpr, SPLIT_K):
    """y[split] [M, N] fp32 = the split's groups of xq @ dequant(w).T (x e4m3 [M, K], its
    scales xs [M, G]); AHEAD: each step's scales loaded during the step before."""
    split, g0, g1, offs_n, offs_m, offs_k, n_ok, m_ok = split_tile(
        M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K)
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * K + (g0 * BLOCK_K + offs_k)[None, :]
    x_ptrs = x_ptr + offs_m[None, :] * K + (g0 * BLOCK_K + offs_k)[:, None]
    s_ptrs = s_ptr + (offs_n // 128) * stride_sn
    xs_ptrs = xs_ptr + offs_m * stride_xs
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    ws = tl.load(s_ptrs + g0, mask=n_ok, other=0.0)
    xs = tl.load(xs_ptrs + g0, mask=m_ok, other=0.0)
    for k in range(g0, g1):
        w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
        x = tl.load(x_ptrs, mask=m_ok[None, :], other=0.0)
        if AHEAD:
            ws_next = tl.load(s_ptrs + k + 1, mask=n_ok & (offs_n * 0 + k + 1 < g1), other=0.0)
            xs_next = tl.load(xs_ptrs + k + 1, mask=m_ok & (offs_m * 0 + k + 1 < g1),
                              other=0.0)
        else:
            ws = tl.load(s_ptrs + k, mask=n_ok, other=0.0)
            xs = tl.load(xs_ptrs + k, mask=m_ok, other=0.0)
        acc += tl.dot(w, x) * ws[:, None] * xs[None, :]
        if AHEAD:
            ws = ws_next
            xs = xs_next
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    y = y_ptr + split.to(tl.int64) * stride_ys + offs_m[None, :] * N + offs_n[:, None]
    tl.store(y, acc, mask=m_ok[None, :] & n_ok[:, None])


SHAPES = {name: V3_FP8_SHAPES[name] for name in
          ("q_b", "o_proj", "down", "gate+up", "shared down")}


def main(M):
    dev = torch.device("cuda")
    for label, N, K, cfg, case, floor, ref in fp8_gemm_cases(SHAPES, M, "µs"):
        w, s, xq, xs, shipped, y = case
        bn, warps, stages, sk = cfg
        out = [f"{label} [{N} x {K}] floor {floor:.1f}: shipped {cfg} "
               f"{graph_time_us(shipped):.1f}"]
        p2 = torch.empty(sk, M, N, device=dev, dtype=torch.float32)
        bm = max(16, triton.next_power_of_2(M))
        for ahead in (False, True):
            def mine(ahead=ahead):
                scaled_kernel[(triton.cdiv(N, bn), sk)](
                    xq, xs, w, s, p2, M, N, K, xs.stride(0), s.stride(0), p2.stride(0),
                    BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, AHEAD=ahead, SPLIT_K=sk,
                    num_warps=warps, num_stages=stages)
                fp8_launch.reduce_partials(p2, y)
            y.zero_()
            mine()
            torch.cuda.synchronize()
            err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
            t = graph_time_us(mine)
            out.append(f"{'ahead' if ahead else 'in step'} {t:.1f} ({floor / t:.2f})"
                       + (f" MISMATCH {err:.2g}" if err > 1e-2 else ""))
        print("; ".join(out), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
