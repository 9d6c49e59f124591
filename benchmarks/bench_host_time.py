"""Host time of one eager decode call: lowering.mla_decode per backend and "auto", and one
decode-only torch.ops.mla.attention_with_output call.

    python benchmarks/bench_host_time.py [--shapes 32x128x4096,1x128x4096] [--json out.json]
    python benchmarks/bench_host_time.py --device cpu --profile    # the Python part, cProfile

Host time per call: the wall time of N back-to-back eager calls, no sync between them,
divided by N. On CUDA a sleep kernel is queued first, long enough to outlast the N
launches, so the GPU never makes the host wait (the "queued" column checks it: the GPU
was still asleep when the host had launched all N calls, so no launch queue filled up).
GPU time per call, for context: the time from the end of the sleep to the end of the
N calls (back-to-back kernels), over N. On CPU there is no queue: the host time is the
whole call (the reference backend, a small shape by default).

Shapes are BxHxS: B requests of one query token, H heads, S cached tokens each, rows of
576 = 512 + 64, pages of 64, bf16 (CUDA) or fp32 (CPU). Runs on the installed package.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time

import torch

import lowering
import mla_ops  # noqa: F401  (registers torch.ops.mla.*)
from lowering.decode.registry import route_unmet

L, R, PAGE, P, V = 512, 64, 64, 128, 128      # DeepSeek-V3 widths
SCALE = 192 ** -0.5


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    shapes = []
    for item in text.split(","):
        parts = item.lower().split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise argparse.ArgumentTypeError(f"a shape is BxHxS of positive ints, got {item!r}")
        shapes.append(tuple(int(p) for p in parts))
    return shapes


def make_decode_inputs(B, H, S, device, dtype, seed=0):
    """q [B, 1, H, 576], kv_cache [B * S / 64, 64, 576], block_table [B, S / 64] int32 (a
    random page order), cache_seqlens [B] int32 = S."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    pages = -(-S // PAGE)
    q = torch.randn(B, 1, H, L + R, generator=g).to(device, dtype)
    kv = torch.randn(B * pages, PAGE, L + R, generator=g).to(device, dtype)
    table = torch.randperm(B * pages, generator=g).int().reshape(B, pages).to(device)
    lens = torch.full((B,), S, dtype=torch.int32, device=device)
    return q, kv, table, lens


