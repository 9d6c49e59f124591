"""Real DeepSeek MoE shapes end to end: a decode step and generate(), HF against the converted
model, side by side in one run, each row with its floor.

Models (mla_ops.hf.models, random weights, bf16, vocab 2048, first layer dense):
  v2-lite   DeepSeek-V2-Lite's shapes, 4 layers (1 dense + 3 MoE: 64 experts top-6, 2 shared)
  v3-moe    DeepSeek-V3's shapes, 2 layers (1 dense + 1 MoE: 256 experts top-8 in 8 groups)

Rows (--rows):
  v2-lite-32x1024, v2-lite-1x4096, v3-moe-32x1024, v3-moe-1x4096
            one decode step with B rows of S cached tokens (random cache rows, no prefill);
            ms per step, median of --iters
  gen-v2-lite, gen-v3-moe
            model.generate() as users call it: B = 8 left-aligned prompts of 2048 tokens,
            128 new tokens, greedy; seconds per call, the median of --repeats calls
            after the first (which compiles, captures and warms up)

Modes (--modes), the same weights throughout:
  hf-eager      HF's model (its own MoE code, experts "grouped_mm"); decode: StaticCache;
                generate(): no cache argument (HF's DynamicCache), disable_compile
  hf-compile    decode: torch.compile(model.forward, fullgraph, mode="reduce-overhead") on
                a StaticCache; generate(): cache_implementation="static" + compile_config
                (fullgraph, reduce-overhead)
  ours-eager    mla_ops.hf.convert(model) (MoE blocks included), a PagedMLACache (for
                generate(): none passed, the default one), no compile; generate()'s
                decode steps replay a CUDA graph of the eager step (convert's default
                generate_graph=True)
  ours-eager-steps   generate() only: as ours-eager with convert(generate_graph=False),
                every decode step an eager forward
  ours-default  generate() only: model.generate(ids) with no compile argument (on CUDA
                the step graph of ours-eager, in place of HF's automatic compile)
  ours-compile  decode: as hf-compile on the PagedMLACache; generate(): compile_config as
                hf-compile's on the default PagedMLACache (which generate() keeps between
                calls that return sequences only, with its step graph: the timed calls
                replay the graph the first call captured, as ours-eager's do)
  ours-compile-cache   generate() only: as ours-compile on a PagedMLACache the caller
                passes (cache=, reset before each call), which keeps the step graph
                captured in the first call for the next
  ours-graph    decode: mla_ops.hf.DecodeGraph replays, each step timed alone (event, call,
                event, wait: its launch latency counted), and also in a greedy loop
                (DecodeGraph.greedy: each step launched without waiting for the last, as a
                generation loop that needs no host decision per step runs);
                generate(): the prefill as one eager forward, then DecodeGraph.greedy for
                the other 127 tokens

Floor: a decode step must read the attention and dense weights, the distinct routed
experts the router picked (counted on HF's model for this very input), the shared experts,
the output head and the latent KV of every row; at --bandwidth (default 4.3 TB/s, an H200's
copy rate). generate()'s floor: the prefill's FLOPs at --peak-tflops (default 989, H200
bf16 dense) plus each decode step's bytes (the KV grows by a token per step; the
distinct experts of a B = 8 step estimated as the expected count for uniform picks).

    python benchmarks/bench_generate.py                         # everything (~8 min on an H200)
    python benchmarks/bench_generate.py --rows v2-lite-32x1024,gen-v2-lite --modes hf-compile,ours-graph
    python benchmarks/bench_generate.py --device cpu --tiny     # a smoke run of the code paths

Slow modes (--slow-modes, default hf-eager and ours-eager-steps) generate --slow-new-tokens new
tokens and a one-token call (the prefill alone), and the full call's time is read as
prefill + (decode part) x 127 / (slow tokens - 1): marked "scaled". Results are appended
to benchmarks/generate_results.jsonl (--json).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import time
from types import SimpleNamespace

import torch

import mla_ops.hf
from bench_hf_decode import (fill_paged_cache, fill_static_cache, host_time, time_greedy,
                             time_steps)
from mla_ops.hf.models import build_model, make_config

MODES = ("hf-eager", "hf-compile", "ours-eager", "ours-eager-steps", "ours-default",
         "ours-compile", "ours-compile-cache", "ours-graph")
GENERATE_ONLY = ("ours-eager-steps", "ours-default", "ours-compile-cache")
DECODE_ROWS = {"v2-lite-32x1024": ("v2-lite", 32, 1024), "v2-lite-1x4096": ("v2-lite", 1, 4096),
               "v3-moe-32x1024": ("v3-moe", 32, 1024), "v3-moe-1x4096": ("v3-moe", 1, 4096)}
GEN_ROWS = {"gen-v2-lite": "v2-lite", "gen-v3-moe": "v3-moe"}
HERE = os.path.dirname(os.path.abspath(__file__))


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def tiny(cfg):
    """--tiny: the same structure at CPU size (hidden 256, 4 heads, 16 experts)."""
    cfg.hidden_size, cfg.intermediate_size, cfg.moe_intermediate_size = 256, 512, 64
    cfg.num_attention_heads = cfg.num_key_value_heads = 4
    if getattr(cfg, "q_lora_rank", None):
        cfg.q_lora_rank = 192
    cfg.n_routed_experts = 16
    cfg.n_group, cfg.topk_group = (4, 2) if cfg.model_type == "deepseek_v3" else (1, 1)
    cfg.num_experts_per_tok = min(cfg.num_experts_per_tok, 4)
    return cfg


# ----------------------------------------------------------------------------- floors


def weight_bytes(model) -> dict:
    """Bytes of what every decode step reads in full (all but the embedding and the routed
    experts), and of one routed expert per MoE layer: {"fixed": n, "expert": [n per layer]}."""
    fixed, expert = 0, []
    for name, p in model.named_parameters():
        if "embed_tokens" in name:
            continue
        if ".mlp.experts." in name:
            continue
        fixed += p.numel() * p.element_size()
    for m in model.modules():
        gu, dn = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
        if isinstance(gu, torch.Tensor) and isinstance(dn, torch.Tensor) and gu.dim() == 3:
            expert.append((gu[0].numel() + dn[0].numel()) * gu.element_size())
    return {"fixed": fixed, "expert": expert}


def count_experts(model):
    """Hooks on HF's routers: the distinct experts each MoE layer picks, per forward."""
    seen = []
    hooks = []
    for m in model.modules():
        if type(m).__name__ in ("DeepseekV3TopkRouter", "DeepseekV2TopkRouter"):
            hooks.append(m.register_forward_hook(
                lambda mod, args, out: seen.append(int(out[-1].unique().numel()))))
    return seen, hooks


