"""Can one persistent kernel run a chain of small dependent GEMVs faster than one launch
each? (GPU probe, not maintained; the open question of NOTES-v2lite-one-row.md's
persistent layer kernel.)

A chain of L phases y_i = W_i @ y_{i-1} (one row, W_i [N, K] bf16, N = K, fp32 sums
rounded to bf16 per phase), V2-Lite-sized weights (2048 x 2048: 8 MB, ~1.9 µs of bytes at
4.3 TB/s). Variants, each captured 20 times in a CUDA graph (µs a chain, median of 5
replays):

    launches    L launches of gemv_kernel, a program per BLOCK_N rows
    cublas      L F.linear calls
    persistent  one launch of chain_kernel: NPROG programs (all resident), each GEMV's row
                blocks spread over them, a grid barrier (an arrival counter, release /
                acquire atomics) between phases
    prefetch    the same, each program loading its next phase's weight rows into
                registers before it waits at the barrier (the weights do not depend on
                the phase before), so the bytes are in flight during the wait
    pdl         L launches of gemv_pdl_kernel with programmatic dependent launch: each
                program lets the next launch start (gdc_launch_dependents), then waits
                for the one before (gdc_wait), then loads its rows
    pdl-preload the same, each program loading its weight rows before the wait, so a
                launch's weights stream while the launch before it runs

The barrier alone: a chain_kernel launch of L phases with N = 0 rows.

    python docs/notes/probe_persistent_chain.py [L] [N,...]
"""
import sys
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from probe_router_configs import graph_us        # same folder (docs/notes)



def block_n(K: int) -> int:
    """Rows a program loads at once: [BLOCK_N, K] bf16 in registers (8 warps)."""
    return 16 if K <= 2048 else 8


@triton.jit
def _rows(x_ptr, w_ptr, rb, N, K: tl.constexpr, BLOCK_N: tl.constexpr):
    """The [BLOCK_N, K] weight rows of row block rb (loaded whole: every byte in flight)."""
    rows = rb * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, K)
    return tl.load(w_ptr + rows[:, None] * K + cols[None, :], mask=(rows < N)[:, None],
                   other=0.0)


@triton.jit
def _finish(x_ptr, y_ptr, w, rb, N, K: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = rb * BLOCK_N + tl.arange(0, BLOCK_N)
    x = tl.load(x_ptr + tl.arange(0, K), cache_modifier=".cg").to(tl.float32)   # [K]
    y = tl.sum(w.to(tl.float32) * x[None, :], axis=1)                           # [BLOCK_N]
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rows < N)


@triton.jit
def gemv_kernel(x_ptr, w_ptr, y_ptr, N, K: tl.constexpr, BLOCK_N: tl.constexpr):
    rb = tl.program_id(0)
    w = _rows(x_ptr, w_ptr, rb, N, K, BLOCK_N)
    _finish(x_ptr, y_ptr, w, rb, N, K, BLOCK_N)


@triton.jit
def gemv_pdl_kernel(x_ptr, w_ptr, y_ptr, N, K: tl.constexpr, BLOCK_N: tl.constexpr,
                    PRELOAD: tl.constexpr):
    rb = tl.program_id(0)
    gdc_launch_dependents()
    if PRELOAD:
        w = _rows(x_ptr, w_ptr, rb, N, K, BLOCK_N)
        gdc_wait()
    else:
        gdc_wait()
        w = _rows(x_ptr, w_ptr, rb, N, K, BLOCK_N)
    _finish(x_ptr, y_ptr, w, rb, N, K, BLOCK_N)


