"""Which sorted (token, k) pairs a program of the MoE decode kernels serves.

The pairs of a decode step are sorted by expert (stable): slot s holds pair sorted_pair[s]
of expert sorted_expert[s]. A program owns slot s; it works only when s is the first slot
of its expert (the others exit at once), and then serves that expert's whole run of slots,
so each chosen expert's weights are streamed once however many tokens chose it.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def expert_run(sorted_expert_ptr, s, P, E, BLOCK_R: tl.constexpr):
    """(expert, run): slot s's expert and the number of slots from s on that hold it, run 0
    where s is not the first slot of its expert or the expert is outside [0, E)."""
    e = tl.load(sorted_expert_ptr + s).to(tl.int32)
    prev = tl.load(sorted_expert_ptr + s - 1, mask=s > 0, other=-1).to(tl.int32)
    offs = s + tl.arange(0, BLOCK_R)                                           # [BLOCK_R]
    ids = tl.load(sorted_expert_ptr + offs, mask=offs < P, other=-1).to(tl.int32)
    run = tl.sum((ids == e).to(tl.int32), axis=0)
    ok = (prev != e) & (e >= 0) & (e < E)
    return e, tl.where(ok, run, 0)


@triton.jit
def run_rows(sorted_pair_ptr, s, m0, run, P, TOP_K, BLOCK_M: tl.constexpr):
    """(pair [BLOCK_M], token [BLOCK_M], ok [BLOCK_M]) of the run's rows m0 : m0 + BLOCK_M."""
    offs_m = m0 + tl.arange(0, BLOCK_M)
    ok = offs_m < run
    pair = tl.load(sorted_pair_ptr + s + offs_m, mask=ok, other=0).to(tl.int32)
    pair = tl.minimum(tl.maximum(pair, 0), P - 1)             # bounded whatever the input
    return pair, pair // TOP_K, ok
