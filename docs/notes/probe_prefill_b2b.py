"""Prefill attention (H200 probe, not maintained): lowering.prefill.varlen_attention against
SDPA's cuDNN call and the raw aten cuDNN op with its LSE, timed one call per event pair
after an idle GPU and 20 calls back to back (the host's launch time hidden).

    python docs/notes/probe_prefill_b2b.py
"""
import torch, statistics
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from lowering.prefill import varlen_attention
def t(fn, reps):
    for _ in range(3): fn()
    torch.cuda.synchronize(); xs = []
    for _ in range(7):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps): fn()
        b.record(); torch.cuda.synchronize(); xs.append(a.elapsed_time(b) / reps)
    return statistics.median(xs)
for B, H, S in ((1,128,8192),(8,128,2048),(1,16,8192),(8,16,2048)):
    q = torch.randn(B*S, H, 192, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B*S, H, 192, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B*S, H, 128, device="cuda", dtype=torch.bfloat16)
    cu = (torch.arange(B+1, device="cuda")*S).to(torch.int32)
    qd, kd, vd = (x.view(B, S, H, -1).transpose(1, 2) for x in (q, k, v))
    def cud():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=192**-0.5)
    def raw():
        return torch.ops.aten._scaled_dot_product_cudnn_attention(qd, kd, vd, None, True, 0.0, True, False, scale=192**-0.5)
    ours = lambda: varlen_attention(q, k, v, cu, S, 192**-0.5)
    fl = 2*B*H*S*S/2*320
    r = {n: (t(f, 1), t(f, 20)) for n, f in (("ours", ours), ("sdpa-cudnn", cud), ("raw-cudnn-lse", raw))}
    print(B, H, S, "  ".join(f"{n}: {a*1e3:.0f}/{b*1e3:.0f} µs ({fl/b/1e9:.0f} TF/s b2b)" for n, (a, b) in r.items()),
          f" ours/cudnn single {r['sdpa-cudnn'][0]/r['ours'][0]:.3f} b2b {r['sdpa-cudnn'][1]/r['ours'][1]:.3f}", flush=True)
