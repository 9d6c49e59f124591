"""Programmatic dependent launch set on the captured graph instead of at launch (GPU probe,
not maintained). It runs against the library of commit 3ba2a17 (lowering/pdl.py,
mla_ops/hf/pdl_edges.py, DecodeGraph(programmatic=...), the PRE_K kernels), reverted after
it: `git checkout 3ba2a17 -- lowering mla_ops tests` first. NOTES-v2lite-one-row.md has
what it measured ("Programmatic edges set on the captured graph", "The PDL checks run").

torch.compile launches the decode ops' kernels itself and cannot ask for PDL
(NOTES-v2lite-one-row.md). A CUDA graph captured with keep_graph=True can be edited before
it is instantiated: mla_ops.hf.pdl_edges makes the edge into a kernel that waits
(lowering/pdl.py) programmatic, as a stream capture of a launch_pdl=True launch records it.

Part 1, the mechanism: probe_persistent_chain.py's chain of 8 one-row GEMVs (weights
loaded before the wait), as separate launches, with launch_pdl=True, and launched plainly
with the edges set on the graph afterwards. µs a chain, median of 5 replays of 20 chains.

Part 2, the model step: DecodeGraphs (compiled step) of one model, each on its own cache
filled alike, Dynamo reset before each (else a runner reuses the compiled step of the one
before it); their first step's logits and 16 greedy tokens compared with the first
variant's, then ms a step (median of --rounds loops of --iters replays, the runners in
turn). Variants:

    plain   DecodeGraph as by default: lowering.config.pdl off (no preloaded tile, no
            wait instructions)
    off     lowering.config.pdl on (first tiles preloaded, the waits emitted) and
            programmatic=False: the waits do nothing
    on      the same, programmatic=True
    on1     programmatic=True with one BLOCK_K tile preloaded (PRELOAD_ELEMS = 0)
    launch  lowering.config.pdl on, programmatic=False, and Inductor compiles the kernels
            of lowering.pdl.PDL_KERNELS with launch_pdl=True (a patch of its private
            CachingAutotuner._create_compile_meta, in-process compiles, no caches): the
            stream capture itself records their programmatic edges, no graph editing

    python docs/notes/probe_graph_pdl.py [--shapes v2-lite:1:4096,v2-lite:32:4096,v3-moe:1:4096]
        [--variants plain,off,on,on1] [--chain 1024,2048,4096] [--rounds 5] [--iters 50]
        [--diagnose [--moe | --diagnose-shape v2-lite:1:4096]]

Compile caches are off for the whole run (Inductor's FX graph cache and the AOTAutograd
cache). lowering.config.pdl is read inside the triton ops' implementations, where AOT
traces them, and the caches key on the Dynamo graph and the kernels' sources, not on
what those implementations read: with the caches on, a runner compiled with pdl on after
one compiled with it off got the first one's kernels (no waits) from the cache.

--diagnose: a tiny V3 (dense layers), the edges into one kernel kind at a time, each
variant's logits and tokens against programmatic=False, and the edges the capture itself
made programmatic; "launch" is the launch variant above (no edge rewritten). --moe keeps
the tiny model's MoE layer; --diagnose-shape runs it on a real shape (name:B:S).
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from types import SimpleNamespace

import torch

sys.path.insert(0, "benchmarks")                    # run from the repository root
sys.path.insert(0, "docs/notes")
import mla_ops.hf  # noqa: E402
from bench_hf_decode import fill_paged_cache  # noqa: E402
from mla_ops.hf.models import build_model, make_config  # noqa: E402
from mla_ops.hf.pdl_edges import programmatic_edges  # noqa: E402


def _edge_kinds(g):
    """{(from_port, to_port, type): count} over the edges of a kept graph."""
    from mla_ops.hf import pdl_edges
    lib = pdl_edges._driver()
    h = pdl_edges.ctypes.c_void_p(g.raw_cuda_graph())
    kinds = {}
    for node in pdl_edges._nodes(lib, h):
        for e in pdl_edges._dependencies(lib, node)[1]:
            k = (e.from_port, e.to_port, e.type)
            kinds[k] = kinds.get(k, 0) + 1
    return kinds


def chain(sizes, L=8):
    import triton
    from probe_persistent_chain import block_n, gemv_kernel, gemv_pdl_kernel
    from probe_router_configs import replay_us
    dev = torch.device("cuda")
    for N in sizes:
        K, BLOCK_N = N, block_n(N)
        nblk = triton.cdiv(N, BLOCK_N)
        w = (torch.randn(L, N, K, device=dev) / K ** 0.5).to(torch.bfloat16)
        y = torch.empty(L + 1, N, device=dev, dtype=torch.bfloat16)
        y[0] = torch.randn(K, device=dev).to(torch.bfloat16)
        ref = y[0]
        for i in range(L):
            ref = (w[i].float() @ ref.float()).to(torch.bfloat16)

        def run(kind):
            for i in range(L):
                if kind == "launches":
                    gemv_kernel[(nblk,)](y[i], w[i], y[i + 1], N, K=K, BLOCK_N=BLOCK_N,
                                         num_warps=8)
                else:
                    gemv_pdl_kernel[(nblk,)](y[i], w[i], y[i + 1], N, K=K, BLOCK_N=BLOCK_N,
                                             PRELOAD=True, num_warps=8,
                                             launch_pdl=kind == "launch_pdl")
        out = [f"N=K={N}"]
        for kind in ("launches", "launch_pdl", "graph edges"):
            run(kind)                                     # compile
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph(keep_graph=True)
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                with torch.cuda.graph(g, stream=s):
                    for _ in range(20):
                        run(kind)
            n = programmatic_edges(g, lambda name: name == "gemv_pdl_kernel") \
                if kind == "graph edges" else 0
            kinds = _edge_kinds(g)
            g.instantiate()
            y[1:].zero_()
            g.replay()
            torch.cuda.synchronize()
            err = (y[-1].float() - ref.float()).abs().max().item()
            out.append(f"{kind} {replay_us(g, 20):.1f} us (edges {n}, err {err:.2g}, "
                       f"(from_port, to_port, type): count {kinds})")
        print("; ".join(out), flush=True)


@contextlib.contextmanager
def inductor_launch_pdl():
    """Inductor compiles the kernels lowering.pdl names with launch_pdl=True, so Triton's
    launcher sets programmatic stream serialization on their launches (torch has no public
    switch for user kernels; this patches a private method, probe only)."""
    from lowering.pdl import is_pdl_kernel
    from torch._inductor import config as ind_config
    from torch._inductor.runtime import triton_heuristics as th
    orig = th.CachingAutotuner._create_compile_meta
    seen = []

    def create(self, cfg):
        meta = orig(self, cfg)
        name = getattr(self.fn, "__name__", "")
        if is_pdl_kernel(name):
            meta["launch_pdl"] = True
            seen.append(name)
        return meta
    def forget():       # compiled modules of the same source would keep their kernels
        from torch._inductor.codecache import PyCodeCache
        PyCodeCache.cache_clear()
    forget()
    th.CachingAutotuner._create_compile_meta = create
    try:
        with ind_config.patch(compile_threads=1, fx_graph_cache=False,
                              fx_graph_remote_cache=False, autotune_local_cache=False):
            yield seen
    finally:
        th.CachingAutotuner._create_compile_meta = orig
        forget()
        print(f"  launch_pdl compiles: {sorted(set(seen))} ({len(seen)})", flush=True)


def _runner(variant, model, cache, B):
    """A DecodeGraph built (compiled, captured) under the variant's settings."""
    import lowering.config as mla_config
    import lowering.pdl as pdl
    saved = pdl.PRELOAD_ELEMS
    if variant == "on1":
        pdl.PRELOAD_ELEMS = 0
    try:
        launch = inductor_launch_pdl() if variant == "launch" else contextlib.nullcontext()
        with mla_config.patch(pdl=variant != "plain"), launch:
            return mla_ops.hf.DecodeGraph(model, cache, batch_size=B,
                                          programmatic=variant in ("on", "on1"))
    finally:
        pdl.PRELOAD_ELEMS = saved


