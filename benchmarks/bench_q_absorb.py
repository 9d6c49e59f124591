"""A decode step's query after q_a_layernorm: three launches against mla::decode_q_absorb.

    unfused: q = decode_linear(q_a, w) (the converted layer's GEMM op), mla::decode_q_rope(q),
             [q_nope @ W_UK_T | q_pe] (lowering.gemm.head_gemm.absorb_query)
    fused:   q_absorb_kernel, each config of SWEEP (checked against fp32 first)

DeepSeek-V3's query (q_lora 1536, 128 heads, P 128, R 64, L 512), bf16, interleaved RoPE.
The weights read are q_b's 75.5 MB and W_UK_T's 16.8 MB; "of ceiling" is the bytes over
the time, as a fraction of the measured copy ceiling. Prints the best configs as the
`lowering.fused.q_absorb.CONFIGS` entries they are.

    python benchmarks/bench_q_absorb.py --timer kernel --show      # rows 1 and 32
"""
from __future__ import annotations

import argparse

import torch

from timing import (add_timer_args, announce_ceiling, best_config, capture,
                    chosen_timer)
from lowering.fused import q_absorb
from lowering.gemm.head_gemm import absorb_query
from mla_ops.hf.linear import decode_linear

# (BLOCK_K, BLOCK_L, num_warps, num_stages) swept
SWEEP = [(bk, bl, w, s) for bk in (64, 128) for bl in (64, 128) for w in (4, 8)
         for s in (2, 3, 4, 5)]


def _graphed(fn):
    """fn captured in a CUDA graph: its replay (three eager launches would otherwise time
    the host's launch gaps, not the kernels)."""
    return capture(fn).replay


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,32", help="comma-separated token counts")
    add_timer_args(ap)
    args = ap.parse_args()
    timer = chosen_timer(args)
    ceil = announce_ceiling()
    Q, N, P, R, L = 1536, 128, 128, 64, 512
    dt, dev = torch.bfloat16, "cuda"
    w = torch.randn(N * (P + R), Q, device=dev, dtype=dt) * Q ** -0.5
    wuk = torch.randn(N, P, L, device=dev, dtype=dt) * P ** -0.5
    nbytes = (w.numel() + wuk.numel()) * 2
    print("\n| rows | unfused µs (of ceiling) | fused µs (of ceiling) | fused / unfused | config |"
          "\n|---|---|---|---|---|")
    best = {}
    for T in (int(r) for r in args.rows.split(",")):
        q_a = torch.randn(T, Q, device=dev, dtype=dt)
        ang = torch.rand(T, R // 2, device=dev) * 100
        cos, sin = torch.cat([ang, ang], -1).cos().to(dt), torch.cat([ang, ang], -1).sin().to(dt)

        def unfused():
            q = decode_linear(q_a, w).view(T, N, P + R)
            return absorb_query(torch.ops.mla.decode_q_rope(q, cos, sin, True), wuk)
        ref = unfused().float()
        t_unfused = timer(_graphed(unfused))
        y = torch.empty(T, N, L + R, device=dev, dtype=dt)

        def make_run(cfg):
            def run():
                q_absorb.launch(q_a, w, wuk, cos, sin, True, y, config=cfg)
            return run, lambda: y
        us, cfg = best_config(SWEEP, make_run, ref, timer=timer, show=args.show)

        def cell(t):
            return f"{t:.1f} ({nbytes / t / 1e6 / (ceil / 1e12):.2f})"
        print(f"| {T} | {cell(t_unfused)} | {cell(us)} | {us / t_unfused:.2f} | {cfg} |",
              flush=True)
        best[T <= 16] = cfg
    print("\nlowering.fused.q_absorb.CONFIGS entries (rows <= 16):")
    for k, cfg in best.items():
        print(f"    {k}: {cfg},")


if __name__ == "__main__":
    main()
