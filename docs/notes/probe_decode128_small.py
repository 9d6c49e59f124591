"""128-head bf16 decode at small batches (H200 probe, not maintained): FlashMLA (its
kernels with the schedule computed outside the call, and with it inside), the Gluon
pair kernel at its default split count and at 4, 8 and 32 (each size compiles a kernel:
allow a few minutes), and the Triton kernel with its value columns in 1, 2 or 4 programs
(V_PARTS: fewer key splits fill the GPU, so fewer fp32 partials to write and merge) at
two split lengths; µs from the first kernel's start
to the last one's end of one call captured in a CUDA graph (profiler, no launch gaps).

    python docs/notes/probe_decode128_small.py [--shapes 1x4096,4x4096] [--splits 4,8,32]
        [--no-triton]
"""
import argparse, sys, torch
sys.path[:0] = ["benchmarks", "docs/notes"]         # run from the repository root
from timing import capture, kernel_time_us
from probe_decode16_rows import inputs
import lowering.decode.flashmla as fm
from lowering.decode.gluon_decode import gluon_decode
from lowering.decode.registry import sm_count
from lowering.decode import triton_decode as td
from lowering.decode.triton_decode import choose_num_splits

L, H, PAGE = 512, 128, 64


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1x4096,4x4096")
    ap.add_argument("--splits", default="4,8,32", help="the Gluon kernel's split counts "
                    "(beside the shipped one)")
    ap.add_argument("--no-triton", action="store_true", help="FlashMLA and Gluon only")
    args = ap.parse_args()
    scale = 192 ** -0.5
    for shape in args.shapes.split(","):
        B, S = (int(v) for v in shape.split("x"))
        q, kv, bt, lens = inputs(B, H, S)
        sched = fm.flashmla_schedule(bt, lens, PAGE, H)
        ref, _ = fm.flashmla_decode(q, kv, bt, lens, scale, True, L, *sched)
        runs = {"flashmla[kernels]": lambda: fm.flashmla_decode(q, kv, bt, lens, scale, True, L,
                                                                *sched),
                "flashmla+sched": lambda: fm.flashmla_decode(q, kv, bt, lens, scale, True, L)}
        auto = choose_num_splits(B, 2, bt.shape[1] * PAGE, sm_count(q.device), min_split_keys=256)
        for n in sorted({*(int(v) for v in args.splits.split(",")), auto}):   # a kernel each
            runs[f"gluon s{n}{'*' if n == auto else ''}"] = (
                lambda n=n: gluon_decode(q, kv, bt, lens, scale, True, n))
        wide = td.CONFIGS[(0, "wide", "gpu")]
        for vp in (() if args.no_triton else (1, 2, 4)):
            for keys in (64, 256):
                cfg = dict(wide, BLOCK_M=64, V_PARTS=vp, min_split_keys=keys)

                def tri(cfg=cfg):
                    td.CONFIGS[(0, "wide", "gpu")] = cfg
                    try:
                        return td.triton_decode(q, kv, bt, lens, None, None, scale, True, L,
                                                0, False, torch.bfloat16)
                    finally:
                        td.CONFIGS[(0, "wide", "gpu")] = wide
                runs[f"triton v{vp} k{keys}"] = tri
        line = []
        for name, fn in runs.items():
            try:
                out, _ = fn()
            except Exception as exc:          # a variant that does not compile (shared memory)
                line.append(f"{name} {type(exc).__name__}")
                continue
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            g = capture(fn, 2)
            us = kernel_time_us(g.replay, reps=20)
            line.append(f"{name} {us:.1f}" + (f" (err {err:.0e})" if err > 1e-2 else ""))
        print(f"B{B} H{H} S{S} µs: " + " | ".join(line), flush=True)
        del q, kv, bt, lens
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
