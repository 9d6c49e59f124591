"""Does flushing the L2 by writing (do_bench's `cache.zero_()`, timing.py's flush) slow the
kernel timed after it? (GPU probe, not maintained.)

After a 256 MB zero_(), the L2 may hold tens of MB of dirty lines, written back to DRAM
while the next kernel reads: a memory-bound kernel then shares the bus with those writes.
Each kernel below is captured in a CUDA graph and timed (events, median of 40) after
no flush (its bytes partly in the L2 from the last replay), after a write flush (zero_
of 256 MB, as our benchmarks flush), and after a read flush (zero_ then a sum over a
second 256 MB buffer, so the L2 holds clean lines of that buffer): DeepSeek-V3's one-row
decode kernels of a few to a few hundred MB, with their bytes' time at the card's
bandwidth.

    python docs/notes/probe_flush_dirty.py
"""
import statistics

import torch

from lowering.fused import q_absorb
from lowering.gemm.fp8_act_quant import quantize_rows_torch
from lowering.gemm.head_gemm import absorb_output
from mla_ops.hf.linear import decode_linear


def timed(fn, mode, bufs, n=40):
    fn(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    w, r = bufs
    ts = []
    for _ in range(n):
        if mode != "none":
            w.zero_()
        if mode == "read":
            r.sum(dtype=torch.int32)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b) * 1000)
    return statistics.median(ts)


def fp8_weight(N, K, dev):
    w = torch.randn(N, K, device=dev) * K ** -0.5
    blocks = w.unflatten(0, (-1, 128)).unflatten(-1, (-1, 128))
    ws = blocks.abs().amax((1, 3)) / 448.0
    return (blocks / ws[:, None, :, None]).to(torch.float8_e4m3fn).flatten(-2).flatten(0, 1), ws


def main():
    dev, dt = "cuda", torch.bfloat16
    name = torch.cuda.get_device_name()
    bw = 4.3e12 if "H200" in name else 3.35e12
    print(name, torch.__version__, flush=True)
    bufs = (torch.empty(256 << 20, dtype=torch.uint8, device=dev),
            torch.ones(256 << 20, dtype=torch.uint8, device=dev))
    cases = {}
    x = torch.randn(1, 16384, device=dev, dtype=dt)
    w16 = torch.randn(7168, 16384, device=dev, dtype=dt) * 0.01
    cases["bf16 decode GEMM o_proj [7168 x 16384]"] = (lambda: decode_linear(x, w16), w16.nbytes)
    w8, ws = fp8_weight(7168, 16384, dev)
    xq, xs = quantize_rows_torch(x, 128)
    cases["fp8 decode GEMM o_proj"] = (
        lambda: torch.ops.mla.decode_linear_fp8(x, w8, ws, 128, 128, xq, xs), w8.nbytes)
    qa = torch.randn(1, 1536, device=dev, dtype=dt)
    qb8, qbs = fp8_weight(128 * 192, 1536, dev)
    qq, qs = quantize_rows_torch(qa, 128)
    cases["fp8 decode GEMM q_b [24576 x 1536]"] = (
        lambda: torch.ops.mla.decode_linear_fp8(qa, qb8, qbs, 128, 128, qq, qs), qb8.nbytes)
    wuk = torch.randn(128, 128, 512, device=dev, dtype=dt) * 0.08
    ang = torch.rand(1, 32, device=dev) * 100
    cos, sin = torch.cat([ang, ang], -1).cos().to(dt), torch.cat([ang, ang], -1).sin().to(dt)
    y = torch.empty(1, 128, 576, device=dev, dtype=dt)
    cases["W8A8 query kernel (q_b + W_UK_T)"] = (
        lambda: q_absorb.launch(qq, qb8, wuk, cos, sin, True, y,
                                config=q_absorb.w8a8_config(1, 1536, 512, 128),
                                w8a8=(qbs, qs, 128)), qb8.nbytes + wuk.nbytes)
    o = torch.randn(1, 128, 512, device=dev, dtype=dt)
    wuv = torch.randn(128, 512, 128, device=dev, dtype=dt) * 0.04
    out = torch.empty(1, 128 * 128, device=dev, dtype=dt)
    cases["W_UV head GEMM"] = (lambda: absorb_output(o, wuv, out), wuv.nbytes)
    src = torch.empty(64 << 20, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    cases["copy 64 MB"] = (lambda: dst.copy_(src), 2 * src.nbytes)
    for label, (fn, nbytes) in cases.items():
        t = {m: timed(fn, m, bufs) for m in ("none", "write", "read")}
        print(f"{label}: {nbytes / 1e6:.1f} MB ({nbytes / bw * 1e6:.1f} µs at "
              f"{bw / 1e12:.2f} TB/s): no flush {t['none']:.1f}, write flush {t['write']:.1f}, "
              f"read flush {t['read']:.1f} µs", flush=True)


if __name__ == "__main__":
    main()
