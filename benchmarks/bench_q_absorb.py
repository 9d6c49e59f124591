"""A decode step's query after q_a_layernorm: three launches against mla::decode_q_absorb.

    unfused: q = decode_linear(q_a, w) (the converted layer's GEMM op), mla::decode_q_rope(q),
             [q_nope @ W_UK_T | q_pe] (lowering.gemm.head_gemm.absorb_query)
    fused:   q_absorb_kernel, each config of SWEEP (checked against the unfused first)

DeepSeek-V3's query (q_lora 1536, 128 heads, P 128, R 64, L 512), bf16, interleaved RoPE.
The weights read are q_b's 75.5 MB and W_UK_T's 16.8 MB; "of ceiling" is the bytes over
the time, as a fraction of the measured copy ceiling. Prints the best configs as the
`lowering.fused.q_absorb.CONFIGS` entries they are.

With --weights fp8, q_b is an FP8 checkpoint's (e4m3, 128 x 128 block scales: 37.7 MB)
and q_a arrives quantized, as the prologue hands it over (mla::decode_qkv_prologue_fp8):
unfused is the fp8 decode GEMM op reading that quantization, the RoPE and the absorbed
GEMM; fused the kernel's W8A8 form (mla::decode_q_absorb_w8a8), its K step the scale
group; the entries printed are `W8A8_CONFIGS`'.

With --model v2-lite, DeepSeek-V2-Lite's decode query (16 heads, no q_lora): unfused is
the prologue op from the q_proj + kv_a partials (mla::decode_q_kv_rope: the query with
RoPE and the cache row) and the absorbed GEMM; fused mla::decode_q_kv_absorb's kernel, each
config of SWEEP_Q_KV (BLOCK_L, L_SPLIT, num_warps, num_stages); W_UK_T's 2.1 MB read.

    python benchmarks/bench_q_absorb.py --timer kernel --show      # rows 1 and 32
    python benchmarks/bench_q_absorb.py --weights fp8 --timer kernel
    python benchmarks/bench_q_absorb.py --model v2-lite --timer kernel
"""
from __future__ import annotations

import argparse

import torch

from timing import (add_timer_args, announce_ceiling, best_config, capture, kernel_time_us,
                    chosen_timer)
from lowering.fused import q_absorb
from lowering.gemm.fp8_act_quant import quantize_rows_torch
from lowering.gemm.head_gemm import absorb_query
from mla_ops.hf.linear import decode_linear

# (BLOCK_K, BLOCK_L, num_warps, num_stages) swept (W8A8: BLOCK_K is the scale group)
SWEEP = [(bk, bl, w, s) for bk in (64, 128) for bl in (64, 128) for w in (4, 8)
         for s in (2, 3, 4, 5)]
SWEEP_W8A8 = [(128, bl, w, s) for bl in (64, 128) for w in (4, 8) for s in (2, 3, 4, 5)]
SWEEP_Q_KV = [(bl, ls, w, s) for bl in (64, 128) for ls in (1, 2, 4, 8) for w in (4, 8)
              for s in (1, 2)]


