"""Two candidate trims of a converted prefill forward's GPU time, A/B in one run (H200 probe,
not maintained; neither is in the library):

  keys-pad     the new tokens' (and context windows') keys for cuDNN as one GEMM into
               [c, N, P + R] with W_UK padded by R zero rows per head, then k_pe written
               into the rope columns, in place of the k_nope GEMM and a cat of
               [k_nope | k_pe] (the cat: 1.5 ms of V3's 46 ms at 1 x 8192)
  router-bf16  the MoE router's logits (HF: F.linear in fp32 on fp32 copies of x and the
               weight, a SIMT GEMM, 0.68 ms there) as a bf16 tensor-core GEMM with fp32
               output (torch.mm(out_dtype=...)): the same exact products, another fp32
               summation order, so an expert may flip where two sit within an fp32 ulp

Each variant's forward (wall ms, bench_prefill.bench_ms) and its logits against the
baseline's (max error over every position, and the share of positions above 0.05).

    python docs/notes/probe_prefill_trims.py v3:1x8192,v2-lite:8x2048
"""
import sys
import torch
import torch.nn.functional as F
sys.path[:0] = [".", "benchmarks"]                  # run from the repository root
import mla_ops.hf
import lowering.prefill.step as pstep
from lowering.moe import router
from bench_prefill import bench_ms, ours_step, spec_models

_padded = {}


def up_project_pad(kv_c, W_UK_T, W_UV, R=64):
    N, P, L = W_UK_T.shape
    key = (W_UK_T.data_ptr(), R)
    if key not in _padded:
        Wp = W_UK_T.new_zeros(N, P + R, L)
        Wp[:, :P] = W_UK_T
        _padded[key] = Wp.reshape(N * (P + R), L).t()
    k = torch.mm(kv_c, _padded[key]).view(-1, N, P + R)                 # [c, N, P + R]
    v = torch.mm(kv_c, W_UV.transpose(0, 1).reshape(L, -1)).view(-1, N, W_UV.shape[-1])
    return k[..., :P], v


def keys_pad(k_nope, k_pe):
    k = k_nope._base.view(*k_nope.shape[:-1], -1)                       # the [c, N, P + R] GEMM output
    k[..., k_nope.shape[-1]:] = k_pe.unsqueeze(-2)
    return k


def route_bf16(x, weight, *args):
    real = F.linear
    F.linear = lambda a, b: torch.mm(x, weight.t(), out_dtype=torch.float32)
    try:
        return ROUTE(x, weight, *args)
    finally:
        F.linear = real


ROUTE = router.route_torch
VARIANTS = {
    "baseline": {},
    "keys-pad": {(pstep, "up_project"): up_project_pad, (pstep, "keys"): keys_pad},
    "router-bf16": {(router, "route_torch"): route_bf16},
}
VARIANTS["both"] = {**VARIANTS["keys-pad"], **VARIANTS["router-bf16"]}

with torch.no_grad():
    for name, row, cfg, model, ids, ctx in spec_models(sys.argv[1]):
        mla_ops.hf.convert(model)
        step = ours_step(model, cfg, ids, ctx)
        base = None
        for tag, patches in VARIANTS.items():
            saved = {k: getattr(*k) for k in patches}
            try:
                for (mod, attr), fn in patches.items():
                    setattr(mod, attr, fn)
                ms = bench_ms(step, warmup=2, iters=10)
                logits = step().float()
            except Exception as e:                       # e.g. no out_dtype in this torch
                print(f"{name} {row} {tag}: {type(e).__name__}: {str(e)[:100]}", flush=True)
                continue
            finally:
                for (mod, attr), fn in saved.items():
                    setattr(mod, attr, fn)
            if base is None:
                base = logits
            err = (logits - base).abs().amax(-1) / base.abs().amax(-1).clamp(min=1.0)
            print(f"{name} {row} {tag}: {ms:.2f} ms; logits vs baseline max {err.max().item():.3f}, "
                  f"> 0.05 at {(err > 0.05).float().mean().item() * 100:.2f} % of positions",
                  flush=True)
        del model, step
        torch.cuda.empty_cache()
