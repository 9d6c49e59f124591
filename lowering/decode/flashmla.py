"""Backend "flashmla": dense MLA decode through FlashMLA's SM90 kernels (PyPI sgl-flash-mla).

Serves: flash_mla importable, q on an SM90 GPU, q bf16 with a bf16 cache (kind "auto"),
L + R = 576, head_dim_v = 512, page size 64. On SM90 the dense bf16 decode lives in
the package's legacy extension (torch.ops.flash_mla_legacy, use_legacy=True).

The same extension has a dense fp8 decode (fp8 e4m3 q and cache, per-tensor scales,
bf16 out): the "flashmla" route of lowering.mla_decode_fp8q (mla::flashmla_decode_fp8q,
conditions in flashmla_fp8q_unmet()). Its scheduler is a separate kernel of its own
(flashmla_schedule_op(..., fp8=True)); everything said below of the table holds for it.

Scheduler metadata. FlashMLA splits each request's keys over the SMs according to a
tile-scheduler table computed from cache_seqlens. A table computed once and reused
while lengths change (or computed outside a captured graph into fresh tensors) gives
stale splits and garbage after some steps. So the table is always computed on the
device from this step's lengths, as a graph op (mla::flashmla_schedule): under CUDA-graph
capture its kernel is captured too, its outputs live in the graph's private pool (fixed
addresses for the graph's life) and every replay refills them from the lengths it is
replayed with. No buffer outlives the step, so nothing is allocated in a CUDA-graph pool
that the graph does not own (cudagraph trees reject such tensors).

Either the decode op computes the table itself (one metadata kernel per call), or the
caller computes it once per step with decode_schedule() and passes it to every layer's
call (the table depends only on the lengths and the query rows per KV head, which all
layers share): one metadata kernel per step instead of one per layer.

Overlap. FlashMLA's scheduler kernel is one warp walking the batch serially (12-14 µs on
an H200 at 32 requests), and nothing but the decode reads its table. So the schedule op
launches it on a side stream (forked from the caller's stream, so it sees the lengths as
they are at that point) and the decode op makes its stream wait for that side stream
before reading the table: the kernel runs beside whatever the caller launches in between
(a model's norms, RoPE, cache write, absorbed query GEMM). Under CUDA-graph capture the
fork and the join become graph edges.

The calls are custom ops (mla::flashmla_schedule, mla::flashmla_decode,
mla::flashmla_decode_fp8q, with fake impls) so torch.compile treats each as one opaque
node; eager calls run their implementations directly (no dispatch on the host).
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch

from lowering.decode.registry import sm_count


@functools.lru_cache(maxsize=None)
def _schedule_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream the scheduler kernels of this device run on."""
    return torch.cuda.Stream(device)


def _join_schedule_stream(device) -> None:
    """Make the current stream wait for the scheduler's side stream: the table may still
    be in the making there. Under capture only when the side stream is in a capture too
    (forked by a schedule op of this capture); a table made outside the capture was
    complete before it began (capture starts with a device synchronize), and waiting on
    work outside a capture would invalidate it."""
    side = _schedule_stream(device)
    if torch.cuda.is_current_stream_capturing():
        with torch.cuda.stream(side):
            if not torch.cuda.is_current_stream_capturing():
                return
    torch.cuda.current_stream(device).wait_stream(side)


@functools.lru_cache(maxsize=1)
def _flash_mla_import_error():
    """None when flash_mla imports with its legacy (SM90) half; else the reason."""
    try:
        import flash_mla  # noqa: F401
    except Exception as exc:  # ImportError, or OSError from a library that will not load
        return f"the flash_mla module is not importable ({type(exc).__name__}: {exc})"
    if not flash_mla.has_legacy():
        return "flash_mla was built without its legacy SM90 kernels"
    return None


