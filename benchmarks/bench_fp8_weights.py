"""One decode step of a DeepSeek-V3-shaped HF model with FP8 block-quantized weights (the
form of DeepSeek-V3 / R1 checkpoints) vs the same model with bf16 weights.

Model: V3's attention (128 heads, q_lora 1536, L 512) and hidden size 7168; --dense-layers
dense layers (intermediate 18432) then MoE layers (V3's 256 routed experts of 2048, top 8
in 8 groups / best 4, one shared expert), vocab 2048, random weights. fp8: the same
weights quantized by HF's own FineGrainedFP8 quantization in 128 x 128 blocks
(mla_ops.hf.fp8_models.quantize_fp8; the output head stays bf16, as HF keeps it). Both
converted with fuse_experts=True and timed as mla_ops.hf.DecodeGraph (the step compiled by
Inductor and captured in one CUDA graph; --no-compile captures the eager step) on a bf16
PagedMLACache (block 64) holding S random tokens per row: ms per step, the median of
--rounds greedy loops of --iters steps.

Floor: the bytes one fp8 step reads / 4.3 TB/s (H200): every fp8 weight and its scales,
the absorbed W_UK_T / W_UV, the bf16 output head and norms, B embedding rows, the shared
expert and the routed experts the batch chooses (expected distinct experts under uniform
routing: E (1 - (1 - k / E)^B) per MoE layer), and the cache rows (B x S x 576 x 2 bytes
per layer). Targets (issue 31): fp8 >= 1.6x bf16 at B = 1, and <= 1.3x its floor.

    python benchmarks/bench_fp8_weights.py                       # B = 1 and 32, S = 4096
    python benchmarks/bench_fp8_weights.py --shapes 1x4096 --experts 64 --no-compile
    python benchmarks/bench_fp8_weights.py --sweep    # the fp8 GEMM kernel's configs per shape

--sweep times the fp8 decode GEMM kernel (lowering/gemm/fp8_linear.py) alone at V3's
decode shapes, 1 and 32 rows, over candidate configs (CUDA-graph replays, L2 flushed),
beside the bf16 decode GEMM op on the same shape, and prints the CONFIGS entries.
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

HBM_BYTES_PER_S = 4.3e12


def v3_moe_config(args):
    from mla_ops.hf.models import make_config
    cfg = make_config("v3-shaped", args.layers)
    cfg.first_k_dense_replace = args.dense_layers
    cfg.n_routed_experts, cfg.num_experts_per_tok = args.experts, args.top_k
    cfg.n_group, cfg.topk_group = (8, 4) if args.experts % 8 == 0 else (1, 1)
    cfg.n_shared_experts, cfg.routed_scaling_factor = 1, 2.5
    cfg._attn_implementation = "sdpa"
    return cfg


def step_bytes(model, cfg, B: int, S: int) -> float:
    """Bytes one decode step of the converted model reads (see the module docstring)."""
    experts = [m for n, m in model.named_modules() if n.endswith("mlp.experts")]
    skip = {id(p) for m in experts for p in m.parameters()}
    skip |= {id(m.kv_b_proj.weight) for m in model.modules() if hasattr(m, "mla_attn")}
    embed = model.get_input_embeddings().weight
    skip.add(id(embed))
    total = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())
                if id(t) not in skip)
    total += B * embed.shape[1] * embed.element_size()
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    chosen = E * (1 - (1 - k / E) ** B)
    for m in experts:
        total += chosen / E * sum(p.numel() * p.element_size() for p in m.parameters())
    total += cfg.num_hidden_layers * B * S * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2
    return total


def fill_cache(cfg, B, S, room, dev):
    import mla_ops.hf
    cache = mla_ops.hf.PagedMLACache(cfg, max_batch_size=B, max_cache_len=S + room,
                                     block_size=64, device=dev, dtype=torch.bfloat16)
    for kv in cache.pool.kv:
        kv.normal_()
    cache.occupy([S] * B)
    return cache


def time_steps(runner, B, dev, iters, rounds) -> float:
    """Median ms per step over `rounds` greedy loops of `iters` steps."""
    ids = torch.zeros(B, 1, dtype=torch.long, device=dev)
    runner.greedy(ids, 2)
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        runner.greedy(ids, iters)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / iters)
    return statistics.median(times)


# (mode, N, K, what): DeepSeek-V3's decode GEMMs (mode as in fp8_linear_kernel.py)
SWEEP_SHAPES = [(1, 2112, 7168, "q_a + kv_a"), (0, 24576, 1536, "q_b"),
                (0, 7168, 16384, "o_proj"), (2, 18432, 7168, "dense gate + up"),
                (0, 7168, 18432, "dense down"), (2, 2048, 7168, "shared expert gate + up"),
                (0, 7168, 2048, "shared expert down")]
SWEEP_CANDIDATES = [(bn, 4, st) for bn in (16, 32, 64, 128) for st in (3, 6)]


def sweep():
    """Time the fp8 kernel's candidate configs per V3 shape (see the module docstring)."""
    from timing import graph_time_us

    from lowering.gemm import fp8_linear
    from lowering.gemm import linear as gemm
    dev = torch.device("cuda")
    best = {}
    for mode, N, K, what in SWEEP_SHAPES:
        ws = [(torch.randn(N, K, device=dev) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
              for _ in range(2 if mode else 1)]
        ss = [torch.rand(-(-N // 128), -(-K // 128), device=dev) * 1e-2 for _ in ws]
        bf = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * K ** -0.5 for _ in ws]
        for M in (1, 32):
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            y1 = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
            y2 = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
            w2, s2 = (ws[1], ss[1]) if mode else (None, None)
            times = {}
            for cfg in SWEEP_CANDIDATES:
                def run(cfg=cfg):
                    fp8_linear.launch(x, ws[0], ss[0], w2, s2, mode, y1,
                                      y2 if mode == 1 else None, 128, 128, cfg)
                times[cfg] = graph_time_us(run)
            if mode == 0:
                bf16 = graph_time_us(lambda: gemm.decode_linear_partials(
                    x, bf[0], gemm.linear_split_k(x, bf[0])))
            elif mode == 1:
                bf16 = graph_time_us(lambda: gemm.decode_linear_pair_partials(
                    x, bf[0], bf[1], gemm.pair_split_k(x, bf[0], bf[1])))
            else:
                bf16 = graph_time_us(lambda: torch.ops.mla.decode_gate_up(x, bf[0], bf[1]))
            cfg = min(times, key=times.get)
            best[(mode, N, K, M <= 16)] = cfg
            floor = N * K * len(ws) / HBM_BYTES_PER_S * 1e6
            print(f"  {what:24s} M={M:2d}: fp8 best {cfg} {times[cfg]:7.1f} us (floor "
                  f"{floor:6.1f}; config now {fp8_linear.pick_config(mode, N, K, M)} "
                  f"{times.get(fp8_linear.pick_config(mode, N, K, M), float('nan')):7.1f}), "
                  f"bf16 op {bf16:7.1f} us: {bf16 / times[cfg]:.2f}x", flush=True)
    print("\nCONFIGS = {")
    for key, cfg in best.items():
        print(f"    {key}: {cfg},")
    print("}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shapes", default="1x4096,32x4096", help="BxS,... (rows x context)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dense-layers", type=int, default=1, help="the first layers, dense")
    ap.add_argument("--experts", type=int, default=256, help="routed experts per MoE layer")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-compile", action="store_true",
                    help="capture the eager step (no Inductor compile: quicker to start)")
    ap.add_argument("--json", default=None, help="append results here as JSON lines")
    ap.add_argument("--sweep", action="store_true",
                    help="time the fp8 GEMM kernel's configs at V3's shapes instead")
    args = ap.parse_args()
    if args.sweep:
        return sweep()

    import mla_ops.hf
    from mla_ops.hf.fp8_models import quantize_fp8
    from mla_ops.hf.models import build_model
    dev = torch.device(args.device)
    if dev.type != "cuda":
        raise SystemExit("the benchmark times CUDA graphs: it needs --device cuda")
    cfg = v3_moe_config(args)
    bf16 = build_model(cfg, dev, torch.bfloat16)
    fp8 = quantize_fp8(bf16)
    models = {}
    for name, m in (("bf16", bf16), ("fp8", fp8)):
        models[name] = mla_ops.hf.convert(m, fuse_experts=True)
    torch.cuda.empty_cache()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; {cfg.num_hidden_layers} "
          f"layers ({args.dense_layers} dense), {cfg.n_routed_experts} experts top "
          f"{cfg.num_experts_per_tok}; {'eager step' if args.no_compile else 'inductor'} in "
          f"a CUDA graph", flush=True)
    room = 2 + 2 + 4 + args.iters * args.rounds + 8
    rows = []
    for shape in args.shapes.split(","):
        B, S = (int(v) for v in shape.split("x"))
        res = {"B": B, "S": S, "layers": cfg.num_hidden_layers, "experts": cfg.n_routed_experts}
        for name, model in models.items():
            torch._dynamo.reset()
            cache = fill_cache(cfg, B, S, room, dev)
            runner = mla_ops.hf.DecodeGraph(model, cache, batch_size=B,
                                            compile=not args.no_compile)
            res[name] = time_steps(runner, B, dev, args.iters, args.rounds)
            res[name + "-floor"] = step_bytes(model, cfg, B, S) / HBM_BYTES_PER_S * 1e3
            del runner, cache
            torch.cuda.empty_cache()
        res["speedup"] = res["bf16"] / res["fp8"]
        res["fp8/floor"] = res["fp8"] / res["fp8-floor"]
        print(f"  B={B} S={S}: bf16 {res['bf16']:.3f} ms (floor {res['bf16-floor']:.3f}), "
              f"fp8 {res['fp8']:.3f} ms (floor {res['fp8-floor']:.3f}): {res['speedup']:.2f}x, "
              f"fp8 at {res['fp8/floor']:.2f}x its floor", flush=True)
        rows.append(res)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(res) + "\n")
    print("\n| B, S | bf16 ms | fp8 ms | fp8 speedup | fp8 floor ms | fp8 / floor |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['B']}, {r['S']} | {r['bf16']:.3f} | {r['fp8']:.3f} | {r['speedup']:.2f}x "
              f"| {r['fp8-floor']:.3f} | {r['fp8/floor']:.2f}x |")


if __name__ == "__main__":
    main()
