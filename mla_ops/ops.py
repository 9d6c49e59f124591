"""The two MLA custom ops in the `mla` namespace.

    mla::kv_cache_update(Tensor kv_c_normed, Tensor k_pe, Tensor(a!) kv_cache,
                         Tensor slot_mapping, str kv_cache_dtype, Tensor k_scale) -> Tensor
    mla::attention_with_output(...)  -> ()   (schema in docs/DESIGN.md)

kv_cache_update returns a fresh 0-element tensor. Passing it to
attention_with_output makes the cache write a data dependency of the read, so
torch.compile can neither drop the write nor move it after the read.

Both ops check their arguments once, here (lowering.checks): shapes, dtypes and devices
always; values (slots, lengths, block ids, query_start_loc) for CPU tensors always and
for CUDA tensors with lowering.config.validate (MLA_VALIDATE=1). What they call inside
takes the checked arguments as they are; the kernels bound what they read and write.
"""
from __future__ import annotations

from typing import Optional

import torch

from lowering.checks import (FLOAT_DTYPES, FP8_DTYPES, check_kv_cache_dtype_pair,
                             check_tensor, is_capturing, wants_value_checks)
from mla_ops.quant import quant_fp8_static

# ---------------------------------------------------------------- kv_cache_update


def _check_cache_update(kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale):
    check_tensor("kv_c_normed", kv_c_normed, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("k_pe", k_pe, dtypes=FLOAT_DTYPES)
    check_tensor("kv_cache", kv_cache, ndim=3, dtypes=FLOAT_DTYPES + FP8_DTYPES, contiguous=True)
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=(torch.int64,))
    T, L = kv_c_normed.shape
    if k_pe.dim() == 3:
        if k_pe.shape[1] != 1:
            raise ValueError(f"k_pe must be [T, R] or [T, 1, R], got shape {tuple(k_pe.shape)}")
    elif k_pe.dim() != 2:
        raise ValueError(f"k_pe must be [T, R] or [T, 1, R], got shape {tuple(k_pe.shape)}")
    if k_pe.shape[0] != T or slot_mapping.shape[0] != T:
        raise ValueError(f"kv_c_normed has {T} tokens but k_pe has {k_pe.shape[0]} and "
                         f"slot_mapping {slot_mapping.shape[0]}")
    if k_pe.dtype != kv_c_normed.dtype:
        raise TypeError(f"k_pe dtype {k_pe.dtype} must equal kv_c_normed dtype {kv_c_normed.dtype}")
    R = k_pe.shape[-1]
    if L + R != kv_cache.shape[-1]:
        raise ValueError(f"kv_cache row width {kv_cache.shape[-1]} must equal kv_c_normed width {L} "
                         f"+ k_pe width {R}")
    for name, t in (("k_pe", k_pe), ("kv_cache", kv_cache), ("slot_mapping", slot_mapping)):
        if t.device != kv_c_normed.device:
            raise ValueError(f"{name} is on {t.device}, kv_c_normed on {kv_c_normed.device}")
    kind = check_kv_cache_dtype_pair(kv_cache, kv_cache_dtype, k_scale, kv_c_normed.dtype, "kv_c_normed")
    if T and wants_value_checks(slot_mapping):
        n = kv_cache.shape[0] * kv_cache.shape[1]
        lo, hi = slot_mapping.min().item(), slot_mapping.max().item()
        if lo < -1 or hi >= n:
            raise ValueError(f"slot_mapping values must be in [-1, {n}) (num_blocks * block_size); "
                             f"got range [{lo}, {hi}]")
    return kind


