"""One-row decode steps with the weights after the attention asked of the L2 while it runs
(H200 probe, not maintained).

At one row the attention is bound by latency, not bytes: ~13 µs a layer for V2-Lite's 4.7
MB of cache, ~23 µs for V3's (BENCHMARKS.md), so DRAM idles through it. The GEMMs after
it (o_proj, then the MoE block's router and shared experts) are small and run at ~0.5 of
the copy rate at one row, bound by their ramp (BENCHMARKS.md, "The MoE decode step"). The
probe asks the L2 for those weights as the attention starts: one thread per 4 KB issues
`cp.async.bulk.prefetch.L2` (evict_last, so the cache rows streaming through do not push
them out), from a kernel on a side stream forked before the attention (joined after it)
or on the main stream just before it. An earlier probe at 32 rows, where DRAM was busy
during the attention, found no gain (docs/notes/HISTORY-hf-decode.md, "What the GEMMs
after the attention pay"); this one asks whether one row, where it is idle, differs.

The step is a DecodeGraph of the eager step (compile=False, so the probe's Python around
each layer's MLAAttention call is what runs); each variant captures its own graph on a
fresh cache. ms per step: the median of --rounds loops of --iters replays, the variants
timed in turn, the whole list twice.

    python docs/notes/probe_l2_prefetch_1row.py [--shapes v2-lite,v3-moe,v3-moe-fp8] [--S 4096]
        [--gc-in-capture]

--gc-in-capture captures with Python's garbage collector on, as DecodeGraph did before it
paused the collector around its capture (the FP8 step's failed capture in this probe,
NOTES-fp8-checkpoints.md); each collection that falls inside a capture is printed.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from types import SimpleNamespace

import torch
import triton
import triton.language as tl

sys.path.insert(0, "benchmarks")                    # run from the repository root
import mla_ops.hf  # noqa: E402
from bench_hf_decode import fill_paged_cache  # noqa: E402
from mla_ops.hf.models import build_model, make_config  # noqa: E402
from mla_ops.layer import MLAAttention  # noqa: E402

CHUNK = 4096                                       # bytes one prefetch asks for


@triton.jit
def prefetch_kernel(p_ptr, n_chunks, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Ask the L2 (evict_last) for chunks [0, n_chunks) of CHUNK bytes at p_ptr (uint8)."""
    i = tl.minimum(tl.program_id(0) * BLOCK + tl.arange(0, BLOCK), n_chunks - 1)
    p = p_ptr + i.to(tl.int64) * CHUNK
    tl.inline_asm_elementwise(
        "{ .reg .b64 pol; createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
        f"cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], {CHUNK}, pol; "
        "mov.u32 $0, 0; }", "=r,l", [p], dtype=tl.int32, is_pure=False, pack=1)


def prefetch(tensors, budget: int) -> None:
    """Ask the L2 for the first `budget` bytes of the tensors, in order (whole 4 KB chunks)."""
    for t in tensors:
        if budget < CHUNK:
            return
        flat = t.detach().reshape(-1).view(torch.uint8)
        n = min(flat.numel(), budget) // CHUNK
        if n:
            prefetch_kernel[(triton.cdiv(n, 128),)](flat, n, CHUNK=CHUNK, BLOCK=128,
                                                    num_warps=4)
        budget -= n * CHUNK


def after_attention(layer) -> list:
    """The weights a layer reads after its attention, in the order it reads them."""
    out = [layer.self_attn.o_proj.weight]
    scale = getattr(layer.self_attn.o_proj, "weight_scale_inv", None)
    if scale is not None:
        out.append(scale)
    mlp = layer.mlp
    gate = getattr(mlp, "gate", None)
    if gate is not None and hasattr(mlp, "experts"):          # a MoE block: router, shared
        out.append(gate.weight)
        out += [p for p in mlp.shared_experts.parameters()]
    return out


def build(shape: str, dev):
    name, fp8 = shape.removesuffix("-fp8"), shape.endswith("-fp8")
    cfg = make_config(name, None)
    cfg._attn_implementation = "sdpa"
    cfg._experts_implementation = "grouped_mm"
    model = build_model(cfg, dev, torch.bfloat16)
    if fp8:
        from mla_ops.hf.fp8_models import quantize_fp8
        model = quantize_fp8(model)
    mla_ops.hf.convert(model)
    return cfg, model


def time_variant(cfg, model, plan, side, budget, on_side, S, args, dev) -> float:
    """ms per step of a DecodeGraph captured with the prefetch patch (budget 0: none)."""
    orig = MLAAttention.forward

    def forward(self, *a, **k):
        ws = plan.get(id(self))
        if not budget or not ws:
            return orig(self, *a, **k)
        main = torch.cuda.current_stream()
        if on_side:
            side.wait_stream(main)
            with torch.cuda.stream(side):
                prefetch(ws, budget)
        else:
            prefetch(ws, budget)
        out = orig(self, *a, **k)
        if on_side:
            main.wait_stream(side)
        return out

    MLAAttention.forward = forward
    try:
        opts = SimpleNamespace(kv_cache_dtype="auto", k_scale=1.0, per_layer_schedule=False)
        cache = fill_paged_cache(cfg, 1, S, args.rounds * args.iters + 16, dev, torch.bfloat16,
                                 opts)
        runner = mla_ops.hf.DecodeGraph(model, cache, batch_size=1, graph=True, compile=False)
        ids = torch.randint(3, cfg.vocab_size, (1, 1), device=dev)
        for _ in range(5):
            runner(ids)
        times = []
        for _ in range(args.rounds):
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(args.iters):
                runner(ids)
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) / args.iters)
        del runner, cache
        torch.cuda.empty_cache()
        return statistics.median(times)
    finally:
        MLAAttention.forward = orig


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="v2-lite,v3-moe,v3-moe-fp8")
    ap.add_argument("--S", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gc-in-capture", action="store_true")
    args = ap.parse_args()
    if args.gc_in_capture:
        import gc

        import mla_ops.hf.graph as graph
        graph.capturing = lambda g, pool=None: torch.cuda.graph(g, pool=pool)

        def report(phase, info):
            if phase == "start" and torch.cuda.is_current_stream_capturing():
                print(f"  a gen-{info['generation']} collection inside a capture", flush=True)
        gc.callbacks.append(report)
    dev = torch.device("cuda")
    side = torch.cuda.Stream()
    MB = 1 << 20
    for shape in args.shapes.split(","):
        cfg, model = build(shape, dev)
        layers = model.model.layers
        plan = {id(l.self_attn.mla_attn): after_attention(l) for l in layers}
        sizes = [sum(t.numel() * t.element_size() for t in plan[id(l.self_attn.mla_attn)])
                 for l in layers]
        print(f"{shape}, 1 x {args.S}: bytes after each attention (MB) "
              f"{[round(s / MB, 1) for s in sizes]}", flush=True)
        variants = {"none": (0, True)}
        for mb in (8, 24, 40):
            variants[f"{mb} MB, side stream"] = (mb * MB, True)
            variants[f"{mb} MB, main stream"] = (mb * MB, False)
        results = {n: [] for n in variants}
        for _ in range(2):
            for name, (budget, on_side) in variants.items():
                results[name].append(time_variant(cfg, model, plan, side, budget, on_side,
                                                  args.S, args, dev))
        base = statistics.mean(results["none"])
        for name, ts in results.items():
            print(f"  {name:20s} {' / '.join(f'{t:.4f}' for t in ts)} ms "
                  f"({base / statistics.mean(ts):.3f}x)", flush=True)
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
