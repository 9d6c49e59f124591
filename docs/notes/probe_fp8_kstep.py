"""Does the fp8 decode GEMM stream faster when each step of its K loop reads several scale
groups of a weight row at once? (GPU probe, not maintained.)

fp8_linear_kernel.py walks K one scale group (128 columns) at a time: at one e4m3 byte a
column that is 128 contiguous bytes of each weight row a step, where the bf16 decode
GEMM's best tiles read 256 or 512 bytes of a row a step (linear.CONFIGS' BLOCK_K). Here
the same W8A8 numerics (x quantized once, fp8 x fp8 products per scale group times both
scales, fp32 sums) with KG groups a step: the step's KG weight tiles [BLOCK_N, 128] of
adjacent columns are loaded together, then each is multiplied and scaled as before.
Mode 0 only (one weight), x pre-quantized (act_quant_kernel, outside the timed call),
split-K partials summed by the shipped reduce.

Each shape at one row, DeepSeek-V3's fp8 decode GEMMs (mode 2's gate + up stood in for by
one weight of both matrices' rows): the shipped launcher (fp8_launch.launch at its CONFIGS
entry, the act quant excluded) against KG = 1, 2, 4 at the same tile and split and at
BLOCK_N 64 / 128; µs of CUDA-graph replays with the L2 flushed (do_bench), and the
fraction of the bytes' time at 4.3 TB/s (H200) / 3.35 TB/s (H100).

    python docs/notes/probe_fp8_kstep.py [rows]
"""
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "benchmarks"))
from lowering.gemm import fp8_launch  # noqa: E402
from probe_common import (V3_FP8_SHAPES, fp8_gemm_cases, split_tile,  # noqa: E402
                          graph_us_do_bench as time_us)
from lowering.gemm.linear import max_shared_bytes  # noqa: E402


@triton.jit
def kstep_kernel(x_ptr, xs_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_xs, stride_sn,
                 stride_ys, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, KG: tl.constexpr, SPLIT_K):
    """y[split] [M, N] fp32 = the split's groups of xq @ dequant(w).T (x e4m3 [M, K], its
    scales xs [M, G]); KG scale groups a loop step."""
    split, g0, g1, offs_n, offs_m, offs_k, n_ok, m_ok = split_tile(
        M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K)
    w_row = w_ptr + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :]          # [BN, BK]
    x_row = x_ptr + offs_m[None, :] * K + offs_k[:, None]                       # [BK, BM]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(g0, g1, KG):
        for j in tl.static_range(KG):
            g = k + j
            k_ok = offs_k < (g1 - g) * BLOCK_K                      # all or none
            w = tl.load(w_row + g * BLOCK_K, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_row + g * BLOCK_K, mask=m_ok[None, :] & k_ok[:, None], other=0.0)
            ws = tl.load(s_ptr + (offs_n // 128) * stride_sn + g,
                         mask=n_ok & (offs_n * 0 + g < g1), other=0.0)
            xs = tl.load(xs_ptr + offs_m * stride_xs + g, mask=m_ok & (offs_m * 0 + g < g1),
                         other=0.0)
            acc += tl.dot(w, x) * ws[:, None] * xs[None, :]
    y = y_ptr + split.to(tl.int64) * stride_ys + offs_m[None, :] * N + offs_n[:, None]
    tl.store(y, acc, mask=m_ok[None, :] & n_ok[:, None])


SHAPES = V3_FP8_SHAPES


def main(M):
    dev = torch.device("cuda")
    smem = max_shared_bytes(0)
    for label, N, K, cfg, case, floor, ref in fp8_gemm_cases(SHAPES, M, "µs"):
        w, s, xq, xs, shipped, y = case
        bn, warps, stages, sk = cfg
        t0 = time_us(shipped)
        out = [f"{label} [{N} x {K}] floor {floor:.1f}: shipped {cfg} {t0:.1f} "
               f"({floor / t0:.2f})"]
        p2 = torch.empty(sk, M, N, device=dev, dtype=torch.float32)
        bm = max(16, triton.next_power_of_2(M))
        for b in (64, 128):
            for kg in (1, 2, 4):
                per_stage = kg * 128 * (b + bm)
                st = max(1, min(stages, smem // per_stage))

                def mine(b=b, kg=kg, st=st):
                    kstep_kernel[(triton.cdiv(N, b), sk)](
                        xq, xs, w, s, p2, M, N, K, xs.stride(0), s.stride(0), p2.stride(0),
                        BLOCK_M=bm, BLOCK_N=b, BLOCK_K=128, KG=kg, SPLIT_K=sk,
                        num_warps=warps, num_stages=st)
                    if sk > 1:
                        fp8_launch.reduce_partials(p2, y)
                try:
                    y.zero_()
                    mine()
                    if sk == 1:
                        y.copy_(p2[0])
                    torch.cuda.synchronize()
                    err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                    t = time_us(mine)
                    bad = f" MISMATCH {err:.2g}" if err > 1e-2 else ""
                    out.append(f"bn{b} kg{kg} st{st} {t:.1f} ({floor / t:.2f}){bad}")
                except Exception as exc:       # noqa: BLE001 (a probe: report and go on)
                    out.append(f"bn{b} kg{kg}: {type(exc).__name__} {str(exc)[:80]}")
        print("; ".join(out), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
