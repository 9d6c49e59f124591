"""Which torch kernels serve MLA prefill attention (q/k 192, v 128) with its LSE, and how
fast: the aten cuDNN ops' schemas, dense cuDNN SDPA with the LSE at four shapes, the
packed varlen cuDNN op (correct but 10-20x slower), and a ragged batch vs float64.
(2026-12-02, H200, torch 2.11: the choice of cuDNN for lowering/prefill/dense.py.)"""
import torch, time, traceback, math
print(torch.__version__, torch.version.cuda, torch.backends.cudnn.version(), torch.cuda.get_device_name())
for name in ["_cudnn_attention_forward", "_scaled_dot_product_cudnn_attention", "_flash_attention_forward", "_efficient_attention_forward"]:
    op = getattr(torch.ops.aten, name, None)
    print(name, None if op is None else [str(s) for s in op._schemas.values()] if hasattr(op, "_schemas") else op.default._schema)
try:
    import torch.nn.attention.varlen as V
    print("varlen module:", dir(V))
except Exception as e:
    print("no varlen", e)
dev = "cuda"
def bench(fn, n=20):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
    e0.record()
    for _ in range(n): fn()
    e1.record(); torch.cuda.synchronize()
    return e0.elapsed_time(e1) / n
scale = 192 ** -0.5
for B, H, S in [(1, 128, 8192), (8, 128, 2048), (1, 16, 8192), (8, 16, 2048)]:
    q = torch.randn(B, H, S, 192, device=dev, dtype=torch.bfloat16)
    k = torch.randn(B, H, S, 192, device=dev, dtype=torch.bfloat16)
    v = torch.randn(B, H, S, 128, device=dev, dtype=torch.bfloat16)
    flops = 2 * B * H * S * S * (192 + 128) / 2
    try:
        f = lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False, scale=scale)
        out = f()
        print("cudnn dense out shapes", [getattr(o, "shape", o) for o in out][:3])
        t = bench(f)
        print(f"cudnn dense B{B} H{H} S{S}: {t:.3f} ms {flops / t / 1e9:.0f} TFLOP/s")
    except Exception as e:
        print("cudnn dense failed", repr(e)[:300])
    # packed layout [T, H, D] via transposed views
    qt = q.transpose(1, 2).reshape(B * S, H, 192).contiguous(); kt = k.transpose(1, 2).reshape(B * S, H, 192).contiguous(); vt = v.transpose(1, 2).reshape(B * S, H, 128).contiguous()
    cu = torch.arange(0, (B + 1) * S, S, device=dev, dtype=torch.int32)
    try:
        op = torch.ops.aten._cudnn_attention_forward
        g = lambda: op(qt, kt, vt, None, cu, cu, S, S, True, 0.0, True, False, scale=scale)
        r = g()
        print("varlen cudnn outputs", [getattr(o, "shape", o) for o in r])
        ref = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False, scale=scale)
        o = r[0]
        print("varlen out vs dense max err", (o.reshape(B, S, H, 128).transpose(1, 2).float() - ref[0].float()).abs().max().item(),
              "lse shape", r[1].shape, ref[1].shape)
        t = bench(g)
        print(f"cudnn varlen B{B} H{H} S{S}: {t:.3f} ms {flops / t / 1e9:.0f} TFLOP/s")
    except Exception as e:
        print("varlen cudnn failed", repr(e)[:600])
# ragged lengths correctness
try:
    lens = [1, 100, 777, 64, 2048, 3]
    T = sum(lens); H = 16
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device=dev, dtype=torch.int32)
    qt = torch.randn(T, H, 192, device=dev, dtype=torch.bfloat16); kt = torch.randn_like(qt); vt = torch.randn(T, H, 128, device=dev, dtype=torch.bfloat16)
    r = torch.ops.aten._cudnn_attention_forward(qt, kt, vt, None, cu, cu, max(lens), max(lens), True, 0.0, True, False, scale=scale)
    o, lse = r[0], r[1]
    print("ragged lse", lse.shape, lse.stride(), "out", o.shape, o.stride())
    errs = []
    for i, L in enumerate(lens):
        a, b = cu[i].item(), cu[i + 1].item()
        qq, kk, vv = (x[a:b].double().transpose(0, 1) for x in (qt, kt, vt))
        s_ = qq @ kk.transpose(1, 2) * scale
        s_ = s_.masked_fill(torch.ones(L, L, device=dev, dtype=torch.bool).triu(1), float("-inf"))
        ls = torch.logsumexp(s_, -1)
        oo = (torch.softmax(s_, -1) @ vv).transpose(0, 1)
        errs.append(((o[a:b].double() - oo).abs().max().item()))
        print(L, "out err", errs[-1], "lse sample", ls[0, :2].tolist())
    print("lse raw", lse.flatten()[:8].tolist())
except Exception:
    traceback.print_exc()
