"""One decode step of a DeepSeek-V3-shaped HF model with FP8 block-quantized weights (the
form of DeepSeek-V3 / R1 checkpoints) vs the same model with bf16 weights.

Model: V3's attention (128 heads, q_lora 1536, L 512) and hidden size 7168; --dense-layers
dense layers (intermediate 18432) then MoE layers (V3's 256 routed experts of 2048, top 8
in 8 groups / best 4, one shared expert), vocab 2048, random weights. fp8: the same
weights quantized by HF's own FineGrainedFP8 quantization in 128 x 128 blocks
(mla_ops.hf.fp8_models.quantize_fp8; the output head stays bf16, as HF keeps it). Both
converted with fuse_experts=True and timed as mla_ops.hf.DecodeGraph (the step compiled by
Inductor and captured in one CUDA graph; --no-compile captures the eager step) on a bf16
PagedMLACache (block 64) holding S random tokens per row: ms per step, the median of
--rounds greedy loops of --iters steps.

Floor: the bytes one fp8 step reads / 4.3 TB/s (H200): every fp8 weight and its scales,
the absorbed W_UK_T / W_UV, the bf16 output head and norms, B embedding rows, the shared
expert and the routed experts the batch chooses (expected distinct experts under uniform
routing: E (1 - (1 - k / E)^B) per MoE layer), and the cache rows (B x S x 576 x 2 bytes
per layer). Targets (issue 31): fp8 >= 1.6x bf16 at B = 1, and <= 1.3x its floor.

    python benchmarks/bench_fp8_weights.py                       # B = 1 and 32, S = 4096
    python benchmarks/bench_fp8_weights.py --shapes 1x4096 --experts 64 --no-compile
    python benchmarks/bench_fp8_weights.py --sweep    # the fp8 GEMM kernel's configs per shape
    python benchmarks/bench_fp8_weights.py --prefill 1x512,1x2048,1x8192   # prefill instead
    python benchmarks/bench_fp8_weights.py --sweep-grouped     # the prefill GEMM's configs

--prefill times one eager forward of B prompts of S tokens into an empty cache per model
(as generate() runs a prefill; the median of --rounds after a warm-up). Past the decode
GEMMs' 64 rows the fp8 model's linears and routed experts run the grouped W8A8 GEMM
(lowering/gemm/grouped.py, lowering/moe/fp8_prefill.py) where transformers' own fp8
kernel does not load.

--sweep-grouped times that grouped W8A8 GEMM's configs at prefill rows (512, 2048, 8192):
V3's linears as one group (grouped.prefill_linear) beside the same product with the
weight dequantized to bf16 and cuBLAS (F.linear), and V3's routed experts
(fp8_prefill.grouped_experts, top 8 of 256, uniform routing) per kernel; it prints the
best as grouped.CONFIG and fp8_prefill.CONFIGS entries.

--sweep times the fp8 decode GEMM kernel (lowering/gemm/fp8_linear.py; its configs in fp8_linear_configs.py) alone at V3's
decode shapes, 1 and 32 rows, over candidate configs (BLOCK_N, stages and the K splits
whose grid fills the SMs: sweep_candidates; CUDA-graph replays, L2 flushed, a split's
reduce launch included), beside the bf16 decode GEMM op on the same shape, and prints
the CONFIGS entries (about a minute on an H200).
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

HBM_BYTES_PER_S = 4.3e12


def v3_moe_config(args):
    from mla_ops.hf.models import make_config
    cfg = make_config("v3-shaped", args.layers)
    cfg.first_k_dense_replace = args.dense_layers
    cfg.n_routed_experts, cfg.num_experts_per_tok = args.experts, args.top_k
    cfg.n_group, cfg.topk_group = (8, 4) if args.experts % 8 == 0 else (1, 1)
    cfg.n_shared_experts, cfg.routed_scaling_factor = 1, 2.5
    cfg._attn_implementation = "sdpa"
    return cfg


def step_bytes(model, cfg, B: int, S: int) -> float:
    """Bytes one decode step of the converted model reads (see the module docstring)."""
    experts = [m for n, m in model.named_modules() if n.endswith("mlp.experts")]
    skip = {id(p) for m in experts for p in m.parameters()}
    skip |= {id(m.kv_b_proj.weight) for m in model.modules() if hasattr(m, "mla_attn")}
    embed = model.get_input_embeddings().weight
    skip.add(id(embed))
    total = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())
                if id(t) not in skip)
    total += B * embed.shape[1] * embed.element_size()
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    chosen = E * (1 - (1 - k / E) ** B)
    for m in experts:
        total += chosen / E * sum(p.numel() * p.element_size() for p in m.parameters())
    total += cfg.num_hidden_layers * B * S * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2
    return total


def fill_cache(cfg, B, S, room, dev):
    import mla_ops.hf
    cache = mla_ops.hf.PagedMLACache(cfg, max_batch_size=B, max_cache_len=S + room,
                                     block_size=64, device=dev, dtype=torch.bfloat16)
    for kv in cache.pool.kv:
        kv.normal_()
    cache.occupy([S] * B)
    return cache


def time_prefill(model, cfg, B, S, dev, rounds) -> float:
    """Median ms of one eager forward of B x S random tokens into an empty cache."""
    import mla_ops.hf
    ids = torch.randint(3, cfg.vocab_size, (B, S), device=dev)
    times = []
    for i in range(rounds + 1):                       # the first call warms up, untimed
        cache = mla_ops.hf.PagedMLACache(cfg, max_batch_size=B, max_cache_len=S + 64,
                                         block_size=64, device=dev, dtype=torch.bfloat16)
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.no_grad():
            a.record()
            model(input_ids=ids, **mla_ops.hf.cache_kwargs(model, cache))
            b.record()
        b.synchronize()
        if i:
            times.append(a.elapsed_time(b))
        del cache
    return statistics.median(times)


def time_steps(runner, B, dev, iters, rounds) -> float:
    """Median ms per step over `rounds` greedy loops of `iters` steps."""
    ids = torch.zeros(B, 1, dtype=torch.long, device=dev)
    runner.greedy(ids, 2)
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        runner.greedy(ids, iters)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / iters)
    return statistics.median(times)


# (mode, N, K, what): DeepSeek-V3's decode GEMMs (mode as in fp8_linear_kernel.py)
SWEEP_SHAPES = [(1, 2112, 7168, "q_a + kv_a"), (0, 24576, 1536, "q_b"),
                (0, 7168, 16384, "o_proj"), (2, 18432, 7168, "dense gate + up"),
                (0, 7168, 18432, "dense down"), (2, 2048, 7168, "shared expert gate + up"),
                (0, 7168, 2048, "shared expert down")]
SWEEP_BLOCK_N = (16, 32, 64, 128)
SWEEP_SPLITS = (1, 2, 4, 8, 16)
SWEEP_STAGES = (3, 4, 6, 8)       # 4 first, then the others for the best tile and split
SWEEP_GRID = (66, 528)            # programs: half the H200's 132 SMs to four per SM


def sweep_candidates(mode: int, N: int, K: int, M: int):
    """(BLOCK_N, num_warps, 4 stages, SPLIT_K) worth timing for a shape: every BLOCK_N of
    SWEEP_BLOCK_N with the splits whose grid lies in SWEEP_GRID (the unsplit one
    always; where no split lands in it, the one nearest its low end)."""
    from lowering.gemm import fp8_linear_configs
    out = []
    for bn in SWEEP_BLOCK_N:
        splits = [sk for sk in SWEEP_SPLITS
                  if fp8_linear_configs.split_k_for((bn, 4, 4, sk), mode, M, N, K, 128) == sk]
        grid = {sk: fp8_linear_configs.n_programs(mode, N, bn, sk) * sk for sk in splits}
        ok = [sk for sk in splits if SWEEP_GRID[0] <= grid[sk] <= SWEEP_GRID[1]]
        if not ok:
            ok = [min(splits, key=lambda sk: abs(grid[sk] - SWEEP_GRID[0]))]
        out += [(bn, 4, 4, sk) for sk in sorted({1, *ok})]
    return out


def quick_time_us(fn) -> float:
    """Median µs of a CUDA-graph replay of fn (L2 flushed): timing.graph_time_us with a
    shorter measurement, so the sweep's configs fit in a minute."""
    from timing import graph_time_us
    return graph_time_us(fn, warmup_calls=2, reps=30)


