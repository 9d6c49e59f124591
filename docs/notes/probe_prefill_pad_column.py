"""The context attention of a bucketed prefill chunk without cuDNN's bias path (H200 probe,
not maintained).

A captured prefill chunk (PrefillGraph) pads each request's context to its bucket, and
`lowering/prefill/dense.py` hides the pad keys with an additive bias [B, 1, Sq, Sk]
(stride 0 over heads and queries). cuDNN takes a slower kernel with a bias: ~0.86 ms
against ~0.64 ms a layer at V3's multi-turn row (512 queries, 4,096 keys, 128 heads).
The variant timed here hides them in the dot product instead: q and k get 8 more columns
(q/k 200 wide: cuDNN wants multiples of 8), q's first extra column 1, k's first extra
column 0 for a real key and -BIG / scale for a pad key, the other extra columns 0. A pad
key's score is then ~-BIG, a real key's unchanged, and no bias is read. Its cost: 4 % more
QK^T FLOPs and the 8 columns written by the key and query producers.

Compared, each against float64 attention over the real keys only, µs of one CUDA-graph
replay (benchmarks/timing.py):
    exact   no padding: the real keys only (the floor of either variant)
    bias    today's call: the bucket's keys and the bias
    column  the bucket's keys, 200 wide with the flag column, no bias

    python docs/notes/probe_prefill_pad_column.py [--shapes 128x512x4096x4608,16x512x4096x4608]
"""
import argparse
import sys

import torch

sys.path[:0] = ["benchmarks"]                       # run from the repository root
from timing import graph_time_us

P_R, V, EXTRA = 192, 128, 8
BIG = 4096.0                      # -BIG / scale stays finite in fp16 too (|x| < 65504)


def cudnn(q, k, v, bias, scale):
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, bias, True, 0.0, False, False, scale=scale)[:2]
    return out, lse


def reference(q, k, v, scale):
    s = torch.matmul(q.double(), k.double().transpose(-1, -2)) * scale     # [1, N, Sq, Sk]
    return torch.matmul(s.softmax(-1), v.double())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="128x512x4096x4608,16x512x4096x4608,"
                                        "128x512x1000x2048,16x2048x4096x8192",
                    help="NxSqxKEYSxBUCKET,...")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__,
          f"cuDNN {torch.backends.cudnn.version()}", flush=True)
    dt, dev = torch.bfloat16, "cuda"
    scale = P_R ** -0.5
    for shape in args.shapes.split(","):
        N, Sq, real, bucket = (int(x) for x in shape.split("x"))
        q = torch.randn(1, N, Sq, P_R, device=dev, dtype=dt)
        k = torch.randn(1, N, bucket, P_R, device=dev, dtype=dt)
        v = torch.randn(1, N, bucket, V, device=dev, dtype=dt)
        ref = reference(q, k[:, :, :real], v[:, :, :real], scale)
        hidden = torch.arange(bucket, device=dev) >= real
        bias = torch.where(hidden, torch.finfo(dt).min / 2, 0.0).to(dt)
        bias = bias[None, None, None, :].expand(1, 1, Sq, bucket)
        qc = torch.cat([q, torch.zeros(1, N, Sq, EXTRA, device=dev, dtype=dt)], -1)
        qc[..., P_R] = 1.0
        kc = torch.cat([k, torch.zeros(1, N, bucket, EXTRA, device=dev, dtype=dt)], -1)
        kc[..., P_R] = torch.where(hidden, -BIG / scale, 0.0).to(dt)
        runs = {
            "exact": lambda: cudnn(q, k[:, :, :real], v[:, :, :real], None, scale),
            "bias": lambda: cudnn(q, k, v, bias, scale),
            "column": lambda: cudnn(qc, kc, v, None, scale),
        }
        flops = 2 * N * Sq * real * (P_R + V)
        line = []
        for name, fn in runs.items():
            try:
                out, _ = fn()
                err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
                us = graph_time_us(fn)
                line.append(f"{name} {us:7.1f} µs ({flops / us / 1e6:4.0f} TFLOP/s of the "
                            f"real keys, err {err:.1e})")
            except Exception as exc:                   # a kernel cuDNN has no plan for
                line.append(f"{name}: {type(exc).__name__}: {str(exc)[:80]}")
        print(f"N={N} Sq={Sq} keys={real} bucket={bucket}: " + " | ".join(line), flush=True)


if __name__ == "__main__":
    main()
