"""Gather a window of every prefill request's cached context into one padded workspace.

For requests b = 0..B-1 (block table rows, context lengths ctx_lens [B] on the device)
and window positions start + j, j < width: workspace[b, j] = the cache row at that
position, dequantized (fp8 * k_scale) and cast to the workspace dtype; positions at or
past ctx_lens[b] (and block ids outside the cache) give zero rows. One launch for all
requests; nothing is read on the host. Reads are bounded by the block table's width and
the cache's block count whatever the lengths say.

    grid = (B, cdiv(width, BLOCK_W)); the row (L + R = 576 wide) in BLOCK_D steps.

gather_context_reference is the same in torch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowering.decode.reference import dequant_cache


@triton.jit
def gather_context_kernel(
    cache_ptr,      # [num_blocks, PAGE, D]
    bt_ptr,         # [B, max_blocks] int32 (row stride bt_stride)
    ctx_lens_ptr,   # [B] int32
    scale_ptr,      # [1] fp32 (fp8 caches)
    out_ptr,        # [B, width, D]
    start, width, bt_stride, max_blocks, num_blocks,
    PAGE: tl.constexpr, D: tl.constexpr, IS_FP8: tl.constexpr,
    BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)      # [BW]
    in_w = j < width
    pos = start + j
    n = tl.load(ctx_lens_ptr + b)
    col = pos // PAGE
    live = in_w & (pos < n) & (col < max_blocks)
    blk = tl.load(bt_ptr + b * bt_stride + col, mask=live, other=0)
    live = live & (blk >= 0) & (blk < num_blocks)
    row = blk.to(tl.int64) * PAGE + pos % PAGE                   # [BW]
    dst = (b * width + j).to(tl.int64) * D                       # [BW]
    if IS_FP8:
        scale = tl.load(scale_ptr)
    for d0 in tl.static_range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        md = d < D
        x = tl.load(cache_ptr + row[:, None] * D + d[None, :],
                    mask=live[:, None] & md[None, :], other=0.0).to(tl.float32)
        if IS_FP8:
            x = x * scale
        tl.store(out_ptr + dst[:, None] + d[None, :], x.to(out_ptr.dtype.element_ty),
                 mask=in_w[:, None] & md[None, :])


def gather_context(kv_cache, block_table, ctx_lens, start: int, width: int, kind: str,
                   k_scale, dtype) -> torch.Tensor:
    """-> workspace [B, width, L + R] dtype: cache positions [start, start + width)."""
    nb, page, D = kv_cache.shape
    B = block_table.shape[0]
    out = torch.empty(B, width, D, dtype=dtype, device=kv_cache.device)
    if B == 0 or width == 0:
        return out
    is_fp8 = kind == "fp8"
    scale = k_scale.reshape(1).float() if is_fp8 else out     # unused without fp8
    BLOCK_W = 32
    gather_context_kernel[(B, triton.cdiv(width, BLOCK_W))](
        kv_cache, block_table, ctx_lens, scale, out, start, width, block_table.stride(0),
        block_table.shape[1], nb, PAGE=page, D=D, IS_FP8=is_fp8, BLOCK_W=BLOCK_W,
        BLOCK_D=64)
    return out


def gather_context_reference(kv_cache, block_table, ctx_lens, start: int, width: int,
                             kind: str, k_scale, dtype) -> torch.Tensor:
    """The same gather in torch."""
    nb, page, D = kv_cache.shape
    pos = start + torch.arange(width, device=kv_cache.device)   # [w]
    col = pos // page
    live = (pos[None, :] < ctx_lens[:, None].long()) & (col < block_table.shape[1])[None, :]
    blk = block_table.long()[:, col.clamp(max=block_table.shape[1] - 1)]  # [B, w]
    live &= (blk >= 0) & (blk < nb)
    row = torch.where(live, blk * page + pos % page, 0)
    x = dequant_cache(kv_cache.reshape(-1, D)[row], kind, k_scale)       # [B, w, D] fp32
    return x.masked_fill(~live[..., None], 0.0).to(dtype)
