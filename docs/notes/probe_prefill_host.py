"""Where a converted model's multi-turn prefill spends host time (H200 probe, not maintained).

V2-Lite shape (bench_prefill.py's model, random weights, bf16): one forward of 512 new
tokens on 4096 cached, ours against HF's.

  --part modules   host ms per submodule of layer 1 (forward hooks; the GPU runs ahead,
                   so host time is what the Python side costs), then the profiler's top
                   self-CPU ops and the kernels launched
  --part syncs     host vs wall time per forward, and every synchronizing CUDA call
                   (torch.cuda.set_sync_debug_mode("warn"), with the file and line)
  --part ops       host µs per eager call: a registered Triton op (mla::rms_norm), its
                   body called directly, its launcher, the raw kernel, an aten op

    python docs/notes/probe_prefill_host.py --part modules,syncs,ops
"""
import argparse
import collections
import os
import sys
import time
import warnings

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from bench_prefill import build, model_config  # noqa: E402

import mla_ops.hf  # noqa: E402

B, S, CTX = 1, 512, 4096


def hooked(model, prefix="model.layers.1"):
    """Forward hooks timing each submodule of one layer on the host."""
    acc, start, hooks = collections.defaultdict(float), {}, []
    for name, m in model.named_modules():
        if name.startswith(prefix) and name.count(".") <= 5:
            hooks.append(m.register_forward_pre_hook(
                lambda m, a, name=name: start.__setitem__(name, time.perf_counter())))
            hooks.append(m.register_forward_hook(
                lambda m, a, o, name=name: acc.__setitem__(
                    name, acc[name] + time.perf_counter() - start[name])))
    return acc, hooks


def part_modules(label, fn, model, n=5):
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    acc, hooks = hooked(model)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t0) / n
    for h in hooks:
        h.remove()
    print(f"--- {label}: host {host * 1e3:.2f} ms per forward (hooks on)")
    for k, v in acc.items():
        print(f"   {v / n * 1e3:8.3f} ms  {k}")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        fn()
        torch.cuda.synchronize()
    ka = p.key_averages()
    print("  kernels:", sum(e.count for e in ka if e.self_device_time_total > 0))
    for e in sorted(ka, key=lambda e: -e.self_cpu_time_total)[:15]:
        print(f"  cpu {e.self_cpu_time_total / 1e3:8.3f} ms  x{e.count:4d}  {e.key[:80]}")


def part_syncs(label, fn):
    for _ in range(3):
        fn(sync_first=True)
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        print(f"{label}: host {1e3 * (t1 - t0):.2f} ms, wall {1e3 * (time.perf_counter() - t0):.2f} ms")
    fn(sync_first=True)
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        fn()
    torch.cuda.set_sync_debug_mode(0)
    for x in w:
        if "synchroniz" in str(x.message):
            print(f"  sync at {x.filename}:{x.lineno}")


def part_ops():
    from lowering.fused import norm
    from lowering.fused.rms_norm_kernel import rms_norm_kernel
    from mla_ops.hf.eager import set_wrap_triton_enabled
    x = torch.randn(512, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2048, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)

    def us(fn, n=2000):
        for _ in range(100):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n * 1e6
    with torch.no_grad(), set_wrap_triton_enabled(False):
        rows = {"aten x * w": us(lambda: x * w),
                "mla::rms_norm (the op)": us(lambda: torch.ops.mla.rms_norm(x, w, 1e-6)),
                "its body, called directly": us(lambda: norm.rms_norm._init_fn(x, w, 1e-6)),
                "its launcher": us(lambda: norm.launch(x, w, 1e-6, y)),
                "the raw kernel[grid]": us(lambda: rms_norm_kernel[(512,)](
                    x, w, y, 2048, x.stride(0), 1e-6, y, y, 1, BLOCK=2048, QUANT_K=0, NATIVE_CAST=True,
                    num_warps=4))}
    for k, v in rows.items():
        print(f"  {v:8.1f} µs  {k}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", default="modules,syncs,ops")
    parts = ap.parse_args().part.split(",")
    if "ops" in parts:
        part_ops()
    if not {"modules", "syncs"} & set(parts):
        return
    from transformers import DynamicCache
    with torch.no_grad():
        cfg = model_config("v2-lite", 2048)
        model = build(cfg, torch.bfloat16)
        ids = torch.randint(3, 2048, (B, S + CTX), device="cuda")
        base = DynamicCache(config=cfg)
        model(ids[:, :CTX], past_key_values=base, use_cache=True)

        def hf(sync_first=False):
            extra = base.get_seq_length() - CTX
            if extra > 0:
                base.crop(-extra)
            if sync_first:
                torch.cuda.synchronize()
                return None
            return model(ids[:, CTX:], past_key_values=base, use_cache=True).logits
        if "modules" in parts:
            part_modules("HF", hf, model)
        if "syncs" in parts:
            part_syncs("HF", hf)
        mla_ops.hf.convert(model)
        cache = mla_ops.hf.PagedMLACache(cfg, max_batch_size=B, max_cache_len=S + CTX + 64,
                                         device="cuda", dtype=torch.bfloat16)
        kw = mla_ops.hf.cache_kwargs(model, cache)
        model(ids[:, :CTX], **kw)
        saved = cache.snapshot()

        def ours(sync_first=False):
            cache.restore(saved)
            if sync_first:
                torch.cuda.synchronize()
                return None
            return model(ids[:, CTX:], **kw).logits
        if "modules" in parts:
            part_modules("ours", ours, model)
        if "syncs" in parts:
            part_syncs("ours", ours)


if __name__ == "__main__":
    main()