def time_runners(runners: dict, ids, rounds: int, iters: int) -> dict:
    """{key: ms a step of each of `rounds` loops of `iters` replays}, the runners in turn."""
    times = {k: [] for k in runners}
    for _ in range(rounds):
        for k, r in runners.items():
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(iters):
                r(ids)
            b.record()
            b.synchronize()
            times[k].append(a.elapsed_time(b) / iters)
    return times


def steps(shapes, variants, rounds, iters):
    dev = torch.device("cuda")
    opts = SimpleNamespace(kv_cache_dtype="auto", k_scale=1.0, per_layer_schedule=False)
    torch._dynamo.config.cache_size_limit = 64     # a compile per runner of one model
    for spec in shapes:
        torch._dynamo.reset()
        name, B, S = spec.split(":")
        B, S = int(B), int(S)
        cfg = make_config(name, None)
        cfg._attn_implementation = "sdpa"
        cfg._experts_implementation = "grouped_mm"
        model = build_model(cfg, dev, torch.bfloat16)
        mla_ops.hf.convert(model)
        runners = {}
        for v in variants:
            torch._dynamo.reset()      # else a runner may reuse the last one's compiled step
            torch.manual_seed(1)
            cache = fill_paged_cache(cfg, B, S, rounds * iters * len(variants) + 64, dev,
                                     torch.bfloat16, opts)
            runners[v] = _runner(v, model, cache, B)
        ids = torch.randint(3, cfg.vocab_size, (B, 1), device=dev,
                            generator=torch.Generator(device=dev).manual_seed(2))
        first = {v: r(ids).clone() for v, r in runners.items()}
        toks = {v: r.greedy(ids, 16) for v, r in runners.items()}
        v0 = variants[0]
        checks = "; ".join(
            f"{v} vs {v0}: logits max |diff| "
            f"{(first[v].float() - first[v0].float()).abs().max().item():.3g}, tokens equal "
            f"{bool((toks[v] == toks[v0]).all())}" for v in variants[1:])
        times = time_runners(runners, ids, rounds, iters)
        med = {v: statistics.median(t) for v, t in times.items()}
        print(f"{spec}: edges " + ", ".join(f"{v} {r.programmatic_edges}"
                                             for v, r in runners.items()), flush=True)
        print(f"  {checks}", flush=True)
        for v in variants:
            print(f"  {v:6s} {med[v]:.4f} ms ({med[v0] / med[v]:.3f}x {v0}); rounds "
                  f"{[round(t, 4) for t in times[v]]}", flush=True)
        del runners, model
        torch.cuda.empty_cache()


