"""Where a converted prefill's logits leave HF's (H200 probe, not maintained): per request
the last position's error, and over every position the share above 0.05, so a few
positions (a router near-tie flipping an expert) tell from most (a path's bug). With
--fp32, HF's bf16 model and ours are each compared with HF's model in float32 (same
weights), so HF's own bf16 share of far-off positions stands beside ours.

    python docs/notes/probe_prefill_logits.py v3:8x2048,v2-lite:8x2048 [--fp32]
"""
import copy
import sys
import torch
sys.path[:0] = [".", "benchmarks"]                  # run from the repository root
import mla_ops.hf
from bench_prefill import hf_step, ours_step, spec_models


def report(tag, got, ref):
    scale = ref.abs().amax(-1).clamp(min=1.0)                          # [B, S]
    err = (got - ref).abs().amax(-1) / scale                           # [B, S]
    last = " ".join(f"{e:.3f}" for e in err[:, -1].tolist())
    print(f"  {tag}: last position per request {last}; positions > 0.05: "
          f"{(err > 0.05).float().mean().item() * 100:.2f} %, median {err.median().item():.4f}, "
          f"max {err.max().item():.3f}", flush=True)


with torch.no_grad():
    for name, row, cfg, model, ids, ctx in spec_models(sys.argv[1]):
        print(f"{name} {row}", flush=True)
        hf32 = None
        if "--fp32" in sys.argv:
            m32 = copy.deepcopy(model).float()
            m32.config._experts_implementation = "eager"   # torch's grouped GEMM takes 16-bit only
            hf32 = hf_step(m32, cfg, ids, ctx)().float()
            del m32
            torch.cuda.empty_cache()
        hf = hf_step(model, cfg, ids, ctx)().float()                   # [B, S, V]
        mla_ops.hf.convert(model)
        ours = ours_step(model, cfg, ids, ctx)().float()
        report("ours vs HF bf16", ours, hf)
        if hf32 is not None:
            report("HF bf16 vs HF fp32", hf, hf32)
            report("ours vs HF fp32", ours, hf32)
        del model, hf, ours, hf32
        torch.cuda.empty_cache()
