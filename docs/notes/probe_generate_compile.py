"""Where generate()'s time goes with the step graphs: the eager step's graph (no compile
argument) against the compiled step's (compile_config) and DecodeGraph's own greedy
loop, on the V2-Lite and V3 generate() rows of benchmarks/bench_generate.py (H200 probe,
not maintained).

For the second call of each mode: the wall time, the time inside the step graphs'
capture (GenerateGraphs._capture: warm-up step, capture), inside the served decode steps
(GenerateGraphs.step, host), the GPU time of one replay of the captured step, and the
top host functions of the call (cProfile, by own time).

    python docs/notes/probe_generate_compile.py [--shapes v2-lite,v3-moe] [--profile]
"""
import argparse
import cProfile
import io
import pstats
import sys
import time

import torch

sys.path[:0] = ["benchmarks"]                       # run from the repository root
import bench_generate as BG
import mla_ops.hf
from mla_ops.hf import generate_graph as GG
from mla_ops.hf.models import build_model, make_config


class Spy:
    """Seconds inside GenerateGraphs._capture and .step, and the runners made."""

    def __init__(self):
        self.capture = self.step = 0.0
        self.steps = 0
        self.runners = []
        self._cap, self._step = GG.GenerateGraphs._capture, GG.GenerateGraphs.step
        spy = self

        def capture(graphs, B):
            t = time.perf_counter()
            r = spy._cap(graphs, B)
            torch.cuda.synchronize()
            spy.capture += time.perf_counter() - t
            spy.runners.append(r)
            return r

        def step(graphs, kwargs):
            t = time.perf_counter()
            out = spy._step(graphs, kwargs)
            spy.step += time.perf_counter() - t
            spy.steps += 1
            return out
        GG.GenerateGraphs._capture, GG.GenerateGraphs.step = capture, step

    def undo(self):
        GG.GenerateGraphs._capture, GG.GenerateGraphs.step = self._cap, self._step


def replay_us(runner, n=50):
    g = runner._graph
    start, end = torch.cuda.Event(True), torch.cuda.Event(True)
    g.replay()
    torch.cuda.synchronize()
    start.record()
    for _ in range(n):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="v2-lite,v3-moe")
    ap.add_argument("--profile", action="store_true", help="cProfile the second call")
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for shape in args.shapes.split(","):
        cfg = make_config(shape, None)
        cfg._attn_implementation = "sdpa"
        cfg._experts_implementation = "grouped_mm"
        model = mla_ops.hf.convert(build_model(cfg, dev, torch.bfloat16))
        ids, mask = BG.prompts(cfg, 8, 2048, dev)
        for mode in ("ours-eager", "ours-compile", "ours-graph"):
            state = {}
            BG.generate_once(model, mode, ids, mask, 128, state)          # compile, warm up
            spy = Spy()
            prof = cProfile.Profile() if args.profile else None
            torch.cuda.synchronize()
            t = time.perf_counter()
            if prof:
                prof.enable()
            BG.generate_once(model, mode, ids, mask, 128, state)
            if prof:
                prof.disable()
            torch.cuda.synchronize()
            wall = time.perf_counter() - t
            spy.undo()
            runner = spy.runners[0] if spy.runners else state.get("runner")
            gpu = replay_us(runner) if runner is not None and runner._graph is not None else 0
            print(f"{shape} {mode}: {wall * 1e3:.1f} ms; capture {spy.capture * 1e3:.1f} ms; "
                  f"{spy.steps} served steps {spy.step * 1e3:.1f} ms host; one replay "
                  f"{gpu:.0f} µs GPU", flush=True)
            if prof:
                s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(14)
                rows = s.getvalue().splitlines()
                top = next(i for i, r in enumerate(rows) if r.strip().startswith("ncalls"))
                print("\n".join(rows[top:top + 15]), flush=True)
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
