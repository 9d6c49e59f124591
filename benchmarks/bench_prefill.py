"""Prefill: our attention op and the converted model's whole prefill forward, vs the rest.

Part "attention": causal attention with q/k 192 (nope 128 + rope 64), v 128, bf16, at
(B, H, S) = 1x128x8192, 8x128x2048, 1x16x8192, 8x16x2048, 1x128x32768:

  ours          lowering.prefill.varlen_attention (mla::prefill_dense_attention, "auto")
                on the packed [T, H, D] tokens of B equal requests (+ its LSE)
  cudnn         F.scaled_dot_product_attention under SDPBackend.CUDNN_ATTENTION
  flex          torch.compile(flex_attention) with a causal block mask
  mem-efficient F.scaled_dot_product_attention under SDPBackend.EFFICIENT_ATTENTION

TFLOP/s count the causal half: 2 * B * H * S^2 / 2 * (192 + 128). "ceiling" is the
fraction of a measured bf16 GEMM (8192^3, torch.mm) rate on the same GPU. Each attention
is timed two ways: "ms" over --burst calls launched back to back between two events (the
GPU's time per call, host launch cost hidden, as in a forward where the host runs ahead),
and "latency_ms" one call per event pair after an idle GPU (the host's time to launch
counts too). ours_vs_cudnn compares the first; latency_ours_vs_cudnn the second.

Part "model": one eager forward of the prompt (as generate() runs prefill), random
weights, bf16, vocab 2048, HF's sdpa attention vs the converted model
(mla_ops.hf.convert + PagedMLACache, block 64):

  v3      DeepSeek-V3 attention (128 heads, q_lora 1536) + 1 dense + 1 MoE layer
          (256 experts, top 8): rows 1x8192 and 8x2048, and multi-turn 1x(4096 + 512)
  v2-lite DeepSeek-V2-Lite shape (16 heads, no q_lora, 64 experts top 6), 4 layers: the
          same rows

ours_graph: the same forward through mla_ops.hf.PrefillGraph (the chunk padded to its
shape bucket and replayed from a CUDA graph; the first of the warm-up calls captures it),
for rows of at most --graph-tokens tokens; larger rows run eagerly there anyway.
"first_call_ms" is that capturing call's time: what a bucket's first chunk costs.

Multi-turn: 4096 tokens already in the cache, 512 new; HF's cache is rolled back to
4096 before each timed forward (DynamicCache.crop), ours by PagedMLACache.restore. The
logits of the last position are compared with HF's (max |diff| / max(1, max |HF|)).

    python benchmarks/bench_prefill.py                      # everything (GPU)
    python benchmarks/bench_prefill.py --parts attention --json prefill_results.jsonl
    python benchmarks/bench_prefill.py --parts model --models v2-lite --rows 1x8192
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from mla_ops.hf import cache_kwargs

ATTN_SHAPES = "1x128x8192,8x128x2048,1x16x8192,8x16x2048,1x128x32768"
MODEL_ROWS = "1x8192,8x2048,multi-turn"
DQK, DV = 192, 128


def bench_ms(fn, warmup=3, iters=10, burst=1) -> float:
    """Median ms per call of fn over iters samples, each `burst` calls back to back
    between two CUDA events (burst 1: one call after an idle GPU, host time included)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(burst):
            fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / burst)
    return statistics.median(times)


def gemm_ceiling_tflops(n=8192) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return 2 * n ** 3 / bench_ms(lambda: torch.mm(a, b), iters=20) / 1e9


def attention_rows(args, ceiling):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    import torch.nn.functional as F
    from lowering.prefill import varlen_attention
    flex = torch.compile(flex_attention, dynamic=False)
    for spec in args.attn_shapes.split(","):
        B, H, S = (int(x) for x in spec.split("x"))
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(B * S, H, DQK, device="cuda", generator=g, dtype=torch.bfloat16)
        k = torch.randn(B * S, H, DQK, device="cuda", generator=g, dtype=torch.bfloat16)
        v = torch.randn(B * S, H, DV, device="cuda", generator=g, dtype=torch.bfloat16)
        cu = (torch.arange(B + 1, device="cuda") * S).to(torch.int32)
        scale = DQK ** -0.5
        qd, kd, vd = (t.view(B, S, H, -1).transpose(1, 2) for t in (q, k, v))   # [B, H, S, D]
        flops = 2 * B * H * S * S / 2 * (DQK + DV)
        mask = create_block_mask(lambda b, h, i, j: i >= j, None, None, S, S, device="cuda")
        runs = {
            "ours": lambda: varlen_attention(q, k, v, cu, S, scale),
            "cudnn": lambda: _sdpa(F, sdpa_kernel, SDPBackend.CUDNN_ATTENTION, qd, kd, vd, scale),
            "flex": lambda: flex(qd, kd, vd, block_mask=mask, scale=scale),
            "mem-efficient": lambda: _sdpa(F, sdpa_kernel, SDPBackend.EFFICIENT_ATTENTION,
                                           qd, kd, vd, scale),
        }
        row = {"part": "attention", "B": B, "H": H, "S": S, "gemm_ceiling_tflops": ceiling}
        for name, fn in runs.items():
            if name not in args.attn_impls.split(","):
                continue
            try:
                ms = bench_ms(fn, iters=args.iters, burst=args.burst)
                row[name] = {"ms": ms, "tflops": flops / ms / 1e9,
                             "ceiling_frac": flops / ms / 1e9 / ceiling,
                             "latency_ms": bench_ms(fn, iters=args.iters)}
            except Exception as e:             # a kernel this torch lacks: say so, go on
                row[name] = {"error": f"{type(e).__name__}: {str(e)[:120]}"}
        if "ours" in row and "cudnn" in row and "ms" in row["ours"] and "ms" in row["cudnn"]:
            row["ours_vs_cudnn"] = row["cudnn"]["ms"] / row["ours"]["ms"]
            row["latency_ours_vs_cudnn"] = row["cudnn"]["latency_ms"] / row["ours"]["latency_ms"]
        emit(args, row)
        del q, k, v, qd, kd, vd
        torch.cuda.empty_cache()


