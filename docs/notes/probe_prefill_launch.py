"""Host µs inside a converted model's prefill forward, measured with perf_counter around
each Triton launch (JITFunction.run, by kernel), each custom-op body, each converted
module's forward, and the forward itself (H200 probe, not maintained). No sync inside.

    python docs/notes/probe_prefill_launch.py v2-lite:multi-turn
"""
import collections, sys, time
import torch
import triton.runtime.jit as tjit
sys.path.insert(0, "benchmarks")                    # run from the repository root
from bench_prefill import ours_step, spec_models

ACC = collections.defaultdict(lambda: [0, 0.0])


def timed(name, fn):
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            ACC[name][0] += 1
            ACC[name][1] += time.perf_counter() - t
    return wrapper


_run = tjit.JITFunction.run
def run(self, *a, **k):
    t = time.perf_counter()
    try:
        return _run(self, *a, **k)
    finally:
        ACC["triton " + self.fn.__name__][0] += 1
        ACC["triton " + self.fn.__name__][1] += time.perf_counter() - t
tjit.JITFunction.run = run


@torch.no_grad()
def main(spec):
    import mla_ops.hf
    for name, row, cfg, model, ids, ctx in spec_models(spec):
        mla_ops.hf.convert(model)
        seen = set()
        for mname, m in model.named_modules():
            cls = type(m)
            if cls in seen or mname == "":
                continue
            seen.add(cls)
            cls.forward = timed("module " + cls.__name__, cls.forward)
        import lowering.prefill.step as st, lowering.prefill.dense as dn
        for mod, attr in ((st, "up_project"), (st, "keys"), (st, "dense_attention"),
                          (dn, "cudnn_dense"), (st, "RaggedLayout")):
            setattr(mod, attr, timed(f"{mod.__name__.split('.')[-1]}.{attr}", getattr(mod, attr)))
        step = ours_step(model, cfg, ids, ctx)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        ACC.clear()
        n = 5
        for _ in range(n):
            torch.cuda.synchronize()
            t = time.perf_counter(); step()
            ACC["FORWARD (host)"][0] += 1; ACC["FORWARD (host)"][1] += time.perf_counter() - t
        torch.cuda.synchronize()
        print(f"== {name} {row}: host µs per forward by item (calls per forward)", flush=True)
        for k, (c, s) in sorted(ACC.items(), key=lambda kv: -kv[1][1]):
            print(f"  {s / n * 1e6:9.1f} µs  x{c / n:5.1f}  ({s / c * 1e6:7.1f} each)  {k}")


if __name__ == "__main__":
    main(sys.argv[1])