def flashmla_unmet(call):
    """None if FlashMLA's dense bf16 decode serves this DecodeCall (on an SM90 GPU, which
    the registry checks), else why not."""
    q, kv_cache = call.q, call.kv_cache
    err = _flash_mla_import_error()
    if err is not None:
        return err
    if call.kind != "auto":
        return "FlashMLA here serves a bf16 cache only (kv_cache_dtype='auto')"
    if q.dtype != torch.bfloat16:
        return f"FlashMLA needs q in bfloat16, got {q.dtype}"
    if q.shape[-1] != 576 or call.head_dim_v != 512:
        return (f"FlashMLA needs q/cache rows of 576 (512 + 64) and head_dim_v 512, got "
                f"{q.shape[-1]} and {call.head_dim_v}")
    if kv_cache.shape[1] != 64:
        return f"FlashMLA needs block_size 64, kv_cache has block_size {kv_cache.shape[1]}"
    return None


# FlashMLA's SM90 decode tiles 64 query rows per CTA and gives each KV head an equal
# share of the SMs; its scheduler table has one 8-int row per SM part.
_BLOCK_M, _META_INTS = 64, 8


def schedule_rows(device, q_rows: int) -> int:
    """Rows of the scheduler table for q_rows query rows (s_q * H) per KV head (one)."""
    return sm_count(device) // -(-q_rows // _BLOCK_M)


def scheduler_metadata(cache_seqlens: torch.Tensor, q_rows: int, num_heads: int,
                       fp8: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA's scheduler kernel on the current stream: table [parts, 8] int32 and split
    offsets [B + 1] int32 for these lengths (fp8: for the dense fp8 kernel, which has a
    scheduler of its own)."""
    import flash_mla
    meta, splits = flash_mla.get_mla_decoding_metadata(
        cache_seqlens, q_rows, 1, None if fp8 else num_heads, fp8, None, use_legacy=True)
    want = schedule_rows(cache_seqlens.device, q_rows)
    if tuple(meta.shape) != (want, _META_INTS):
        raise RuntimeError(f"flash_mla returned a scheduler table of shape {tuple(meta.shape)}, "
                           f"expected ({want}, {_META_INTS}); this flash_mla version is not "
                           f"supported (sgl-flash-mla 1.0.0 is)")
    return meta, splits


def compute_schedule(cache_seqlens: torch.Tensor, q_rows: int, num_heads: int,
                     fp8: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """scheduler_metadata() on the side stream, for a table made once per step and read
    by later decode calls (which join the side stream first): see Overlap above."""
    main, side = torch.cuda.current_stream(cache_seqlens.device), \
        _schedule_stream(cache_seqlens.device)
    side.wait_stream(main)                       # the lengths as the caller's stream has them
    with torch.cuda.stream(side):
        meta, splits = scheduler_metadata(cache_seqlens, q_rows, num_heads, fp8)
    cache_seqlens.record_stream(side)            # not reused by the caller while side reads it
    for t in (meta, splits):
        t.record_stream(main)                    # allocated on side, read on main
    return meta, splits


flashmla_schedule_op = torch.library.custom_op("mla::flashmla_schedule",
                                               mutates_args=())(compute_schedule)


@flashmla_schedule_op.register_fake
def _(cache_seqlens, q_rows, num_heads, fp8=False):
    B = cache_seqlens.shape[0]
    return (cache_seqlens.new_empty((schedule_rows(cache_seqlens.device, q_rows), _META_INTS)),
            cache_seqlens.new_empty((B + 1,)))


@functools.lru_cache(maxsize=1)
def dense_decode_kernel():
    """FlashMLA's dense decode entry (the legacy extension's op, resolved once: the
    Python wrapper around it costs host time on every call)."""
    import flash_mla  # noqa: F401  (loads torch.ops.flash_mla_legacy)
    return torch.ops.flash_mla_legacy.dense_decode_fwd.default


def flashmla_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                    cache_seqlens: torch.Tensor, softmax_scale: float, causal: bool,
                    head_dim_v: int, sched_meta: Optional[torch.Tensor] = None,
                    sched_splits: Optional[torch.Tensor] = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, s_q, H, 576] bf16 -> out [B, s_q, H, 512], lse [B, H, s_q]. Without a
    schedule FlashMLA's entry computes the table itself, on the current stream (nothing
    to overlap within one call)."""
    if sched_meta is not None:
        _join_schedule_stream(q.device)
    out, lse, _, _ = dense_decode_kernel()(
        q, kv_cache.unsqueeze(2), head_dim_v, cache_seqlens, block_table, softmax_scale,
        causal, sched_meta, sched_splits)
    return out, lse


