"""Where the GPU waits inside one prefill forward (H200 probe, not maintained): the host
syncs the forward makes (torch's sync debug mode, each distinct stack once, our and HF's
frames only), then the kernels of one forward in time order and the largest idle gaps
between them (the kernel before and after each), HF's forward and the converted one.

    python docs/notes/probe_prefill_gaps.py v3:1x8192,v2-lite:1x8192
"""
import collections, sys, traceback, warnings
import torch
sys.path.insert(0, "benchmarks")                    # run from the repository root
from torch.profiler import profile, ProfilerActivity
from bench_prefill import bench_ms, hf_step, ours_step, spec_models

KEEP = ("mla_ops", "lowering", "transformers/models", "transformers/masking", "bench_prefill")


def syncs(fn):
    seen = collections.Counter()

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        frames = [f for f in traceback.extract_stack()[:-1] if any(k in f.filename for k in KEEP)]
        seen[" <- ".join(f"{f.filename.split('/')[-1]}:{f.lineno}({f.name})"
                         for f in reversed(frames[-4:]))] += 1
    old = warnings.showwarning
    warnings.showwarning = show
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = old
    torch.cuda.synchronize()
    return seen


def gaps(fn, top=12):
    fn(); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        fn()
        torch.cuda.synchronize()
    ks = sorted(((e.time_range.start, e.time_range.end, e.name) for e in p.events()
                 if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda k: k[0])
    out, end, prev, idle = [], None, None, 0.0
    for s, e, name in ks:
        if end is not None and s > end:
            out.append((s - end, prev, name))
            idle += s - end
        if end is None or e > end:
            end, prev = e, name
    span = ks[-1][1] - ks[0][0]
    return span, idle, len(ks), sorted(out, reverse=True)[:top]


@torch.no_grad()
def main(spec):
    import mla_ops.hf
    for name, row, cfg, model, ids, ctx in spec_models(spec):
        print(f"== {name} {row}", flush=True)
        for tag in ("HF", "ours"):
            if tag == "ours":
                mla_ops.hf.convert(model)
            step = (hf_step if tag == "HF" else ours_step)(model, cfg, ids, ctx)
            wall = bench_ms(step, 2, 5)
            s = syncs(step)
            span, idle, n, top = gaps(step)
            print(f"  {tag}: wall {wall:.2f} ms; profiled span {span / 1e3:.2f} ms, GPU idle "
                  f"{idle / 1e3:.2f} ms between {n} kernels; {sum(s.values())} syncs", flush=True)
            for where, c in s.most_common():
                print(f"    sync x{c}: {where}")
            for g, a, b in top:
                print(f"    gap {g:8.1f} µs  after {a[:60]}  before {b[:60]}")
            del step
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1])
