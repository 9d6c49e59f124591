"""Triton kernel: DeepSeek-V3.2's lightning-indexer scores over a paged key pool.

For request b, its query token s (q [Hi, Di], head weights w [Hi] fp32) and every key
position j of its block table (the key at pool[block_table[b, j // BS], j % BS]):

    index[b, s, j] = sum_h w[h] * relu(scale * q[h] . key_j)     for j <= limit[b, s]
                   = -inf                                          otherwise, or where the
                                                                   table entry is -1

One program: TOKENS consecutive query tokens of one request and TILES tiles of BLOCK_N key
positions. The keys are read straight from the pool through the block table (no gathered
copy), each tile once for the program's tokens:

    k    = pool rows of the tile           [BLOCK_N, DP]   (16-bit, masked past Di)
    s    = q_rows @ k^T                    [TOKENS * HP, BLOCK_N]   fp32 accumulation
    s    = relu(s * scale) * w_rows
    idx  = s summed over each token's rows [TOKENS, BLOCK_N]

The rows of q_rows are (token, head) pairs, HP heads a token (Hi padded to a power of two
of at least 16: a zero query row and a zero weight add nothing). Tiles past the largest
limit of the program's tokens read nothing: they are written -inf. Every read is bounded:
table entries past the table, key positions past a token's limit and -1 entries are
masked, block ids are clamped to the pool.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def indexer_scores_kernel(
    q_ptr,          # [B, S, HI, DI] 16-bit, contiguous
    w_ptr,          # [B, S, HI] fp32, contiguous
    pool_ptr,       # [NB, BS, DI] 16-bit, last dim contiguous
    table_ptr,      # [B, M] int32 (block ids, -1: none)
    limit_ptr,      # [B, S] int32 / int64: the last key position a token sees
    out_ptr,        # [B, S, N] fp32, contiguous (N = M * BS)
    scale, S, N, NB, stride_pool_blk, stride_pool_row, stride_table,
    HI: tl.constexpr, DI: tl.constexpr, BS: tl.constexpr,
    HP: tl.constexpr, DP: tl.constexpr, TOKENS: tl.constexpr,
    BLOCK_N: tl.constexpr, TILES: tl.constexpr, DOT_F32: tl.constexpr,
):
    pid_n = tl.program_id(0)
    b = tl.program_id(1)
    s0 = tl.program_id(2) * TOKENS

    # ---- the program's query rows, weights and limits
    rows = tl.arange(0, TOKENS * HP)                            # [TOKENS * HP]
    row_tok = s0 + rows // HP
    row_head = rows % HP
    d = tl.arange(0, DP)                                        # [DP]
    d_ok = d < DI
    row_ok = (row_tok < S) & (row_head < HI)
    q_off = ((b * S + row_tok) * HI + row_head).to(tl.int64) * DI
    q = tl.load(q_ptr + q_off[:, None] + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)    # [TOKENS * HP, DP]
    if DOT_F32:
        q = q.to(tl.float32)

    w_rows = tl.load(w_ptr + (b * S + row_tok) * HI + row_head,
                     mask=row_ok, other=0.0)                    # [TOKENS * HP] fp32
    tok = s0 + tl.arange(0, TOKENS)                             # [TOKENS]
    tok_ok = tok < S
    lim = tl.load(limit_ptr + b * S + tok, mask=tok_ok, other=-1)           # [TOKENS]
    lim = tl.minimum(tl.maximum(lim, -1), N).to(tl.int32)
    lim_max = tl.max(lim, axis=0)
    out_row = (b * S + tok).to(tl.int64) * N                    # [TOKENS]

    # ---- tiles [lo, hi) hold keys some token sees; [tail, end) none
    lo = pid_n * (TILES * BLOCK_N)
    end = tl.minimum(lo + TILES * BLOCK_N, N)
    hi = tl.minimum(end, lim_max + 1)
    cols = tl.arange(0, BLOCK_N)                                # [BLOCK_N]
    for start in range(lo, hi, BLOCK_N):
        j = start + cols                                        # [BLOCK_N] key positions
        in_table = j < N
        blk = tl.load(table_ptr + b * stride_table + j // BS, mask=in_table, other=-1)
        has_key = in_table & (blk >= 0)
        read = has_key & (j <= lim_max)
        blk = tl.minimum(tl.maximum(blk, 0), NB - 1).to(tl.int64)
        k_off = blk * stride_pool_blk + (j % BS) * stride_pool_row  # [BLOCK_N]
        k = tl.load(pool_ptr + k_off[:, None] + d[None, :],
                    mask=read[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, DP]
        if DOT_F32:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k))                              # [TOKENS * HP, BLOCK_N] fp32
        s = tl.maximum(s * scale, 0.0)
        s = s * w_rows[:, None]                                   # weighted, padded rows 0
        if TOKENS == 1:
            idx = tl.sum(s, axis=0)[None, :]                    # [1, BLOCK_N]
        else:                                                   # each token's HP rows
            idx = tl.zeros((TOKENS, BLOCK_N), tl.float32)
            for t in tl.static_range(TOKENS):
                part = tl.sum(tl.where((row_tok == s0 + t)[:, None], s, 0.0), axis=0)
                idx = tl.where((tok == s0 + t)[:, None], part[None, :], idx)
        seen = has_key[None, :] & (j[None, :] <= lim[:, None])  # [TOKENS, BLOCK_N]
        idx = tl.where(seen, idx, float("-inf"))
        tl.store(out_ptr + out_row[:, None] + j[None, :], idx,
                 mask=tok_ok[:, None] & in_table[None, :])

    tail = lo + tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_N) * BLOCK_N
    none = tl.full((TOKENS, BLOCK_N), float("-inf"), tl.float32)
    for start in range(tail, end, BLOCK_N):
        j = start + cols
        tl.store(out_ptr + out_row[:, None] + j[None, :], none,
                 mask=tok_ok[:, None] & (j < N)[None, :])