def _sdpa(F, sdpa_kernel, backend, q, k, v, scale):
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


def model_config(name, vocab):
    from transformers import DeepseekV2Config, DeepseekV3Config
    mla = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
               max_position_embeddings=16384, pad_token_id=0, bos_token_id=1, eos_token_id=2,
               vocab_size=vocab, first_k_dense_replace=1)
    if name == "v3":
        return DeepseekV3Config(hidden_size=7168, intermediate_size=18432,
                                moe_intermediate_size=2048, num_hidden_layers=2,
                                num_attention_heads=128, num_key_value_heads=128,
                                q_lora_rank=1536, n_routed_experts=256, num_experts_per_tok=8,
                                n_shared_experts=1, n_group=8, topk_group=4,
                                rope_interleave=True, **mla)
    return DeepseekV2Config(hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
                            num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=16,
                            q_lora_rank=None, n_routed_experts=64, num_experts_per_tok=6,
                            n_shared_experts=2, n_group=1, topk_group=1, topk_method="greedy",
                            **mla)


def build(cfg, dtype):
    from transformers import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
    cls = DeepseekV3ForCausalLM if cfg.model_type == "deepseek_v3" else DeepseekV2ForCausalLM
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("cuda"):
            model = cls(cfg).eval()
    finally:
        torch.set_default_dtype(old)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "embed" not in name:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    return model


def parse_row(spec):
    if spec == "multi-turn":
        return 1, 512, 4096
    B, S = (int(x) for x in spec.split("x"))
    return B, S, 0


def spec_models(spec, vocab=2048, dtype=torch.bfloat16):
    """For "model:row,..." (models as --models, rows as --rows name them): per item
    (name, row, cfg, HF's model built, random ids [B, S + context] on CUDA, context)."""
    for item in spec.split(","):
        name, row = item.split(":")
        B, S, ctx = parse_row(row)
        cfg = model_config(name, vocab)
        model = build(cfg, dtype)
        yield name, row, cfg, model, torch.randint(3, vocab, (B, S + ctx), device="cuda"), ctx


def hf_step(model, cfg, ids, ctx):
    """HF's forward of ids[:, ctx:] after ctx cached tokens (its DynamicCache rolled back to
    them before each call; a fresh cache when ctx is 0): a callable returning the logits."""
    from transformers import DynamicCache
    base = DynamicCache(config=cfg)
    if ctx:
        model(ids[:, :ctx], **cache_kwargs(model, base), use_cache=True)

    def step():
        if ctx:                                          # back to the ctx cached tokens
            extra = base.get_seq_length() - ctx
            if extra > 0:                                # crop() takes a negative count
                base.crop(-extra)
            cache = base
        else:
            cache = DynamicCache(config=cfg)
        return model(ids[:, ctx:], **cache_kwargs(model, cache), use_cache=True).logits
    return step


def context_cache(model, cfg, ids, ctx, dtype):
    """A PagedMLACache holding ids[:, :ctx] (written by the model), and its snapshot."""
    import mla_ops.hf
    B, total = ids.shape
    cache = mla_ops.hf.PagedMLACache(cfg, max_batch_size=B, max_cache_len=total, device="cuda",
                                     dtype=dtype)
    if ctx:
        model(ids[:, :ctx], **cache_kwargs(model, cache), use_cache=True)
    return cache, cache.snapshot()


