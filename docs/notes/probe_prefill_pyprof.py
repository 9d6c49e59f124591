"""A Python profile of a converted model's prefill forward (H200 probe, not maintained):
host ms per forward without the profiler, then cProfile over five forwards, sorted by
own time and by cumulative time, for the rows asked.

    python docs/notes/probe_prefill_pyprof.py v2-lite:multi-turn,v2-lite:1x8192
"""
import cProfile, io, pstats, sys, time
import torch
sys.path.insert(0, "benchmarks")                    # run from the repository root
from bench_prefill import ours_step, spec_models


@torch.no_grad()
def main(spec):
    import mla_ops.hf
    for name, row, cfg, model, ids, ctx in spec_models(spec):
        mla_ops.hf.convert(model)
        step = ours_step(model, cfg, ids, ctx)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        host = []
        for _ in range(5):
            torch.cuda.synchronize()
            t = time.perf_counter(); step(); host.append(time.perf_counter() - t)
        torch.cuda.synchronize()
        print(f"== {name} {row}: host ms per forward {sorted(host)[2] * 1e3:.2f}", flush=True)
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        pr.disable()
        for key in ("tottime", "cumulative"):
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats(key).print_stats(45)
            print(s.getvalue().replace("/tmp/site/", "").replace("/opt/torch/.venv/lib/python3.12/site-packages/", ""), flush=True)
        del model, step
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1])
