"""Stage 2 of MLA decode: merge the per-split partial results by their log-sum-exp.

Stage 1 leaves, for each request b, split s and folded query row r = t * H + h,
an fp32 partial output o_s (already normalised by its own softmax sum) and its
natural-log lse_s (-inf for a split that saw no key). The full result is

    lse = log(sum_s exp(lse_s))
    out = sum_s exp(lse_s - lse) * o_s

One program per (row, request) handles the whole L-wide row. The splits are
visited one after another in index order (first the maximum, then the weighted
sum), so the reduction order is fixed: empty splits add exact zeros, and a
request's result does not depend on how many splits the launch had.

    grid = (s_q * H, B)
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
):
    ROWS: tl.constexpr = S_Q * H
    r = tl.program_id(0)
    b = tl.program_id(1)
    offs_l = tl.arange(0, L)                                 # [L]
    base = b.to(tl.int64) * num_splits * ROWS + r            # index of (b, split 0, r)

    # pass 1: the largest partial lse
    m = tl.load(part_lse_ptr + base)
    for s in range(1, num_splits):
        m = tl.maximum(m, tl.load(part_lse_ptr + base + s * ROWS))
    m_use = tl.where(m == float("-inf"), 0.0, m)

    # pass 2: weighted sum in split order
    total = tl.zeros([1], dtype=tl.float32).sum(0)           # scalar 0.0
    acc = tl.zeros([L], dtype=tl.float32)                    # [L]
    for s in range(0, num_splits):
        w = tl.exp(tl.load(part_lse_ptr + base + s * ROWS) - m_use)
        o_s = tl.load(part_out_ptr + (base + s * ROWS) * L + offs_l)
        acc += w * o_s
        total += w

    has = total > 0.0
    t_safe = tl.where(has, total, 1.0)
    tl.store(out_ptr + (b.to(tl.int64) * ROWS + r) * L + offs_l,
             (acc / t_safe).to(out_ptr.dtype.element_ty))
    lse = tl.where(has, m_use + tl.log(t_safe), float("-inf"))
    tl.store(lse_ptr + b * ROWS + (r % H) * S_Q + r // H, lse)
