"""Stage 2 of MLA decode: merge the per-split partial results by their log-sum-exp.

Stage 1 leaves, for each request b, split s and folded query row r = t * H + h,
an fp32 partial output o_s (already normalised by its own softmax sum) and its
natural-log lse_s (-inf for a split that saw no key). The full result is

    lse = log(sum_s exp(lse_s))
    out = sum_s exp(lse_s - lse) * o_s

One program per (row, request, BLOCK_L value columns): the whole L-wide row where there
are many rows to merge, parts of it where few are (on an H200 at one request of 16
heads and 32 splits, 64-column parts: 2.6 µs against 5.0 for whole rows; at 128 heads
whole rows are faster). The splits are read SPLIT_BLOCK at a time as one [SPLIT_BLOCK,
BLOCK_L] tile, so a request cut into many splits costs a few dependent memory round
trips, not one per split (at one request of 128 heads and 34 splits: 6.4 µs, split by
split 7.2). The reduction order is fixed by
SPLIT_BLOCK alone: chunks are added in split order, and inside a chunk the tile sum
has one fixed shape. Empty splits and the padding past num_splits add exact zeros, so
a request's result does not depend on how many splits the launch had beyond its own
(the batch-invariant mode relies on this).

    grid = (s_q * H, B, L // BLOCK_L)
"""
import triton
import triton.language as tl


@triton.jit
def mla_decode_merge_kernel(
    part_out_ptr,   # [B, num_splits, ROWS, L] fp32
    part_lse_ptr,   # [B, num_splits, ROWS] fp32, natural log
    out_ptr,        # [B, ROWS, L] output dtype  (= [B, s_q, H, L])
    lse_ptr,        # [B, H, s_q] fp32
    num_splits,     # splits per request
    S_Q: tl.constexpr, H: tl.constexpr, L: tl.constexpr,
    SPLIT_BLOCK: tl.constexpr,   # splits read per step (a power of two)
    BLOCK_L: tl.constexpr,       # value columns per program (a power of two dividing L)
):
    ROWS: tl.constexpr = S_Q * H
    r = tl.program_id(0)
    b = tl.program_id(1)
    offs_l = tl.program_id(2) * BLOCK_L + tl.arange(0, BLOCK_L)   # [BLOCK_L]
    offs_s = tl.arange(0, SPLIT_BLOCK)                       # [SB]
    base = b.to(tl.int64) * num_splits * ROWS + r            # index of (b, split 0, r)

    # pass 1: the largest partial lse
    m = tl.full([SPLIT_BLOCK], float("-inf"), tl.float32)    # [SB]
    for s0 in range(0, num_splits, SPLIT_BLOCK):
        s = s0 + offs_s
        m = tl.maximum(m, tl.load(part_lse_ptr + base + s * ROWS, mask=s < num_splits,
                                  other=float("-inf")))
    m = tl.max(m, axis=0)
    m_use = tl.where(m == float("-inf"), 0.0, m)

    # pass 2: weighted sum, one [SB, BLOCK_L] tile of partial outputs per step
    total = tl.zeros([SPLIT_BLOCK], dtype=tl.float32)        # [SB]
    acc = tl.zeros([BLOCK_L], dtype=tl.float32)              # [BLOCK_L]
    for s0 in range(0, num_splits, SPLIT_BLOCK):
        s = s0 + offs_s
        live = s < num_splits
        w = tl.exp(tl.load(part_lse_ptr + base + s * ROWS, mask=live,
                           other=float("-inf")) - m_use)     # [SB], 0 where empty
        o_s = tl.load(part_out_ptr + (base + s[:, None] * ROWS) * L + offs_l[None, :],
                      mask=live[:, None], other=0.0)         # [SB, L]
        acc += tl.sum(w[:, None] * o_s, axis=0)             # o_s [SB, BLOCK_L]
        total += w
    total_sum = tl.sum(total, axis=0)

    has = total_sum > 0.0
    t_safe = tl.where(has, total_sum, 1.0)
    tl.store(out_ptr + (b.to(tl.int64) * ROWS + r) * L + offs_l,
             (acc / t_safe).to(out_ptr.dtype.element_ty))
    if tl.program_id(2) == 0:
        lse = tl.where(has, m_use + tl.log(t_safe), float("-inf"))
        tl.store(lse_ptr + b * ROWS + (r % H) * S_Q + r // H, lse)
