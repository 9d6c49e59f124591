"""A DeepSeek MoE router's choice, one program per token:

    partial [SPLIT, T, E] fp32 (router_logits_kernel.py at a decode step's rows; a
        prefill's fp32 logits as one split), bias [E] (MODE 0)
    logits[e]      = partial[0, t, e] + partial[1, t, e] + ... (in split order)   [BLOCK_E]
    topk_idx [T, K] int64, topk_weight [T, K] fp32: HF's router on these logits

MODE (HF's DeepseekV3TopkRouter / DeepseekV2TopkRouter):
    0  V3: scores = sigmoid(logits); choice = scores + bias; group score = the sum of the
       two largest choice values of the group (a duplicated maximum counts twice); the
       TOPK_GROUP best groups kept, the others' choice -inf; the TOP_K best choices;
       weight = the unbiased score, with NORM divided by (their sum + 1e-20); * scale
    1  V2 greedy: scores = softmax(logits); the TOP_K best scores; weight = score * scale
    2  V2 group_limited_greedy: group score = the group's best score; the TOPK_GROUP best
       groups kept, the others' scores 0.0; the TOP_K best of those; weight = score * scale

Experts are contiguous groups of GROUP_SIZE = E / N_GROUP, of any size: with GROUPS_2D (E a
power of two, N_GROUP and GROUP_SIZE too) the groups are the rows of [N_GROUP, GROUP_SIZE]
and ranked all at once, else masks over the [BLOCK_E] lanes, one group at a time. Every
selection (the groups' top-2, the groups, the experts) is rounds of "largest value, lowest
lane holding it" (one (value, lane) reduction, tl.max's return_indices with ties to the
left; the experts' rounds carry the winner's score in the same reduction, (value, lane,
score) through _take_larger), the winner knocked out before the next round, so
equal values go to the LOWER index, the rule of torch.topk on CUDA (its radix select keeps
the lowest indices among the values equal to the k-th); the chosen set is then the one
torch's topk keeps. Outputs are in the order chosen: descending value, ties lower index
first (HF's sorted=False order is unspecified; the experts sum over k).

Numerics, to match torch's fp32 ops to an ulp or so: sigmoid = 1 / (1 + exp(-x)) and
softmax = exp(x - max) / sum with IEEE division (div_rn), as torch's CUDA kernels compute
them; exp is libdevice's accurate expf on the GPU (LIBDEVICE; tl.exp lowers to the
approximate ex2.approx there) and numpy's exp under the CPU interpreter, which cannot call
libdevice. The remaining differences from torch are the summation orders (logits, softmax
denominator, the norm's sum of K weights).
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from lowering.fused.fp8_rounding import div_rn


@triton.jit
def _exp(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        y = libdevice.exp(x)
    else:
        y = tl.exp(x)
    return y


@triton.jit
def _take_larger(v1, i1, w1, v2, i2, w2):
    """The (value, lane, carried) triple of the larger value, the lower lane on a tie."""
    first = (v1 > v2) | ((v1 == v2) & (i1 < i2))
    return tl.where(first, v1, v2), tl.where(first, i1, i2), tl.where(first, w1, w2)


@triton.jit
def _first_max(v):
    """(the largest value of v [N], the lowest lane holding it): one (value, lane)
    reduction, not a max and then a search for its lane."""
    return tl.max(v, axis=0, return_indices=True, return_indices_tie_break_left=True)


@triton.jit
def select_experts(
    logits,                       # [BLOCK_E] fp32, one token's router logits
    bias_ptr, E, GROUP_SIZE, N_GROUP, TOPK_GROUP, TOP_K, scale,
    MODE: tl.constexpr, NORM: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUPS_2D: tl.constexpr, LIBDEVICE: tl.constexpr,
):
    """(top_i [BLOCK_K] int32, top_w [BLOCK_K] fp32): one token's choice as the module
    says, lanes TOP_K and up unused. router_select_kernel's body, and a building block
    for kernels that select beside other work."""
    lanes = tl.arange(0, BLOCK_E)                                            # [BLOCK_E]
    valid = lanes < E
    neg_inf = tl.full([BLOCK_E], float("-inf"), tl.float32)
    if MODE == 0:                 # sigmoid; the bias only for the choice
        one = tl.full([BLOCK_E], 1.0, tl.float32)
        scores = div_rn(one, one + _exp(-logits, LIBDEVICE))                 # [BLOCK_E]
        bias = tl.load(bias_ptr + lanes, mask=valid, other=0.0).to(tl.float32)
        choice = tl.where(valid, scores + bias, neg_inf)
    else:                         # softmax over the E experts
        mx = tl.max(tl.where(valid, logits, neg_inf), axis=0)
        ex = tl.where(valid, _exp(logits - mx, LIBDEVICE), 0.0)
        scores = div_rn(ex, tl.zeros_like(ex) + tl.sum(ex, axis=0))          # [BLOCK_E]
        choice = tl.where(valid, scores, neg_inf)

    if MODE != 1:                 # keep the TOPK_GROUP best groups
        gid = lanes // GROUP_SIZE                                            # [BLOCK_E]
        glanes = tl.arange(0, BLOCK_G)                                       # [BLOCK_G]
        if GROUPS_2D:             # every group at once, a row each
            c2 = tl.reshape(choice, [BLOCK_G, BLOCK_E // BLOCK_G])           # [G, GROUP_SIZE]
            m1, i1 = tl.max(c2, axis=1, return_indices=True,
                            return_indices_tie_break_left=True)              # [BLOCK_G]
            if MODE == 0:         # + the second largest (m1 again if it is there twice)
                jl = tl.arange(0, BLOCK_E // BLOCK_G)
                m1 = m1 + tl.max(tl.where(jl[None, :] == i1[:, None], float("-inf"), c2),
                                 axis=1)
            gscore = m1
        else:                     # groups as masks over the lanes, one at a time
            gscore = tl.full([BLOCK_G], float("-inf"), tl.float32)
            for g in range(N_GROUP):
                v = tl.where(gid == g, choice, neg_inf)
                m1, i1 = _first_max(v)
                if MODE == 0:
                    m1 = m1 + tl.max(tl.where(lanes == i1, neg_inf, v), axis=0)
                gscore = tl.where(glanes == g, m1, gscore)
        kept = tl.zeros([BLOCK_E], dtype=tl.int32)
        for _ in range(TOPK_GROUP):
            gm, gi = _first_max(gscore)
            kept = tl.where(gid == gi, 1, kept)
            gscore = tl.where(glanes == gi, float("-inf"), gscore)
        if MODE == 0:
            choice = tl.where(kept != 0, choice, neg_inf)
        else:                     # HF zeroes the scores of the other groups
            choice = tl.where(valid, tl.where(kept != 0, scores, 0.0), neg_inf)
            scores = choice

    klanes = tl.arange(0, BLOCK_K)                                           # [BLOCK_K]
    top_i = tl.zeros([BLOCK_K], dtype=tl.int32)
    top_w = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k in range(TOP_K):        # the winner's score carried through the same reduction
        m, i, w = tl.reduce((choice, lanes, scores), 0, _take_larger)
        top_i = tl.where(klanes == k, i, top_i)
        top_w = tl.where(klanes == k, w, top_w)
        choice = tl.where(lanes == i, neg_inf, choice)
    if NORM:
        den = tl.sum(top_w, axis=0) + 1e-20
        top_w = div_rn(top_w, tl.zeros_like(top_w) + den)
    top_w = top_w * scale
    return top_i, top_w


@triton.jit
def router_select_kernel(
    part_ptr,                     # [SPLIT, T, E] fp32 contiguous
    bias_ptr,                     # [E] (MODE 0: e_score_correction_bias, any float dtype)
    idx_ptr, wgt_ptr,             # topk_idx [T, TOP_K] int64, topk_weight [T, TOP_K] fp32
    T, E, GROUP_SIZE, N_GROUP, TOPK_GROUP, TOP_K, scale,
    SPLIT: tl.constexpr,          # the partials' count, unrolled: their loads all in flight
    MODE: tl.constexpr, NORM: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUPS_2D: tl.constexpr,      # BLOCK_E == BLOCK_G * GROUP_SIZE == E: groups as rows
    LIBDEVICE: tl.constexpr,
):
    t = tl.program_id(0)
    lanes = tl.arange(0, BLOCK_E)                                            # [BLOCK_E]
    valid = lanes < E
    logits = tl.zeros([BLOCK_E], dtype=tl.float32)
    for s in tl.static_range(SPLIT):                                         # in split order
        logits += tl.load(part_ptr + (s * T + t) * E + lanes, mask=valid, other=0.0)
    top_i, top_w = select_experts(logits, bias_ptr, E, GROUP_SIZE, N_GROUP, TOPK_GROUP, TOP_K,
                                  scale, MODE, NORM, BLOCK_E, BLOCK_G, BLOCK_K, GROUPS_2D,
                                  LIBDEVICE)
    klanes = tl.arange(0, BLOCK_K)                                           # [BLOCK_K]
    k_ok = klanes < TOP_K
    tl.store(idx_ptr + t * TOP_K + klanes, top_i.to(tl.int64), mask=k_ok)
    tl.store(wgt_ptr + t * TOP_K + klanes, top_w, mask=k_ok)
