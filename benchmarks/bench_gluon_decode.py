"""The Gluon decode prototype (gluon_decode_proto.py) on a GPU: correctness against
float64, then its time against FlashMLA and the Triton kernel.

    python benchmarks/bench_gluon_decode.py      (H200, triton 3.6, flash_mla on the path)

Each shape: random bf16 q / paged cache (shuffled pages), every request at length S.
Prints the max error against the float64 reference (a wrong barrier shows up as garbage
or a hang: run it under `timeout`), then CUDA-graph medians of ours, FlashMLA (kernels
only: schedule outside) and the Triton stage-1 + merge.
"""
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import gluon_decode_proto as g  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: E402
import lowering  # noqa: E402
from lowering.triton_merge_kernel import mla_decode_merge_kernel  # noqa: E402


def gluon_decode(q, kv, table, lens, scale, splits, BN=32, STAGES=2):
    B, _, H, D = q.shape
    q2 = q.reshape(B * H, D)
    lay_q = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)
    lay_k = gl.NVMMASharedLayout.get_default_for([BN, 64], gl.bfloat16)
    q_desc = TensorDescriptor.from_tensor(q2, [64, 64], lay_q)
    kv_desc = TensorDescriptor.from_tensor(kv.view(-1, D), [BN, 64], lay_k)
    out = torch.empty(B, 1, H, 512, device=q.device, dtype=q.dtype)
    lse = torch.empty(B, H, 1, device=q.device, dtype=torch.float32)
    if splits == 1:
        o1, l1 = out, lse
    else:
        o1 = torch.empty(B, splits, H, 512, device=q.device, dtype=torch.float32)
        l1 = torch.empty(B, splits, H, device=q.device, dtype=torch.float32)

    def run():
        g.mla_decode_pingpong_kernel[(H // 64, B, splits)](
            q_desc, kv_desc, table, lens, o1, l1, scale * g.LOG2E, table.stride(0),
            table.shape[1], kv.shape[0], splits, H=H, PAGE=kv.shape[1], BN=BN,
            STAGES=STAGES, DIRECT=splits == 1, num_warps=4)
        if splits > 1:
            mla_decode_merge_kernel[(H, B)](o1, l1, out, lse, splits, S_Q=1, H=H, L=512,
                                            SPLIT_BLOCK=min(16, triton.next_power_of_2(splits)),
                                            num_warps=4)
    return run, out, lse


def reference(q, kv, table, lens, scale):
    B, _, H, D = q.shape
    outs = []
    for b in range(B):
        n = int(lens[b])
        rows = kv[table[b, : (n + 63) // 64].long()].reshape(-1, D)[:n].double()   # [n, 576]
        s = (q[b, 0].double() @ rows.T) * scale                                       # [H, n]
        outs.append(torch.softmax(s, -1) @ rows[:, :512])
    return torch.stack(outs)[:, None]                                                # [B, 1, H, 512]


def graph_us(fn):
    fn()
    torch.cuda.synchronize()
    g_ = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g_):
        fn()
    return triton.testing.do_bench(g_.replay, warmup=25, rep=200, return_mode="median") * 1e3


def main():
    torch.manual_seed(0)
    dev, dt, scale = "cuda", torch.bfloat16, 192 ** -0.5
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for B, H, S in [(2, 128, 200), (3, 64, 777), (32, 128, 4096), (1, 128, 4096),
                    (64, 128, 8192), (8, 128, 32768)]:
        nb = B * triton.cdiv(S, 64)
        kv = torch.randn(nb, 64, 576, device=dev, dtype=dt)
        table = torch.randperm(nb, device=dev, dtype=torch.int32).view(B, -1)
        lens = torch.full((B,), S, device=dev, dtype=torch.int32)
        if B == 3:
            lens = torch.tensor([1, 100, 777], device=dev, dtype=torch.int32)
        q = torch.randn(B, 1, H, 576, device=dev, dtype=dt)
        splits = max(1, min(sms // (B * H // 64), triton.cdiv(S, 256), 64))
        t0 = time.time()
        run, out, lse = gluon_decode(q, kv, table, lens, scale, splits)
        run()
        torch.cuda.synchronize()
        msg = f"B={B} H={H} S={S} splits={splits} (first call {time.time() - t0:.1f} s)"
        if B * S <= 300_000:
            ref = reference(q, kv, table, lens, scale)
            err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
            msg += f": rel err {err:.2e} {'OK' if err < 2e-2 else 'WRONG'}"
        if S >= 4096:
            ours = graph_us(run)
            sched = lowering.decode_schedule(kv, table, lens, num_heads=H)
            fm = graph_us(lambda: lowering.mla_decode(q, kv, table, lens, scale, backend="flashmla",
                                                      schedule=sched))
            tr = graph_us(lambda: lowering.mla_decode(q, kv, table, lens, scale, backend="triton"))
            msg += (f"; ours {ours:.1f} µs, FlashMLA kernels {fm:.1f} (ours {fm / ours:.2f}x of its "
                    f"throughput), Triton {tr:.1f} ({fm / tr:.2f}x)")
        print(msg, flush=True)


if __name__ == "__main__":
    main()
