"""Host and wall time of a converted V2-Lite prefill forward (H200 probe, not
maintained) as it runs, then with every mla:: custom op replaced by its Python body (no
dispatcher, autograd layer or alias check), against HF's; then a Python profile of the
multi-turn forward. Rows: 512 new on 4096 cached, 1 x 8192, 8 x 2048.

    python docs/notes/probe_op_bypass.py
"""
import sys, time, io, cProfile, pstats, torch
sys.path.insert(0, "benchmarks")                    # run from the repository root
from bench_prefill import build, model_config
import mla_ops.hf
from torch._library.custom_ops import OPDEFS

def timeit(fn, label, n=10):
    rows = []
    for _ in range(n):
        fn(sync_first=True)
        t0 = time.perf_counter(); fn(); t1 = time.perf_counter(); torch.cuda.synchronize()
        rows.append((t1 - t0, time.perf_counter() - t0))
    rows.sort()
    h, w = rows[n // 2]
    print(f"{label}: host {h*1e3:.2f} ms wall {w*1e3:.2f} ms (median of {n})", flush=True)

with torch.no_grad():
    for B, S, CTX in ((1, 512, 4096), (1, 8192, 0), (8, 2048, 0)):
        cfg = model_config("v2-lite", 2048)
        model = build(cfg, torch.bfloat16)
        ids = torch.randint(3, 2048, (B, S + CTX), device="cuda")
        from transformers import DynamicCache
        base = DynamicCache(config=cfg)
        if CTX:
            model(ids[:, :CTX], past_key_values=base, use_cache=True)
        def hf(sync_first=False):
            extra = base.get_seq_length() - CTX
            if extra > 0: base.crop(-extra)
            if sync_first: torch.cuda.synchronize(); return None
            return model(ids[:, CTX:], past_key_values=base, use_cache=True).logits
        timeit(hf, f"HF B{B} S{S} ctx{CTX}")
        ref = hf()
        mla_ops.hf.convert(model)
        cache = mla_ops.hf.PagedMLACache(cfg, max_batch_size=B, max_cache_len=S + CTX + 64, device="cuda", dtype=torch.bfloat16)
        kw = mla_ops.hf.cache_kwargs(model, cache)
        if CTX: model(ids[:, :CTX], **kw)
        saved = cache.snapshot()
        def ours(sync_first=False):
            cache.restore(saved)
            if sync_first: torch.cuda.synchronize(); return None
            return model(ids[:, CTX:], **kw).logits
        timeit(ours, f"ours B{B} S{S} ctx{CTX}")
        a = ours()
        saved_attrs = {}
        for name, d in list(OPDEFS.items()):
            if name.startswith("mla::"):
                short = name.split("::")[1]
                saved_attrs[short] = getattr(torch.ops.mla, short)
                setattr(torch.ops.mla, short, d._init_fn)
        timeit(ours, f"ours-bypass B{B} S{S} ctx{CTX}")
        b = ours()
        print("  bypass max diff", (a.float() - b.float()).abs().max().item(), " vs HF", (a.float() - ref.float()).abs().max().item(), flush=True)
        if CTX:
            pr = cProfile.Profile(); pr.enable()
            for _ in range(5): ours()
            pr.disable(); torch.cuda.synchronize()
            s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30); print(s.getvalue()[:7000])
        for short, v in saved_attrs.items():
            setattr(torch.ops.mla, short, v)
        del model, cache, saved, base
        torch.cuda.empty_cache()
