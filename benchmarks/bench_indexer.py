"""Config sweep of the lightning-indexer kernel (mla::indexer_scores,
lowering/decode/indexer.py) at DeepSeek-V3.2's indexer shape: 64 heads of 128, pages of 64.

    python benchmarks/bench_indexer.py [--seqlens 8192,32768,131072] [--batch 32]
        [--tokens 1,2] [--timer graph|kernel] [--show]

For each context length n and query tokens per request (1: decode; 2: a decode step
with one speculative token), every request at length n in random page order: each
config of the grid below is checked against the fp32 torch reference and timed; the
best is printed with the keys' bytes (B * n * 256) over its time, beside the copy
ceiling, the shipped config's time and torch.topk's time on the scores (select_slots
runs it after the kernel). The winners belong in indexer.CONFIGS["gpu"].
"""
from __future__ import annotations

import argparse
import itertools
import sys

import torch

from timing import add_timer_args, announce_ceiling, best_config, chosen_timer

HI, DI, PAGE, TOPK = 64, 128, 64, 2048
GRID = dict(BLOCK_N=(64, 128), num_warps=(4, 8), num_stages=(2, 3, 4), MAX_TILES=(8, 32))


def make_inputs(B, S, n, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    blocks = B * n // PAGE
    q = torch.randn(B, S, HI, DI, device="cuda", generator=g).bfloat16()
    w = torch.randn(B, S, HI, device="cuda", generator=g) * HI ** -0.5
    pool = torch.randn(blocks, PAGE, DI, device="cuda", generator=g).bfloat16()
    table = torch.randperm(blocks, device="cuda", generator=g).int().reshape(B, n // PAGE)
    limit = n - S + torch.arange(S, device="cuda").expand(B, S)                # [B, S]
    return q, w, pool, table, limit


def sweep_shape(B, S, n, timer, show):
    import lowering.decode.indexer as ix
    args = (*make_inputs(B, S, n), DI ** -0.5)
    ref = ix.indexer_scores_reference(*args)                               # [B, S, n]
    shipped = dict(ix.CONFIGS["gpu"])
    out = {}

    def make_run(cfg):
        def run():
            ix.CONFIGS["gpu"] = dict(shipped, **cfg)
            try:
                out["x"] = ix.indexer_scores_op(*args)
            finally:
                ix.CONFIGS["gpu"] = shipped
        return run, lambda: out["x"]

    configs = [dict(zip(GRID, v)) for v in itertools.product(*GRID.values())]
    us, cfg = best_config(configs, make_run, ref, tol=1e-4, timer=timer, show=show)
    base_us = timer(lambda: ix.indexer_scores_op(*args))
    top_us = timer(lambda: ref.topk(min(TOPK, n), dim=-1))
    nbytes = B * n * DI * 2
    print(f"B={B} S={S} n={n}: best {us:.1f} µs ({nbytes / us * 1e-3:.0f} GB/s) {cfg}; "
          f"shipped {base_us:.1f} µs ({nbytes / base_us * 1e-3:.0f} GB/s); "
          f"topk {top_us:.1f} µs", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqlens", default="8192,32768,131072")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", default="1,2", help="query tokens per request")
    add_timer_args(ap)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_indexer.py needs a CUDA GPU")
    announce_ceiling()
    timer = chosen_timer(args)
    for S in (int(s) for s in args.tokens.split(",")):
        for n in (int(x) for x in args.seqlens.split(",")):
            sweep_shape(args.batch, S, n, timer, args.show)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
