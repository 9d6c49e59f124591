"""The few-rows Gluon kernel over an fp8 cache (gluon_rows_kernel.py, bf16 query) at
(B, H, S), three calls, to run under Nsight Compute; POOL > 0 draws every block table
entry from POOL pages, so the cache stays in the L2 and the kernel's per-tile chain, not
DRAM, bounds it:

    ncu --clock-control none -k regex:rows --launch-skip 2 -c 1 --section SpeedOfLight \\
        --section WarpStateStats --section MemoryWorkloadAnalysis_Tables \\
        --section InstructionStats --print-details all \\
        python docs/notes/ncu_fp8_rows.py 128 16 4096 256
"""
import sys
import torch
import lowering.decode.gluon_decode as gd
from mla_ops.hf.eager import set_wrap_triton_enabled

B, H, S = (int(x) for x in sys.argv[1:4])
POOL = int(sys.argv[4]) if len(sys.argv) > 4 else 0
L, R, PAGE = 512, 64, 64
g = torch.Generator(device="cuda").manual_seed(1)
q = torch.randn(B, 1, H, L + R, device="cuda", dtype=torch.bfloat16, generator=g)
kv = torch.randn(B * S // PAGE, PAGE, L + R, device="cuda", dtype=torch.bfloat16, generator=g)
ks = (kv.float().abs().amax() / 448.0).reshape(1)
kv8 = (kv.float() / ks).to(torch.float8_e4m3fn)
if POOL:
    bt = torch.randint(0, POOL, (B, S // PAGE), device="cuda", generator=g, dtype=torch.int32)
else:
    bt = torch.randperm(B * S // PAGE, device="cuda", generator=g).int().reshape(B, S // PAGE)
lens = torch.full((B,), S, dtype=torch.int32, device="cuda")
with set_wrap_triton_enabled(False):
    for _ in range(3):
        gd.gluon_decode_fp8_cache(q, kv8, bt, lens, ks, 192 ** -0.5, True)
torch.cuda.synchronize()
