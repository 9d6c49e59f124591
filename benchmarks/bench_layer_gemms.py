"""The weight GEMMs of one DeepSeek-V3-shaped decode layer (and the output head), one by
one, at decode batch sizes.

A decode step streams every weight once; at M <= 32 rows each GEMM is a weight read, so its
time against the copy ceiling says how close the layer can get to the bandwidth floor.
Each row times what HF's modules run (cuBLAS, `torch.mm`; for the fused rows the unfused
GEMMs they replace) against the weight-streaming kernel of lowering/gemm/linear_kernel.py in the
mode the converted model uses (q_a + kv_a in one launch, gate + up with SiLU x up in one
launch), best of CONFIGS, each checked against cuBLAS first. Prints the best configs as
the `lowering.gemm.linear.CONFIGS` entries they are.

    python benchmarks/bench_layer_gemms.py                   # H200: V3 dims, M = 1 and 32
    python benchmarks/bench_layer_gemms.py --model v2-lite   # V2-Lite's dims (v2: V2 / V2.5)
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from timing import (announce_ceiling, best_config, gemm_header, gemm_row,
                    add_timer_args, chosen_timer, print_configs)
from lowering.gemm import linear

# (name, mode, out_features (w1, w2), in_features) of V3's attention + dense MLP weights
V3_GEMMS = [
    ("q_a_proj + kv_a_proj_with_mqa", 1, (1536, 576), 7168),
    ("q_b_proj", 0, (128 * 192,), 1536),
    ("o_proj", 0, (7168,), 128 * 128),
    ("gate_proj, up_proj (+ SiLU x up)", 2, (18432, 18432), 7168),
    ("down_proj", 0, (7168,), 18432),
    ("lm_head, V3 vocabulary (once per step)", 0, (129280,), 7168),
    ("lm_head, 2048-token vocabulary (the HF benchmark's)", 0, (2048,), 7168),
]
# DeepSeek-V2-Lite: no q_lora (q_proj + kv_a in one launch), 16 heads, hidden 2048, dense
# intermediate 10944, shared experts 2 x 1408
V2_LITE_GEMMS = [
    ("q_proj + kv_a_proj_with_mqa", 1, (16 * 192, 576), 2048),
    ("o_proj", 0, (2048,), 16 * 128),
    ("gate_proj, up_proj (+ SiLU x up), dense layer", 2, (10944, 10944), 2048),
    ("down_proj, dense layer", 0, (2048,), 10944),
    ("shared experts gate + up (+ SiLU x up)", 2, (2816, 2816), 2048),
    ("shared experts down", 0, (2048,), 2816),
    ("lm_head, 2048-token vocabulary (the HF benchmark's)", 0, (2048,), 2048),
]
# DeepSeek-V2 / V2.5 (hidden 5120, 128 heads, q_lora 1536, dense intermediate 12288,
# shared experts 2 x 1536)
V2_GEMMS = [
    ("q_a_proj + kv_a_proj_with_mqa", 1, (1536, 576), 5120),
    ("q_b_proj", 0, (128 * 192,), 1536),
    ("o_proj", 0, (5120,), 128 * 128),
    ("gate_proj, up_proj (+ SiLU x up), dense layer", 2, (12288, 12288), 5120),
    ("down_proj, dense layer", 0, (5120,), 12288),
    ("shared experts gate + up (+ SiLU x up)", 2, (3072, 3072), 5120),
    ("shared experts down", 0, (5120,), 3072),
]
MODELS = {"v3": V3_GEMMS, "v2-lite": V2_LITE_GEMMS, "v2": V2_GEMMS}

# (BLOCK_N, BLOCK_K, num_warps, num_stages) swept
SWEEP = [
    (16, 256, 4, 4), (16, 256, 4, 8), (16, 512, 4, 4), (16, 512, 4, 6), (32, 128, 4, 8),
    (32, 256, 4, 4), (32, 256, 4, 6), (32, 256, 8, 6), (32, 512, 4, 3), (32, 512, 8, 4),
    (64, 128, 4, 6), (64, 128, 8, 8), (64, 256, 4, 4), (64, 256, 8, 4), (128, 128, 8, 4),
    (32, 64, 4, 8), (32, 128, 4, 6), (64, 64, 4, 8), (64, 128, 4, 5), (128, 64, 4, 4),
    (128, 64, 8, 4),
    # few stages: several programs per SM, all resident in one wave
    (64, 64, 4, 3), (64, 64, 8, 3), (64, 128, 4, 2), (64, 128, 4, 3),
]

# split-K variants (fifth entry: K splits), tried for modes 0 and 1; timed without the sum
# of the partials, which a converted model leaves to Inductor to fuse into the consumer
SPLIT_SWEEP = [
    (16, 256, 4, 4, 2), (16, 256, 4, 4, 4), (16, 128, 4, 4, 4), (16, 128, 4, 6, 7),
    (32, 256, 4, 4, 2), (32, 256, 4, 4, 4), (32, 128, 4, 4, 7), (16, 512, 4, 3, 2),
    (64, 128, 4, 4, 2), (64, 128, 4, 4, 4), (16, 256, 4, 4, 7), (32, 128, 4, 6, 4),
]


def reference(mode, x, ws):
    """What HF's modules compute, in fp32 (for the check) and as a timed cuBLAS closure."""
    if mode == 2:
        ref = F.silu(x.float() @ ws[0].float().T) * (x.float() @ ws[1].float().T)
    else:
        ref = torch.cat([x.float() @ w.float().T for w in ws], dim=-1)
    outs = [torch.empty(x.shape[0], w.shape[0], device=x.device, dtype=x.dtype) for w in ws]

    def cublas():              # the GEMMs alone (the SiLU x up kernel not counted)
        for w, o in zip(ws, outs):
            torch.mm(x, w.t(), out=o)
    return ref, cublas


