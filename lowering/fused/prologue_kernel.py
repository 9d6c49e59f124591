"""The attention prologue of a DeepSeek decode step, after the q_a + kv_a GEMM: two
programs per token (grid (T, 2)), one for q_a's norm, one for the cache row.

    part [SPLIT, T, NQ + L + R]  fp32 split-K partial sums of [q_a | kv_c | k_pe]
    q_out  [T, NQ]     = rms_norm(q_a) * w_q                       (q_a_layernorm)
    kv_out [T, L + R]  = [rms_norm(kv_c) * w_kv | rope(k_pe)]      (the cache row)

It replaces the partial sums, both RMSNorms, the key's RoPE and the cat of the unfused
graph (four or five small kernels, the RoPE one a single latency-bound program). Each
sum is rounded to the activation dtype first (the GEMM's output); the norms round as HF's
RMSNorm does (x * rsqrt(mean(x^2) + eps) before the weight multiply); RoPE runs in fp32
and rounds once, as Inductor computes HF's RoPE.

RoPE (R even, H = R / 2; cos / sin are HF's rows cat(freqs, freqs) * scaling, [T, R]):
    INTERLEAVE (DeepSeek-V3's pairs):  k1 = k[0::2], k2 = k[1::2], angle j for pair j
    else (rotate_half):                k1 = k[:H],   k2 = k[H:]
    out[:H] = k1 * cos[:H] - k2 * sin[:H],   out[H:] = k2 * cos[H:] + k1 * sin[H:]
"""
from __future__ import annotations

import triton
import triton.language as tl

from lowering.fused.q_rope_kernel import rotate


@triton.jit
def _row_sum(ptr, offs, mask, stride_split, SPLIT: tl.constexpr):
    """The fp32 sum over the SPLIT partials of ptr[offs] (0 where masked)."""
    acc = tl.load(ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(ptr + s * stride_split + offs, mask=mask, other=0.0)
    return acc


@triton.jit
def _rms_norm(x, w_ptr, offs, mask, n, eps, dt):
    """HF's RMSNorm of one row x (fp32 holding dtype-dt values, 0 where masked)."""
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)   # issued before the sum
    var = tl.sum(x * x, axis=0) / n
    y = (x * tl.math.rsqrt(var + eps)).to(dt).to(tl.float32)
    return (w * y).to(dt)


@triton.jit
def qkv_prologue_kernel(
    part_ptr,                  # [SPLIT, T, NQ + L + R] fp32, contiguous
    wq_ptr, wkv_ptr,           # [NQ], [L]: the two norms' weights
    cos_ptr, sin_ptr,          # [T, R] rows, stride stride_cs (last dim contiguous)
    q_out_ptr,                 # [T, NQ]
    kv_out_ptr,                # [T, L + R]
    stride_split, stride_cs, eps_q, eps_kv,
    SPLIT: tl.constexpr, NQ: tl.constexpr, L: tl.constexpr, R: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_H: tl.constexpr,
    INTERLEAVE: tl.constexpr,
):
    t = tl.program_id(0)
    dt = q_out_ptr.dtype.element_ty
    row = part_ptr + t.to(tl.int64) * (NQ + L + R)
    if tl.program_id(1) == 0:
        # q_a -> q_a_layernorm
        oq = tl.arange(0, BLOCK_Q)
        mq = oq < NQ
        x = _row_sum(row, oq, mq, stride_split, SPLIT).to(dt).to(tl.float32)  # [BLOCK_Q]
        tl.store(q_out_ptr + t.to(tl.int64) * NQ + oq,
                 _rms_norm(x, wq_ptr, oq, mq, NQ, eps_q, dt), mask=mq)
    else:
        # kv_c -> kv_a_layernorm, into the row's first L columns
        out = kv_out_ptr + t.to(tl.int64) * (L + R)
        ol = tl.arange(0, BLOCK_L)
        ml = ol < L
        kv = _row_sum(row + NQ, ol, ml, stride_split, SPLIT).to(dt).to(tl.float32)  # [BLOCK_L]
        tl.store(out + ol, _rms_norm(kv, wkv_ptr, ol, ml, L, eps_kv, dt), mask=ml)

        # k_pe -> RoPE, into the last R columns
        H: tl.constexpr = R // 2
        j = tl.arange(0, BLOCK_H)
        mh = j < H
        if INTERLEAVE:
            i1, i2, c2 = 2 * j, 2 * j + 1, j          # pair j, rotated by angle j
        else:
            i1, i2, c2 = j, H + j, H + j
        k1 = _row_sum(row + NQ + L, i1, mh, stride_split, SPLIT).to(dt).to(tl.float32)
        k2 = _row_sum(row + NQ + L, i2, mh, stride_split, SPLIT).to(dt).to(tl.float32)
        cs = t.to(tl.int64) * stride_cs
        cos1 = tl.load(cos_ptr + cs + j, mask=mh, other=0.0).to(tl.float32)
        sin1 = tl.load(sin_ptr + cs + j, mask=mh, other=0.0).to(tl.float32)
        cos2 = tl.load(cos_ptr + cs + c2, mask=mh, other=0.0).to(tl.float32)
        sin2 = tl.load(sin_ptr + cs + c2, mask=mh, other=0.0).to(tl.float32)
        o1, o2 = rotate(k1, k2, cos1, sin1, cos2, sin2, dt)
        tl.store(out + L + j, o1, mask=mh)
        tl.store(out + L + H + j, o2, mask=mh)
