"""The decode step with and without programmatic edges, at the landing form of PDL
(commit e0379c9: the waits compiled for every Hopper launch, DecodeGraph(programmatic=...)).
GPU probe, not maintained; NOTES-v2lite-one-row.md has what it measured.

For each shape (name:B:S) one converted model, two DecodeGraphs of one compiled step
(programmatic False, then True), each on its own cache filled alike: their first
step's logits and 16 greedy tokens compared (bit for bit expected), then ms a step
(median of --rounds loops of --iters replays, the runners in turn).

    python docs/notes/probe_pdl_step.py [--shapes v2-lite:1:4096,v3-moe:1:4096]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from types import SimpleNamespace

import torch

sys.path.insert(0, "benchmarks")                    # run from the repository root
sys.path.insert(0, "docs/notes")
import mla_ops.hf  # noqa: E402
from bench_hf_decode import fill_paged_cache  # noqa: E402
from mla_ops.hf.models import build_model, make_config  # noqa: E402
from probe_graph_pdl import time_runners  # noqa: E402


def run(spec: str, rounds: int, iters: int) -> None:
    dev = torch.device("cuda")
    name, B, S = spec.split(":")
    B, S = int(B), int(S)
    cfg = make_config(name, None)
    cfg._attn_implementation = "sdpa"
    cfg._experts_implementation = "grouped_mm"
    model = mla_ops.hf.convert(build_model(cfg, dev, torch.bfloat16))
    opts = SimpleNamespace(kv_cache_dtype="auto", k_scale=1.0, per_layer_schedule=False)
    runners = {}
    for prog in (False, True):
        torch.manual_seed(1)
        cache = fill_paged_cache(cfg, B, S, rounds * iters * 2 + 64, dev, torch.bfloat16, opts)
        runners[prog] = mla_ops.hf.DecodeGraph(model, cache, batch_size=B, programmatic=prog)
    ids = torch.randint(3, cfg.vocab_size, (B, 1), device=dev,
                        generator=torch.Generator(device=dev).manual_seed(2))
    first = {p: r(ids).clone() for p, r in runners.items()}
    toks = {p: r.greedy(ids, 16) for p, r in runners.items()}
    times = time_runners(runners, ids, rounds, iters)
    med = {p: statistics.median(t) for p, t in times.items()}
    print(f"{spec}: edges {runners[True].programmatic_edges}; logits bit-equal "
          f"{torch.equal(first[False], first[True])}, max |diff| "
          f"{(first[False].float() - first[True].float()).abs().max().item():.3g}; tokens equal "
          f"{torch.equal(toks[False], toks[True])}", flush=True)
    for p in runners:
        print(f"  programmatic={p!s:5}  {med[p]:.4f} ms ({med[False] / med[p]:.3f}x); rounds "
              f"{[round(t, 4) for t in times[p]]}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="v2-lite:1:4096,v3-moe:1:4096")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    for spec in args.shapes.split(","):
        run(spec, args.rounds, args.iters)


if __name__ == "__main__":
    main()
