"""Candidate trims of a converted prefill forward's GPU time, A/B in one run (H200 probe,
not maintained; neither is in the library):

  keys-pad     the new tokens' (and context windows') keys for cuDNN as one GEMM into
               [c, N, P + R] with W_UK padded by R zero rows per head, then k_pe written
               into the rope columns, in place of the k_nope GEMM and a cat of
               [k_nope | k_pe] (the cat: 1.5 ms of V3's 46 ms at 1 x 8192)
  router-select the MoE router of a prefill batch as HF's own fp32 logits GEMM (the same
               cuBLAS call, so the same logits) and then mla::moe_route's selection kernel
               (router_select_kernel.py) over all rows, in place of HF's ~10 sort, top-k
               and pointwise kernels (0.3 ms of top-k alone at V3 1 x 8192) and their
               host calls. (A bf16 tensor-core GEMM for the logits, tried 2026-12-04, is
               not the same numerics: the router weight is fp32 in these models.)

Each variant's forward (wall ms, bench_prefill.bench_ms) and its logits against the
baseline's (max error over every position, and the share of positions above 0.05).

    python docs/notes/probe_prefill_trims.py v3:1x8192,v2-lite:8x2048
"""
import sys
import torch
import torch.nn.functional as F
import triton
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


def route_select(x, weight, bias, mode, top_k, n_group, topk_group, norm_topk_prob, scale):
    T, E = x.shape[0], weight.shape[0]
    if not x.is_cuda or T <= router.MAX_ROWS:
        return ROUTE(x, weight, bias, mode, top_k, n_group, topk_group, norm_topk_prob, scale)
    logits = F.linear(x.type(torch.float32), weight.type(torch.float32))     # [T, E], HF's
    idx = torch.empty((T, top_k), dtype=torch.int64, device=x.device)
    wt = torch.empty((T, top_k), dtype=torch.float32, device=x.device)
    grouped = mode != 1
    router.router_select_kernel[(T,)](
        logits, bias if mode == 0 else logits, idx, wt, T, E,
        E // n_group if grouped else E, n_group if grouped else 1,
        topk_group if grouped else 1, top_k, float(scale),
        SPLIT=1, MODE=mode, NORM=bool(norm_topk_prob) and mode == 0,
        BLOCK_E=max(16, triton.next_power_of_2(E)),
        BLOCK_G=max(2, triton.next_power_of_2(n_group if grouped else 1)),
        BLOCK_K=max(2, triton.next_power_of_2(top_k)), LIBDEVICE=True,
        num_warps=router.SELECT_WARPS, num_stages=1)
    if CHECK:                                        # the same experts as HF's calls?
        ref = ROUTE(x, weight, bias, mode, top_k, n_group, topk_group, norm_topk_prob, scale)
        same = (idx.sort(1)[0] == ref[0].sort(1)[0]).all(1)
        CHECK.append((T, int((~same).sum())))
    return idx, wt


CHECK = []
ROUTE = router.route_torch
VARIANTS = {
    "baseline": {},
    "keys-pad": {(pstep, "up_project"): up_project_pad, (pstep, "kernel_keys"): keys_pad},
    "router-select": {(router, "route_torch"): route_select},
}

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
            if tag == "router-select":                   # experts against HF's calls
                CHECK.append(None)
                step()
                rows = [c for c in CHECK[1:] if c]
                print(f"  tokens with another expert set than HF's calls: "
                      f"{sum(n for _, n in rows)} of {sum(t for t, _ in rows)}", flush=True)
                CHECK.clear()
        del model, step
        torch.cuda.empty_cache()