def scatter_rows_no_sync(flat: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor):
    """flat[slot] = rows[t] for every slot >= 0, without a device->host sync (graph capture).

    A fixed-size index_copy_ cannot skip padding rows, so each padding row is sent to the
    slot of the first real token with that token's row: duplicate writes of equal values,
    whatever order they land in. With no real token at all, padding rewrites slot 0 with
    its own current value.
    """
    # index_select with a one-element index tensor throughout: indexing with a 0-dim
    # tensor would read it on the host.
    # Out-of-range slots (unchecked under capture) are dropped like padding, never written.
    keep = (slot_mapping >= 0) & (slot_mapping < flat.shape[0])       # [T]
    first = torch.argmax(keep.to(torch.int32)).reshape(1)             # [1] a real token, if any
    pad_idx = slot_mapping.index_select(0, first).clamp(min=0)        # [1]
    if flat.dtype in FP8_DTYPES:        # CUDA has no fp8 index_copy_/where: move bytes
        flat, rows = flat.view(torch.uint8), rows.view(torch.uint8)
    pad_row = torch.where(keep.index_select(0, first)[:, None], rows.index_select(0, first),
                          flat.index_select(0, pad_idx))              # [1, L + R]
    idx = torch.where(keep, slot_mapping, pad_idx)                    # [T]
    flat.index_copy_(0, idx, torch.where(keep[:, None], rows, pad_row))


def _triton_cache_write(kv_cache: torch.Tensor):
    """lowering's one-kernel cache write for a CUDA cache when triton is importable."""
    if not kv_cache.is_cuda:
        return None
    try:
        from mla_ops.cache.write_kernel import write_cache_rows
    except ImportError:
        return None
    return write_cache_rows


torch.library.define(
    "mla::kv_cache_update",
    "(Tensor kv_c_normed, Tensor k_pe, Tensor(a!) kv_cache, Tensor slot_mapping, "
    "str kv_cache_dtype, Tensor k_scale) -> Tensor")


@torch.library.impl("mla::kv_cache_update", "CompositeExplicitAutograd")
def kv_cache_update(kv_c_normed: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, kv_cache_dtype: str,
                    k_scale: torch.Tensor) -> torch.Tensor:
    kind = _check_cache_update(kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale)
    T, L = kv_c_normed.shape
    write_rows = _triton_cache_write(kv_cache)
    if write_rows is not None:      # CUDA: one kernel (concat, fp8 quant, skip pads/bad slots)
        write_rows(kv_c_normed, k_pe.reshape(T, -1), kv_cache, slot_mapping,
                   k_scale.reshape(1) if kind == "fp8" else None)
        return torch.empty(0, dtype=kv_cache.dtype, device=kv_cache.device)
    rows = torch.cat([kv_c_normed, k_pe.reshape(T, -1)], dim=-1)   # [T, L + R]
    rows = quant_fp8_static(rows, k_scale) if kind == "fp8" else rows.to(kv_cache.dtype)
    flat = kv_cache.view(-1, kv_cache.shape[-1])                     # [num_blocks * block_size, L + R]
    if slot_mapping.device.type == "cpu" and not is_capturing(slot_mapping):
        valid = slot_mapping >= 0           # the slots were checked (CPU: always)
        flat[slot_mapping[valid]] = rows[valid]
    else:                                   # unchecked slots: out-of-range ones dropped
        scatter_rows_no_sync(flat, rows, slot_mapping)
    return torch.empty(0, dtype=kv_cache.dtype, device=kv_cache.device)


@torch.library.register_fake("mla::kv_cache_update")
def _(kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale):
    return torch.empty(0, dtype=kv_cache.dtype, device=kv_cache.device)


# ---------------------------------------------------------- attention_with_output


torch.library.define(
    "mla::attention_with_output",
    "(Tensor q, Tensor kv_c_normed, Tensor k_pe, Tensor kv_cache, Tensor W_UK_T, Tensor W_UV, "
    "Tensor block_table, Tensor seq_lens, Tensor query_start_loc, SymInt num_decode_tokens, "
    "float softmax_scale, str kv_cache_dtype, Tensor k_scale, Tensor kv_cache_dep, "
    "Tensor(a!) output, Tensor? output_scale=None, Tensor(b!)? output_block_scale=None, "
    "SymInt workspace_rows=8192, str backend=\"auto\", Tensor? decode_q=None, "
    "Tensor? decode_q_scale=None, Tensor? decode_schedule=None, "
    "Tensor? decode_splits=None, SymInt[]? prefill_shape=None) -> ()")