@triton.jit
def _barrier(cnt_ptr, target):
    tl.debug_barrier()                                   # the program's stores issued
    tl.atomic_add(cnt_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def chain_kernel(w_ptr, y_ptr, cnt_ptr, L, N, NPROG,
                 K: tl.constexpr, BLOCK_N: tl.constexpr, PREFETCH: tl.constexpr):
    """w [L, N, K], y [L + 1, N] (N = K) with y[0] = x; phase i reads y[i] and writes
    y[i + 1]. With PREFETCH, cdiv(N, BLOCK_N) <= NPROG (one row block a program)."""
    pid = tl.program_id(0)
    n_blocks = tl.cdiv(N, BLOCK_N)
    if PREFETCH:
        w_next = _rows(y_ptr, w_ptr, pid, N, K, BLOCK_N)
    for i in range(0, L):
        src = y_ptr + i * N
        if PREFETCH:
            w = w_next
            if i + 1 < L:
                w_next = _rows(y_ptr, w_ptr + (i + 1) * N * K, pid, N, K, BLOCK_N)
            if pid < n_blocks:
                _finish(src, y_ptr + (i + 1) * N, w, pid, N, K, BLOCK_N)
        else:
            for rb in range(pid, n_blocks, NPROG):
                w = _rows(src, w_ptr + i * N * K, rb, N, K, BLOCK_N)
                _finish(src, y_ptr + (i + 1) * N, w, rb, N, K, BLOCK_N)
        if i + 1 < L:
            _barrier(cnt_ptr, NPROG * (i + 1))
    # the last program past every barrier puts the counter back for the next launch
    tl.debug_barrier()
    last = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
    if last == NPROG * L - 1:
        tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")


def main(L, sizes):
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    cnt = torch.zeros(1, dtype=torch.int32, device=dev)
    for N in sizes:
        K = N
        BLOCK_N = block_n(K)
        nblk = triton.cdiv(N, BLOCK_N)
        w = (torch.randn(L, N, K, device=dev) / K ** 0.5).to(torch.bfloat16)
        y = torch.empty(L + 1, N, device=dev, dtype=torch.bfloat16)       # y[0]: x
        y[0] = torch.randn(K, device=dev).to(torch.bfloat16)
        x = y[0].clone()
        ref = x
        for i in range(L):                                   # the chain in fp32, rounded
            ref = (w[i].float() @ ref.float()).to(torch.bfloat16)
        floor = L * N * K * 2 / 4.3e12 * 1e6

        def launches():
            for i in range(L):
                gemv_kernel[(nblk,)](y[i], w[i], y[i + 1], N, K=K, BLOCK_N=BLOCK_N,
                                     num_warps=8)

        def pdl(preload):
            def run():
                for i in range(L):
                    gemv_pdl_kernel[(nblk,)](y[i], w[i], y[i + 1], N, K=K, BLOCK_N=BLOCK_N,
                                             PRELOAD=preload, num_warps=8, launch_pdl=True)
            return run

        def cublas():
            src = x[None]
            for i in range(L):
                src = F.linear(src, w[i])

        def persistent(nprog, prefetch):
            def run():
                chain_kernel[(nprog,)](w, y, cnt, L, N, nprog, K=K, BLOCK_N=BLOCK_N,
                                       PREFETCH=prefetch, num_warps=8)
            return run

        out = [f"L={L} N=K={N}: floor {floor:.1f} µs ({L} x {N * K * 2 / 2**20:.0f} MiB)"]
        for name, fn in (("launches", launches), ("cublas", cublas),
                         ("pdl", pdl(False)), ("pdl-preload", pdl(True)),
                         (f"persistent {sms}", persistent(sms, False)),
                         (f"persistent {nblk}", persistent(nblk, False)),
                         (f"prefetch {nblk}", persistent(nblk, True))):
            if "persistent" in name or "prefetch" in name:
                if nblk > sms and "prefetch" in name:
                    continue
            y[1:].zero_()
            try:
                fn()
                torch.cuda.synchronize()
                if name != "cublas":
                    err = (y[-1].float() - ref.float()).abs().max().item()
                    ok = ("" if err < 0.05 * max(1.0, ref.float().abs().max().item())
                          else f" (MISMATCH {err:.3g})")
                else:
                    ok = ""
                us = graph_us(fn)
                out.append(f"{name} {us:.1f}{ok}")
            except Exception as exc:
                out.append(f"{name}: {type(exc).__name__}: {str(exc)[:120]}")
        # the barriers alone: L phases of no rows

        def barriers():
            chain_kernel[(sms,)](w, y, cnt, L, 0, sms, K=K, BLOCK_N=BLOCK_N,
                                 PREFETCH=False, num_warps=8)
        out.append(f"{L - 1} barriers alone {graph_us(barriers):.1f}")
        print("; ".join(out), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 8,
         [int(n) for n in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1024, 2048, 4096])
