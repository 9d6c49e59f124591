"""One decode call per implementation at one shape, for profiling under ncu.

    ncu --clock-control none -k regex:'stage1|gluon|flash_fwd' python docs/notes/ncu_decode.py 64 128 8192

With "fp8" after the shape, also the fp8 q + fp8 cache kernels: ours through
gluon_decode_fp8q (the landed tile config) and FlashMLA's (its schedule computed outside):

    ncu --clock-control none -k regex:'mla_decode_pair|mla_decode_fp8|flash' \
        python docs/notes/ncu_decode.py 32 128 4096 fp8
"""
import sys

import torch

import lowering.decode.triton_decode as td  # noqa: E402

B, H, S = (int(x) for x in sys.argv[1:4])
FP8 = sys.argv[4:5] == ["fp8"]
L, R, PAGE = 512, 64, 64
q = torch.randn(B, 1, H, L + R, device="cuda", dtype=torch.bfloat16)
kv = torch.randn(B * S // PAGE, PAGE, L + R, device="cuda", dtype=torch.bfloat16)
bt = torch.randperm(B * S // PAGE, device="cuda").int().reshape(B, S // PAGE)
lens = torch.full((B,), S, dtype=torch.int32, device="cuda")
for _ in range(2):
    td.triton_decode_op(q, kv, bt, lens, None, None, 192 ** -0.5, True, L, 0, False, torch.bfloat16)
from lowering.decode.gluon_decode import gluon_decode_op  # noqa: E402
from lowering.decode.registry import route_unmet  # noqa: E402
if route_unmet("gluon", q, kv) is None:
    for _ in range(2):
        gluon_decode_op(q, kv, bt, lens, 192 ** -0.5, True)
try:
    import lowering.decode.flashmla as fm
    for _ in range(2):
        fm.flashmla_decode_op(q, kv, bt, lens, 192 ** -0.5, True, L)
except ImportError:
    pass
if FP8:
    import lowering  # noqa: E402
    from sweep_gluon_fp8 import quantize  # noqa: E402   (per-tensor e4m3, as the sweep)

    q8, q_scale = quantize(q)
    kv8, k_scale = quantize(kv)
    for backend in ("gluon", "flashmla"):
        try:
            sched = (lowering.decode_schedule(kv8, bt, lens, num_heads=H, fp8q=True)
                     if backend == "flashmla" else None)
            for _ in range(2):
                lowering.mla_decode_fp8q(q8, kv8, bt, lens, 192 ** -0.5, q_scale=q_scale,
                                         k_scale=k_scale, backend=backend, schedule=sched)
        except (ImportError, lowering.BackendUnavailable) as exc:
            print(f"fp8 {backend}: {exc}")
torch.cuda.synchronize()
