"""The fp8 decode GEMM with its activations quantized once (act_quant_kernel, then the GEMM
reading e4m3 x and its scales: launch(pre_quant=True), the default) against every program
quantizing its x tiles itself (pre_quant=False, the kernel before), at DeepSeek-V3's
decode shapes with the shipped CONFIGS (H200 probe, not maintained). µs of fp8_linear.run
(the quant kernel and any split reduce included; CUDA-graph replay, L2 flushed), the
outputs compared bit for bit.

    python docs/notes/probe_fp8_prequant.py
"""
import sys
import torch
sys.path.insert(0, "benchmarks")                    # run from the repository root
from bench_fp8_weights import SWEEP_SHAPES, quick_time_us, sweep_tensors
from lowering.gemm import fp8_linear
from lowering.gemm import fp8_linear_configs

for M in (1, 32):
    for mode, N, K, what in SWEEP_SHAPES:
        t = sweep_tensors(mode, N, K, M)
        x, ws, ss, _, y1, y2 = t
        cfg = fp8_linear_configs.pick_config(mode, N if mode != 1 else N, K, M)
        w2, s2 = (ws[1], ss[1]) if mode else (None, None)
        outs, us = [], []
        for pq in (False, True):
            o1, o2 = torch.empty_like(y1), torch.empty_like(y2)

            def call(o1=o1, o2=o2, pq=pq):
                fp8_linear.run(x, ws[0], ss[0], w2, s2, mode, o1, o2 if mode == 1 else None,
                               128, 128, cfg, pre_quant=pq)
            call(); torch.cuda.synchronize()
            outs.append((o1.clone(), o2.clone()))
            us.append(quick_time_us(call))
        same = all(torch.equal(a, b) for a, b in zip(*outs))
        print(f"M={M:2d} {what:24s} cfg {cfg}: in-program quant {us[0]:7.1f} µs, "
              f"quantized once {us[1]:7.1f} µs ({us[0] / us[1]:.2f}x), bit-equal {same}",
              flush=True)
