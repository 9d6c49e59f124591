"""How the W8A8 query kernel (q_b + RoPE + W_UK_T absorption, one program per head) scales
with the bytes each program streams and with the programs per SM, at one row (probe, not
maintained): DeepSeek-V3's widths (P 128, R 64), e4m3 q_b with 128 x 128 scales, bf16
W_UK_T; Q (q_b's K: phase 1) and L (W_UK_T's columns: phase 2) varied, N heads varied
(128: one program per SM; 256: two), and the shipped config beside other stages / warps;
the q_b fp8 decode GEMM op alone for reference. Each launch captured in a CUDA graph, L2
flushed before each replay, median µs.

    python docs/notes/probe_q_absorb_scaling.py
"""
import torch
from lowering.fused import q_absorb
from lowering.gemm.fp8_act_quant import quantize_rows_torch
from probe_common import graph_us_write_flush as graph_us


def case(N, Q, L, cfg=None, T=1, P=128, R=64):
    dev, dt = "cuda", torch.bfloat16
    w = torch.randn(N * (P + R), Q, device=dev) * Q ** -0.5
    blocks = w.unflatten(0, (-1, 128)).unflatten(-1, (-1, 128))
    ws = blocks.abs().amax((1, 3)) / 448.0
    w8 = (blocks / ws[:, None, :, None]).to(torch.float8_e4m3fn).flatten(-2).flatten(0, 1)
    wuk = (torch.randn(N, P, L, device=dev) * P ** -0.5).to(dt)
    q_a = torch.randn(T, Q, device=dev, dtype=dt)
    q_q, q_s = quantize_rows_torch(q_a, 128)
    ang = torch.rand(T, R // 2, device=dev) * 100
    cos, sin = torch.cat([ang, ang], -1).cos().to(dt), torch.cat([ang, ang], -1).sin().to(dt)
    y = torch.empty(T, N, L + R, device=dev, dtype=dt)
    cfg = cfg or q_absorb.w8a8_config(T, Q, L, 128)
    us = graph_us(lambda: q_absorb.launch(q_q, w8, wuk, cos, sin, True, y, config=cfg,
                                          w8a8=(ws, q_s, 128)))
    ph1, ph2 = N * (P + R) * Q, N * P * L * 2
    gemm = graph_us(lambda: torch.ops.mla.decode_linear_fp8(q_a, w8, ws, 128, 128, q_q, q_s))
    print(f"N {N:4d} Q {Q:5d} L {L:4d} cfg {cfg}: {us:6.1f} µs; per program "
          f"{(ph1 + ph2) / N / 1024:6.1f} KB (q_b {ph1 / N / 1024:.0f} + W_UK_T "
          f"{ph2 / N / 1024:.0f}), {(ph1 + ph2) / us / 1e6:.2f} TB/s; q_b GEMM op alone "
          f"{gemm:.1f} µs", flush=True)


def main():
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    shipped = q_absorb.w8a8_config(1, 1536, 512, 128)
    for N, Q, L in ((128, 1536, 512), (128, 768, 512), (128, 384, 512), (128, 1536, 256),
                    (128, 1536, 128), (64, 1536, 512), (256, 1536, 512), (256, 768, 256)):
        case(N, Q, L)
    for cfg in ((128, 128, 4, 4), (128, 128, 4, 5), (128, 128, 8, 3), (128, 128, 8, 5),
                (128, 64, 4, 3), (128, 64, 8, 4)):
        if cfg != shipped:
            case(128, 1536, 512, cfg)


if __name__ == "__main__":
    main()