def _graphed(fn, timer):
    """For the kernel timer, fn captured in a CUDA graph: its replay (three eager launches
    would otherwise time the host's launch gaps, not the kernels). The graph timer captures
    fn itself (a replay cannot be captured again)."""
    return capture(fn).replay if timer is kernel_time_us else fn


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,32", help="comma-separated token counts")
    ap.add_argument("--weights", choices=("bf16", "fp8"), default="bf16",
                    help="q_b's weights: bf16, or an FP8 checkpoint's (W8A8)")
    ap.add_argument("--model", choices=("v3", "v2-lite"), default="v3",
                    help="v3: q_b's query kernel; v2-lite: the query and cache row from the "
                         "q_proj + kv_a partials")
    add_timer_args(ap)
    args = ap.parse_args()
    timer = chosen_timer(args)
    ceil = announce_ceiling()
    if args.model == "v2-lite":
        return v2_lite(args, timer, ceil)
    Q, N, P, R, L = 1536, 128, 128, 64, 512
    dt, dev = torch.bfloat16, "cuda"
    fp8 = args.weights == "fp8"
    w = torch.randn(N * (P + R), Q, device=dev, dtype=dt) * Q ** -0.5
    wuk = torch.randn(N, P, L, device=dev, dtype=dt) * P ** -0.5
    if fp8:      # block-quantized as a checkpoint stores it: e4m3 and scale_inv per block
        blocks = w.float().unflatten(0, (-1, 128)).unflatten(-1, (-1, 128))  # [n, 128, k, 128]
        ws = blocks.abs().amax((1, 3)) / 448.0                               # [n, k]
        w = (blocks / ws[:, None, :, None]).to(torch.float8_e4m3fn).flatten(-2).flatten(0, 1)
    nbytes = w.numel() * w.element_size() + wuk.numel() * 2
    print("\n| rows | unfused µs (of ceiling) | fused µs (of ceiling) | fused / unfused | config |"
          "\n|---|---|---|---|---|")
    best = {}
    for T in (int(r) for r in args.rows.split(",")):
        q_a = torch.randn(T, Q, device=dev, dtype=dt)
        ang = torch.rand(T, R // 2, device=dev) * 100
        cos, sin = torch.cat([ang, ang], -1).cos().to(dt), torch.cat([ang, ang], -1).sin().to(dt)

        q_q, q_s = quantize_rows_torch(q_a, 128)            # as the prologue hands q_a over

        def unfused():
            if fp8:
                q = torch.ops.mla.decode_linear_fp8(q_a, w, ws, 128, 128, q_q, q_s)
            else:
                q = decode_linear(q_a, w)
            q = q.view(T, N, P + R)
            return absorb_query(torch.ops.mla.decode_q_rope(q, cos, sin, True), wuk)
        ref = unfused().float()
        t_unfused = timer(_graphed(unfused, timer))
        y = torch.empty(T, N, L + R, device=dev, dtype=dt)

        def make_run(cfg):
            def run():
                if fp8:
                    q_absorb.launch(q_q, w, wuk, cos, sin, True, y, config=cfg,
                                    w8a8=(ws, q_s, 128))
                else:
                    q_absorb.launch(q_a, w, wuk, cos, sin, True, y, config=cfg)
            return run, lambda: y
        us, cfg = best_config(SWEEP_W8A8 if fp8 else SWEEP, make_run, ref, timer=timer,
                              show=args.show)

        def cell(t):
            return f"{t:.1f} ({nbytes / t / 1e6 / (ceil / 1e12):.2f})"
        print(f"| {T} | {cell(t_unfused)} | {cell(us)} | {us / t_unfused:.2f} | {cfg} |",
              flush=True)
        best[T <= 16] = cfg
    print(f"\nlowering.fused.q_absorb.{'W8A8_CONFIGS' if fp8 else 'CONFIGS'} entries "
          f"(rows <= 16):")
    for k, cfg in best.items():
        print(f"    {k}: {cfg},")


def v2_lite(args, timer, ceil):
    """--model v2-lite: decode_q_kv_rope + the absorbed GEMM against q_kv_absorb_kernel."""
    N, P, R, L, H, S = 16, 128, 64, 512, 2048, 2          # two K splits of q_proj + kv_a
    dt, dev = torch.bfloat16, "cuda"
    wuk = torch.randn(N, P, L, device=dev, dtype=dt) * P ** -0.5
    w_kv = torch.rand(L, device=dev, dtype=dt) + 0.5
    nbytes = wuk.numel() * 2
    print("\n| rows | unfused µs (of ceiling) | fused µs (of ceiling) | fused / unfused | config |"
          "\n|---|---|---|---|---|")
    best = {}
    for T in (int(r) for r in args.rows.split(",")):
        part = torch.randn(S, T, N * (P + R) + L + R, device=dev) * (H ** -0.5)
        ang = torch.rand(T, R // 2, device=dev) * 100
        cos, sin = ang.cos(), ang.sin()

        def unfused():
            q, kv = torch.ops.mla.decode_q_kv_rope(part, w_kv, cos, sin, 1e-6, N)
            return absorb_query(q.reshape(T, N, P + R), wuk)
        ref = unfused().float()
        t_unfused = timer(_graphed(unfused, timer))
        y = torch.empty(T, N, L + R, device=dev, dtype=dt)
        kv_out = torch.empty(T, L + R, device=dev, dtype=dt)

        def make_run(cfg):
            def run():
                q_absorb.launch_q_kv(part, w_kv, wuk, cos, sin, 1e-6, y, kv_out, config=cfg)
            return run, lambda: y
        us, cfg = best_config(SWEEP_Q_KV, make_run, ref, timer=timer, show=args.show)

        def cell(t):
            return f"{t:.1f} ({nbytes / t / 1e6 / (ceil / 1e12):.2f})"
        print(f"| {T} | {cell(t_unfused)} | {cell(us)} | {us / t_unfused:.2f} | {cfg} |",
              flush=True)
        best[T] = cfg
    print("\nlowering.fused.q_absorb.Q_KV_CONFIG candidates (BLOCK_L, L_SPLIT, num_warps, "
          "num_stages) by rows:")
    for k, cfg in best.items():
        print(f"    {k}: {cfg}")


if __name__ == "__main__":
    main()