def expected_distinct(E: int, picks: int, k: int) -> float:
    """Expected distinct experts among `picks` tokens of k distinct picks each, uniform."""
    return E * (1 - (1 - k / E) ** picks)


def kv_bytes(cfg, tokens: int) -> int:
    return tokens * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2 * cfg.num_hidden_layers


def prefill_flops(cfg, wb, B: int, S: int) -> float:
    """2 x active weights x tokens + causal attention (q.k over 192, p.v over 128)."""
    K = cfg.num_experts_per_tok
    active = wb["fixed"] / 2 + sum(e / 2 * K for e in wb["expert"])     # parameters
    N = cfg.num_attention_heads
    attn = 2 * B * S * S / 2 * N * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
                                    + cfg.v_head_dim) * cfg.num_hidden_layers
    return 2 * active * B * S + attn


# ----------------------------------------------------------------------------- decode rows


def decode_row(args, model, cfg, mode, B, S, dev, dtype, distinct):
    """ms per decode step of this mode (model: HF's for hf-*, converted for ours-*)."""
    extra = 3 * (args.warmup + args.iters) + 80
    ids = torch.randint(3, cfg.vocab_size, (B, 1), device=dev)
    pos = torch.full((B, 1), S, device=dev, dtype=torch.long)
    opts = SimpleNamespace(kv_cache_dtype="auto", k_scale=1.0, per_layer_schedule=False)
    ours = mode.startswith("ours")
    cache = (fill_paged_cache(cfg, B, S, extra, dev, dtype, opts) if ours
             else fill_static_cache(cfg, B, S, extra, dev, dtype))
    kw = mla_ops.hf.cache_kwargs(model, cache)
    compiled = mode.endswith("compile")
    mark = compiled and dev.type == "cuda"
    fwd = (torch.compile(model.forward, fullgraph=True, dynamic=False,
                         backend="inductor" if dev.type == "cuda" else "aot_eager",
                         mode="reduce-overhead" if dev.type == "cuda" else None)
           if compiled else model.forward)

    def step():
        with torch.no_grad():
            return fwd(input_ids=ids, position_ids=pos, logits_to_keep=1, **kw).logits
    t0 = time.perf_counter()
    if mode == "hf-eager" and distinct is not None:
        seen, hooks = count_experts(model)
        step()
        for h in hooks:
            h.remove()
        distinct[:] = seen
    run = step
    if mode == "ours-graph":
        runner = mla_ops.hf.DecodeGraph(model, cache, batch_size=B,
                                        graph=dev.type == "cuda")
        run = functools.partial(runner, ids)
    run()
    sync(dev)
    first = time.perf_counter() - t0
    sec = time_steps(run, dev, args.warmup, args.iters, mark)
    host = host_time(run, dev, mark, n=10) if dev.type == "cuda" else None
    loop = (time_greedy(runner, ids, dev, args.iters) * 1e3
            if mode == "ours-graph" and dev.type == "cuda" else None)
    return sec * 1e3, first, host, loop


