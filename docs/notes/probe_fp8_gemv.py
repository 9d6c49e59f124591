"""Does the fp8 decode GEMM stream faster at one row without tensor cores? (GPU probe, not
maintained.)

fp8_linear_kernel.py multiplies each [BLOCK_N, 128] e4m3 weight tile by the e4m3 x tile
with tl.dot (the row padded to 16), then scales the product per group; alone at one row
its GEMMs stream at ~1.6-2.5 TB/s on an H100 (docs/notes/probe_fp8_kstep.py). Here the
same W8A8 numerics on the CUDA cores: the tile widened to fp32, times x's e4m3 values
widened, summed along K (each product of two e4m3 values is exact in fp32), then
times both scales: KG scale groups a loop step, BLOCK_N weight rows a program, the
shipped K split and twice it, the partials summed by the shipped reduce. x is quantized
once outside the timed call (as act_quant_kernel does). DeepSeek-V3's fp8 decode GEMMs
(the gate + up stood in for by one weight of both matrices' rows), µs of CUDA-graph
replays with the L2 flushed, and the fraction of the bytes' time at 4.3 TB/s (H200) /
3.35 TB/s (H100); every variant checked against the shipped kernel's output first.

    python docs/notes/probe_fp8_gemv.py [rows] [seconds]
"""
import os
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "benchmarks"))
from lowering.gemm import fp8_launch  # noqa: E402
from probe_common import (V3_FP8_SHAPES, fp8_gemm_cases, split_tile,  # noqa: E402
                          graph_us_do_bench as time_us)


@triton.jit
def gemv_kernel(x_ptr, xs_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_xs, stride_sn,
                stride_ys, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, KG: tl.constexpr, SPLIT_K):
    """y[split] [M, N] fp32 = the split's groups of xq @ dequant(w).T on the CUDA cores
    (x e4m3 [M, K] with scales xs [M, G]); KG scale groups a loop step."""
    split, g0, g1, offs_n, offs_m, offs_k, n_ok, m_ok = split_tile(
        M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K)
    w_row = w_ptr + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :]          # [BN, BK]
    x_row = x_ptr + offs_m[:, None] * K + offs_k[None, :]                       # [BM, BK]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(g0, g1, KG):
        for j in tl.static_range(KG):
            g = k + j
            k_ok = offs_k < (g1 - g) * BLOCK_K                      # all or none
            w = tl.load(w_row + g * BLOCK_K, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_row + g * BLOCK_K, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            ws = tl.load(s_ptr + (offs_n // 128) * stride_sn + g,
                         mask=n_ok & (offs_n * 0 + g < g1), other=0.0)
            xs = tl.load(xs_ptr + offs_m * stride_xs + g, mask=m_ok & (offs_m * 0 + g < g1),
                         other=0.0)
            wf = w.to(tl.float32)                                             # [BN, BK]
            xf = x.to(tl.float32)                                             # [BM, BK]
            part = tl.sum(wf[:, None, :] * xf[None, :, :], axis=2)           # [BN, BM]
            acc += part * ws[:, None] * xs[None, :]
    y = y_ptr + split.to(tl.int64) * stride_ys + offs_m[None, :] * N + offs_n[:, None]
    tl.store(y, acc, mask=m_ok[None, :] & n_ok[:, None])


SHAPES = V3_FP8_SHAPES
VARIANTS = [(bn, w, st, kg, sm) for bn in (64, 128) for w in (4, 8) for st in (3, 5)
            for kg in (1, 2) for sm in (1, 2)]


def main(M, budget_s):
    t_end = time.time() + budget_s
    dev = torch.device("cuda")
    for label, N, K, cfg, case, floor, ref in fp8_gemm_cases(SHAPES, M, "µs"):
        w, s, xq, xs, shipped, y = case
        sk = cfg[3]
        t0 = time_us(shipped)
        out, best = [], None
        bm = triton.next_power_of_2(M)
        for bn, warps, st, kg, smul in VARIANTS:
            if time.time() > t_end:
                out.append("(budget spent)")
                break
            split = sk * smul
            p2 = torch.empty(split, M, N, device=dev, dtype=torch.float32)

            def mine(bn=bn, warps=warps, st=st, kg=kg, split=split, p2=p2):
                gemv_kernel[(triton.cdiv(N, bn), split)](
                    xq, xs, w, s, p2, M, N, K, xs.stride(0), s.stride(0), p2.stride(0),
                    BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, KG=kg, SPLIT_K=split,
                    num_warps=warps, num_stages=st)
                fp8_launch.reduce_partials(p2, y)
            try:
                y.zero_()
                mine()
                torch.cuda.synchronize()
                err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                t = time_us(mine)
                tag = f"bn{bn} w{warps} st{st} kg{kg} split{split}"
                if err > 1e-2:
                    out.append(f"{tag} MISMATCH {err:.2g}")
                    continue
                if best is None or t < best[0]:
                    best = (t, tag)
            except Exception as exc:       # noqa: BLE001 (a probe: report and go on)
                out.append(f"bn{bn} w{warps} st{st} kg{kg}: {type(exc).__name__} "
                           f"{str(exc)[:60]}")
        bt = f"best {best[1]} {best[0]:.1f} ({floor / best[0]:.2f}, {t0 / best[0]:.2f}x)" \
            if best else "no variant ran"
        print(f"{label} [{N} x {K}] floor {floor:.1f}: shipped {cfg} {t0:.1f} "
              f"({floor / t0:.2f}); CUDA cores {bt}" + ("; " + "; ".join(out) if out else ""),
              flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 1,
         float(sys.argv[2]) if len(sys.argv) > 2 else 240)