@torch.library.impl("mla::attention_with_output", "CompositeExplicitAutograd")
def attention_with_output(
        q: torch.Tensor,                 # [T, N, P + R] post-RoPE
        kv_c_normed: torch.Tensor,       # [T, L] this step's latents
        k_pe: torch.Tensor,              # [T, R] or [T, 1, R]
        kv_cache: torch.Tensor,          # [num_blocks, block_size, L + R]
        W_UK_T: torch.Tensor,            # [N, P, L]
        W_UV: torch.Tensor,              # [N, L, V]
        block_table: torch.Tensor,       # [B, max_blocks] int32
        seq_lens: torch.Tensor,          # [B] int32
        query_start_loc: torch.Tensor,   # [B + 1] int32
        num_decode_tokens: int,
        softmax_scale: float,
        kv_cache_dtype: str,
        k_scale: torch.Tensor,
        kv_cache_dep: torch.Tensor,      # 0-element result of mla::kv_cache_update
        output: torch.Tensor,            # [T, N * V], written
        output_scale: Optional[torch.Tensor] = None,        # [1] fp32: static fp8 output
        output_block_scale: Optional[torch.Tensor] = None,  # [T, N*V // g] fp32, written
        workspace_rows: int = 8192,
        backend: str = "auto",
        decode_q: Optional[torch.Tensor] = None,        # [nd, N, L + R] prebuilt decode query
        decode_q_scale: Optional[torch.Tensor] = None,  # [1] fp32 when decode_q is fp8
        # FlashMLA's table for this step's decode lengths (lowering.decode_schedule, of
        # block_table / seq_lens bounded with lowering.bound_decode_inputs; with an fp8
        # decode_q, decode_schedule(..., fp8q=True): the op cannot tell the two apart)
        decode_schedule: Optional[torch.Tensor] = None,
        decode_splits: Optional[torch.Tensor] = None,
        # the prefill requests' (num_requests, max_query_len, max_context_len,
        # min_context_len) when the caller knows them on the host (MLAMetadata.prefill_shape):
        # the op then reads nothing back from the device; trusted like the lengths. The
        # maxima may be upper bounds and the minimum a lower bound (a bucket's shape)
        prefill_shape: Optional[list] = None,
) -> None:
    from mla_ops.attention import (check_attention_args, check_decode_query,
                                   check_prefill_shape, run_attention)
    check_attention_args(q, kv_c_normed, k_pe, kv_cache, W_UK_T, W_UV, block_table, seq_lens,
                         query_start_loc, num_decode_tokens, softmax_scale, kv_cache_dtype,
                         k_scale, kv_cache_dep, output, output_scale, output_block_scale,
                         workspace_rows, backend)
    check_decode_query(decode_q, decode_q_scale, q, W_UK_T, num_decode_tokens)
    check_prefill_shape(prefill_shape, q, seq_lens, query_start_loc, num_decode_tokens)
    if (decode_schedule is None) != (decode_splits is None):
        raise ValueError("pass decode_schedule and decode_splits together (both from "
                         "lowering.decode_schedule) or neither")
    schedule = None if decode_schedule is None else (decode_schedule, decode_splits)
    run_attention(q, kv_c_normed, k_pe, kv_cache, W_UK_T, W_UV, block_table, seq_lens,
                  query_start_loc, num_decode_tokens, softmax_scale, kv_cache_dtype, k_scale,
                  output, output_scale, output_block_scale, workspace_rows, backend,
                  decode_q, decode_q_scale, schedule, prefill_shape)


@torch.library.register_fake("mla::attention_with_output")
def _(q, kv_c_normed, k_pe, kv_cache, W_UK_T, W_UV, block_table, seq_lens, query_start_loc,
      num_decode_tokens, softmax_scale, kv_cache_dtype, k_scale, kv_cache_dep, output,
      output_scale=None, output_block_scale=None, workspace_rows=8192, backend="auto",
      decode_q=None, decode_q_scale=None, decode_schedule=None, decode_splits=None,
      prefill_shape=None):
    return None
