"""Which decode GEMM configs fit an H200's shared memory at 1-64 rows, per mode
(2026-12-02, triton 3.6): modes 0 and 2 take (BLOCK_M + BLOCK_N * (1 | 2)) * BLOCK_K * 2
bytes per stage, mode 1 up to twice that; behind lowering.gemm.linear.fit_stages."""
import torch, itertools, triton
from lowering.gemm import linear as L
dev = "cuda"
K = 1024
for mode, (bn, bk, w, st), M in itertools.product([0, 1, 2], [(32, 256, 4, 4), (64, 128, 4, 6), (64, 256, 4, 4), (64, 64, 8, 3), (64, 128, 4, 5), (64, 128, 4, 4)], [1, 16, 32, 48, 64]):
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    w1 = torch.randn(bn * 2, K, device=dev, dtype=torch.bfloat16)
    w2 = torch.randn(bn * 2, K, device=dev, dtype=torch.bfloat16)
    y1 = torch.empty(M, bn * 2, device=dev, dtype=torch.bfloat16); y2 = torch.empty_like(y1)
    bm = max(16, triton.next_power_of_2(M))
    est = (bm + bn * (2 if mode == 2 else 1)) * bk * 2
    try:
        L.launch(x, w1, w2 if mode else None, mode, y1, y2 if mode == 1 else None, (bn, bk, w, st))
        torch.cuda.synchronize()
        res = "ok"
    except Exception as e:
        res = str(e)[:90]
    print(f"mode {mode} cfg {(bn, bk, w, st)} M {M} BLOCK_M {bm} est/stage {est} est {est * st} -> {res}")
