"""The fp8 routed experts (lowering/moe/fp8_experts.py) at DeepSeek-V3's shape with each
kernel's activations quantized once before it (PRE_QUANT) or by every program (H200
probe, not maintained): µs of run_kernels (CUDA-graph replay, L2 flushed) for the four
(gate_up, down) choices, T tokens of top-8 among 256 experts, and the largest difference
from the all-in-program result.

    python docs/notes/probe_fp8_experts_prequant.py
"""
import sys
import torch
sys.path.insert(0, "benchmarks")                    # run from the repository root
from bench_fp8_weights import quick_time_us
from lowering.moe import fp8_experts

dev, FP8 = torch.device("cuda"), torch.float8_e4m3fn
E, I, H, K = 256, 2048, 7168, 8
g = torch.Generator(device=dev).manual_seed(0)
gu = (torch.randn(E, 2 * I, H, device=dev, generator=g) * 100).clamp(-448, 448).to(FP8)
gus = torch.rand(E, 2 * I // 128, H // 128, device=dev, generator=g) * 0.02 + 1e-3
dn = (torch.randn(E, H, I, device=dev, generator=g) * 100).clamp(-448, 448).to(FP8)
dns = torch.rand(E, H // 128, I // 128, device=dev, generator=g) * 0.02 + 1e-3
for T in (1, 32):
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    idx = torch.stack([torch.randperm(E, device=dev)[:K] for _ in range(T)])
    w = torch.rand(T, K, device=dev)
    base = None
    for pq in ((False, False), (True, False), (False, True), (True, True)):
        def call(pq=pq):
            return fp8_experts.run_kernels(x, idx, w, gu, gus, dn, dns, 128, 128, pre_quant=pq)
        out = call()
        base = out if base is None else base
        err = ((out.float() - base.float()).abs().max() / base.float().abs().max()).item()
        print(f"T={T:2d} pre-quant (gate_up, down) = {pq}: {quick_time_us(call):7.1f} µs, "
              f"max rel diff {err:.2e}", flush=True)
# tiles for the pre-quantized kernels (DEFAULT_CONFIG's entries replaced one at a time)
default = dict(fp8_experts.DEFAULT_CONFIG)
for T in (1, 32):
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    idx = torch.stack([torch.randperm(E, device=dev)[:K] for _ in range(T)])
    w = torch.rand(T, K, device=dev)
    for kernel, tiles in (("gate_up", [(16, 4, 3), (32, 4, 4), (64, 4, 3), (64, 4, 4)]),
                          ("down", [(32, 4, 3), (64, 4, 4), (128, 4, 3), (128, 8, 4)])):
        for tile in tiles:
            fp8_experts.DEFAULT_CONFIG[kernel] = (*tile, True)

            def call():
                return fp8_experts.run_kernels(x, idx, w, gu, gus, dn, dns, 128, 128)
            call()
            print(f"T={T:2d} {kernel:7s} tile {tile}: {quick_time_us(call):7.1f} µs", flush=True)
        fp8_experts.DEFAULT_CONFIG.update(default)
