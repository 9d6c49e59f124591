"""Merge two partial attentions of the same queries by their log-sum-exp, in one launch.

For each token t and head n, with partial results (o_a, lse_a) over one set of keys and
(o_b, lse_b) over another (each o normalised by its own softmax sum; lse -inf for a part
that saw no key, whose o is then ignored even if it is NaN):

    lse = log(exp(lse_a) + exp(lse_b))
    out = exp(lse_a - lse) * o_a + exp(lse_b - lse) * o_b

    grid = (T, cdiv(N, BLOCK_N)); one program: a [BLOCK_N, V] tile of one token.

merge_attn_states_reference is the same in torch (any device).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def merge_attn_states_kernel(
    out_ptr,      # [T, N, V] out dtype
    lse_ptr,      # [T, N] fp32
    a_ptr,        # [T, N, V]
    lse_a_ptr,    # [T, N] fp32
    b_ptr,        # [T, N, V]
    lse_b_ptr,    # [T, N] fp32
    N, V,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)       # [BN]
    v = tl.arange(0, BLOCK_V)                                    # [BV]
    mn = n < N
    m2 = mn[:, None] & (v[None, :] < V)
    la = tl.load(lse_a_ptr + t * N + n, mask=mn, other=float("-inf"))
    lb = tl.load(lse_b_ptr + t * N + n, mask=mn, other=float("-inf"))
    m = tl.maximum(la, lb)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    wa = tl.exp(la - m_use)                                      # 0 where lse_a is -inf
    wb = tl.exp(lb - m_use)
    total = wa + wb
    has = total > 0.0
    t_safe = tl.where(has, total, 1.0)
    offs = (t * N + n[:, None]) * V + v[None, :]                 # [BN, BV]
    oa = tl.load(a_ptr + offs, mask=m2, other=0.0).to(tl.float32)
    ob = tl.load(b_ptr + offs, mask=m2, other=0.0).to(tl.float32)
    o = tl.where(wa[:, None] > 0.0, oa * wa[:, None], 0.0) + \
        tl.where(wb[:, None] > 0.0, ob * wb[:, None], 0.0)
    tl.store(out_ptr + offs, (o / t_safe[:, None]).to(out_ptr.dtype.element_ty), mask=m2)
    tl.store(lse_ptr + t * N + n, tl.where(has, m_use + tl.log(t_safe), float("-inf")), mask=mn)


@torch.library.custom_op("mla::merge_attn_states", mutates_args=())
def merge_attn_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                      lse_b: torch.Tensor,
                      out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(out_a, lse_a), (out_b, lse_b): [T, N, V], [T, N] fp32 -> merged (out [T, N, V]
    out_dtype, lse [T, N] fp32). One kernel launch."""
    T, N, V = out_a.shape
    out = torch.empty(T, N, V, dtype=out_dtype, device=out_a.device)
    lse = torch.empty(T, N, dtype=torch.float32, device=out_a.device)
    if T == 0:
        return out, lse
    BLOCK_N = min(16, triton.next_power_of_2(N))
    merge_attn_states_kernel[(T, triton.cdiv(N, BLOCK_N))](
        out, lse, out_a.contiguous(), lse_a.contiguous(), out_b.contiguous(),
        lse_b.contiguous(), N, V, BLOCK_N=BLOCK_N, BLOCK_V=triton.next_power_of_2(V))
    return out, lse


@merge_attn_states.register_fake
def _(out_a, lse_a, out_b, lse_b, out_dtype):
    return out_a.new_empty(out_a.shape, dtype=out_dtype), lse_a.new_empty(lse_a.shape)


def merge_attn_states_reference(out_a, lse_a, out_b, lse_b, out_dtype=None):
    """The same merge in torch."""
    lse = torch.logaddexp(lse_a, lse_b)                          # [T, N]
    finite = torch.isfinite(lse)
    safe = torch.where(finite, lse, 0.0)
    w_a = torch.where(torch.isfinite(lse_a) & finite, torch.exp(lse_a - safe), 0.0)[..., None]
    w_b = torch.where(torch.isfinite(lse_b) & finite, torch.exp(lse_b - safe), 0.0)[..., None]
    o = (torch.where(w_a > 0, out_a.float() * w_a, 0.0)
         + torch.where(w_b > 0, out_b.float() * w_b, 0.0))
    return o.to(out_dtype or out_a.dtype), lse
