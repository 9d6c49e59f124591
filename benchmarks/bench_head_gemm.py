"""MLA's absorbed per-head GEMMs of a decode step: cuBLAS against lowering/gemm/head_gemm.py.

    query:  [q_nope @ W_UK_T | q_pe]  q [t, N, 192] -> [t, N, 576]   (W_UK_T [N, 128, 512])
    output: o [t, N, 512] @ W_UV -> [t, N*128]                         (W_UV [N, 512, 128])

cuBLAS is what the attention op ran before the kernel (a strided-batch bmm into the
destination, plus the q_pe copy for the query); the kernel is timed for each config of
SWEEP, checked against fp32 first. CUDA-graph replays with the L2 flushed (a decode step
reads these weights once per layer, never from L2). Prints the best configs as the
`lowering.gemm.head_gemm.CONFIGS` entries they are.

    python benchmarks/bench_head_gemm.py            # H200: V3 dims, 128 heads, t = 1, 32
"""
from __future__ import annotations

import argparse

import torch

from timing import (announce_ceiling, best_config, gemm_header, gemm_row,
                    add_timer_args, chosen_timer, print_configs)
from lowering.gemm import head_gemm

# (BLOCK_J, BLOCK_K, num_warps, num_stages) swept
SWEEP = [
    (32, 64, 4, 2), (32, 128, 4, 2), (32, 128, 4, 3), (64, 32, 4, 4), (64, 64, 4, 3),
    (64, 128, 4, 2), (64, 128, 4, 3), (64, 128, 8, 3), (128, 32, 4, 4), (128, 64, 4, 3),
    (128, 64, 8, 3), (128, 128, 4, 2), (128, 128, 8, 2), (256, 32, 4, 3), (256, 64, 8, 2),
    (32, 256, 4, 2), (64, 256, 4, 2), (16, 128, 4, 3), (16, 256, 4, 2),
]


def cases(t, N, P, R, L, V, dev):
    """(name, K, J, copy, a, w, y, cublas closure, fp32 reference) for both GEMMs."""
    dt = torch.bfloat16
    q = torch.randn(t, N, P + R, device=dev, dtype=dt)
    wk = torch.randn(N, P, L, device=dev, dtype=dt) / P ** 0.5
    qm = torch.empty(t, N, L + R, device=dev, dtype=dt)
    o = torch.randn(t, N, L, device=dev, dtype=dt)
    wv = torch.randn(N, L, V, device=dev, dtype=dt) / L ** 0.5
    out = torch.empty(t, N, V, device=dev, dtype=dt)

    def cublas_query():
        torch.bmm(q[..., :P].transpose(0, 1), wk, out=qm.transpose(0, 1)[..., :L])
        qm[..., L:] = q[..., P:]

    def cublas_output():
        torch.bmm(o.transpose(0, 1), wv, out=out.transpose(0, 1))

    ref_q = torch.cat([torch.einsum("tnp,npl->tnl", q[..., :P].float(), wk.float()),
                       q[..., P:].float()], -1)
    ref_o = torch.einsum("tnl,nlv->tnv", o.float(), wv.float())
    return [("query: q_nope @ W_UK_T | q_pe", P, L, R, q, wk, qm, cublas_query, ref_q),
            ("output: o @ W_UV", L, V, 0, o, wv, out, cublas_output, ref_o)]


def best_kernel(a, w, y, copy, ref, timer, show):
    def make_run(cfg):
        y.fill_(float("nan"))
        return (lambda: head_gemm.launch(a, w, y, copy, cfg)), (lambda: y)
    fits = [c for c in SWEEP if c[0] <= w.shape[2] and c[1] <= w.shape[1]]
    return best_config(fits, make_run, ref, timer=timer, show=show)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,32")
    ap.add_argument("--heads", type=int, default=128)
    add_timer_args(ap)
    args = ap.parse_args()
    timer = chosen_timer(args)
    dev = torch.device("cuda")
    ceil = announce_ceiling()
    configs = {}
    for t in (int(r) for r in args.rows.split(",")):
        gemm_header(f"t = {t}, N = {args.heads}", "MB moved", "kernel")
        for name, K, J, copy, a, w, y, cublas, ref in cases(t, args.heads, 128, 64, 512, 128, dev):
            nbytes = (a.numel() + w.numel() + y.numel()) * 2
            c_us = timer(cublas)
            k_us, cfg = best_kernel(a, w, y, copy, ref, timer, args.show)
            configs[(K, J, t <= 16)] = cfg
            print(gemm_row(name, f"{nbytes / 1e6:.1f}", nbytes, c_us, k_us, ceil, cfg), flush=True)
    print_configs("lowering.gemm.head_gemm.CONFIGS", configs)


if __name__ == "__main__":
    main()
