"""The few-rows Gluon kernel over a bf16 cache at 16 heads (H200 probe, not maintained):
the attention alone against FlashMLA (scheduler in the call, and its kernels alone) and
the Triton kernel, µs of one CUDA-graph replay (benchmarks/timing.py) and GB/s of cache
read; then whole V2-Lite DecodeGraph steps with the bf16 decode route forced to each of
FlashMLA, Gluon and Triton (step µs from events over 100 replays; ROUNDS alternating).

    python docs/notes/probe_decode16_rows.py [--steps v2-lite:32:1024,v2-lite:1:4096] [--rounds 2]
    python docs/notes/probe_decode16_rows.py --sweep       # split counts of the Gluon kernel
    python docs/notes/probe_decode16_rows.py --few 1x1024,1x4096,2x4096   # one request's rule
"""
import argparse, sys, torch
sys.path[:0] = ["benchmarks", "docs/notes"]         # run from the repository root
from timing import graph_time_us
import lowering.decode.triton_decode as td
from lowering.decode import registry

L, R, PAGE = 512, 64, 64
SHAPES = [(1, 4096), (8, 4096), (32, 1024), (32, 4096), (64, 8192), (128, 4096), (256, 1024)]


def inputs(B, H, S, s_q=1):
    g = torch.Generator(device="cuda").manual_seed(0)
    blocks = B * S // PAGE
    kv = torch.randn(blocks, PAGE, L + R, device="cuda", dtype=torch.bfloat16, generator=g)
    q = torch.randn(B, s_q, H, L + R, device="cuda", dtype=torch.bfloat16, generator=g)
    bt = torch.randperm(blocks, device="cuda", generator=g).int().reshape(B, S // PAGE)
    lens = torch.full((B,), S, dtype=torch.int32, device="cuda")
    return q, kv, bt, lens


def attention(H=16, s_q=1):
    import lowering.decode.flashmla as fm
    from lowering.decode.gluon_decode import gluon_decode_op
    scale = 192 ** -0.5
    for B, S in SHAPES:
        q, kv, bt, lens = inputs(B, H, S, s_q)
        gb = B * S * (L + R) * 2 / 1e3
        ref, _ = td.triton_decode_op(q, kv, bt, lens, None, None, scale, True, L, 0, False,
                                     torch.bfloat16)
        sched = fm.flashmla_schedule(bt, lens, PAGE, H)
        runs = {
            "gluon": lambda: gluon_decode_op(q, kv, bt, lens, scale, True),
            "flashmla": lambda: fm.flashmla_decode_op(q, kv, bt, lens, scale, True, L),
            "flashmla[kernels]": lambda: fm.flashmla_decode_op(q, kv, bt, lens, scale, True, L,
                                                               *sched),
            "triton": lambda: td.triton_decode_op(q, kv, bt, lens, None, None, scale, True, L,
                                                  0, False, torch.bfloat16),
        }
        line = []
        for name, fn in runs.items():
            out, _ = fn()
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            us = graph_time_us(fn)
            line.append(f"{name} {us:6.1f} µs ({gb / us:4.0f} GB/s, err {err:.0e})")
        print(f"H{H} s_q{s_q} B{B} S{S}: " + " | ".join(line), flush=True)
        del q, kv, bt, lens
        torch.cuda.empty_cache()


def sweep_splits(H=16):
    """The Gluon kernel at fixed split counts: µs from its first kernel's start to the
    merge's end in a CUDA-graph replay (profiler; no launch gaps), each after an L2 flush."""
    from timing import capture, kernel_time_us
    from lowering.decode.gluon_decode import gluon_decode_op
    from lowering.decode.registry import sm_count
    from lowering.decode.triton_decode import choose_num_splits
    scale = 192 ** -0.5
    for B, S in [(1, 4096), (1, 1024), (4, 4096), (32, 1024), (32, 1280), (8, 4096),
                 (32, 4096), (256, 1024), (128, 4096)]:
        q, kv, bt, lens = inputs(B, H, S)
        auto = choose_num_splits(B, 1, S, sm_count(q.device), min_split_keys=256)
        line = []
        # one request: past MIN_SPLIT_KEYS' 16 splits of 4096 keys, down to a tile a split
        more = (24, 32, 48, 64) if B * S <= 4 * 4096 else ()
        for n in sorted({1, 2, 3, 4, 5, 6, 8, 12, 16, auto, *more}):
            if n * 64 > S:
                continue
            g = capture(lambda: gluon_decode_op(q, kv, bt, lens, scale, True, n), 2)
            us = kernel_time_us(g.replay, reps=20)
            line.append(f"{n}{'*' if n == auto else ''}: {us:.1f}")
        print(f"splits B{B} S{S} (µs): " + ", ".join(line), flush=True)
        del q, kv, bt, lens
        torch.cuda.empty_cache()


def sweep_few_requests(shapes, H=16):
    """The few-rows kernel over a bf16 and an fp8 cache at one and two requests: the split
    counts of MIN_SPLIT_KEYS' rule (old) and of rows_splits (new, starred) beside others,
    µs from its first kernel's start to the merge's end in a CUDA-graph replay (profiler),
    each after an L2 flush."""
    from timing import capture, kernel_time_us
    from lowering.decode.gluon_decode import (MIN_SPLIT_KEYS, gluon_decode_fp8_cache_op,
                                              gluon_decode_op, rows_splits)
    from lowering.decode.registry import sm_count
    scale = 192 ** -0.5
    for B, S in shapes:
        q, kv, bt, lens = inputs(B, H, S)
        k_scale = torch.full((1,), 0.05, device="cuda")
        kv8 = (kv.float() / 0.05).clamp(-448, 448).to(torch.float8_e4m3fn)
        sms = sm_count(q.device)
        old = td.choose_num_splits(B, 1, S, sms, min_split_keys=MIN_SPLIT_KEYS)
        new = rows_splits(B, S, sms)
        for kind in ("bf16", "fp8"):
            line = []
            for n in sorted({old, new, 8, 16, 32, 48, 64}):
                if n * 64 > S or n > td.MAX_SPLITS:
                    continue
                if kind == "bf16":
                    fn = lambda n=n: gluon_decode_op(q, kv, bt, lens, scale, True, n)
                else:
                    fn = lambda n=n: gluon_decode_fp8_cache_op(q, kv8, bt, lens, k_scale, scale,
                                                               True, n)
                us = kernel_time_us(capture(fn, 2).replay, reps=20)
                tag = ("*" if n == new else "") + ("(old)" if n == old else "")
                line.append(f"{n}{tag}: {us:.1f}")
            print(f"{kind} B{B} S{S} (µs): " + ", ".join(line), flush=True)
        del q, kv, kv8, bt, lens
        torch.cuda.empty_cache()


def step_us(shape, B, S, only):
    """A DecodeGraph step's µs with the bf16 decode route `only` (and the reference)."""
    from probe_step_kernels import replay_us
    saved = dict(registry.TABLE["bf16"])
    registry.TABLE["bf16"].clear()
    registry.TABLE["bf16"].update({only: saved[only], "reference": saved["reference"]})
    registry._chosen.clear()
    try:
        return replay_us(shape, B, S)
    finally:
        registry.TABLE["bf16"].clear()
        registry.TABLE["bf16"].update(saved)
        registry._chosen.clear()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", default="v2-lite:32:1024,v2-lite:1:4096")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--skip-attention", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="the Gluon kernel's split counts only")
    ap.add_argument("--few", default="", help="BxS,...: the split counts at a few requests, "
                    "bf16 and fp8 caches, the old rule against rows_splits")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    if args.sweep:
        sweep_splits()
        return
    if args.few:
        sweep_few_requests([tuple(int(v) for v in x.split("x")) for x in args.few.split(",")])
        return
    if not args.skip_attention:
        attention()
        attention(s_q=2)
    for item in filter(None, args.steps.split(",")):
        shape, B, S = item.split(":")
        B, S = int(B), int(S)
        res = {"flashmla": [], "gluon": [], "triton": []}
        for _ in range(args.rounds):
            for k in res:
                res[k].append(step_us(shape, B, S, k))
        print(f"{shape} {B}x{S}: " + ", ".join(
            f"{k} {min(v):.1f} µs (runs {', '.join(f'{x:.1f}' for x in v)})" for k, v in res.items()),
            flush=True)


if __name__ == "__main__":     # probe_decode128_small.py imports inputs()
    main()