flashmla_decode_op = torch.library.custom_op("mla::flashmla_decode",
                                             mutates_args=())(flashmla_decode)


@flashmla_decode_op.register_fake
def _(q, kv_cache, block_table, cache_seqlens, softmax_scale, causal, head_dim_v,
      sched_meta=None, sched_splits=None):
    B, s_q, H, _ = q.shape
    return (q.new_empty((B, s_q, H, head_dim_v)),
            q.new_empty((B, H, s_q), dtype=torch.float32))


class FP8Schedule(NamedTuple):
    """The dense fp8 kernel's (table, splits): a type of its own, so that neither kernel is
    handed the other's table (the two have the same shapes)."""
    table: torch.Tensor
    splits: torch.Tensor


def flashmla_schedule(block_table, cache_seqlens, block_size: int, num_heads: int, s_q: int = 1,
                      bounded: bool = False, fp8: bool = False):
    """The scheduler table for a decode call over these lengths (see the module docstring);
    fp8: for the dense fp8 kernel (an FP8Schedule).

    The lengths are bounded to the block table's width first (unless the caller already
    did: bounded), as the decode call bounds them under CUDA-graph capture, so the table
    never covers blocks the table lacks.
    """
    lens = cache_seqlens if bounded else cache_seqlens.clamp(1, block_table.shape[1] * block_size)
    schedule = flashmla_schedule_op if torch.compiler.is_compiling() else compute_schedule
    meta, splits = schedule(lens, s_q * num_heads, num_heads, fp8)
    return FP8Schedule(meta, splits) if fp8 else (meta, splits)


