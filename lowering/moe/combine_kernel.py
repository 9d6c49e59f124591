"""The routed experts' outputs of a prefill batch summed back per token, weighted.

After the grouped GEMMs (lowering/moe/prefill.py) the (token, k) pairs' outputs lie in
expert order, y [P, H]. Token t's result is

    out[t] = sum_k weight[t, k] * y[slot[t, k]]          (fp32 products and sum, one rounding)

where slot[t, k] is the row of y holding pair (t, k). HF's grouped_mm experts get the same
with three passes over P x H fp32 values (the weighted copy, its gather back to token
order, the sum over k); this reads y once and writes out once.

    grid = (T, cdiv(H, BLOCK_H))
"""
import triton
import triton.language as tl


@triton.jit
def moe_combine_kernel(
    y_ptr,        # [P, H] the pairs' outputs, unit last stride
    slot_ptr,     # [T, K] int: row of y of pair (t, k)
    w_ptr,        # [T, K] routing weights (any float dtype; used in fp32)
    out_ptr,      # [T, H]
    P, H, stride_y, stride_out,
    K: tl.constexpr, KP: tl.constexpr,        # top_k, and it rounded up to a power of 2
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0)
    hb = tl.program_id(1)
    ks = tl.arange(0, KP)
    k_ok = ks < K
    slot = tl.load(slot_ptr + t * K + ks, mask=k_ok, other=0)                      # [KP]
    slot = tl.minimum(tl.maximum(slot, 0), P - 1).to(tl.int64)   # bounded reads, whatever slot holds
    w = tl.load(w_ptr + t * K + ks, mask=k_ok, other=0.0).to(tl.float32)          # [KP]
    offs = hb * BLOCK_H + tl.arange(0, BLOCK_H)                                   # [BLOCK_H]
    h_ok = offs < H
    y = tl.load(y_ptr + slot[:, None] * stride_y + offs[None, :],
                mask=k_ok[:, None] & h_ok[None, :], other=0.0)                     # [KP, BLOCK_H]
    acc = tl.sum(y.to(tl.float32) * w[:, None], axis=0)                           # [BLOCK_H]
    tl.store(out_ptr + t.to(tl.int64) * stride_out + offs,
             acc.to(out_ptr.dtype.element_ty), mask=h_ok)
