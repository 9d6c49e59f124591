"""Host against GPU progress through one converted prefill forward (H200 probe, not
maintained). At the entry and exit of the model's forward, HF's mask builder, the cache's
plan (prepare) and room check, and every module of the first two decoder layers (then each
layer whole), a marker takes the host's perf_counter and records a CUDA event. Printed per
marker: host ms since the step began, the GPU's ms when it reached the marker, and their
difference: near zero, the GPU was waiting for the host there; large, the host ran ahead.

    python docs/notes/probe_prefill_timeline.py v3:1x8192,v2-lite:multi-turn
"""
import sys, time
import torch
sys.path.insert(0, "benchmarks")                    # run from the repository root
from bench_prefill import bench_ms, ours_step, spec_models

MARKS = []


def mark(name):
    e = torch.cuda.Event(enable_timing=True)
    e.record()
    MARKS.append((name, time.perf_counter(), e))


def wrap(obj, attr, name):
    fn = getattr(obj, attr)

    def inner(*a, **k):
        mark(name + " >")
        try:
            return fn(*a, **k)
        finally:
            mark(name + " <")
    setattr(obj, attr, inner)


@torch.no_grad()
def main(spec):
    import mla_ops.hf
    import mla_ops.hf.step as hstep
    for name, row, cfg, model, ids, ctx in spec_models(spec):
        mla_ops.hf.convert(model)
        step = ours_step(model, cfg, ids, ctx)
        print(f"== {name} {row}: wall {bench_ms(step, 2, 5):.2f} ms", flush=True)
        inner = model.model
        wrap(inner, "forward", "model")
        wrap(sys.modules[type(inner).__module__], "create_causal_mask", "mask")
        wrap(hstep, "check_room", "check_room")
        wrap(hstep, "_plan_torch", "plan")
        for i, layer in enumerate(inner.layers):
            if i < 2:
                for cname, child in layer.named_children():
                    wrap(child, "forward", f"L{i}.{cname}")
            else:
                wrap(layer, "forward", f"L{i}")
        wrap(model.lm_head, "forward", "lm_head")
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        MARKS.clear()
        time.sleep(0.05)
        mark("start")
        step()
        mark("end")
        torch.cuda.synchronize()
        _, t0, e0 = MARKS[0]
        print(f"  {'marker':28s} {'host ms':>8s} {'GPU ms':>8s} {'GPU - host':>10s}")
        for nm, t, e in MARKS:
            h, g = (t - t0) * 1e3, e0.elapsed_time(e)
            print(f"  {nm:28s} {h:8.2f} {g:8.2f} {g - h:10.2f}")
        del model, step
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1])