def ours_step(model, cfg, ids, ctx, dtype=torch.bfloat16):
    """The converted model's forward of ids[:, ctx:] over a PagedMLACache holding ids[:, :ctx]
    (restored before each call): a callable returning the logits."""
    cache, saved = context_cache(model, cfg, ids, ctx, dtype)

    def step():
        cache.restore(saved)
        return model(ids[:, ctx:], **cache_kwargs(model, cache), use_cache=True).logits
    return step


def ours_graph_step(model, cfg, ids, ctx, max_tokens, dtype=torch.bfloat16):
    """ours_step through PrefillGraph: (a callable returning the logits [B, 1, V], the
    runner)."""
    import mla_ops.hf
    cache, saved = context_cache(model, cfg, ids, ctx, dtype)
    runner = mla_ops.hf.PrefillGraph(model, cache, max_tokens=max_tokens)

    def step():
        cache.restore(saved)
        return runner(ids[:, ctx:])
    return step, runner


def graph_row(args, model, cfg, ids, ctx, dtype):
    """{ours_graph_ms, first_call_ms, logits} of one row through PrefillGraph."""
    from mla_ops.hf.prefill_graph import MIN_TOKENS, bucket
    B, total = ids.shape
    if B * bucket(total - ctx, MIN_TOKENS, total) > args.graph_tokens:
        return None
    step, runner = ours_graph_step(model, cfg, ids, ctx, args.graph_tokens, dtype)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    first = (time.perf_counter() - t0) * 1e3
    ms = bench_ms(step, warmup=2, iters=args.iters)
    logits = step()[:, -1].float().clone()
    captured = all(c.graph is not None for c in runner.chunks.values())
    del step, runner
    torch.cuda.empty_cache()
    return {"ours_graph_ms": ms, "first_call_ms": first, "captured": captured}, logits


@torch.no_grad()
def model_rows(args):
    import mla_ops.hf
    dtype = torch.bfloat16
    for name in args.models.split(","):
        cfg = model_config(name, args.vocab)
        model = build(cfg, dtype)
        rows = [parse_row(r) for r in args.rows.split(",")]
        g = torch.Generator().manual_seed(1)
        ids = {r: torch.randint(3, args.vocab, (r[0], r[1] + r[2]), generator=g).cuda()
               for r in rows}
        hf = {}
        for r in rows:                                   # HF first, then convert in place
            step = hf_step(model, cfg, ids[r], r[2])
            hf[r] = (bench_ms(step, warmup=2, iters=args.iters), step()[:, -1].float())
            del step
            torch.cuda.empty_cache()
        mla_ops.hf.convert(model)
        for r in rows:
            B, S, ctx = r
            step = ours_step(model, cfg, ids[r], ctx, dtype)
            ms = bench_ms(step, warmup=2, iters=args.iters)
            logits = step()[:, -1].float()
            hf_ms, hf_logits = hf[r]
            err = ((logits - hf_logits).abs().max() / max(1.0, hf_logits.abs().max().item())).item()
            T = B * S
            row = {"part": "model", "model": name, "B": B, "S": S, "context": ctx,
                   "hf_ms": hf_ms, "ours_ms": ms, "speedup": hf_ms / ms,
                   "tokens_per_s": T / ms * 1e3, "logit_err": err}
            del step
            torch.cuda.empty_cache()
            graph = graph_row(args, model, cfg, ids[r], ctx, dtype)
            if graph is not None:
                g, g_logits = graph
                g["graph_speedup"] = hf_ms / g["ours_graph_ms"]
                g["graph_logit_err"] = ((g_logits - hf_logits).abs().max()
                                        / max(1.0, hf_logits.abs().max().item())).item()
                g["graph_vs_eager_err"] = ((g_logits - logits).abs().max()
                                           / max(1.0, logits.abs().max().item())).item()
                row.update(g)
            emit(args, row)
        del model
        torch.cuda.empty_cache()


def emit(args, row):
    print(json.dumps(row))
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(row) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n", 1)[1])
    ap.add_argument("--parts", default="attention,model", help="attention,model")
    ap.add_argument("--attn-shapes", default=ATTN_SHAPES, help="BxHxS,...")
    ap.add_argument("--attn-impls", default="ours,cudnn,flex,mem-efficient")
    ap.add_argument("--models", default="v3,v2-lite", help="v3,v2-lite")
    ap.add_argument("--rows", default=MODEL_ROWS, help="BxS,... and/or multi-turn")
    ap.add_argument("--graph-tokens", type=int, default=2048,
                    help="PrefillGraph's max_tokens: rows up to it are also timed captured")
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--burst", type=int, default=20,
                    help="attention calls back to back per timed sample (GPU time per call)")
    ap.add_argument("--json", default=None, help="append results here as JSON lines")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    import mla_ops  # noqa: F401  (registers the ops)
    parts = args.parts.split(",")
    t0 = time.time()
    if "attention" in parts:
        attention_rows(args, gemm_ceiling_tflops())
    if "model" in parts:
        model_rows(args)
    print(f"# done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
