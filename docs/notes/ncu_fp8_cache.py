"""The Triton stage-1 decode kernel over an fp8 cache (bf16 query) and over a bf16
cache at (B, 16, S), two calls each, to run under Nsight Compute:

    ncu --clock-control none -k regex:stage1 -c 4 --section SpeedOfLight \
        --section WarpStateStats --section Occupancy --section LaunchStats \
        python docs/notes/ncu_fp8_cache.py 128 16 4096
"""
import sys, torch
import lowering.decode.triton_decode as td
B, H, S = (int(x) for x in sys.argv[1:4])
L, R, PAGE = 512, 64, 64
q = torch.randn(B, 1, H, L + R, device="cuda", dtype=torch.bfloat16)
kv = torch.randn(B * S // PAGE, PAGE, L + R, device="cuda", dtype=torch.bfloat16)
kv8 = (kv * 0.25).to(torch.float8_e4m3fn)
ks = torch.tensor([4.0], device="cuda")
bt = torch.randperm(B * S // PAGE, device="cuda").int().reshape(B, S // PAGE)
lens = torch.full((B,), S, dtype=torch.int32, device="cuda")
from mla_ops.hf.eager import set_wrap_triton_enabled
with set_wrap_triton_enabled(False):
    for kind, cache, scale in ((1, kv8, ks), (0, kv, None)):
        for _ in range(2):
            td.triton_decode(q, cache, bt, lens, None, scale, 192 ** -0.5, True, L, kind, False, torch.bfloat16)
torch.cuda.synchronize()