def make_op_args(B, H, S, device, dtype, backend, seed=1):
    """The arguments of a decode-only mla::attention_with_output call: B tokens, one per
    request, over the cache of make_decode_inputs."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    _, kv, table, lens = make_decode_inputs(B, H, S, device, dtype, seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device, dtype)
    q = rand(B, H, P + R)
    qsl = torch.arange(B + 1, dtype=torch.int32, device=device)
    out = torch.empty(B, H * V, dtype=dtype, device=device)
    return (q, rand(B, L), rand(B, R), kv, rand(H, P, L, scale=P ** -0.5),
            rand(H, L, V, scale=L ** -0.5), table, lens, qsl, B, SCALE, "auto",
            torch.ones(1, device=device), torch.empty(0, device=device, dtype=dtype), out,
            None, None, 8192, backend)


def time_calls(fn, calls: int, repeats: int, device) -> dict:
    """Median host µs per call over `repeats` runs of `calls` back-to-back calls, and on
    CUDA the GPU µs per call and whether the host never waited on the GPU."""
    for _ in range(3):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    guess_s = (time.perf_counter() - t0) / 5                  # per call, host + GPU
    hosts, gpus, queued = [], [], True
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            # ~2 GHz: a sleep that outlasts the launches of `calls` calls, with room
            torch.cuda._sleep(int(2e9 * (3 * calls * guess_s + 2e-3)))
            start.record()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        if device.type == "cuda":
            queued &= not start.query()       # the GPU still asleep: nothing waited
            end.record()
            torch.cuda.synchronize()
            gpus.append(start.elapsed_time(end) * 1e3 / calls)
        hosts.append((t1 - t0) * 1e6 / calls)
    return dict(host_us=statistics.median(hosts),
                gpu_us=statistics.median(gpus) if gpus else None,
                queued=queued if device.type == "cuda" else None)


def backends_for(q, kv, device) -> list[str]:
    """The mla_decode backends that serve these inputs, then "auto"."""
    names = [n for n in lowering.BACKENDS if route_unmet(n, q, kv) is None]
    if device.type == "cuda" and "reference" in names and len(names) > 1:
        names.remove("reference")                 # a dense torch gather: not a kernel
    return names + ["auto"]


def bench_shape(B, H, S, device, args) -> list[dict]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q, kv, table, lens = make_decode_inputs(B, H, S, device, dtype)
    rows = []

    def add(entry, backend, fn):
        row = dict(entry=entry, backend=backend, B=B, H=H, S=S, device=str(device),
                   **time_calls(fn, args.calls, args.repeats, device))
        rows.append(row)
        print(format_row(row), flush=True)

    for backend in backends_for(q, kv, device):
        add("mla_decode", backend, lambda b=backend: lowering.mla_decode(
            q, kv, table, lens, SCALE, backend=b))
    if lowering.uses_flashmla(device, dtype, H, L + R, PAGE):
        # as a model's step calls it: inputs bounded and the schedule made once per step
        bt, bl = lowering.bound_decode_inputs(kv, table, lens)
        sched = lowering.decode_schedule(kv, bt, bl, num_heads=H, bounded=True)
        add("mla_decode", "auto[bounded+schedule]", lambda: lowering.mla_decode(
            q, kv, bt, bl, SCALE, schedule=sched, bounded=True))
        # what the flashmla route cannot undercut: FlashMLA's extension op called alone
        from lowering.decode.flashmla import dense_decode_kernel
        kernel, kv4 = dense_decode_kernel(), kv.unsqueeze(2)
        add("flash_mla extension op", "alone (the route's floor)", lambda: kernel(
            q, kv4, L, bl, bt, SCALE, True, *sched))
    op_args = make_op_args(B, H, S, device, dtype, "auto")
    add("attention_with_output", "auto",
        lambda: torch.ops.mla.attention_with_output(*op_args))
    if args.profile:
        profile(lambda: lowering.mla_decode(q, kv, table, lens, SCALE), args.calls)
    return rows


def profile(fn, calls: int) -> None:
    """cProfile of `calls` calls: where the host time goes, by function (own time)."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(20)


def format_row(row) -> str:
    gpu = "-" if row["gpu_us"] is None else f"{row['gpu_us']:9.1f}"
    queued = "-" if row["queued"] is None else ("yes" if row["queued"] else "NO")
    return (f"{row['entry']:22s} {row['backend']:24s} {row['B']:4d} {row['H']:4d} "
            f"{row['S']:6d} {row['host_us']:9.1f} {gpu:>9s} {queued:>6s}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cuda (default where present) or cpu")
    ap.add_argument("--shapes", type=parse_shapes, default=None,
                    help="BxHxS,... (default: 32x128x4096,1x128x4096,128x16x4096 on CUDA, "
                         "2x16x128 on CPU)")
    ap.add_argument("--calls", type=int, default=50, help="back-to-back calls per timing")
    ap.add_argument("--repeats", type=int, default=7, help="timings per row (median)")
    ap.add_argument("--profile", action="store_true",
                    help="also print a cProfile of mla_decode(auto) calls per shape")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here (use --device cpu)")
    shapes = args.shapes or ([(32, 128, 4096), (1, 128, 4096), (128, 16, 4096)]
                             if device.type == "cuda" else [(2, 16, 128)])
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{name}  torch {torch.__version__}  {args.calls} calls x {args.repeats} repeats")
    print(f"{'entry':22s} {'backend':24s} {'B':>4s} {'H':>4s} {'S':>6s} {'host µs':>9s} "
          f"{'GPU µs':>9s} {'queued':>6s}")
    rows = []
    for B, H, S in shapes:
        rows += bench_shape(B, H, S, device, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=name, torch=torch.__version__, calls=args.calls,
                           repeats=args.repeats, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