# ----------------------------------------------------------------------------- generate rows


def prompts(cfg, B, S, dev, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, cfg.vocab_size, (B, S), generator=g).to(dev)
    return ids, torch.ones_like(ids)


def generate_once(model, mode, ids, mask, new, state):
    """One generate() call of this mode -> new tokens [B, new]."""
    from transformers.generation.configuration_utils import CompileConfig
    S = ids.shape[1]
    kw = dict(attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    cc = CompileConfig(fullgraph=True, dynamic=False, mode="reduce-overhead")
    with torch.no_grad():
        if mode in ("hf-eager", "ours-eager"):
            return model.generate(ids, disable_compile=True, **kw)[:, S:]
        if mode == "ours-eager-steps":
            model.mla_generate_graph = False              # as convert(generate_graph=False)
            try:
                return model.generate(ids, disable_compile=True, **kw)[:, S:]
            finally:
                model.mla_generate_graph = True
        if mode == "ours-default":
            return model.generate(ids, **kw)[:, S:]
        if mode == "hf-compile":
            return model.generate(ids, cache_implementation="static", compile_config=cc,
                                  **kw)[:, S:]
        if mode == "ours-compile":
            return model.generate(ids, compile_config=cc, **kw)[:, S:]
        if mode == "ours-compile-cache":
            if "cache" not in state:
                state["cache"] = mla_ops.hf.PagedMLACache(
                    model.config, max_batch_size=ids.shape[0], max_cache_len=S + new + 4,
                    device=ids.device, dtype=model.dtype)
            state["cache"].reset()
            return model.generate(ids, compile_config=cc, **kw,
                                  **mla_ops.hf.cache_kwargs(model, state["cache"]))[:, S:]
        # ours-graph: the prefill as one eager forward, then DecodeGraph's greedy replays
        B = ids.shape[0]
        if "cache" not in state:
            state["cache"] = mla_ops.hf.PagedMLACache(
                model.config, max_batch_size=B, max_cache_len=S + new + 4,
                device=ids.device, dtype=model.dtype)
        cache = state["cache"]
        cache.reset()
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        first = model(input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=1,
                      **mla_ops.hf.cache_kwargs(model, cache)).logits[:, -1].argmax(-1)
        if "runner" not in state:
            state["runner"] = mla_ops.hf.DecodeGraph(model, cache, batch_size=B,
                                                     graph=ids.device.type == "cuda")
        rest = state["runner"].greedy(first, new - 1)
        return torch.cat([first[:, None], rest], 1)


def timed(fn, dev):
    sync(dev)
    t = time.perf_counter()
    out = fn()
    sync(dev)
    return time.perf_counter() - t, out


def generate_row(args, model, mode, ids, mask, dev):
    """(seconds of the median of --repeats calls after the first, seconds of the first,
    tokens, scaled?)."""
    new = args.new_tokens
    state = {}
    slow = mode in args.slow_modes.split(",") and args.slow_new_tokens < new
    n = args.slow_new_tokens if slow else new
    first, _ = timed(lambda: generate_once(model, mode, ids, mask, n, state), dev)
    runs = [timed(lambda: generate_once(model, mode, ids, mask, n, state), dev)
            for _ in range(args.repeats)]
    sec, out = sorted(runs, key=lambda r: r[0])[len(runs) // 2]        # the median call
    if slow:     # prefill + (n - 1) steps measured: read 127 steps from them
        one, _ = timed(lambda: generate_once(model, mode, ids, mask, 1, {}), dev)
        sec = one + (sec - one) * (new - 1) / max(n - 1, 1)
    return sec, first, out, slow


# ----------------------------------------------------------------------------- main


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rows", default=",".join([*DECODE_ROWS, *GEN_ROWS]),
                    help=f"comma-separated, of {[*DECODE_ROWS, *GEN_ROWS]}")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {list(MODES)}")
    ap.add_argument("--batch", type=int, default=8, help="generate(): prompts per call")
    ap.add_argument("--prompt-len", type=int, default=2048, help="generate(): tokens per prompt")
    ap.add_argument("--new-tokens", type=int, default=128, help="generate(): new tokens")
    ap.add_argument("--slow-modes", default="hf-eager,ours-eager-steps",
                    help="generate(): modes timed with --slow-new-tokens and scaled")
    ap.add_argument("--slow-new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=1,
                    help="generate(): timed calls after the first (the median is reported)")
    ap.add_argument("--warmup", type=int, default=3, help="decode rows: steps before timing")
    ap.add_argument("--iters", type=int, default=10, help="decode rows: timed steps")
    ap.add_argument("--bandwidth", type=float, default=4.3, help="TB/s for the floor")
    ap.add_argument("--peak-tflops", type=float, default=989.0,
                    help="bf16 TFLOP/s for the prefill part of generate()'s floor")
    ap.add_argument("--tiny", action="store_true",
                    help="CPU-sized models of the same structure (a smoke run)")
    ap.add_argument("--json", default=os.path.join(HERE, "generate_results.jsonl"),
                    help="append one JSON line per row here ('' for none)")
    args = ap.parse_args()
    rows = [r for r in args.rows.split(",") if r]
    modes = [m for m in args.modes.split(",") if m]
    bad = [r for r in rows if r not in DECODE_ROWS and r not in GEN_ROWS]
    bad += [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"unknown rows / modes {bad}")
    dev, dtype = torch.device(args.device), torch.bfloat16
    if args.tiny:
        args.prompt_len, args.new_tokens = min(args.prompt_len, 64), min(args.new_tokens, 8)
        args.slow_new_tokens = min(args.slow_new_tokens, 4)
    bw = args.bandwidth * 1e12
    import transformers
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}; floor at "
          f"{args.bandwidth} TB/s, {args.peak_tflops} TFLOP/s", flush=True)
    results = []
    for shape in ("v2-lite", "v3-moe"):
        mine = [r for r in rows if DECODE_ROWS.get(r, (None,))[0] == shape
                or GEN_ROWS.get(r) == shape]
        if not mine:
            continue
        cfg = make_config(shape, None)
        if args.tiny:
            cfg = tiny(cfg)
        cfg._attn_implementation = "sdpa"
        cfg._experts_implementation = "grouped_mm"
        print(f"\n{shape}: building ({cfg.num_hidden_layers} layers)", flush=True)
        model = build_model(cfg, dev, dtype)
        wb = weight_bytes(model)
        res = {r: {"row": r, "modes": {}} for r in mine}
        distinct = {r: [] for r in mine}
        converted = False
        for mode in modes:                       # HF's modes first, then convert in place
            if mode.startswith("ours") and not converted:
                mla_ops.hf.convert(model)
                converted = True
            if not mode.startswith("ours") and converted:
                print(f"  {mode}: skipped (modes run HF's first; list them first)", flush=True)
                continue
            for r in mine:
                if r in DECODE_ROWS and mode in GENERATE_ONLY:
                    continue
                torch._dynamo.reset()
                torch._dynamo.utils.counters.clear()
                try:
                    if r in DECODE_ROWS:
                        _, B, S = DECODE_ROWS[r]
                        if args.tiny:
                            B, S = min(B, 4), min(S, 256)
                        res[r].update(B=B, S=S)
                        ms, first, host, loop = decode_row(args, model, cfg, mode, B, S, dev,
                                                           dtype, distinct[r])
                        cell = {"ms": ms, "first_s": first, "host_ms": None if host is None
                                else host * 1e3, "loop_ms": loop}
                        print(f"  {r} {mode}: {ms:.3f} ms/step (first call {first:.1f} s"
                              + (f", host {host * 1e3:.3f} ms/step" if host else "")
                              + (f", in a greedy loop {loop:.3f} ms/step" if loop else "")
                              + ")", flush=True)
                    else:
                        ids, mask = prompts(cfg, args.batch, args.prompt_len, dev)
                        sec, first, out, scaled = generate_row(args, model, mode, ids, mask, dev)
                        cell = {"s": sec, "first_s": first, "scaled": scaled,
                                "tokens": out.tolist() if not scaled else None}
                        print(f"  {r} {mode}: {sec:.3f} s{' (scaled)' if scaled else ''} "
                              f"(first call {first:.1f} s)", flush=True)
                except Exception as e:          # keep the other cells
                    print(f"  {r} {mode} failed: {type(e).__name__}: {e}"[:600], flush=True)
                    cell = None
                breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
                if cell is not None and breaks:
                    cell["graph_breaks"] = breaks
                res[r]["modes"][mode] = cell
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
        for r in mine:
            res[r]["floor"] = floor_of(args, cfg, wb, r, distinct[r], bw, res[r])
            results.append(res[r])
        del model
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    report(results, modes)
    if args.json:
        with open(args.json, "a") as f:
            for r in results:
                cells = {m: ({k: v for k, v in c.items() if k != "tokens"} if c else None)
                         for m, c in r["modes"].items()}
                f.write(json.dumps({"row": r["row"], "floor": r["floor"], "modes": cells,
                                    "B": r.get("B"), "S": r.get("S"),
                                    "torch": torch.__version__, "tiny": args.tiny}) + "\n")


