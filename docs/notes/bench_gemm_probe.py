"""How far the decode GEMMs are from the memory system: a read ceiling and a TMA probe.

1. Read ceiling: a Triton kernel that only reads 1 GiB (grid-stride, fp32 sum per
   program), against the copy ceiling the other benchmarks use (bytes read + written).
2. The same weight-streaming GEMM as lowering/gemm/linear_kernel.py (y = x @ w.T, or
   silu(x @ wg.T) * (x @ wu.T)), with its tiles loaded by the Hopper tensor-memory
   accelerator (host-side `TensorDescriptor`s) instead of pointer loads, against the
   kernel the converted model runs (its CONFIGS entry, or the best few-stage config) and
   cuBLAS, at 32 rows, for the layer's three big GEMMs. Same timing as the other GEMM
   benchmarks (timing.graph_time_us: CUDA-graph replays, L2 flushed).
3. --inductor-check: whether this torch's Inductor compiles a torch.library.triton_op
   whose kernel takes TensorDescriptor arguments (what the decode GEMM ops would need).

    python docs/notes/bench_gemm_probe.py [--inductor-check]        # H200
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

# A probe kept as it ran: the shared timing helpers are in benchmarks/ (lowering is the
# installed package).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "benchmarks"))
from timing import announce_ceiling, graph_time_us  # noqa: E402
from lowering.gemm import linear  # noqa: E402


@triton.jit
def read_kernel(p, out, n, BLOCK: tl.constexpr, NPROG: tl.constexpr):
    acc = tl.zeros((BLOCK,), tl.float32)
    for i in tl.range(tl.program_id(0) * BLOCK, n, NPROG * BLOCK, num_stages=4):
        acc += tl.load(p + i + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(out + tl.program_id(0), tl.sum(acc))


@triton.jit
def tma_linear_kernel(x_desc, w_desc, u_desc, y_ptr, M, N, K, stride_ym,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      GATED: tl.constexpr, STAGES: tl.constexpr):
    n0 = tl.program_id(0) * BLOCK_N
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)                 # w rows x x rows
    acc_u = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    for k in tl.range(0, tl.cdiv(K, BLOCK_K), num_stages=STAGES):
        x = x_desc.load([0, k * BLOCK_K])                           # [BLOCK_M, BLOCK_K]
        acc = tl.dot(w_desc.load([n0, k * BLOCK_K]), tl.trans(x), acc)
        if GATED:
            acc_u = tl.dot(u_desc.load([n0, k * BLOCK_K]), tl.trans(x), acc_u)
    if GATED:      # rounded like the unfused modules, as the converted model's kernel does
        g = acc.to(tl.bfloat16).to(tl.float32)
        acc = (g * tl.sigmoid(g)).to(tl.bfloat16).to(tl.float32) * acc_u.to(tl.bfloat16).to(tl.float32)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    tl.store(y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None], acc.to(tl.bfloat16),
             mask=(offs_m < M)[None, :] & (offs_n < N)[:, None])


def tma_launcher(x, w, u, y, cfg, wrap=False):
    from triton.tools.tensor_descriptor import TensorDescriptor
    bn, bk, warps, stages = cfg
    M, K = x.shape
    bm = max(16, triton.next_power_of_2(M))
    xd = TensorDescriptor.from_tensor(x, [bm, bk])
    wd = TensorDescriptor.from_tensor(w, [bn, bk])
    ud = TensorDescriptor.from_tensor(u if u is not None else w, [bn, bk])
    kernel = torch.library.wrap_triton(tma_linear_kernel) if wrap else tma_linear_kernel

    def run():
        kernel[(triton.cdiv(w.shape[0], bn),)](
            xd, wd, ud, y, M, w.shape[0], K, y.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
            GATED=u is not None, STAGES=stages, num_warps=warps)
    return run


def read_ceiling():
    a = torch.randn(1 << 29, device="cuda", dtype=torch.bfloat16)              # 1 GiB
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for block, per_sm, warps in [(2048, 4, 8), (2048, 8, 4), (4096, 2, 8)]:
        nprog = sms * per_sm
        out = torch.empty(nprog, device="cuda")
        us = graph_time_us(lambda: read_kernel[(nprog,)](a, out, a.numel(), BLOCK=block,
                                                         NPROG=nprog, num_warps=warps))
        print(f"read-only, {block} elements x {nprog} programs, {warps} warps: "
              f"{a.numel() * 2 / us / 1e6:.2f} TB/s", flush=True)


def best(cfgs, make_run, y, ref):
    res = []
    for cfg in cfgs:
        try:
            run = make_run(cfg)
            run()
            torch.cuda.synchronize()
        except Exception as e:              # e.g. out of shared memory
            print(f"    {cfg}: {type(e).__name__}", flush=True)
            continue
        if ((y.float() - ref).abs().max() / ref.abs().max()).item() < 2e-2:
            res.append((graph_time_us(run), cfg))
    return min(res)


def gemms(M=32):
    print(f"\n| GEMM, {M} rows | weight MB | cuBLAS µs | kernel µs (config) | TMA µs (config) |\n"
          "|---|---|---|---|---|", flush=True)
    few = [(bn, bk, 4, s) for bn in (64, 128) for bk in (64, 128) for s in (2, 3, 4)]
    for name, N, K, gated in [("o_proj", 7168, 16384, False), ("down_proj", 7168, 18432, False),
                              ("gate + up (+ SiLU x up)", 18432, 7168, True)]:
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        u = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) if gated else None
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        ref = F.silu(x.float() @ w.float().T) * (x.float() @ u.float().T) if gated else x.float() @ w.float().T
        y = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        mode = 2 if gated else 0
        cur = linear.pick_config(mode, N, K, M)       # the converted model's, None: cuBLAS
        cfgs = few + ([cur[:4]] if cur is not None and cur[:4] not in few else [])
        if gated:
            g, h = torch.empty_like(y), torch.empty_like(y)
            cub = graph_time_us(lambda: (torch.mm(x, w.t(), out=g), torch.mm(x, u.t(), out=h)))
        else:
            cub = graph_time_us(lambda: torch.mm(x, w.t(), out=y))
        k_us, k_cfg = best(cfgs, lambda c: lambda: linear.launch(x, w, u, mode, y, None, c),
                           y, ref)
        t_us, t_cfg = best(cfgs, lambda c: tma_launcher(x, w, u, y, c), y, ref)
        print(f"| {name} | {w.numel() * 2 * (2 if gated else 1) / 1e6:.0f} | {cub:.1f} | "
              f"{k_us:.1f} {k_cfg} | {t_us:.1f} {t_cfg} |", flush=True)


def inductor_check():
    """Compile a triton_op whose kernel takes TensorDescriptors; report what happens."""
    @torch.library.triton_op("mla_probe::tma_linear", mutates_args={})
    def tma_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)
        tma_launcher(x, w, None, y, (64, 64, 4, 3), wrap=True)()
        return y

    x = torch.randn(32, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    try:
        out = torch.compile(lambda x: tma_linear(x, w) * 2, fullgraph=True)(x)
        err = ((out.float() - 2 * (x.float() @ w.float().T)).abs().max()).item()
        print(f"\nInductor + triton_op with TensorDescriptor args: compiled, max abs err {err:.2e}")
    except Exception as e:
        lines = [ln for ln in str(e).splitlines() if "Error" in ln] or [str(e)]
        print(f"\nInductor + triton_op with TensorDescriptor args: {type(e).__name__}: "
              f"{lines[0].strip()[:200]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--inductor-check", action="store_true")
    args = ap.parse_args()
    announce_ceiling()
    read_ceiling()
    gemms()
    if args.inductor_check:
        inductor_check()


if __name__ == "__main__":
    main()
