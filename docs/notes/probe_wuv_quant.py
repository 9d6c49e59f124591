"""The W_UV GEMM with o_proj's activation quant in its epilogue, against the two launches
an FP8 checkpoint's decode step runs today (GPU probe, not maintained).

Today: the attention's W_UV GEMM (lowering/gemm/head_gemm.py, bf16 out [t, N * V]), then
o_proj's op quantizes that row per 128 columns (act_quant_kernel, one launch) before its
fp8 GEMM. The alternative: lowering/fused/wuv_quant.py writes the e4m3 row and its scales
from the GEMM's epilogue (one launch, the path Pass B takes). Each variant captured in a
CUDA graph; µs from its first kernel's start to its last one's end (the gap between two
launches counted), L2 flushed before each call. The outputs are compared dequantized
(the two GEMMs sum in different orders, so a value may round to a neighbouring e4m3).
--sweep also times the fused kernel at each (BLOCK_L, num_warps, num_stages) of SWEEP and
prints the fastest per row count (wuv_quant.CONFIGS' entries).

    python docs/notes/probe_wuv_quant.py [t,t,...] [--heads N] [--sweep]
"""
import sys

import torch

sys.path.insert(0, "benchmarks")                    # run from the repository root
from timing import capture, kernel_time_us

from lowering.fused.wuv_quant import CONFIGS, wuv_quant
from lowering.gemm.fp8_act_quant import quant_buffers, quantized
from lowering.gemm.head_gemm import absorb_output

L, V, GROUP = 512, 128, 128
SWEEP = [(bl, w, s) for bl in (32, 64, 128) for w in (4, 8) for s in (2, 3, 4, 5)]


def t_graph(fn):
    g = capture(fn, 2)
    return kernel_time_us(g.replay, reps=30)


def main():
    args = sys.argv[1:]
    heads = 128
    if "--heads" in args:
        i = args.index("--heads")
        heads = int(args[i + 1])
        del args[i:i + 2]
    sweep = "--sweep" in args
    if sweep:
        args.remove("--sweep")
    rows = [int(x) for x in (args[0] if args else "1,4,32").split(",")]
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    g = torch.Generator(device="cuda").manual_seed(0)
    W = (torch.randn(heads, L, V, device="cuda", generator=g) / 16).bfloat16()
    for t in rows:
        a = torch.randn(t, heads, L, device="cuda", generator=g).bfloat16()
        dst = torch.empty(t, heads * V, dtype=torch.bfloat16, device="cuda")
        bufs = quant_buffers(dst, GROUP)
        y = torch.empty(t, heads * V, dtype=torch.float8_e4m3fn, device="cuda")
        s = torch.empty(t, heads * V // GROUP, dtype=torch.float32, device="cuda")

        def two():
            absorb_output(a, W, dst)
            quantized(dst, GROUP, True, out=bufs)

        def one():
            wuv_quant(a, W, group_size=GROUP, out=y, block_scale=s)

        def gemm_only():
            absorb_output(a, W, dst)

        two()
        one()
        d1 = bufs[0].double() * bufs[1].repeat_interleave(GROUP, 1).double()
        d2 = y.double() * s.repeat_interleave(GROUP, 1).double()
        rel = ((d1 - d2).norm() / d1.norm()).item()
        differ = (bufs[0].view(torch.uint8) != y.view(torch.uint8)).double().mean().item()
        t2, t1, tg = t_graph(two), t_graph(one), t_graph(gemm_only)
        mb = heads * L * V * 2 / 1e6
        print(f"t={t:3d} heads={heads}  W_UV {mb:.1f} MB  head GEMM alone {tg:6.1f} us  "
              f"head GEMM + act quant {t2:6.1f} us  fused {t1:6.1f} us  "
              f"two / fused {t2 / t1:5.2f}x  (rel diff {rel:.1e}, e4m3 codes differing "
              f"{differ:.1e}; config {CONFIGS[t <= 16]})")
        if sweep:
            times = {}
            for cfg in SWEEP:
                def run(cfg=cfg):
                    wuv_quant(a, W, group_size=GROUP, out=y, block_scale=s, config=cfg)
                try:
                    times[cfg] = t_graph(run)
                except Exception as exc:     # e.g. out of shared memory
                    print(f"  {cfg}: {type(exc).__name__}")
            for cfg, us in sorted(times.items(), key=lambda kv: kv[1])[:6]:
                print(f"  {cfg}: {us:6.1f} us  (two launches / this {t2 / us:5.2f}x)")


if __name__ == "__main__":
    main()
