"""The dense prefill attention's keys, [k_nope | k_pe] per head: torch.cat of k_nope with
k_pe expanded over the heads against lowering/prefill/keys_kernel.py (H200 probe, not
maintained). µs (do_bench median, L2 flushed) and the bytes moved per µs.

    python docs/notes/probe_prefill_keys.py
"""
import torch
import triton.testing
from lowering.prefill.keys_kernel import keys_reference, prefill_keys

P, R, L = 128, 64, 512
for T, N in [(8192, 128), (16384, 128), (8192, 16), (16384, 16), (512, 16), (4096, 128)]:
    k_nope = torch.randn(T, N * P, device="cuda", dtype=torch.bfloat16).view(T, N, P)
    row = torch.randn(T, L + R, device="cuda", dtype=torch.bfloat16)
    k_pe = row[:, L:]
    assert torch.equal(prefill_keys(k_nope, k_pe), keys_reference(k_nope, k_pe))
    nbytes = (T * N * P + T * R + T * N * (P + R)) * 2
    cat = triton.testing.do_bench(lambda: keys_reference(k_nope, k_pe), return_mode="median") * 1e3
    ker = triton.testing.do_bench(lambda: prefill_keys(k_nope, k_pe), return_mode="median") * 1e3
    print(f"T {T:6d} N {N:4d}: cat {cat:8.1f} µs ({nbytes / cat / 1e6:5.2f} TB/s), "
          f"kernel {ker:8.1f} µs ({nbytes / ker / 1e6:5.2f} TB/s), {cat / ker:5.2f}x", flush=True)
