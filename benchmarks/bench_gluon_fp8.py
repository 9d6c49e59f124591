"""The fp8 Gluon decode prototype (gluon_fp8_proto.py) on a GPU: correctness against
float64 on the dequantized values, then its time beside our BF16 kernels and FlashMLA.

    python benchmarks/bench_gluon_fp8.py      (H200, triton 3.6, flash_mla on the path)

Each shape: random q / paged cache (shuffled pages, -1 past each length in the block
table, NaN bytes in unwritten rows of a request's last page), quantized to e4m3 with
per-tensor scales. Prints the error against float64 (a wrong barrier shows up as garbage
or a hang: run it under `timeout`), then CUDA-graph medians of the prototype (each
STAGES in GLUON_FP8_STAGES), the gluon BF16 backend, the Triton fp8 q+cache kernel and
FlashMLA's kernels (schedule outside).
"""
import os
import sys
import time

import torch
import triton

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
import gluon_fp8_proto as g  # noqa: E402
from timing import graph_time_us  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: E402
import lowering  # noqa: E402
from lowering.triton_decode import mla_decode_fp8q, stage1_outputs  # noqa: E402
from lowering.triton_merge_kernel import mla_decode_merge_kernel  # noqa: E402
from mla_reference import decode_ref64, make_case, rel_err  # noqa: E402

L, R = 512, 64
STAGES = [int(s) for s in os.environ.get("GLUON_FP8_STAGES", "8,6").split(",")]


def fp8_decode(q8, kv8, table, lens, q_scale, k_scale, scale, splits, BN=32, STAGES=8):
    """Returns (run, out [B, S_Q, H, 512] bf16, lse [B, H, S_Q])."""
    B, S_Q, H, D = q8.shape
    f8 = gl.float8e4nv
    q_desc = TensorDescriptor.from_tensor(q8.reshape(B * S_Q * H, D), [64, 64],
                                          gl.NVMMASharedLayout.get_default_for([64, 64], f8))
    kv_desc = TensorDescriptor.from_tensor(kv8.view(-1, D), [BN, 64],
                                           gl.NVMMASharedLayout.get_default_for([BN, 64], f8))
    out, lse, o1, l1 = stage1_outputs(B, S_Q, H, 512, splits, torch.bfloat16, q8.device)

    def run():
        g.mla_decode_fp8_kernel[(S_Q * H // 64, B, splits)](
            q_desc, kv_desc, table, lens, q_scale, k_scale, o1, l1, scale * g.LOG2E,
            table.stride(0), table.shape[1], kv8.shape[0], splits, S_Q=S_Q, H=H,
            PAGE=kv8.shape[1], BN=BN, STAGES=STAGES, DIRECT=splits == 1, CAUSAL=True,
            num_warps=4)
        if splits > 1:
            mla_decode_merge_kernel[(S_Q * H, B)](
                o1, l1, out, lse, splits, S_Q=S_Q, H=H, L=512,
                SPLIT_BLOCK=min(16, triton.next_power_of_2(splits)), num_warps=4)
    return run, out, lse


def quantize(x):
    scale = (x.float().abs().amax() / 448.0).reshape(1)
    return (x.float() / scale).to(torch.float8_e4m3fn), scale


def poison_unwritten_rows(kv8, bt, cl):
    page = kv8.shape[1]
    kv8 = kv8.clone()
    raw = kv8.view(torch.uint8)
    for b, n in enumerate(cl.tolist()):
        if n % page:
            raw[int(bt[b, n // page]), n % page:] = 0x7F               # e4m3fn NaN
    return kv8


def main():
    dev, scale = "cuda", 192 ** -0.5
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cases = [(2, 1, 128, [200, 37], 0), (3, 1, 64, [1, 100, 777], 4), (2, 2, 128, [300, 65], 0),
             (1, 3, 64, [100], 0), (2, 1, 128, [5000, 40], 48),
             (32, 1, 128, [4096] * 32, None), (1, 1, 128, [4096], None),
             (64, 1, 128, [8192] * 64, None), (8, 1, 128, [32768] * 8, None)]
    for B, S_Q, H, lens, splits in cases:
        q, kv, bt, cl = make_case(B, S_Q, H, L, R, 64, lens, dev, seed=B + H)
        q8, q_scale = quantize(q)
        kv8, k_scale = quantize(kv)
        S = max(lens)
        if splits is None:
            splits = max(1, min(sms // (B * S_Q * H // 64), triton.cdiv(S, 256), 64))
        msg = f"B={B} s_q={S_Q} H={H} S={S} splits={splits}:"
        check = B * S <= 300_000
        if check:
            ref, ref_lse = decode_ref64(q8.double() * q_scale.double(), kv8.double() *
                                        k_scale.double(), bt, cl, scale, True, L)
        timed = S >= 4096 and len(set(lens)) == 1
        if timed:
            sched = lowering.decode_schedule(kv, bt, cl, num_heads=H)
            fm = graph_time_us(lambda: lowering.mla_decode(q, kv, bt, cl, scale,
                                                           backend="flashmla", schedule=sched))
            gb = graph_time_us(lambda: lowering.mla_decode(q, kv, bt, cl, scale, backend="gluon"))
            tq = graph_time_us(lambda: mla_decode_fp8q(q8, kv8, bt, cl, scale, q_scale=q_scale,
                                                       k_scale=k_scale))
            msg += f" FlashMLA kernels {fm:.1f} µs, gluon bf16 {gb:.1f}, triton fp8 {tq:.1f};"
        kv8_run = poison_unwritten_rows(kv8, bt, cl) if check else kv8
        for stages in STAGES:
            t0 = time.time()
            run, out, lse = fp8_decode(q8, kv8_run, bt, cl, q_scale, k_scale, scale, splits,
                                       STAGES=stages)
            run()
            torch.cuda.synchronize()
            msg += f" [{stages} stages, first call {time.time() - t0:.1f} s"
            if check:
                err = rel_err(out, ref)
                lerr = (lse.double() - ref_lse).abs().max().item()
                ok = err < 5e-2 and lerr < 1e-2 and bool(torch.isfinite(out).all())
                msg += f": rel err {err:.2e}, lse err {lerr:.1e} {'OK' if ok else 'WRONG'}"
            if timed:
                us = graph_time_us(run)
                msg += (f": {us:.1f} µs = {gb / us:.2f}x gluon bf16, {fm / us:.2f}x FlashMLA, "
                        f"{tq / us:.2f}x triton fp8")
            msg += "]"
        print(msg, flush=True)


if __name__ == "__main__":
    main()
