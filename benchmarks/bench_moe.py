"""One DeepSeek MoE block alone (router, routed experts, shared experts) at the real V2-Lite
and V3 shapes, random weights, bf16: HF's block with its grouped_mm and eager experts
against the converted block (mla_ops.hf.moe.convert_moe: the routed experts of a decode step
on mla::moe_experts_decode), with the bytes floor.

    python benchmarks/bench_moe.py                      # H200: both shapes, T = 1, 32, 2048
    python benchmarks/bench_moe.py --shapes v2-lite --tokens 1 32 --json moe.json
    python benchmarks/bench_moe.py --tokens 512 2048 --sweep-stream --no-compile

Prefill rows (more tokens than the decode op takes) also time the routed experts alone in
both prefill forms (torch's grouped GEMM, the weight-streaming grouped kernel) on the same
routing, on CUDA.

Rows are tokens through the block: 1 and 32 are a decode step's B, 2048 a prefill. Each
variant is checked against HF's grouped_mm output first, then timed as the median of
CUDA-graph replays with the L2 flushed between them (timing.graph_time_us); HF's eager
experts (a data-dependent loop with host syncs, which a graph cannot capture) are timed
as eager calls. "compiled" variants are torch.compile(fullgraph=True) before capture.
The floor is the bytes the block must read (the router, the distinct experts the router
picked for this input, the shared experts) at the copy bandwidth measured here. Without
CUDA (a smoke run) the timings are wall-clock medians of eager calls.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch

SHAPES = {
    # hidden, moe_intermediate, experts, top_k, n_shared, (V3 only) n_group, topk_group
    "v2-lite": dict(family="v2", hidden_size=2048, moe_intermediate_size=1408,
                    n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2,
                    topk_method="greedy", routed_scaling_factor=1.0),
    "v3": dict(family="v3", hidden_size=7168, moe_intermediate_size=2048,
               n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1, n_group=8,
               topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.5),
    # a small one for a run without a GPU
    "tiny": dict(family="v3", hidden_size=256, moe_intermediate_size=96, n_routed_experts=16,
                 num_experts_per_tok=4, n_shared_experts=1, n_group=4, topk_group=2,
                 norm_topk_prob=True, routed_scaling_factor=2.5),
}


def build_block(shape: dict, device, dtype):
    """An HF MoE block of this shape with random weights (never zeros), on device."""
    from transformers import DeepseekV2Config, DeepseekV3Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    kw = dict(shape)
    family = kw.pop("family")
    cfg = (DeepseekV3Config if family == "v3" else DeepseekV2Config)(hidden_act="silu", **kw)
    cfg._experts_implementation = "grouped_mm"
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)               # the experts built in dtype: no fp32 copy
    try:
        with torch.device(device):
            block = (DeepseekV3MoE if family == "v3" else DeepseekV2Moe)(cfg)
    finally:
        torch.set_default_dtype(default)
    block = block.to(dtype).eval().requires_grad_(False)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():                        # in place: no temporary copy
            p.normal_(0.0, p.shape[-1] ** -0.5, generator=g)
        for name, b in block.named_buffers():
            if "e_score_correction_bias" in name:
                b.uniform_(0.0, 0.1, generator=g)
    return block


def copy_bandwidth(device) -> float:
    """Bytes per second a device copy moves (read + write) on 2 GiB."""
    import triton.testing
    src = torch.empty(1 << 30, dtype=torch.int16, device=device)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=10, rep=100,
                                 return_mode="median")
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def floor_bytes(block, topk_idx: torch.Tensor) -> int:
    e = block.experts
    distinct = int(torch.unique(topk_idx).numel())
    per_expert = (e.gate_up_proj[0].numel() + e.down_proj[0].numel()) * e.gate_up_proj.element_size()
    shared = sum(p.numel() * p.element_size() for p in block.shared_experts.parameters())
    router = block.gate.weight.numel() * block.gate.weight.element_size()
    return distinct * per_expert + shared + router


def time_us(fn, graph: bool) -> float:
    if not torch.cuda.is_available():
        fn()
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts) * 1e6
    import triton.testing
    if not graph:
        return triton.testing.do_bench(fn, warmup=5, rep=50, return_mode="median") * 1e3
    from timing import graph_time_us      # benchmarks/timing.py, beside this script
    return graph_time_us(fn, warmup_calls=3)


def hf_view(block):
    """HF's own block over the converted block's weights (no copies): the HF classes back on
    shallow copies of the block and its shared experts."""
    hf = copy.copy(block)
    hf._modules = dict(block._modules)
    hf.__class__ = type(block).__mro__[1]
    shared = copy.copy(block.shared_experts)
    shared.__class__ = next(c for c in type(shared).__mro__
                            if c.__module__.startswith("transformers."))
    hf._modules["shared_experts"] = shared
    return hf


def variants(block, compile_: bool):
    """(name, fn(x) -> y, capturable) of what is compared; block is converted already."""
    cfg = block.experts.config
    hf_block = hf_view(block)

    def hf(impl):
        def run(x):
            cfg._experts_implementation = impl
            try:
                return hf_block(x)
            finally:
                cfg._experts_implementation = "grouped_mm"
        return run

    out = [("hf grouped_mm", hf("grouped_mm"), True), ("hf eager", hf("eager"), False),
           ("ours", block.forward, True)]
    if compile_:
        out.insert(1, ("hf grouped_mm compiled",
                       torch.compile(hf("grouped_mm"), fullgraph=True), True))
        out.append(("ours compiled", torch.compile(block.forward, fullgraph=True), True))
    return out


def run_shape(name: str, tokens: list, args, bandwidth: float, device) -> list:
    from mla_ops.hf.moe import convert_moe, route
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    block = build_block(SHAPES[name], device, dtype)
    convert_moe(block)
    rows = []
    for T in tokens:
        x = torch.randn(1, T, block.gate.hidden_dim, device=device, dtype=dtype)
        with torch.no_grad():
            idx, _ = route(block, x.view(T, -1))
            nbytes = floor_bytes(block, idx)
            floor_us = nbytes / bandwidth * 1e6 if bandwidth else float("nan")
            ref = hf_view(block)(x).float()
            print(f"\n{name}, T={T}: {int(torch.unique(idx).numel())} distinct experts, "
                  f"{nbytes / 1e6:.1f} MB, floor {floor_us:.1f} µs")
            for vname, fn, capturable in variants(block, args.compile and T <= args.compile_max):
                if vname == "hf eager" and T > args.eager_max:
                    continue
                y = fn(x).float()
                err = ((y - ref).abs().max() / ref.abs().max()).item()
                us = time_us(lambda: fn(x), graph=capturable)
                rows.append(dict(shape=name, tokens=T, variant=vname, us=us, floor_us=floor_us,
                                 bytes=nbytes, rel_err=err))
                print(f"  {vname:26s} {us:10.1f} µs  {us / floor_us:6.2f}x floor  "
                      f"rel err {err:.1e}")
    del block
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


GATE_UP_SWEEP = [(16, 128, 4, 3), (16, 256, 4, 3), (32, 64, 4, 4), (32, 128, 4, 3),
                 (32, 128, 4, 4), (32, 256, 4, 3), (32, 256, 8, 3), (64, 64, 4, 3),
                 (64, 128, 4, 3), (64, 128, 8, 3), (64, 128, 4, 2), (128, 64, 8, 3)]
DOWN_SWEEP = [(32, 128, 4, 3), (32, 256, 4, 3), (64, 64, 4, 4), (64, 128, 4, 3),
              (64, 128, 4, 4), (64, 128, 8, 3), (64, 256, 4, 3), (64, 256, 8, 3),
              (128, 64, 4, 3), (128, 128, 8, 3), (128, 64, 8, 4), (32, 64, 4, 6)]


def sweep_shape(name: str, tokens: list, device) -> None:
    """Time each kernel of the decode op alone over the configs above (launchers called
    directly; nothing in the library is changed) and print the best as CONFIGS entries."""
    from lowering.moe import experts
    from mla_ops.hf.moe import convert_moe, route
    block = build_block(SHAPES[name], device, torch.bfloat16)
    convert_moe(block)
    e = block.experts
    gate_up, down = e.gate_up_proj, e.down_proj
    E, I2, H = gate_up.shape
    I = I2 // 2
    for T in [t for t in tokens if t <= experts.MAX_ROWS]:
        x = torch.randn(T, H, device=device, dtype=torch.bfloat16)
        with torch.no_grad():
            idx, w = route(block, x)
        K = idx.shape[1]
        pairs = experts.flat_pairs(idx)
        h = torch.empty(T * K, I, device=device, dtype=x.dtype)
        out = torch.zeros(T * K, H, device=device, dtype=torch.float32)
        wf = w.reshape(-1).float()
        best = {}
        for kernel, sweep in (("gate_up", GATE_UP_SWEEP), ("down", DOWN_SWEEP)):
            times = []
            for cfg in sweep:
                if kernel == "gate_up":
                    fn = lambda: experts.launch_gate_up(x, gate_up, pairs, K, h, cfg)
                else:
                    fn = lambda: experts.launch_down(h, down, wf, pairs, K, out, cfg)
                try:
                    times.append((time_us(fn, graph=True), cfg))
                except Exception as exc:                       # out of resources etc.
                    print(f"  {kernel} {cfg}: {type(exc).__name__}")
            us, cfg = min(times)
            best[kernel] = cfg
            N, Kdim = (I, H) if kernel == "gate_up" else (H, I)
            print(f"    ({kernel!r}, {N}, {Kdim}, {T <= 16}): {cfg},   # {name} T={T}: "
                  f"{us:.1f} µs")
    del block
    torch.cuda.empty_cache()


# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): few pairs an expert (weight-bound tiles), then
# GEMM tiles for many (where torch's grouped GEMM now runs: does the kernel beat it there?)
STREAM_SWEEP = [(bm, bn, bk, w, st) for bm in (16, 32, 64) for bn, bk, w, st in
                ((64, 128, 4, 3), (64, 64, 4, 4), (128, 64, 4, 3), (128, 64, 8, 3),
                 (64, 128, 4, 2), (32, 128, 4, 4))] + [
                (128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (64, 128, 64, 4, 4),
                (128, 64, 64, 4, 3), (64, 256, 64, 8, 3)]


def prefill_experts(name: str, tokens: list, bandwidth: float, device, sweep: bool) -> list:
    """The routed experts alone at prefill sizes, in lowering/moe/prefill.py's two forms on
    the same routing: torch's grouped GEMM and the weight-streaming grouped kernel, against
    the distinct experts' bytes; which one grouped_experts takes (STREAM_PAIRS). With sweep,
    the streaming kernels over STREAM_SWEEP, the best printed as STREAM_CONFIGS entries."""
    from lowering.moe import experts, prefill
    from mla_ops.hf.moe import convert_moe, route
    block = build_block(SHAPES[name], device, torch.bfloat16)
    convert_moe(block)
    gate_up, down = block.experts.gate_up_proj, block.experts.down_proj
    E = gate_up.shape[0]
    per_expert = (gate_up[0].numel() + down[0].numel()) * gate_up.element_size()
    rows = []
    for T in [t for t in tokens if t > experts.MAX_ROWS]:
        x = torch.randn(T, gate_up.shape[2], device=device, dtype=torch.bfloat16)
        with torch.no_grad():
            idx, w = route(block, x)
        K = idx.shape[1]
        nbytes = int(torch.unique(idx).numel()) * per_expert
        floor_us = nbytes / bandwidth * 1e6
        picks = "streamed" if T * K <= prefill.STREAM_PAIRS * E else "grouped_mm"
        print(f"\n{name} routed experts, T={T}: {T * K / E:.1f} pairs an expert, "
              f"{nbytes / 1e9:.2f} GB, floor {floor_us:.1f} µs; grouped_experts takes {picks}")
        forms = {"grouped_mm": prefill.grouped_mm_experts, "streamed": prefill.streamed_experts}
        ref = forms["grouped_mm"](x, idx, w, gate_up, down).float()
        for form, fn in forms.items():
            err = ((fn(x, idx, w, gate_up, down).float() - ref).abs().max()
                   / ref.abs().max()).item()
            us = time_us(lambda: fn(x, idx, w, gate_up, down), graph=True)
            rows.append(dict(shape=name, tokens=T, variant=f"experts {form}", us=us,
                             floor_us=floor_us, bytes=nbytes, rel_err=err))
            print(f"  {form:12s} {us:10.1f} µs  {us / floor_us:6.2f}x floor  "
                  f"{nbytes / us / 1e6:5.2f} TB/s  rel err vs grouped_mm {err:.1e}")
        if not sweep:
            continue
        for kernel in ("gate_up", "down"):
            times = []
            for cfg in STREAM_SWEEP:
                fn = lambda: prefill.streamed_experts(x, idx, w, gate_up, down, {kernel: cfg})
                try:
                    times.append((time_us(fn, graph=True), cfg))
                except Exception as exc:                       # out of resources etc.
                    print(f"  {kernel} {cfg}: {type(exc).__name__}")
            us, cfg = min(times)
            print(f"  best {kernel} (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) {cfg}: "
                  f"{us:.1f} µs (the whole form)")
    del block
    torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["v2-lite", "v3"], choices=sorted(SHAPES))
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 32, 2048],
                    help="tokens through the block (a decode step's B; a prefill's length)")
    ap.add_argument("--no-compile", dest="compile", action="store_false",
                    help="skip the torch.compile(fullgraph=True) variants")
    ap.add_argument("--compile-max", type=int, default=64,
                    help="compile variants only up to this many tokens (default 64)")
    ap.add_argument("--eager-max", type=int, default=4096,
                    help="time HF's eager experts only up to this many tokens")
    ap.add_argument("--json", metavar="PATH", help="write the rows as JSON here")
    ap.add_argument("--sweep-stream", action="store_true",
                    help="with the prefill rows (tokens past the decode op's), sweep the "
                         "streaming grouped kernel's configs (CUDA)")
    ap.add_argument("--sweep", action="store_true",
                    help="time the decode op's two kernels over candidate configs instead "
                         "(CUDA) and print the best as lowering.moe.experts.CONFIGS entries")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.sweep:
        if device.type != "cuda":
            raise SystemExit("--sweep needs a CUDA device")
        for name in args.shapes:
            sweep_shape(name, args.tokens, device)
        return
    bandwidth = copy_bandwidth(device) if device.type == "cuda" else 0.0
    if bandwidth:
        print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s ({torch.cuda.get_device_name()})")
    rows = []
    for name in args.shapes:
        rows += run_shape(name, args.tokens, args, bandwidth, device)
        if device.type == "cuda":
            rows += prefill_experts(name, args.tokens, bandwidth, device, args.sweep_stream)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=str(device), bandwidth=bandwidth, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