def check_schedule(schedule, q, fp8=False):
    """A caller's (sched_meta [parts, 8], sched_splits [B + 1]) int32 pair on q's device,
    made for the kernel that will read it (fp8: the dense fp8 kernel)."""
    if not (isinstance(schedule, (tuple, list)) and len(schedule) == 2):
        raise TypeError("decode_schedule must be the (table, splits) pair from decode_schedule()")
    if isinstance(schedule, FP8Schedule) != fp8:
        raise TypeError(f"decode_schedule was computed with fp8q={not fp8}; this call needs "
                        f"one from decode_schedule(..., fp8q={fp8})")
    meta, splits = schedule
    B, s_q, H, _ = q.shape
    for name, t in (("decode_schedule table", meta), ("decode_schedule splits", splits)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.device != q.device:
            raise TypeError(f"{name} must be an int32 tensor on {q.device}")
    rows = schedule_rows(q.device, s_q * H)
    if tuple(meta.shape) != (rows, _META_INTS) or tuple(splits.shape) != (B + 1,):
        raise ValueError(f"decode_schedule must be a [{rows}, {_META_INTS}] table and [{B + 1}] "
                         f"splits for {B} requests x {s_q * H} query rows; got "
                         f"{tuple(meta.shape)} and {tuple(splits.shape)} (compute it with "
                         f"decode_schedule() from this call's lengths)")


def run_flashmla(call):
    """Route "flashmla" of lowering.mla_decode (a checked DecodeCall, inputs bounded).
    call.schedule: (table, splits) from flashmla_schedule() for these lengths, or None
    to compute it in this call."""
    q = call.q
    meta = splits = None
    if call.schedule is not None:
        check_schedule(call.schedule, q)
        meta, splits = call.schedule
    decode = flashmla_decode_op if torch.compiler.is_compiling() else flashmla_decode
    return decode(q, call.kv_cache, call.block_table, call.cache_seqlens, call.softmax_scale,
                  call.causal, call.head_dim_v, meta, splits)


# ---- fp8 q and cache: the route "flashmla" of lowering.mla_decode_fp8q ----


def flashmla_fp8q_unmet(call):
    """None if FlashMLA's dense fp8 kernel serves this mla_decode_fp8q DecodeCall (on an
    SM90 GPU, which the registry checks), else why not."""
    q, kv_cache = call.q, call.kv_cache
    err = _flash_mla_import_error()
    if err is not None:
        return err
    if not _has_fp8_decode():
        return "this flash_mla build has no dense fp8 decode (fwd_kvcache_mla_fp8)"
    if q.shape[-1] != 576 or call.head_dim_v != 512:
        return (f"FlashMLA's fp8 decode needs rows of 576 and head_dim_v 512, got "
                f"{q.shape[-1]} and {call.head_dim_v}")
    if kv_cache.shape[1] != 64:
        return f"FlashMLA needs block_size 64, kv_cache has block_size {kv_cache.shape[1]}"
    if q.shape[2] % 16 or q.shape[2] > 128:
        return (f"FlashMLA's fp8 decode is used here for 16 to 128 heads in steps of 16 (the "
                f"counts tested), q has {q.shape[2]}")
    if call.out_dtype != torch.bfloat16:
        return f"FlashMLA's fp8 decode writes bfloat16 only, out_dtype is {call.out_dtype}"
    return None


@functools.lru_cache(maxsize=1)
def _has_fp8_decode() -> bool:
    return hasattr(torch.ops.flash_mla_legacy, "fwd_kvcache_mla_fp8")


def flashmla_decode_fp8q(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                         cache_seqlens: torch.Tensor, q_scale: torch.Tensor,
                         k_scale: torch.Tensor, softmax_scale: float, causal: bool,
                         sched_meta: Optional[torch.Tensor] = None,
                         sched_splits: Optional[torch.Tensor] = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, s_q, H, 576] e4m3 (true value = q * q_scale), kv_cache [blocks, 64, 576] e4m3
    (true value = kv * k_scale), scales [1] fp32 -> out [B, s_q, H, 512] bf16, lse [B, H, s_q].
    The scheduler table is computed here unless given (sched_meta, sched_splits)."""
    import flash_mla
    for name, t in (("q", q), ("kv_cache", kv_cache)):
        if t.data_ptr() % 16 or any(st * t.element_size() % 16 for st in t.stride()[:-1]):
            raise ValueError(f"{name} must start at a 16-byte aligned address with 16-byte "
                             f"aligned strides for FlashMLA's fp8 kernel (call .contiguous() "
                             f"on a copy that is)")
    _, s_q, H, _ = q.shape
    meta, splits = sched_meta, sched_splits
    if meta is None:                  # made here, on this stream: nothing to join
        meta, splits = scheduler_metadata(cache_seqlens, s_q * H, H, True)
    else:
        _join_schedule_stream(q.device)
    sched = flash_mla.flash_mla_interface.FlashMLASchedMeta()
    sched.tile_scheduler_metadata, sched.num_splits = meta, splits
    return flash_mla.flash_mla_with_kvcache(
        q, kv_cache.unsqueeze(2), block_table, cache_seqlens, 512, sched,
        softmax_scale=softmax_scale, causal=causal, is_fp8_kvcache=True, use_legacy=True,
        descale_q=q_scale, descale_k=k_scale)


flashmla_decode_fp8q_op = torch.library.custom_op("mla::flashmla_decode_fp8q",
                                                  mutates_args=())(flashmla_decode_fp8q)


@flashmla_decode_fp8q_op.register_fake
def _(q, kv_cache, block_table, cache_seqlens, q_scale, k_scale, softmax_scale, causal,
      sched_meta=None, sched_splits=None):
    B, s_q, H, _ = q.shape
    return (q.new_empty((B, s_q, H, 512), dtype=torch.bfloat16),
            q.new_empty((B, H, s_q), dtype=torch.float32))


def run_flashmla_fp8q(call):
    """Route "flashmla-fp8q" of lowering.mla_decode_fp8q (a checked DecodeCall, inputs
    bounded). call.schedule: flashmla_schedule(..., fp8=True) for these lengths, or None
    to compute it in this call."""
    q = call.q
    meta = splits = None
    if call.schedule is not None:
        check_schedule(call.schedule, q, fp8=True)
        meta, splits = call.schedule
    decode = flashmla_decode_fp8q_op if torch.compiler.is_compiling() else flashmla_decode_fp8q
    return decode(q, call.kv_cache, call.block_table, call.cache_seqlens,
                  call.q_scale.reshape(1), call.k_scale.reshape(1), call.softmax_scale,
                  call.causal, meta, splits)