def sweep_tensors(mode, N, K, M, fill=True):
    """(x, weights, scales, bf16 weights, y1, y2) of a sweep shape on the GPU; fill=False
    leaves them unset (compiling needs only their shapes)."""
    dev = torch.device("cuda")
    n = 2 if mode else 1
    if fill:
        ws = [(torch.randn(N, K, device=dev) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
              for _ in range(n)]
        ss = [torch.rand(-(-N // 128), -(-K // 128), device=dev) * 1e-2 for _ in ws]
        bf = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * K ** -0.5 for _ in ws]
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    else:
        ws = [torch.empty(N, K, device=dev, dtype=torch.float8_e4m3fn) for _ in range(n)]
        ss = [torch.ones(-(-N // 128), -(-K // 128), device=dev) for _ in ws]
        bf = [torch.zeros(N, K, device=dev, dtype=torch.bfloat16) for _ in ws]
        x = torch.zeros(M, K, device=dev, dtype=torch.bfloat16)
    y1 = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
    y2 = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
    return x, ws, ss, bf, y1, y2


def sweep_call(mode, t, cfg):
    """A no-argument call of the fp8 GEMM (fp8_linear.run, split reduce included) with cfg,
    or with cfg None of the bf16 decode GEMM op on the same shape."""
    from lowering.gemm import fp8_linear
    from lowering.gemm import linear as gemm
    x, ws, ss, bf, y1, y2 = t
    if cfg is not None:
        w2, s2 = (ws[1], ss[1]) if mode else (None, None)
        return lambda: fp8_linear.run(x, ws[0], ss[0], w2, s2, mode, y1,
                                      y2 if mode == 1 else None, 128, 128, cfg)
    if mode == 0:
        return lambda: gemm.decode_linear_partials(x, bf[0], gemm.linear_split_k(x, bf[0]))
    if mode == 1:
        return lambda: gemm.decode_linear_pair_partials(x, bf[0], bf[1],
                                                        gemm.pair_split_k(x, bf[0], bf[1]))
    return lambda: torch.ops.mla.decode_gate_up(x, bf[0], bf[1])


def compile_tasks(tasks) -> int:
    """Run each (mode, N, K, M, cfg) once on unset tensors, so that Triton's on-disk cache
    holds its kernels when the timing process asks (a worker of precompile)."""
    for mode, N, K, M, cfgs in tasks:
        t = sweep_tensors(mode, N, K, M, fill=False)
        for cfg in cfgs:
            sweep_call(mode, t, cfg)()
        del t
    torch.cuda.synchronize()
    return len(tasks)


def precompile(pool, jobs) -> bool:
    """Compile the kernels of jobs {(mode, N, K, M): [cfg, ...]} in the worker processes
    (Triton compiles one kernel at a time per process; its disk cache is shared), one job
    per task, the largest first; whether they did. Without a pool (or where a worker
    fails) the timing process compiles them."""
    if pool is None:
        return False
    tasks = sorted(([(*key, cfgs)] for key, cfgs in jobs.items()), key=lambda t: -len(t[0][4]))
    try:
        pool.map(compile_tasks, tasks, chunksize=1)
    except Exception as e:            # compiling then happens while timing
        print(f"  (precompiling failed: {type(e).__name__}: {e}; compiling while timing)",
              flush=True)
        return False
    return True


def sweep():
    """Time the fp8 kernel's candidate configs per V3 shape (see the module docstring):
    per shape and row count every BLOCK_N with the splits sweep_candidates keeps at 4
    stages, then the other SWEEP_STAGES and the activations quantized in every program
    (PRE_QUANT False) for the best; each through fp8_linear.run (the quant launch and a
    split's reduce included). Worker processes compile each round's kernels first."""
    import multiprocessing
    import os
    import time

    from lowering.gemm import fp8_linear_configs

    if not torch.cuda.is_available():
        raise SystemExit("--sweep times CUDA graphs: it needs a CUDA device")
    t0 = time.perf_counter()
    shapes = [(mode, N, K, M, what) for mode, N, K, what in SWEEP_SHAPES for M in (1, 32)]
    first = {(m, N, K, M): [*sweep_candidates(m, N, K, M), fp8_linear_configs.pick_config(m, N, K, M),
                            None] for m, N, K, M, _ in shapes}
    workers = min(8, max(1, (os.cpu_count() or 2) // 2))
    try:
        pool = multiprocessing.get_context("spawn").Pool(workers)
    except Exception as e:
        print(f"  (no worker processes: {e}; compiling while timing)", flush=True)
        pool = None
    try:
        if precompile(pool, first):
            print(f"  [{time.perf_counter() - t0:5.1f} s] compiled the first round's kernels "
                  f"in {workers} processes", flush=True)
        times = {}
        for mode, N, K, M, what in shapes:
            t = sweep_tensors(mode, N, K, M)
            times[mode, N, K, M] = {cfg: quick_time_us(sweep_call(mode, t, cfg))
                                    for cfg in first[mode, N, K, M]}
            del t
            print(f"  [{time.perf_counter() - t0:5.1f} s] {what} M={M}: "
                  f"{len(first[mode, N, K, M]) - 1} configs", flush=True)
        second = {}
        for key, tm in times.items():      # the best tile and split at every stage count,
            top = min((c for c in tm if c is not None), key=tm.get)   # and quantizing in
            second[key] = [c for c in (*((top[0], top[1], st, top[3]) for st in SWEEP_STAGES),
                                       (*top[:4], False))            # every program
                           if c not in tm]
        precompile(pool, second)
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    best, notes = {}, {}
    for mode, N, K, M, what in shapes:
        tm = times[mode, N, K, M]
        t = sweep_tensors(mode, N, K, M)
        tm.update({cfg: quick_time_us(sweep_call(mode, t, cfg)) for cfg in second[mode, N, K, M]})
        del t
        bf16 = tm.pop(None)
        now = fp8_linear_configs.pick_config(mode, N, K, M)
        cfg = min(tm, key=tm.get)
        best[(mode, N, K, M <= 16)] = cfg
        notes[(mode, N, K, M <= 16)] = f"{what}, M={M}: {tm[cfg]:.1f} us, bf16 {bf16:.1f}"
        floor = N * K * (2 if mode else 1) / HBM_BYTES_PER_S * 1e6
        print(f"  [{time.perf_counter() - t0:5.1f} s, {len(tm)} configs] {what:24s} M={M:2d}: "
              f"fp8 best {cfg} {tm[cfg]:7.1f} us (floor {floor:6.1f}; config now {now} "
              f"{tm[now]:7.1f}), bf16 op {bf16:7.1f} us: {bf16 / tm[cfg]:.2f}x", flush=True)
    print("\nCONFIGS = {   # (mode, N, K, rows <= 16): (BLOCK_N, num_warps, num_stages, "
          "SPLIT_K[, PRE_QUANT])")
    for key, cfg in best.items():
        print(f"    {key}: {cfg},   # {notes[key]}")
    print("}", flush=True)


GROUPED_SWEEP = [(bm, bn, w, st) for bm, bn in ((64, 128), (128, 128), (64, 64), (32, 128),
                                                (128, 64), (16, 128))
                 for w, st in ((4, 3), (8, 3), (8, 4))]
PREFILL_LINEARS = {"q_a + kv_a": (2112, 7168), "q_b": (24576, 1536), "o_proj": (7168, 16384),
                   "dense gate + up": (36864, 7168), "dense down": (7168, 18432)}


def sweep_grouped():
    """--sweep-grouped (module docstring): µs of CUDA-graph replays (L2 flushed)."""
    import torch.nn.functional as F
    from lowering.gemm import grouped
    from lowering.gemm.fp8_linear import dequantize
    from lowering.moe import fp8_prefill
    if not torch.cuda.is_available():
        raise SystemExit("--sweep-grouped times CUDA graphs: it needs a CUDA device")
    dev, fp8 = torch.device("cuda"), torch.float8_e4m3fn

    def w8(*shape):
        w = (torch.randn(*shape, device=dev) * 100).clamp(-448, 448).to(fp8)
        s = torch.rand(*shape[:-2], -(-shape[-2] // 128), -(-shape[-1] // 128),
                       device=dev) * 1e-2 + 1e-3
        return w, s

    def best(fns):
        tm = {}
        for cfg, fn in fns.items():
            try:
                tm[cfg] = quick_time_us(fn)
            except Exception as exc:                           # out of resources etc.
                print(f"    {cfg}: {type(exc).__name__}", flush=True)
        return min(tm, key=tm.get), tm
    for M in (512, 2048, 8192):
        for what, (N, K) in PREFILL_LINEARS.items():
            w, s = w8(N, K)
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            cfg, tm = best({c: (lambda c=c: grouped.prefill_linear(x, w, s, 128, 128, c))
                            for c in GROUPED_SWEEP})
            wd = dequantize(w, s, 128, 128, torch.bfloat16)
            cublas = quick_time_us(lambda: F.linear(x, wd))
            deq = quick_time_us(lambda: F.linear(x, dequantize(w, s, 128, 128, torch.bfloat16)))
            tf = 2 * M * N * K / 1e6
            print(f"  {what:16s} M={M:5d}: best {cfg} {tm[cfg]:8.1f} µs "
                  f"({tf / tm[cfg]:5.0f} TFLOP/s; CONFIG {grouped.CONFIG} "
                  f"{tm.get(grouped.CONFIG, float('nan')):8.1f}), bf16 cuBLAS on the "
                  f"dequantized weight {cublas:8.1f}, with its dequantization {deq:8.1f}",
                  flush=True)
    E, I, H, top = 256, 2048, 7168, 8
    gu, gus = w8(E, 2 * I, H)
    dn, dns = w8(E, H, I)
    for T in (512, 2048):
        x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
        idx = torch.stack([torch.randperm(E, device=dev)[:top] for _ in range(T)])
        wts = torch.rand(T, top, device=dev)
        for kernel in ("gate_up", "down"):
            cfg, tm = best({c: (lambda c=c: fp8_prefill.grouped_experts(
                x, idx, wts, gu, gus, dn, dns, 128, 128, {kernel: c})) for c in GROUPED_SWEEP})
            now = fp8_prefill.CONFIGS[kernel]
            print(f"  experts {kernel:8s} T={T:5d}: best {cfg} {tm[cfg]:8.1f} µs (both "
                  f"kernels; CONFIGS {now} {tm.get(now, float('nan')):8.1f})", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shapes", default="1x4096,32x4096", help="BxS,... (rows x context)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dense-layers", type=int, default=1, help="the first layers, dense")
    ap.add_argument("--experts", type=int, default=256, help="routed experts per MoE layer")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-compile", action="store_true",
                    help="capture the eager step (no Inductor compile: quicker to start)")
    ap.add_argument("--json", default=None, help="append results here as JSON lines")
    ap.add_argument("--sweep", action="store_true",
                    help="time the fp8 GEMM kernel's configs at V3's shapes instead")
    ap.add_argument("--prefill", default=None,
                    help="BxS,...: time one eager prefill forward per model instead")
    ap.add_argument("--sweep-grouped", action="store_true",
                    help="time the prefill rows' grouped W8A8 GEMM configs instead")
    args = ap.parse_args()
    if args.sweep:
        return sweep()
    if args.sweep_grouped:
        return sweep_grouped()

    import mla_ops.hf
    from mla_ops.hf.fp8_models import quantize_fp8
    from mla_ops.hf.models import build_model
    dev = torch.device(args.device)
    if dev.type != "cuda":
        raise SystemExit("the benchmark times CUDA graphs: it needs --device cuda")
    cfg = v3_moe_config(args)
    bf16 = build_model(cfg, dev, torch.bfloat16)
    fp8 = quantize_fp8(bf16)
    models = {}
    for name, m in (("bf16", bf16), ("fp8", fp8)):
        models[name] = mla_ops.hf.convert(m, fuse_experts=True)
    torch.cuda.empty_cache()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; {cfg.num_hidden_layers} "
          f"layers ({args.dense_layers} dense), {cfg.n_routed_experts} experts top "
          f"{cfg.num_experts_per_tok}; {'eager step' if args.no_compile else 'inductor'} in "
          f"a CUDA graph", flush=True)
    if args.prefill:
        return prefill_rows(args, models, cfg, dev)
    room = 2 + 2 + 4 + args.iters * args.rounds + 8
    rows = []
    for shape in args.shapes.split(","):
        B, S = (int(v) for v in shape.split("x"))
        res = {"B": B, "S": S, "layers": cfg.num_hidden_layers, "experts": cfg.n_routed_experts}
        for name, model in models.items():
            torch._dynamo.reset()
            cache = fill_cache(cfg, B, S, room, dev)
            runner = mla_ops.hf.DecodeGraph(model, cache, batch_size=B,
                                            compile=not args.no_compile)
            res[name] = time_steps(runner, B, dev, args.iters, args.rounds)
            res[name + "-floor"] = step_bytes(model, cfg, B, S) / HBM_BYTES_PER_S * 1e3
            del runner, cache
            torch.cuda.empty_cache()
        res["speedup"] = res["bf16"] / res["fp8"]
        res["fp8/floor"] = res["fp8"] / res["fp8-floor"]
        print(f"  B={B} S={S}: bf16 {res['bf16']:.3f} ms (floor {res['bf16-floor']:.3f}), "
              f"fp8 {res['fp8']:.3f} ms (floor {res['fp8-floor']:.3f}): {res['speedup']:.2f}x, "
              f"fp8 at {res['fp8/floor']:.2f}x its floor", flush=True)
        rows.append(res)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(res) + "\n")
    print("\n| B, S | bf16 ms | fp8 ms | fp8 speedup | fp8 floor ms | fp8 / floor |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['B']}, {r['S']} | {r['bf16']:.3f} | {r['fp8']:.3f} | {r['speedup']:.2f}x "
              f"| {r['fp8-floor']:.3f} | {r['fp8/floor']:.2f}x |")


def prefill_rows(args, models, cfg, dev):
    """--prefill: ms of one eager forward per model and shape, fp8 against bf16."""
    print("\n| B, S | bf16 ms | fp8 ms | bf16 / fp8 |\n|---|---|---|---|")
    for shape in args.prefill.split(","):
        B, S = (int(v) for v in shape.split("x"))
        res = {"prefill": True, "B": B, "S": S, "layers": cfg.num_hidden_layers,
               "experts": cfg.n_routed_experts}
        for name, model in models.items():
            res[name] = time_prefill(model, cfg, B, S, dev, args.rounds)
            torch.cuda.empty_cache()
        print(f"| {B}, {S} | {res['bf16']:.2f} | {res['fp8']:.2f} | "
              f"{res['bf16'] / res['fp8']:.2f}x |", flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(res) + "\n")


if __name__ == "__main__":
    main()
