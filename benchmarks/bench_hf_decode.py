"""One decode step of a DeepSeek-V3-shaped HF model: HF vs the converted model.

Model: DeepseekV3ForCausalLM with V3's attention (128 heads, q_lora 1536, L 512, R 64,
P 128, V 128), hidden 7168, intermediate 18432, 2 dense layers, vocab 2048 (so the head
is negligible; --vocab 129280 for V3's), bf16, random weights. Each (B, S) times one
decode step with S tokens of context per row:

  hf-eager     HF forward, StaticCache(max_cache_len=S+n), no compile
  hf-compile   torch.compile(model.forward, fullgraph, mode) with the same StaticCache
  ours-compile converted model + PagedMLACache(block 64), same compile settings
  ours-graph   mla_ops.hf.DecodeGraph: the converted model compiled by inductor without
               graph trees, the whole decode step captured once in one CUDA graph and
               replayed (no per-step guards or graph-tree bookkeeping)

--config v2-lite / v3-moe: the released MoE models' shapes (1 dense layer, the rest MoE;
HF's experts "grouped_mm"); benchmarks/bench_generate.py times them with every mode and
their floor. HF's modes run HF's model as built, ours a converted copy (same weights).
Caches are filled with random rows (no prefill is run). Reported: ms per layer = median
step time / num_layers (the step includes embedding, final norm and head).

    python benchmarks/bench_hf_decode.py --device cuda                       # the table
    python benchmarks/bench_hf_decode.py --device cpu --config tiny --shapes 2x64 --iters 3
    python benchmarks/bench_hf_decode.py --device cuda --modes ours-graph \
        --kv-cache-dtype fp8 --k-scale 0.05 --fp8-decode-query 0.05 --ab mla-backend=gluon
    python benchmarks/bench_hf_decode.py --device cuda --modes ours-graph \
        --ab "config.linear_impl=torch;convert.fuse_norms=False;cache.schedule_per_step=False"

A/B variants (--ab) go through the public surface only: lowering.config settings,
convert() and PagedMLACache arguments, and the layers' decode backend.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch

import mla_ops.hf
from mla_ops.hf import cache_kwargs
from mla_ops.hf.models import build_model, make_config


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def fill_static_cache(cfg, B, S, extra, dev, dtype):
    from transformers import StaticCache
    cache = StaticCache(config=cfg, max_cache_len=S + extra)
    L, R = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    for layer in cache.layers:   # keys [B, 1, max, L], values [B, 1, max, R] (HF's MLA layout)
        layer.lazy_initialization(torch.empty(B, 1, 0, L, device=dev, dtype=dtype),
                                  torch.empty(B, 1, 0, R, device=dev, dtype=dtype))
        layer.keys.normal_()
        layer.values.normal_()
        layer.cumulative_length.fill_(S)
    return cache


def fill_paged_cache(cfg, B, S, extra, dev, dtype, args, **cache_args):
    """A PagedMLACache of B rows holding S random tokens each (cache_args: PagedMLACache
    arguments over the command line's)."""
    kw = dict(block_size=64, kv_cache_dtype=args.kv_cache_dtype, k_scale=args.k_scale,
              schedule_per_step=not args.per_layer_schedule)
    kw.update(cache_args)
    cache = mla_ops.hf.PagedMLACache(cfg, max_batch_size=B, max_cache_len=S + extra,
                                     device=dev, dtype=dtype, **kw)
    for kv in cache.pool.kv:     # random rows (an fp8 cache: N(0, 1) / k_scale, rounded)
        kv.copy_(torch.randn(kv.shape, device=dev).div_(kw["k_scale"]).to(kv.dtype))
    cache.occupy([S] * B)
    return cache


def time_steps(step, dev, warmup, iters, mark):
    """Median seconds of step() after warmup calls."""
    for _ in range(warmup):
        if mark:
            torch.compiler.cudagraph_mark_step_begin()
        step()
    sync(dev)
    times = []
    for _ in range(iters):
        if mark:
            torch.compiler.cudagraph_mark_step_begin()
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            step()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def time_greedy(runner, ids, dev, steps):
    """Seconds per step of runner.greedy(ids, steps): a generation loop's steps, each fed
    the last one's tokens on the device and launched without waiting for it, so the
    graph's launch latency overlaps the previous step (time_steps waits after every step
    and so includes it)."""
    runner.greedy(ids, 2)
    sync(dev)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    runner.greedy(ids, steps)
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / 1e3 / steps


def host_time(step, dev, mark, n=20):
    """Host seconds per step() call when the GPU never makes the host wait."""
    sync(dev)
    t = time.perf_counter()
    for _ in range(n):
        if mark:
            torch.compiler.cudagraph_mark_step_begin()
        step()
    host = (time.perf_counter() - t) / n
    sync(dev)
    return host


def _literal(value: str):
    """VALUE as a Python literal (True, 32, 0.05, 'x'), else as the string itself."""
    import ast
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return value


def _variant(spec):
    """One --ab variant: '&'-joined settings made together, each one of
        mla-backend=NAME      every converted layer's decode backend
        config.NAME=VALUE     a lowering.config setting (e.g. config.linear_impl=torch)
        convert.ARG=VALUE     a convert() argument (e.g. convert.fuse_norms=False): the
                              variant converts a model of its own (same weights)
        cache.ARG=VALUE       a PagedMLACache argument (e.g. cache.schedule_per_step=False)
    -> {"backend": NAME or None, "config": {...}, "convert": {...}, "cache": {...}}"""
    import lowering.config as mla_config
    out = {"backend": None, "config": {}, "convert": {}, "cache": {}}
    for part in spec.split("&"):
        target, sep, value = part.partition("=")
        kind, _, name = target.partition(".")
        if not sep or (target != "mla-backend" and (kind not in out or kind == "backend"
                                                    or not name)):
            raise SystemExit(f"--ab: {part!r} is not mla-backend=NAME, config.NAME=VALUE, "
                             f"convert.ARG=VALUE or cache.ARG=VALUE")
        if target == "mla-backend":
            out["backend"] = value
        elif kind == "config":
            if name not in mla_config.current():
                raise SystemExit(f"--ab: lowering.config has no setting {name!r}; settings: "
                                 f"{sorted(mla_config.current())}")
            out["config"][name] = _literal(value)
        else:
            out[kind][name] = _literal(value)
    return out


def ab_compare(args, runner_a, model, cfg, B, S, extra, dev, dtype, backend, nl):
    """--ab: one more DecodeGraph per ';'-separated variant, each compiled (dynamo reset
    first, so nothing compiled earlier is reused) and captured with that variant's
    settings in force (and timed with its lowering.config settings in force), all timed
    against runner_a in rounds of greedy loops (args.iters steps each), each round
    starting with the next variant. A variant equal to the default measures the
    harness's own spread."""
    import lowering.config as mla_config
    runners = [("as is", runner_a, {})]
    for spec in args.ab.split(";"):
        v = _variant(spec)
        m = model
        if v["convert"]:
            m = build_model(cfg, dev, dtype)
            mla_ops.hf.convert(m, **{"backend": args.mla_backend,
                                     "fp8_decode_query": args.fp8_decode_query, **v["convert"]})
        layers = [mod.mla_attn for mod in m.modules() if hasattr(mod, "mla_attn")]
        old = [a.backend for a in layers]
        if v["backend"] is not None:
            for a in layers:
                a.backend = v["backend"]
        try:
            with mla_config.patch(**v["config"]):
                cache_b = fill_paged_cache(cfg, B, S, extra, dev, dtype, args, **v["cache"])
                torch._dynamo.reset()
                runners.append((spec, mla_ops.hf.DecodeGraph(m, cache_b, batch_size=B,
                                                             backend=backend,
                                                             mode=args.graph_compile_mode),
                                v["config"]))
        finally:
            for a, b in zip(layers, old):
                a.backend = b
    ids = torch.zeros(B, 1, dtype=torch.long, device=dev)
    times = {name: [] for name, _, _ in runners}
    for i in range(args.ab_rounds):          # each round starts with the next variant
        for name, r, settings in runners[i % len(runners):] + runners[:i % len(runners)]:
            with mla_config.patch(**settings):
                times[name].append(time_greedy(r, ids, dev, args.iters))
    ms = {k: statistics.median(v) * 1e3 / nl for k, v in times.items()}
    a = ms["as is"]
    print(f"  A/B B={B} S={S} ({args.ab_rounds} alternating rounds of {args.iters}-step "
          f"greedy loops), ms/layer: as is {a:.3f}", flush=True)
    for spec, _, _ in runners[1:]:
        print(f"    with {spec}: {ms[spec]:.3f} ({ms[spec] / a:.3f}x)", flush=True)
    return {"ab": args.ab, "ab-ms": ms}


def profile_step(step, mark, title, steps=3, top=12, timeline=False):
    """Top GPU kernels over `steps` steps, per step."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            if mark:
                torch.compiler.cudagraph_mark_step_begin()
            step()
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    rows.sort(key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in rows) / steps
    launches = sum(e.count for e in rows) / steps
    print(f"  profile {title}: {total / 1e3:.3f} ms of GPU kernels per step "
          f"({launches:.0f} kernels)", flush=True)
    for e in rows[:top]:
        print(f"    {e.self_device_time_total / steps / 1e3:8.3f} ms  x{e.count // steps:<3d} {e.key[:90]}",
              flush=True)
    if timeline:
        print_timeline(prof, steps)


def print_timeline(prof, steps):
    """The last step's GPU kernels in launch order: start gap, duration (µs), name."""
    from torch.autograd import DeviceType
    ev = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA),
                key=lambda e: e.time_range.start)
    per = len(ev) // steps
    last, prev_end = ev[-per:], None
    print(f"  timeline of one step ({per} kernels): gap before / duration µs", flush=True)
    for e in last:
        gap = 0.0 if prev_end is None else e.time_range.start - prev_end
        prev_end = e.time_range.end
        print(f"    {gap:6.1f} {e.time_range.end - e.time_range.start:7.1f}  {e.name[:100]}",
              flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--config", choices=["v3-shaped", "tiny", "v2-lite", "v3-moe"],
                    default="v3-shaped",
                    help="v2-lite / v3-moe: the released MoE models' shapes (first layer "
                         "dense, the rest MoE; mla_ops.hf.models.MOE_SHAPES)")
    ap.add_argument("--layers", type=int, default=None,
                    help="default: 2 (v2-lite: 4)")
    ap.add_argument("--shapes", default="1x4096,32x4096,32x1024")
    ap.add_argument("--modes", default="ours-compile,hf-eager,hf-compile")
    ap.add_argument("--compile-mode", default=None,
                    help="torch.compile mode (default: reduce-overhead on CUDA, i.e. CUDA graphs)")
    ap.add_argument("--backend", default=None, help="default: inductor on CUDA, aot_eager on CPU")
    ap.add_argument("--graph-compile-mode", default=None,
                    help="torch.compile mode inside ours-graph (e.g. max-autotune-no-cudagraphs)")
    ap.add_argument("--mla-backend", default="auto", help="decode kernel: auto | reference | ...")
    ap.add_argument("--per-layer-schedule", action="store_true",
                    help="ours: PagedMLACache(schedule_per_step=False): every layer's "
                         "FlashMLA call computes its own scheduler metadata (the default "
                         "computes it once per step in the plan)")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                    help="ours: the paged cache's storage (fp8: e4m3 with --k-scale)")
    ap.add_argument("--k-scale", type=float, default=1.0, help="ours: the fp8 cache's scale")
    ap.add_argument("--fp8-decode-query", type=float, default=None, metavar="Q_SCALE",
                    help="ours: convert(fp8_decode_query=Q_SCALE): fp8 x fp8 decode "
                         "(needs --kv-cache-dtype fp8)")
    ap.add_argument("--vocab", type=int, default=None,
                    help="vocabulary size (default: the config's; 129280 is DeepSeek-V3's, "
                         "whose output head then weighs more than a layer)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", default=None, help="append results here as JSON lines")
    ap.add_argument("--top", type=int, default=12, help="kernels listed by --profile")
    ap.add_argument("--profile", action="store_true",
                    help="print the top GPU kernels of one compiled step per mode")
    ap.add_argument("--ab", default=None, metavar="SETTING=VALUE[&...][;...]",
                    help="ours-graph: also capture one more DecodeGraph per ';'-separated "
                         "variant ('&' joins settings made together), each setting one of "
                         "mla-backend=NAME (every layer's decode backend), "
                         "config.NAME=VALUE (a lowering.config setting, e.g. "
                         "config.linear_impl=torch, config.head_gemm_impl=torch), "
                         "convert.ARG=VALUE (a convert() argument, e.g. "
                         "convert.fuse_norms=False, convert.decode_head=False), "
                         "cache.ARG=VALUE (a PagedMLACache argument, e.g. "
                         "cache.schedule_per_step=False), and time them alternately in one "
                         "process (runs of the same code differ by up to 7%% between "
                         "processes)")
    ap.add_argument("--ab-rounds", type=int, default=10)
    ap.add_argument("--timeline", action="store_true",
                    help="with --profile: also list one step's kernels in launch order")
    args = ap.parse_args()

    import lowering
    for spec in args.ab.split(";") if args.ab else ():
        _variant(spec)                       # refuse a bad --ab before building anything
    dev = torch.device(args.device)
    dtype = torch.bfloat16
    on_cuda = dev.type == "cuda"
    backend = args.backend or ("inductor" if on_cuda else "aot_eager")
    cmode = args.compile_mode or ("reduce-overhead" if on_cuda and backend == "inductor" else None)
    mark = cmode == "reduce-overhead"
    cfg = make_config(args.config, args.layers)
    if args.vocab:
        cfg.vocab_size = args.vocab
    cfg._attn_implementation = "sdpa"
    cfg._experts_implementation = "grouped_mm"
    if args.fp8_decode_query is not None and args.kv_cache_dtype != "fp8":
        ap.error("--fp8-decode-query needs --kv-cache-dtype fp8")
    modes = args.modes.split(",")
    # HF's modes run HF's model as built; ours a converted copy of it (same weights)
    hf_model = build_model(cfg, dev, dtype)
    model = copy.deepcopy(hf_model) if any(m.startswith("hf") for m in modes) else hf_model
    mla_ops.hf.convert(model, backend=args.mla_backend, fp8_decode_query=args.fp8_decode_query)
    nl = cfg.num_hidden_layers
    extra = 3 * (args.warmup + args.iters) + 80      # every timed, warm-up or host-timed step adds a token
    if args.ab:
        extra += args.ab_rounds * (args.iters + 2) * (1 + args.ab.count(";"))
    print(f"torch {torch.__version__}, transformers {__import__('transformers').__version__}, "
          f"{torch.cuda.get_device_name() if on_cuda else 'cpu'}; compile backend {backend}, "
          f"mode {cmode}; mla backend {args.mla_backend}", flush=True)
    rows = []
    for shape in args.shapes.split(","):
        B, S = (int(x) for x in shape.split("x"))
        res = {"B": B, "S": S, "layers": nl, "mla_backend": args.mla_backend,
               "kv_cache_dtype": args.kv_cache_dtype, "fp8_decode_query": args.fp8_decode_query}
        for mode in modes:
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            ids = torch.randint(3, cfg.vocab_size, (B, 1), device=dev)
            pos = torch.full((B, 1), S, device=dev, dtype=torch.long)
            if mode.startswith("ours"):
                cache = fill_paged_cache(cfg, B, S, extra, dev, dtype, args)
            else:
                cache = fill_static_cache(cfg, B, S, extra, dev, dtype)
            fwd = (model if mode.startswith("ours") else hf_model).forward
            ckw = cache_kwargs(model if mode.startswith("ours") else hf_model, cache)
            graph = mode.endswith("graph")      # DecodeGraph compiles; the first step is eager
            if graph and not on_cuda:
                print(f"  {mode} needs CUDA; skipped", flush=True)
                continue
            if mode.endswith("compile"):
                fwd = torch.compile(fwd, fullgraph=True, dynamic=False,
                                    backend=backend, mode=cmode)
            lowering.backend_choices.clear()

            def step():
                with torch.no_grad():
                    return fwd(input_ids=ids, position_ids=pos, **ckw,
                               logits_to_keep=1).logits
            run = step

            t0 = time.perf_counter()
            try:
                try:
                    step()
                except Exception as e:
                    if not mode.startswith("ours") or args.mla_backend == "reference":
                        raise
                    print(f"  {mode} with mla backend {args.mla_backend!r} failed "
                          f"({type(e).__name__}: {e}"[:400] + "); retrying with 'reference'",
                          flush=True)
                    args.mla_backend = "reference"
                    for m in model.modules():
                        if hasattr(m, "mla_attn"):
                            m.mla_attn.backend = "reference"
                    torch._dynamo.reset()
                    if mode.endswith("compile"):
                        fwd = torch.compile(model.forward, fullgraph=True, dynamic=False,
                                            backend=backend, mode=cmode)
                    step()
                sync(dev)
                if graph:
                    runner = mla_ops.hf.DecodeGraph(model, cache, batch_size=B,
                                                    backend=backend,
                                                    mode=args.graph_compile_mode)

                    def run():
                        return runner(ids)
                first = time.perf_counter() - t0
                mk = mark and mode.endswith("compile")
                sec = time_steps(run, dev, args.warmup, args.iters, mk)
                host = host_time(run, dev, mk)
                loop = time_greedy(runner, ids, dev, args.iters) if graph else None
            except Exception as e:       # keep the other rows of the table
                print(f"  {mode} B={B} S={S} failed: {type(e).__name__}: {e}"[:600], flush=True)
                res[mode] = None
                continue
            res[mode] = sec * 1e3 / nl
            if loop is not None:
                res[mode + "-loop"] = loop * 1e3 / nl
            if args.profile and on_cuda:
                profile_step(run, mark and mode.endswith("compile"), f"{mode} B={B} S={S}",
                             top=args.top, timeline=args.timeline)
            served = dict(lowering.backend_choices) if mode.startswith("ours") else {}
            skips = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
            if mode.endswith("compile") and mark and skips:
                print(f"  {mode}: CUDA graphs skipped ({skips})", flush=True)
            res[mode + "-host"] = host * 1e3 / nl
            if args.ab and graph:
                res.update(ab_compare(args, runner, model, cfg, B, S, extra, dev, dtype, backend, nl))
            print(f"  B={B} S={S} {mode}: {res[mode]:.3f} ms/layer"
                  + (f" (in a greedy loop {res[mode + '-loop']:.3f})" if loop else "")
                  + f", host {host * 1e3:.3f} ms/step (first call {first:.1f} s)"
                  + (f" decode kernel {served}" if served else ""), flush=True)
            del cache
            if on_cuda:
                torch.cuda.empty_cache()
        rows.append(res)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(res) + "\n")

    print("\n| B, S | " + " | ".join(modes) + " | hf-compile / best ours |")
    print("|---|" + "---|" * (len(modes) + 1))
    for r in rows:
        cells = [f"{r[m]:.3f}" if r.get(m) else "—" for m in modes]
        ours = [r[m] for m in modes if m.startswith("ours") and r.get(m)]
        sp = (f"{r['hf-compile'] / min(ours):.1f}x" if r.get("hf-compile") and ours else "—")
        print(f"| {r['B']}, {r['S']} | " + " | ".join(cells) + f" | {sp} |")


if __name__ == "__main__":
    main()
