"""Backend "flashmla": dense MLA decode through FlashMLA's SM90 kernel (PyPI sgl-flash-mla).

Serves: flash_mla importable, q on an SM90 GPU, q bf16 with a bf16 cache (kind "auto"),
L + R = 576, head_dim_v = 512, page size 64. On SM90 the dense bf16 decode lives in
the package's legacy extension (torch.ops.flash_mla_legacy, use_legacy=True).

Scheduler metadata. FlashMLA splits each request's keys over the SMs according to a
tile-scheduler table computed from cache_seqlens. A table computed once and reused
while lengths change (or computed outside a captured graph into fresh tensors) gives
stale splits and garbage after some steps. Here the table is computed inside this op,
on the device, from the cache_seqlens it is called with. Under CUDA-graph capture the
metadata kernel is captured too: its output buffers belong to the graph's private pool
(fixed addresses for the graph's life) and every replay refills them from the lengths
it is replayed with. No buffer outlives the call, so nothing is allocated in a CUDA-graph
pool that the graph does not own (cudagraph trees reject such tensors).

The call is wrapped as the custom op mla::flashmla_decode (with a fake impl) so
torch.compile treats it as one opaque node.
"""
from __future__ import annotations

import functools

import torch

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


def flashmla_unmet(q, kv_cache, kind):
    if q.device.type != "cuda":
        return f"q is on {q.device.type}, FlashMLA needs a CUDA device"
    if torch.cuda.get_device_capability(q.device) != (9, 0):
        cap = torch.cuda.get_device_capability(q.device)
        return f"FlashMLA's dense decode needs an SM90 GPU, this one is SM{cap[0]}{cap[1]}"
    err = _flash_mla_import_error()
    if err is not None:
        return err
    if kind != "auto":
        return "FlashMLA here serves a bf16 cache only (kv_cache_dtype='auto')"
    if q.dtype != torch.bfloat16:
        return f"FlashMLA needs q in bfloat16, got {q.dtype}"
    if q.shape[-1] != 576:
        return f"FlashMLA needs q/cache rows of 576 (512 + 64), got {q.shape[-1]}"
    if kv_cache.shape[1] != 64:
        return f"FlashMLA needs block_size 64, kv_cache has block_size {kv_cache.shape[1]}"
    return None


@torch.library.custom_op("mla::flashmla_decode", mutates_args=())
def flashmla_decode_op(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                       cache_seqlens: torch.Tensor, softmax_scale: float, causal: bool,
                       head_dim_v: int) -> tuple[torch.Tensor, torch.Tensor]:
    import flash_mla
    B, s_q, H, _ = q.shape
    meta, splits = flash_mla.get_mla_decoding_metadata(
        cache_seqlens, s_q * H, 1, H, False, None, use_legacy=True)
    sched = flash_mla.flash_mla_interface.FlashMLASchedMeta()
    sched.tile_scheduler_metadata, sched.num_splits = meta, splits
    out, lse = flash_mla.flash_mla_with_kvcache(
        q, kv_cache.unsqueeze(2), block_table, cache_seqlens, head_dim_v, sched,
        softmax_scale=softmax_scale, causal=causal, is_fp8_kvcache=False, use_legacy=True)
    return out, lse


@flashmla_decode_op.register_fake
def _(q, kv_cache, block_table, cache_seqlens, softmax_scale, causal, head_dim_v):
    B, s_q, H, _ = q.shape
    return (q.new_empty((B, s_q, H, head_dim_v)),
            q.new_empty((B, H, s_q), dtype=torch.float32))


def flashmla_decode(q, kv_cache, block_table, cache_seqlens, softmax_scale, *, causal, kind,
                    k_scale, head_dim_v):
    """Backend "flashmla" of lowering.mla_decode (arguments already validated there)."""
    if head_dim_v != 512:
        from .backends import BackendUnavailable
        raise BackendUnavailable(f"backend 'flashmla' needs head_dim_v 512, got {head_dim_v}")
    return flashmla_decode_op(q, kv_cache, block_table, cache_seqlens, float(softmax_scale),
                              bool(causal), int(head_dim_v))
