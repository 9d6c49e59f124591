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
from timing import graph_time_us  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: E402
import lowering  # noqa: E402
from lowering.triton_merge_kernel import mla_decode_merge_kernel  # noqa: E402


def gluon_decode(q, kv, table, lens, scale, splits, BN=32, STAGES=2):
    B, S_Q, H, D = q.shape
    q2 = q.reshape(B * S_Q * H, D)
    lay_q = gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16)
    lay_k = gl.NVMMASharedLayout.get_default_for([BN, 64], gl.bfloat16)
    q_desc = TensorDescriptor.from_tensor(q2, [64, 64], lay_q)
    kv_desc = TensorDescriptor.from_tensor(kv.view(-1, D), [BN, 64], lay_k)
    out = torch.empty(B, S_Q, H, 512, device=q.device, dtype=q.dtype)
    lse = torch.empty(B, H, S_Q, device=q.device, dtype=torch.float32)
    if splits == 1:
        o1, l1 = out, lse
    else:
        o1 = torch.empty(B, splits, S_Q * H, 512, device=q.device, dtype=torch.float32)
        l1 = torch.empty(B, splits, S_Q * H, device=q.device, dtype=torch.float32)

    def run():
        g.mla_decode_pingpong_kernel[(S_Q * H // 64, B, splits)](
            q_desc, kv_desc, table, lens, o1, l1, scale * g.LOG2E, table.stride(0),
            table.shape[1], kv.shape[0], splits, S_Q=S_Q, H=H, PAGE=kv.shape[1], BN=BN,
            STAGES=STAGES, DIRECT=splits == 1, num_warps=4)
        if splits > 1:
            mla_decode_merge_kernel[(S_Q * H, B)](
                o1, l1, out, lse, splits, S_Q=S_Q, H=H, L=512,
                SPLIT_BLOCK=min(16, triton.next_power_of_2(splits)), num_warps=4)
    return run, out, lse


def reference(q, kv, table, lens, scale):
    """float64 out [B, S_Q, H, 512] and lse [B, H, S_Q]; token t sees keys
    [0, len - S_Q + t]."""
    B, S_Q, H, D = q.shape
    outs, lses = [], []
    for b in range(B):
        n = int(lens[b])
        rows = kv[table[b, : (n + 63) // 64].long()].reshape(-1, D)[:n].double()   # [n, 576]
        o_b, l_b = [], []
        for t in range(S_Q):
            vis = rows[: n - S_Q + t + 1]
            sc = (q[b, t].double() @ vis.T) * scale                                   # [H, n']
            o_b.append(torch.softmax(sc, -1) @ vis[:, :512])
            l_b.append(torch.logsumexp(sc, -1))
        outs.append(torch.stack(o_b))
        lses.append(torch.stack(l_b, -1))
    return torch.stack(outs), torch.stack(lses)


def main():
    torch.manual_seed(0)
    dev, dt, scale = "cuda", torch.bfloat16, 192 ** -0.5
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for B, S_Q, H, S in [(2, 1, 128, 200), (3, 1, 64, 777), (2, 2, 128, 300), (1, 3, 64, 100),
                         (32, 1, 128, 4096), (1, 1, 128, 4096), (64, 1, 128, 8192),
                         (8, 1, 128, 32768)]:
        nb = B * triton.cdiv(S, 64)
        kv = torch.randn(nb, 64, 576, device=dev, dtype=dt)
        table = torch.randperm(nb, device=dev, dtype=torch.int32).view(B, -1)
        lens = torch.full((B,), S, device=dev, dtype=torch.int32)
        if B == 3:
            lens = torch.tensor([1, 100, 777], device=dev, dtype=torch.int32)
        q = torch.randn(B, S_Q, H, 576, device=dev, dtype=dt)
        splits = max(1, min(sms // (B * S_Q * H // 64), triton.cdiv(S, 256), 64))
        t0 = time.time()
        run, out, lse = gluon_decode(q, kv, table, lens, scale, splits)
        run()
        torch.cuda.synchronize()
        msg = f"B={B} s_q={S_Q} H={H} S={S} splits={splits} (first call {time.time() - t0:.1f} s)"
        if B * S <= 300_000:
            ref, ref_lse = reference(q, kv, table, lens, scale)
            err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
            lerr = (lse.double() - ref_lse).abs().max().item()
            ok = err < 2e-2 and lerr < 1e-2
            msg += f": rel err {err:.2e}, lse err {lerr:.1e} {'OK' if ok else 'WRONG'}"
        if S >= 4096:
            ours = graph_time_us(run)
            sched = lowering.decode_schedule(kv, table, lens, num_heads=H)
            fm = graph_time_us(lambda: lowering.mla_decode(
                q, kv, table, lens, scale, backend="flashmla", schedule=sched))
            tr = graph_time_us(lambda: lowering.mla_decode(q, kv, table, lens, scale, backend="triton"))
            msg += (f"; ours {ours:.1f} µs, FlashMLA kernels {fm:.1f} (ours {fm / ours:.2f}x of its "
                    f"throughput), Triton {tr:.1f} ({fm / tr:.2f}x)")
        print(msg, flush=True)


if __name__ == "__main__":
    main()
