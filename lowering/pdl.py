"""Programmatic dependent launch (PDL): which kernels may start before the kernel they
follow has finished.

A kernel launched with a programmatic dependency may begin while its predecessor still
runs; it must then wait (`gdc_wait`, PTX griddepcontrol.wait) before it reads anything
an earlier kernel wrote, and write nothing before that wait. The kernels named in
PDL_KERNELS follow that rule: before their wait they only compute addresses and load
weights (tensors no step writes); each also lets its own successor launch early
(`gdc_launch_dependents`). Without a programmatic dependency both instructions do
nothing, so the same compiled kernel serves ordinary launches.

torch.compile launches these kernels itself and cannot ask for PDL, so the dependency is
set afterwards, on the captured CUDA graph (mla_ops.hf.pdl_edges, DecodeGraph's
`programmatic=True`): only edges into a kernel named here become programmatic.

The kernels emit the wait wherever gdc_enabled says so: on every Hopper or newer GPU,
never on the CPU interpreter. The GEMMs then load their first PRE_K columns of K
(preload_k) as one tile before it; the norms load their weight first. The choice is not a
setting on purpose: a triton op's implementation is traced below Dynamo, so the compile
caches do not key on what it reads (lowering/config.py), and a setting read there could
pair kernels compiled without their waits with a graph whose edges are programmatic.
Compiled alike for every launch, a kernel's waits are there whenever an edge into it is
made programmatic, and do nothing where it is not.
"""
from __future__ import annotations

import functools

import torch

# Triton kernels (function names, which are the compiled kernels' names) that wait before
# touching any tensor a step writes. Add a kernel here only with that proof in its source.
PDL_KERNELS = frozenset({
    "decode_linear_kernel",       # lowering/gemm/linear_kernel.py: the first weight tiles before the wait
    "fp8_linear_kernel",          # lowering/gemm/fp8_linear_kernel.py: the first group's tile and scales
    "head_gemm_kernel",           # lowering/gemm/head_gemm_kernel.py: likewise
    "residual_rms_norm_kernel",   # lowering/fused/residual_norm_kernel.py: the norm weight before the wait
    "rms_norm_kernel",            # lowering/fused/rms_norm_kernel.py: likewise
})


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def gdc_enabled(t: torch.Tensor) -> bool:
    """Whether the kernels launched on t's device emit the PDL wait: an sm_90 or newer GPU."""
    return t.is_cuda and _capability(t.device.index if t.device.index is not None
                                     else torch.cuda.current_device())[0] >= 9


# Weight elements one program loads before its wait: 64 registers a thread at 4 warps in bf16.
PRELOAD_ELEMS = 16384


def preload_k(block_n: int, block_k: int, k_range: int, weights: int = 1) -> int:
    """PRE_K of a GEMM program streaming `weights` weights' [block_n, k_range] rows in
    block_k tiles: a power of two of whole tiles, within k_range and PRELOAD_ELEMS."""
    tiles = min(-(-k_range // block_k), PRELOAD_ELEMS // (block_n * block_k * weights))
    return block_k << max(0, tiles.bit_length() - 1) if tiles > 1 else block_k


def is_pdl_kernel(name: str) -> bool:
    """A compiled kernel's name is one of PDL_KERNELS, as given or with the numeric suffix
    a compiler adds to tell variants apart (`head_gemm_kernel_0`)."""
    if name in PDL_KERNELS:
        return True
    base, _, tail = name.rpartition("_")
    return tail.isdigit() and base in PDL_KERNELS
