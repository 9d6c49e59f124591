"""Fusion passes on one MLA decode layer with an fp8 KV cache: fused vs unfused.

    python benchmarks/bench_fusion.py [--json out.json] [--shapes 32x128x4096,...]

The layer builds the 576-wide decode query in the graph and quantizes it to fp8 (static
q_scale; fp8 x fp8 decode), and its output feeds a DeepSeek-style activation quant
(dynamic per-token-group 128) as an FP8 o_proj would. Three compiles of the same function:
  unfused  passes off: Inductor's cat, the quant ops, bmm + separate output quant
  passA    decode-query cat + quant fused
  fused    Pass A + Pass B (output quant in the op: W_UV GEMM epilogue for decode rows)
For each: CUDA kernels per step (torch.profiler), time per step with the compiled
function launched normally (median of triton do_bench) and replayed from a CUDA graph
(timing.graph_time_us: the median replay after an L2 flush),
and the fused output checked against the unfused one.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton.testing

import passes
from timing import graph_time_us as time_graph
from mla_ops import MLAAttention, MLAMetadata, PagedLatentCache

P, R, V, L, PAGE = 128, 64, 128, 512, 64


def build(B, N, S, dev="cuda"):
    g = torch.Generator(device=dev).manual_seed(0)
    layer = MLAAttention(N, P, R, V, L, (P + R) ** -0.5, kv_cache_dtype="fp8").to(dev)
    kv_b = torch.randn(N * (P + V), L, generator=g, device=dev) / L ** 0.5
    layer.absorb(kv_b.to(torch.bfloat16))
    layer.enable_fp8_decode_query(0.05)
    nb = B * (-(-(S + 1) // PAGE)) + 1
    cache = PagedLatentCache(1, nb, PAGE, kv_lora_rank=L, qk_rope_head_dim=R,
                             dtype=torch.bfloat16, kv_cache_dtype="fp8", k_scale=0.02, device=dev)
    cache.kv[0].copy_((torch.randn(cache.kv[0].shape, generator=g, device=dev) * 5).to(torch.float8_e4m3fn))
    for i in range(B):
        cache.allocator.allocate(i, S)
    meta = MLAMetadata.build(cache.allocator, range(B), [1] * B, device=dev)
    q = torch.randn(B, N, P + R, generator=g, device=dev).bfloat16()
    kv_c = torch.randn(B, L, generator=g, device=dev).bfloat16()
    k_pe = torch.randn(B, 1, R, generator=g, device=dev).bfloat16()
    return layer, cache, meta, (q, kv_c, k_pe)


def count_kernels(fn):
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return len(names), names


def run_shape(B, N, S):
    layer, cache, meta, (q, kv_c, k_pe) = build(B, N, S)
    kv, ks = cache.kv[0], cache.k_scale
    snap = kv.clone()

    def fn(q, kv_c, k_pe, kv, ks, meta):
        return torch.ops.mla.quant_fp8_group(layer(q, kv_c, k_pe, kv, ks, meta), 128, False)

    rows, outs = {}, {}
    for name, (a, b) in {"unfused": (False, False), "passA": (True, False),
                         "fused": (True, True)}.items():
        torch._dynamo.reset()
        compiled = passes.compile_with_passes(fn, pass_a_on=a, pass_b_on=b)
        kv.copy_(snap)
        with torch._inductor.config.patch(fx_graph_cache=False):   # run the pass: match counts
            outs[name] = compiled(q, kv_c, k_pe, kv, ks, meta)
        call = lambda: compiled(q, kv_c, k_pe, kv, ks, meta)          # noqa: E731
        n, names = count_kernels(call)
        launch_us = triton.testing.do_bench(call, warmup=25, rep=200, return_mode="median") * 1e3
        try:
            graph_us = time_graph(call)
        except Exception as e:          # noqa: BLE001 - report, keep the other numbers
            graph_us = None
            print(f"  graph capture failed for {name}: {type(e).__name__}: {e}", flush=True)
        f = compiled.fusion
        rows[name] = dict(kernels=n, launch_us=round(launch_us, 1),
                          graph_us=None if graph_us is None else round(graph_us, 1),
                          matches={p: dict(f.match_counts(p)) for p in ("A", "B")},
                          kernel_names=names)
    y_u, s_u = outs["unfused"]
    y_f, s_f = outs["fused"]
    deq = lambda y, s: y.double() * s.double().repeat_interleave(128, 1)    # noqa: E731
    diff = (deq(y_f, s_f) - deq(y_u, s_u)).abs()
    ref = deq(y_u, s_u).abs()
    check = dict(passA_bitwise=bool(torch.equal(outs["passA"][0].view(torch.uint8),
                                                 y_u.view(torch.uint8))),
                 fused_rel_l2=float(diff.norm() / ref.norm()),
                 fused_elems_differing=float((y_f.view(torch.uint8) != y_u.view(torch.uint8))
                                             .double().mean()))
    return dict(B=B, N=N, S=S, variants=rows, check=check)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json")
    ap.add_argument("--shapes", default="1x128x4096,32x128x4096,128x16x4096")
    args = ap.parse_args()
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    results = []
    for spec in args.shapes.split(","):
        B, N, S = map(int, spec.split("x"))
        r = run_shape(B, N, S)
        results.append(r)
        for name, v in r["variants"].items():
            print(f"B={B:4d} N={N:3d} S={S:5d} {name:8s} kernels={v['kernels']:3d} "
                  f"launch={v['launch_us']:8.1f}us graph={v['graph_us']}us "
                  f"matches={v['matches']}", flush=True)
        print(f"  check {r['check']}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
