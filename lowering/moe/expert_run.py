"""Which (token, k) pairs a program of the MoE decode kernels serves, read straight from the
router's choice (no sort).

The P = T * TOP_K pairs of a decode step are the flattened topk_idx: pair p = (token
p // TOP_K, k p % TOP_K) chose expert topk_idx[p]. A program owns pair s; it works only when
s is the first pair (lowest index) that chose its expert (the others exit at once), and then
serves every pair of that expert, in increasing pair order, so each chosen expert's weights
are streamed once however many tokens chose it.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def expert_run(topk_idx_ptr, s, P, E, BLOCK_R: tl.constexpr):
    """(expert, run, match): pair s's expert; the number of pairs that chose it where s is
    the first of them (else 0, and 0 for an expert outside [0, E)); match [BLOCK_R] int32:
    1 for the pairs that chose it (BLOCK_R >= P)."""
    offs = tl.arange(0, BLOCK_R)                                               # [BLOCK_R]
    ids = tl.load(topk_idx_ptr + offs, mask=offs < P, other=-1).to(tl.int32)
    e = tl.load(topk_idx_ptr + s).to(tl.int32)
    match = ((ids == e) & (offs < P)).to(tl.int32)
    first = tl.min(tl.where(match != 0, offs, BLOCK_R), axis=0)
    run = tl.sum(match, axis=0)
    ok = (first == s) & (e >= 0) & (e < E)
    return e, tl.where(ok, run, 0), match


@triton.jit
def run_rows(match, m0, run, P, TOP_K, BLOCK_M: tl.constexpr):
    """(pair [BLOCK_M], token [BLOCK_M], ok [BLOCK_M]) of the run's rows m0 : m0 + BLOCK_M:
    row m is the pair after exactly those whose rank (how many of the pairs up to it chose
    the expert; it never decreases) is <= m. Called inside the run's loop, so the programs
    that serve no run (most of them) never count."""
    offs_m = m0 + tl.arange(0, BLOCK_M)
    ok = offs_m < run
    ranks = tl.cumsum(match, axis=0)                                           # [BLOCK_R]
    pair = tl.sum((ranks[None, :] <= offs_m[:, None]).to(tl.int32), axis=1)   # [BLOCK_M]
    pair = tl.minimum(pair, P - 1)                            # bounded whatever the input
    return pair, pair // TOP_K, ok