def diagnose(B=3, S=300, moe=False, name="tiny", only=None):
    """Which kernels' programmatic edges change the step: a tiny V3 (dense layers, bf16),
    DecodeGraph with the edges into one kernel kind at a time; the first step's logits and
    10 greedy tokens against programmatic=False, and the edges each variant changed.
    Every variant but `launch` captures the same compiled step (Dynamo is reset only
    around `launch`, which compiles its own); `only` keeps the named variants ("off"
    always first, the reference)."""
    import lowering.config as mla_config
    import mla_ops.hf.graph as graph_mod
    from lowering.pdl import PDL_KERNELS, is_pdl_kernel
    from mla_ops.hf import pdl_edges
    dev = torch.device("cuda")
    cfg = make_config(name, None)
    if not moe and name == "tiny":
        cfg.first_k_dense_replace = cfg.num_hidden_layers
    cfg._attn_implementation = "sdpa"
    cfg._experts_implementation = "grouped_mm"
    print(f"diagnose: {name} B {B} S {S}, layers {cfg.num_hidden_layers}, dense {cfg.first_k_dense_replace}",
          flush=True)
    model = build_model(cfg, dev, torch.bfloat16)
    mla_ops.hf.convert(model)
    opts = SimpleNamespace(kv_cache_dtype="auto", k_scale=1.0, per_layer_schedule=False)
    ids = torch.randint(3, cfg.vocab_size, (B, 1), device=dev,
                        generator=torch.Generator(device=dev).manual_seed(2))
    variants = {"off": None, "none": lambda name: False, "all": is_pdl_kernel}
    for k in sorted(PDL_KERNELS):      # one kind: its name, or with a variant's suffix
        variants[k] = lambda name, k=k: name.rstrip("_0123456789") == k
    variants["launch"] = lambda name: False                   # last: it compiles its own
    if only:
        variants = {k: v for k, v in variants.items() if k == "off" or k in only}
    ref = None
    orig = graph_mod.programmatic_edges
    torch._dynamo.reset()
    for name, accept in variants.items():
        if name == "launch":       # compiles its own kernels: a fresh Dynamo, last
            torch._dynamo.reset()
        torch.manual_seed(1)
        cache = fill_paged_cache(cfg, B, S, 64, dev, torch.bfloat16, opts)
        torch.cuda.synchronize()
        log, already = [], []

        def rewrite(g, accept=accept, log=log, already=already):
            lib = pdl_edges._driver()
            h = pdl_edges.ctypes.c_void_p(g.raw_cuda_graph())
            for node in pdl_edges._nodes(lib, h):        # edges programmatic as captured
                deps, data = pdl_edges._dependencies(lib, node)
                for d, e in zip(deps, data):
                    if e.type != 0:
                        already.append((pdl_edges._kernel_name(lib, d),
                                        pdl_edges._kernel_name(lib, node), e.from_port))
            return orig(g, accept=accept, log=log)
        graph_mod.programmatic_edges = rewrite
        try:
            launch = inductor_launch_pdl() if name == "launch" else contextlib.nullcontext()
            with mla_config.patch(pdl=True), launch:
                r = mla_ops.hf.DecodeGraph(model, cache, batch_size=B,
                                           programmatic=accept is not None)
        finally:
            graph_mod.programmatic_edges = orig
        out = r(ids).clone()
        toks = r.greedy(ids, 10)
        if ref is None:
            ref = (out, toks)
        d = (out.float() - ref[0].float()).abs().max().item()
        print(f"diagnose {name}: edges {len(log)}, logits max |diff| {d:.3g}, tokens equal "
              f"{bool((toks == ref[1]).all())}; edges {sorted(set(log))}; programmatic as "
              f"captured {sorted(set(already))}", flush=True)
        del r, cache


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="v2-lite:1:4096,v2-lite:32:4096,v3-moe:1:4096")
    ap.add_argument("--variants", default="plain,off,on,on1")
    ap.add_argument("--chain", default="1024,2048,4096")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--diagnose", action="store_true")
    ap.add_argument("--moe", action="store_true", help="--diagnose with the MoE layers kept")
    ap.add_argument("--diagnose-shape", default="", help="name:B:S instead of the tiny model")
    ap.add_argument("--diagnose-variants", default="",
                    help="comma list of diagnose variants (off always runs); default all")
    args = ap.parse_args()
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    functorch_config.enable_autograd_cache = False     # see the docstring: the caches do
    inductor_config.fx_graph_cache = False             # not key on lowering.config.pdl
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    import traceback
    if args.diagnose:
        only = set(args.diagnose_variants.split(",")) if args.diagnose_variants else None
        try:
            if args.diagnose_shape:
                n, b, t = args.diagnose_shape.split(":")
                diagnose(int(b), int(t), name=n, only=only)
            else:
                diagnose(moe=args.moe, only=only)
        except Exception:
            traceback.print_exc()
    if args.chain:
        try:
            chain([int(n) for n in args.chain.split(",")])
        except Exception:
            traceback.print_exc()
    for shape in args.shapes.split(",") if args.shapes else []:
        try:
            steps([shape], args.variants.split(","), args.rounds, args.iters)
        except Exception:
            traceback.print_exc()


if __name__ == "__main__":
    main()