def floor_of(args, cfg, wb, row, distinct, bw, res) -> float:
    """The row's floor: ms per decode step, or seconds per generate() call."""
    E, K = cfg.n_routed_experts, cfg.num_experts_per_tok
    if row in DECODE_ROWS:
        _, B, S = DECODE_ROWS[row]
        B, S = res.get("B", B), res.get("S", S)
        picks = distinct or [expected_distinct(E, B, K)] * len(wb["expert"])
        experts = sum(n * e for n, e in zip(picks, wb["expert"]))
        return (wb["fixed"] + experts + kv_bytes(cfg, B * S)) / bw * 1e3
    B, S, new = args.batch, args.prompt_len, args.new_tokens
    step_w = wb["fixed"] + sum(expected_distinct(E, B, K) * e for e in wb["expert"])
    decode = sum(step_w + kv_bytes(cfg, B * (S + i)) for i in range(1, new)) / bw
    return prefill_flops(cfg, wb, B, S) / (args.peak_tflops * 1e12) + decode


def report(results, modes):
    """The markdown table: each mode's time, the floor and the ratios the targets name."""
    print("\n| row | " + " | ".join(modes) + " | floor | best ours / floor | "
          "ours-graph in a greedy loop / floor | hf-compile / best ours | "
          "hf-compile / ours-compile | hf-eager / ours-eager |")
    print("|---|" + "---|" * (len(modes) + 6))
    for r in results:
        unit = "ms" if r["row"] in DECODE_ROWS else "s"
        val = {m: (c["ms"] if unit == "ms" else c["s"]) for m, c in r["modes"].items() if c}
        cells = [f"{val[m]:.3f}" + ("*" if (r["modes"][m] or {}).get("scaled") else "")
                 if m in val else "—" for m in modes]
        ours = [val[m] for m in val if m.startswith("ours")]
        best = min(ours) if ours else None
        fl = r["floor"]

        def ratio(a, b):
            return f"{a / b:.2f}x" if a and b else "—"
        loop = (r["modes"].get("ours-graph") or {}).get("loop_ms")
        in_loop = f"{loop:.3f} ms, {ratio(loop, fl)}" if loop else "—"
        print(f"| {r['row']} ({unit}) | " + " | ".join(cells) + f" | {fl:.3f} | "
              f"{ratio(best, fl)} | {in_loop} | {ratio(val.get('hf-compile'), best)} | "
              f"{ratio(val.get('hf-compile'), val.get('ours-compile'))} | "
              f"{ratio(val.get('hf-eager'), val.get('ours-eager'))} |")
        toks = {m: c["tokens"] for m, c in r["modes"].items() if c and c.get("tokens")}
        if len(toks) > 1:
            ref = next(iter(toks))
            for m, t in toks.items():
                if m != ref:
                    same = (torch.tensor(t) == torch.tensor(toks[ref])).float().mean().item()
                    print(f"    {r['row']}: {m} gives {same:.0%} of {ref}'s tokens")
    print("(ms per decode step, s per generate() call; * scaled from --slow-new-tokens; "
          "the last three columns are speedups: above 1 ours is faster)")

if __name__ == "__main__":
    main()
