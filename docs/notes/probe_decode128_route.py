"""A/B of the 128-head bf16 decode route inside whole V3-shaped DecodeGraph steps (GPU
probe, not maintained): flashmla_pays forced True from 64 heads (FlashMLA, its scheduler
once a step: the route before 2026-12-06) against forced False there (the Gluon pair
kernel, no FlashMLA schedule); below 64 heads the shipped rule. The steps of
bench_fp8_weights.py's V3 shape (2 layers, 1 dense) with bf16 and with fp8 weights, each
variant compiled and captured once; step µs from events over N greedy steps, ROUNDS
rounds alternating the variants (medians). Run 2026-12-06 before the rule changed, when
the shipped rule was the "flashmla" variant.

    python docs/notes/probe_decode128_route.py 1,2,4,8 [ROUNDS] [N]
"""
import argparse, sys, torch
sys.path[:0] = ["benchmarks", "docs/notes"]         # run from the repository root
import lowering
import mla_ops.hf
from lowering.decode import registry
from mla_ops.hf.fp8_models import quantize_fp8
from mla_ops.hf.models import build_model
from bench_fp8_weights import v3_moe_config, fill_cache

SHIPPED = registry.flashmla_pays


def use(gluon):
    """gluon True / False: the variant's rule from 64 heads; None: the shipped rule."""
    def pays(h, b, n, dtype=torch.bfloat16):
        return SHIPPED(h, b, n, dtype) if h < 64 or gluon is None else not gluon
    registry.flashmla_pays = lowering.flashmla_pays = pays


def build(model, cfg, B, S, gluon: bool):
    """A compiled, captured DecodeGraph of `model` over a cache of B rows at S tokens,
    its route chosen at trace time with the variant's flashmla_pays."""
    use(gluon)
    torch._dynamo.reset()
    cache = fill_cache(cfg, B, S, 400, torch.device("cuda"))
    runner = mla_ops.hf.DecodeGraph(model, cache, batch_size=B, compile=True)
    ids = torch.zeros(B, 1, dtype=torch.long, device="cuda")
    runner.greedy(ids, 3)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
        runner.greedy(ids, 1)
        torch.cuda.synchronize()
    names = {e.name for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA}
    print(f"  B{B} {'gluon' if gluon else 'shipped'}: FlashMLA kernels in the step: "
          f"{any('flash' in n for n in names)}; pair kernel: "
          f"{any('pair' in n or 'gluon' in n for n in names)}", flush=True)
    use(None)
    return runner, cache, ids


def step_us(runner, ids, n):
    """µs a step over n greedy steps of a built DecodeGraph."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    runner.greedy(ids, n)
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / n * 1000


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("batches")
    ap.add_argument("rounds", nargs="?", type=int, default=3)
    ap.add_argument("n", nargs="?", type=int, default=50)
    ap.add_argument("--S", type=int, default=4096)
    a = ap.parse_args()
    cfg = v3_moe_config(argparse.Namespace(layers=2, dense_layers=1, experts=256, top_k=8))
    torch.manual_seed(0)
    bf16 = build_model(cfg, torch.device("cuda"), torch.bfloat16)
    models = {"bf16": mla_ops.hf.convert(bf16, fuse_experts=True)}
    models["fp8"] = mla_ops.hf.convert(quantize_fp8(build_model(cfg, torch.device("cuda"),
                                                                torch.bfloat16)),
                                       fuse_experts=True)
    for B in (int(v) for v in a.batches.split(",")):
        for name, model in models.items():
            built = {v: build(model, cfg, B, a.S, v == "gluon") for v in ("flashmla", "gluon")}
            res = {v: [] for v in built}
            for _ in range(a.rounds):
                for variant, (runner, cache, ids) in built.items():
                    res[variant].append(step_us(runner, ids, a.n))
            del built
            torch.cuda.empty_cache()
            use(None)
            med = {k: sorted(v)[len(v) // 2] for k, v in res.items()}
            print(f"{name} weights B{B} S{a.S}: " + "; ".join(
                f"{k} {med[k]:.1f} µs (runs {', '.join(f'{x:.1f}' for x in v)})"
                for k, v in res.items()) + f"; gluon/flashmla speedup "
                f"{med['flashmla'] / med['gluon']:.3f}x", flush=True)


if __name__ == "__main__":
    main()