def best_triton(mode, x, ws, ref, timer=None, show=False):
    """(µs, config) of the fastest correct config."""
    M = x.shape[0]
    y1 = torch.empty(M, ws[0].shape[0], device=x.device, dtype=x.dtype)
    y2 = torch.empty(M, ws[1].shape[0], device=x.device, dtype=x.dtype) if mode == 1 else None
    w2 = ws[1] if len(ws) > 1 else None
    N = sum(w.shape[0] for w in ws) if mode == 1 else ws[0].shape[0]

    def make_run(cfg):
        S = linear.split_k_of(cfg)
        parts = torch.empty(S, M, N, device=x.device, dtype=torch.float32) if S > 1 else None

        def run():            # split-K as the partials op launches it: one output tensor
            if S > 1:
                linear.launch(x, ws[0], w2, mode, parts, None, cfg,
                              y2_col0=ws[0].shape[0] if mode == 1 else 0)
            else:
                linear.launch(x, ws[0], w2, mode, y1, y2, cfg)

        def output():
            if S > 1:
                return parts.sum(0)
            return torch.cat([y1, y2], -1) if mode == 1 else y1
        return run, output
    return best_config(SWEEP + (SPLIT_SWEEP if mode != 2 else []), make_run, ref, timer=timer,
                       show=show)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,32")
    ap.add_argument("--model", default="v3", choices=sorted(MODELS), help="whose weight shapes")
    ap.add_argument("--gemms", default=None,
                    help="indices into the model's GEMMs to time, e.g. 0,2 (default: all)")
    add_timer_args(ap)
    args = ap.parse_args()
    timer = chosen_timer(args)
    dev = torch.device("cuda")
    ceil = announce_ceiling()
    configs = {}
    for M in (int(m) for m in args.rows.split(",")):
        gemm_header(f"M = {M}", "weight MB", "Triton")
        tot_c = tot_t = tot_b = 0.0
        gemms = MODELS[args.model]
        chosen = gemms if args.gemms is None else [gemms[int(i)] for i in args.gemms.split(",")]
        for name, mode, ns, k in chosen:
            ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for n in ns]
            x = torch.randn(M, k, device=dev, dtype=torch.bfloat16)
            ref, cublas = reference(mode, x, ws)
            nbytes = sum(w.numel() * 2 for w in ws) + x.numel() * 2 + M * sum(ns) * 2
            c_us = timer(cublas)
            t_us, cfg = best_triton(mode, x, ws, ref, timer, args.show)
            if not name.startswith("lm_head"):           # "the layer" counts its own GEMMs
                tot_c, tot_t, tot_b = tot_c + c_us, tot_t + t_us, tot_b + nbytes
            configs[(mode, sum(ns) if mode == 1 else ns[0], k, M <= 16)] = cfg
            print(gemm_row(name, f"{nbytes / 1e6:.1f}", nbytes, c_us, t_us, ceil, cfg), flush=True)
            del ws
        if tot_b:
            print(gemm_row("the layer", f"{tot_b / 1e6:.0f}", tot_b, tot_c, tot_t, ceil), flush=True)
    print_configs("lowering.gemm.linear.CONFIGS", configs)


if __name__ == "__main__":
    main()
