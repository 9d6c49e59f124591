"""One MLA layer on CPU: a prefill, then decode steps, checked against dense attention.

    python examples/mla_layer_demo.py [--device cpu|cuda] [--steps 8]

Builds DeepSeek-V3-sized attention dims (N heads of P=128/R=64/V=128 over a 512-wide
latent), a paged latent cache, and runs the layer through the two custom ops
(mla::kv_cache_update, mla::attention_with_output) under torch.compile.
"""
from __future__ import annotations

import argparse
import time

import torch

from mla_ops import MLAAttention, MLAMetadata, PagedLatentCache, mla_softmax_scale


def dense_attention(q, kv_c, k_pe, kv_b, N, P, V, scale):
    """Unabsorbed MHA for the last q.shape[0] positions of the sequence (float64)."""
    S, s = kv_c.shape[0], q.shape[0]
    kv = (kv_c.double() @ kv_b.double().t()).view(S, N, P + V)
    k = torch.cat([kv[..., :P], k_pe.double()[:, None].expand(S, N, -1)], -1)
    sc = torch.einsum("snd,knd->nsk", q.double(), k) * scale
    pos = torch.arange(S - s, S, device=q.device)[:, None]
    sc = sc.masked_fill(torch.arange(S, device=q.device)[None] > pos, float("-inf"))
    return torch.einsum("nsk,knv->snv", sc.softmax(-1), kv[..., P:]).reshape(s, -1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=100)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--no-compile", action="store_true")
    args = ap.parse_args()
    dev, N, P, R, V, L = torch.device(args.device), args.heads, 128, 64, 128, 512
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    torch.manual_seed(0)
    scale = mla_softmax_scale(P + R)
    kv_b = (torch.randn(N * (P + V), L) / L ** 0.5).to(dev, dtype)
    layer = MLAAttention(N, P, R, V, L, scale).to(dev)
    layer.absorb(kv_b)
    total = args.prompt + args.steps
    cache = PagedLatentCache(1, -(-total // args.block_size) + 1, args.block_size, dtype=dtype, device=dev)
    run = layer if args.no_compile else torch.compile(layer, fullgraph=True)
    kv_c = torch.randn(total, L, device=dev, dtype=dtype)
    k_pe = torch.randn(total, R, device=dev, dtype=dtype)
    q = torch.randn(total, N, P + R, device=dev, dtype=dtype)
    worst = 0.0

    def step(a, b):
        nonlocal worst
        meta = MLAMetadata.build(cache.allocator, [0], [b - a], max_blocks=cache.num_blocks, device=dev)
        out = run(q[a:b], kv_c[a:b], k_pe[a:b, None], cache.kv[0], cache.k_scale, meta)
        ref = dense_attention(q[a:b], kv_c[:b], k_pe[:b], kv_b, N, P, V, scale)
        worst = max(worst, ((out.double() - ref).norm() / ref.norm()).item())

    t0 = time.perf_counter()
    step(0, args.prompt)
    print(f"prefill of {args.prompt} tokens: {time.perf_counter() - t0:.2f} s (includes compile)")
    t0 = time.perf_counter()
    for i in range(args.steps):
        step(args.prompt + i, args.prompt + i + 1)
    dt = (time.perf_counter() - t0) / args.steps
    print(f"{args.steps} decode steps: {dt * 1e3:.1f} ms/step (first includes compile)")
    print(f"KV cache: {cache.bytes_per_token_per_layer()} bytes/token/layer "
          f"(dense MHA would need {N * (P + R + V) * torch.finfo(dtype).bits // 8})")
    print(f"max relative error vs float64 dense attention: {worst:.2e}")
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    if worst > tol:
        raise SystemExit(f"FAILED: error {worst:.2e} above {tol:.0e}")
    print("OK")


if __name__ == "__main__":
    main()
