"""One decode step of a DeepSeek-V3-shaped model at tensor parallel 2 against one GPU.

Run on a machine with two GPUs (NCCL; NVLink multicast off: NCCL_NVLS_ENABLE=0 is set
here unless the environment sets it):

    torchrun --nproc-per-node 2 benchmarks/bench_tensor_parallel.py
    torchrun --nproc-per-node 2 benchmarks/bench_tensor_parallel.py --modes ours-tp1,ours-tp2 \\
        --shapes 32x4096 --experts 64
    torchrun --nproc-per-node 2 benchmarks/bench_tensor_parallel.py --config tiny \\
        --shapes 2x64 --iters 3 --modes ours-tp1,ours-tp2     # CPU, gloo: the script's check

Model: DeepseekV3ForCausalLM with V3's attention (128 heads, q_lora 1536, L 512, R 64,
P 128, V 128) and hidden size 7168, one dense layer (intermediate 18432) and one MoE
layer (--experts routed experts of 2048, top 8 in 4 of 8 groups, one shared expert),
vocab 2048, bf16, random weights (the same on every rank). The caches hold S random
rows per request (no prefill). Modes, each timed per step (median of CUDA events over
--iters steps, after --warmup):

  ours-tp1  rank 0 alone: mla_ops.hf.convert(model) + PagedMLACache, the whole decode
            step compiled by Inductor and replayed as one CUDA graph (DecodeGraph)
  ours-tp2  both ranks: the same model split by mla_ops.hf.shard (64 heads, half of
            every MLP and expert per rank; the functional all-reduces in the graph)
  hf-tp2    transformers' own tp_plan model (from_pretrained(..., tp_plan="auto") of a
            checkpoint of the same weights written to --workdir first), eager, on a
            StaticCache; transformers' DeepSeek-V3 plan splits the MLPs and experts
            and leaves the attention whole on every rank

Reported: ms per layer = step time / layers (the slower rank's); ours-tp2's logits
against ours-tp1's on the same cache rows (a check that the split computes the same).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch


def make_moe_config(name: str, layers: int, experts: int):
    """V3's attention and layer shapes ("tiny": CPU-sized): layer 0 dense, the others MoE
    (V3's routing)."""
    from mla_ops.hf.models import make_config
    cfg = make_config(name, layers)
    if name == "tiny":
        cfg._attn_implementation = "sdpa"
        return cfg
    cfg.first_k_dense_replace = 1
    cfg.n_routed_experts, cfg.num_experts_per_tok = experts, min(8, experts)
    cfg.n_group = 8 if experts % 8 == 0 and experts >= 32 else 1
    cfg.topk_group = 4 if cfg.n_group == 8 else 1
    cfg.n_shared_experts, cfg.moe_intermediate_size = 1, 2048
    cfg.routed_scaling_factor = 2.5
    cfg._attn_implementation = "sdpa"
    return cfg


def event_time(fn, iters: int, warmup: int, dev) -> float:
    """Median seconds of fn() by CUDA events (the host clock on CPU), each step waited for."""
    for _ in range(warmup):
        fn()
    if dev.type != "cuda":
        times = []
        for _ in range(iters):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return statistics.median(times)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def slowest(sec: float, dev, group=None) -> float:
    """The largest of the ranks' times (every rank of group calls it)."""
    import torch.distributed as dist
    t = torch.tensor([sec], device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.item()


def ours_step(model, cfg, B, S, extra, dtype, num_heads, dev):
    """(step function, first logits [B, vocab]) of a DecodeGraph on a paged cache of B rows
    of S random tokens (the same rows on every rank: seeded)."""
    import mla_ops.hf
    torch._dynamo.reset()
    torch.manual_seed(1)
    cache = mla_ops.hf.PagedMLACache(cfg, max_batch_size=B, max_cache_len=S + extra,
                                     block_size=64, device=dev, dtype=dtype,
                                     num_heads=num_heads)
    for kv in cache.pool.kv:
        kv.normal_()
    cache.occupy([S] * B)
    runner = mla_ops.hf.DecodeGraph(model, cache, batch_size=B,
                                    backend="inductor" if dev.type == "cuda" else "aot_eager")
    ids = torch.randint(3, cfg.vocab_size, (B, 1), generator=torch.Generator().manual_seed(2))
    ids = ids.to(dev)
    first = runner(ids).float().reshape(B, -1).clone()
    return (lambda: runner(ids)), first


def hf_step(model, cfg, B, S, extra, dtype, dev):
    from bench_hf_decode import fill_static_cache      # (a sibling script of this folder)
    from mla_ops.hf import cache_kwargs
    cache = fill_static_cache(cfg, B, S, extra, dev, dtype)
    ids = torch.randint(3, cfg.vocab_size, (B, 1), generator=torch.Generator().manual_seed(2))
    ids, pos = ids.to(dev), torch.full((B, 1), S, device=dev, dtype=torch.long)

    def step():
        with torch.no_grad():
            return model(input_ids=ids, position_ids=pos, **cache_kwargs(model, cache),
                         logits_to_keep=1).logits
    return step


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="1x4096,32x4096", help="BxS, comma-separated")
    ap.add_argument("--modes", default="ours-tp1,ours-tp2,hf-tp2")
    ap.add_argument("--config", choices=["v3-shaped", "tiny"], default="v3-shaped",
                    help="tiny: CPU-sized (4 heads, hidden 256, 8 experts), runs on CPU "
                         "with gloo where there is no GPU")
    ap.add_argument("--layers", type=int, default=2, help="layer 0 dense, the rest MoE")
    ap.add_argument("--experts", type=int, default=256, help="routed experts (V3: 256)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--workdir", default=None,
                    help="hf-tp2's checkpoint goes here (default: a temporary directory)")
    args = ap.parse_args()

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    import torch.distributed as dist
    import mla_ops.hf
    from mla_ops.hf.models import build_model
    if "LOCAL_RANK" not in os.environ:
        raise SystemExit("run under torchrun: "
                         "torchrun --nproc-per-node 2 benchmarks/bench_tensor_parallel.py")
    rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        dev = torch.device("cuda", rank)
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", device_id=dev)
    elif args.config == "tiny":
        dev = torch.device("cpu")
        dist.init_process_group("gloo")
    else:
        raise SystemExit("the v3-shaped model needs GPUs (--config tiny runs on CPU)")
    world = dist.get_world_size()
    solo = dist.new_group([0])
    modes = args.modes.split(",")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    cfg = make_moe_config(args.config, args.layers, args.experts)
    nl, extra = cfg.num_hidden_layers, 3 * (args.warmup + args.iters) + 16
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"torch {torch.__version__}, transformers {__import__('transformers').__version__}, "
        f"{world} x {torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}; "
        f"{args.config}, {nl} layers (1 dense), "
        f"{cfg.n_routed_experts} experts", flush=True)
    results = {}

    t0 = time.perf_counter()
    model = build_model(cfg, dev, dtype, seed=0)          # the same weights on every rank
    mla_ops.hf.convert(model, fuse_experts=True)
    say(f"model built and converted in {time.perf_counter() - t0:.0f} s", flush=True)
    first1 = {}
    if "ours-tp1" in modes:
        if rank == 0:
            for B, S in shapes:
                step, first1[B, S] = ours_step(model, cfg, B, S, extra, dtype, None, dev)
                sec = slowest(event_time(step, args.iters, args.warmup, dev), dev, solo)
                results["ours-tp1", B, S] = sec * 1e3 / nl
                print(f"  B={B} S={S} ours-tp1: {sec * 1e3 / nl:.3f} ms/layer", flush=True)
        dist.barrier()
    if "ours-tp2" in modes:
        mla_ops.hf.shard(model, dist.group.WORLD)
        heads = cfg.num_attention_heads // world
        for B, S in shapes:
            step, first = ours_step(model, cfg, B, S, extra, dtype, heads, dev)
            sec = slowest(event_time(step, args.iters, args.warmup, dev), dev)
            results["ours-tp2", B, S] = sec * 1e3 / nl
            err = ((first - first1[B, S]).abs().max().item() / first1[B, S].abs().max().item()
                   if (B, S) in first1 else float("nan"))
            say(f"  B={B} S={S} ours-tp2: {sec * 1e3 / nl:.3f} ms/layer (logits vs ours-tp1: "
                f"max rel diff {err:.2e})", flush=True)
    del model
    torch._dynamo.reset()
    if dev.type == "cuda":
        torch.cuda.empty_cache()

    if "hf-tp2" in modes:
        from transformers import AutoModelForCausalLM
        work = [args.workdir or (tempfile.mkdtemp(prefix="bench_tp_") if rank == 0 else None)]
        dist.broadcast_object_list(work, src=0)             # rank 0's directory, everywhere
        work = work[0]
        path = os.path.join(work, "checkpoint")
        if rank == 0:
            t0 = time.perf_counter()
            build_model(cfg, dev, dtype, seed=0).save_pretrained(path)
            print(f"checkpoint written in {time.perf_counter() - t0:.0f} s", flush=True)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        dist.barrier()
        try:
            hf = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=dtype).eval()
            for B, S in shapes:
                sec = slowest(event_time(hf_step(hf, cfg, B, S, extra, dtype, dev), args.iters,
                                         args.warmup, dev), dev)
                results["hf-tp2", B, S] = sec * 1e3 / nl
                say(f"  B={B} S={S} hf-tp2: {sec * 1e3 / nl:.3f} ms/layer", flush=True)
        except Exception as e:             # keep the rows measured so far
            print(f"  rank {rank}: hf-tp2 failed: {type(e).__name__}: {e}"[:600], flush=True)
        finally:
            dist.barrier()
            if rank == 0 and args.workdir is None:
                shutil.rmtree(work, ignore_errors=True)

    say("\n| B, S | " + " | ".join(modes) + " | ours-tp1 / ours-tp2 |")
    say("|---|" + "---|" * (len(modes) + 1))
    for B, S in shapes:
        cells = [f"{results[m, B, S]:.3f}" if (m, B, S) in results else "—" for m in modes]
        a, b = results.get(("ours-tp1", B, S)), results.get(("ours-tp2", B, S))
        say(f"| {B}, {S} | " + " | ".join(cells) + f" | {f'{a / b:.2f}x' if a and b else '—'} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
