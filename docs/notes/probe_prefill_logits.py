"""Where a converted prefill's logits leave HF's (H200 probe, not maintained): per request
the last position's error, and over every position the share above 0.05, so a few
positions (a router near-tie flipping an expert) tell from most (a path's bug).

    python docs/notes/probe_prefill_logits.py v3:8x2048,v2-lite:8x2048
"""
import sys
import torch
sys.path[:0] = [".", "benchmarks"]                  # run from the repository root
import mla_ops.hf
from bench_prefill import hf_step, ours_step, spec_models

with torch.no_grad():
    for name, row, cfg, model, ids, ctx in spec_models(sys.argv[1]):
        hf = hf_step(model, cfg, ids, ctx)().float()                   # [B, S, V]
        mla_ops.hf.convert(model)
        ours = ours_step(model, cfg, ids, ctx)().float()
        scale = hf.abs().amax(-1).clamp(min=1.0)                       # [B, S]
        err = (ours - hf).abs().amax(-1) / scale                       # [B, S]
        last = " ".join(f"{e:.3f}" for e in err[:, -1].tolist())
        print(f"{name} {row}: last position per request {last}; positions > 0.05: "
              f"{(err > 0.05).float().mean().item() * 100:.2f} %, median {err.median().item():.4f}, "
              f"max {err.max().item():.3f}", flush=True)
        del model, hf, ours
        torch.cuda.empty_cache()
