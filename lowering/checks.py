"""Input checks shared by every decode backend.

Every public entry validates before it touches memory, and names the argument
that is wrong. Value checks that would need a device->host copy (block ids in
range) are skipped while a CUDA graph is being captured or torch.compile traces the
call (lengths and block ids are then clamped into the cache in the graph instead);
shape and dtype checks always run.
"""
from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn,)
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


def is_capturing(t: torch.Tensor) -> bool:
    """True where a host sync is not possible: torch.compile is tracing the caller (its
    tensors are fake), or a CUDA graph is being captured on t's device."""
    if torch.compiler.is_compiling():
        return True
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def canonical_kv_cache_dtype(kv_cache_dtype: str) -> str:
    if not isinstance(kv_cache_dtype, str) or kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    return "auto" if kv_cache_dtype == "auto" else "fp8"


def check_tensor(name: str, t, ndim: int | None = None, dtypes=None, contiguous=False):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() first)")


def check_kv_cache_dtype_pair(kv_cache: torch.Tensor, kv_cache_dtype: str,
                              k_scale, ref_dtype: torch.dtype, ref_name: str) -> str:
    """Check that the cache storage dtype agrees with kv_cache_dtype; return "auto"|"fp8"."""
    kind = canonical_kv_cache_dtype(kv_cache_dtype)
    if kind == "fp8":
        if kv_cache.dtype not in FP8_DTYPES:
            raise TypeError(
                f"kv_cache must be torch.float8_e4m3fn when kv_cache_dtype={kv_cache_dtype!r}, "
                f"got {kv_cache.dtype}")
        if k_scale is None:
            raise ValueError("k_scale is required when kv_cache_dtype is 'fp8'")
    else:
        if kv_cache.dtype in FP8_DTYPES:
            raise TypeError("kv_cache is float8_e4m3fn: pass kv_cache_dtype='fp8' and k_scale")
        if kv_cache.dtype != ref_dtype:
            raise TypeError(
                f"kv_cache dtype {kv_cache.dtype} must equal {ref_name} dtype {ref_dtype} "
                f"when kv_cache_dtype='auto'")
    if k_scale is not None:
        check_tensor("k_scale", k_scale, dtypes=(torch.float32,))
        if k_scale.numel() != 1:
            raise ValueError(f"k_scale must hold one value (per-tensor scale), got shape {tuple(k_scale.shape)}")
        if k_scale.device != kv_cache.device:
            raise ValueError(f"k_scale is on {k_scale.device}, kv_cache on {kv_cache.device}")
    return kind


def check_decode_args(q, kv_cache, block_table, cache_seqlens, softmax_scale,
                      kv_cache_dtype, k_scale, head_dim_v):
    """Validate mla_decode arguments; return (kind, head_dim_v)."""
    check_tensor("q", q, ndim=4, dtypes=FLOAT_DTYPES)
    check_tensor("kv_cache", kv_cache, ndim=3, dtypes=FLOAT_DTYPES + FP8_DTYPES, contiguous=True)
    check_tensor("block_table", block_table, ndim=2, dtypes=(torch.int32,), contiguous=True)
    check_tensor("cache_seqlens", cache_seqlens, ndim=1, dtypes=(torch.int32,), contiguous=True)
    B, s_q, H, D = q.shape
    nb, bs, Dk = kv_cache.shape
    if D != Dk:
        raise ValueError(f"q head size {D} must equal the cache row width kv_cache.shape[-1]={Dk} (L+R)")
    if q.stride(-1) != 1:
        raise ValueError("q must be contiguous in its last dim")
    if block_table.shape[0] != B:
        raise ValueError(f"block_table has {block_table.shape[0]} rows, q has batch {B}")
    if cache_seqlens.shape[0] != B:
        raise ValueError(f"cache_seqlens has {cache_seqlens.shape[0]} entries, q has batch {B}")
    for name, t in (("kv_cache", kv_cache), ("block_table", block_table), ("cache_seqlens", cache_seqlens)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    if not isinstance(softmax_scale, (float, int)) or not softmax_scale > 0:
        raise ValueError(f"softmax_scale must be a positive float, got {softmax_scale!r}")
    if head_dim_v is None:
        head_dim_v = D - 64
    if not 0 < head_dim_v < D:
        raise ValueError(f"head_dim_v must be in (0, {D}), got {head_dim_v}")
    kind = check_kv_cache_dtype_pair(kv_cache, kv_cache_dtype, k_scale, q.dtype, "q")
    if B > 0 and not is_capturing(q):
        max_blocks = block_table.shape[1]
        lens = cache_seqlens.to("cpu")
        if (lens < s_q).any():
            raise ValueError(f"cache_seqlens must be >= s_q={s_q} (the query tokens are in the cache), got {lens.tolist()}")
        if (lens > max_blocks * bs).any():
            raise ValueError(
                f"cache_seqlens {lens.max().item()} exceeds the blocks given: block_table has "
                f"{max_blocks} blocks of {bs}")
        needed = (lens + bs - 1) // bs  # [B]
        bt = block_table.to("cpu")
        used = torch.arange(max_blocks)[None, :] < needed[:, None]
        ids = bt[used]
        if ids.numel() and (ids.min() < 0 or ids.max() >= nb):
            raise ValueError(f"block_table holds block ids outside [0, {nb}) within cache_seqlens")
    return kind, head_dim_v


def bound_for_capture(q, kv_cache, block_table, cache_seqlens):
    """Under CUDA-graph capture or torch.compile the value checks above are skipped (they
    need a host sync), so bound what a kernel can read: bad lengths or block ids then give
    wrong rows, never an out-of-bounds access. Elsewhere the checks have run: no-op."""
    if not is_capturing(q):
        return block_table, cache_seqlens
    return bound_decode_inputs(kv_cache, block_table, cache_seqlens)


def check_table_and_lengths(kv_cache, block_table, cache_seqlens) -> None:
    """A paged cache [num_blocks, block_size, D], block_table [B, M] int32 and
    cache_seqlens [B] int32 on the cache's device (shapes and types only, no host sync)."""
    check_tensor("kv_cache", kv_cache, ndim=3)
    check_tensor("block_table", block_table, ndim=2, dtypes=(torch.int32,))
    check_tensor("cache_seqlens", cache_seqlens, ndim=1, dtypes=(torch.int32,))
    if cache_seqlens.shape[0] != block_table.shape[0]:
        raise ValueError(f"cache_seqlens has {cache_seqlens.shape[0]} entries, block_table "
                         f"{block_table.shape[0]} rows")
    for name, t in (("block_table", block_table), ("cache_seqlens", cache_seqlens)):
        if t.device != kv_cache.device:
            raise ValueError(f"{name} is on {t.device}, kv_cache on {kv_cache.device}")


def bound_decode_inputs(kv_cache, block_table, cache_seqlens):
    """(block_table clamped to [0, num_blocks - 1], cache_seqlens to [1, table width x
    block_size]): what a decode kernel may read, whatever the values. A caller that
    bounds once for many calls passes bounded=True to mla_decode."""
    check_table_and_lengths(kv_cache, block_table, cache_seqlens)
    nb, bs, _ = kv_cache.shape
    return (block_table.clamp(0, nb - 1),
            cache_seqlens.clamp(1, block_table.shape[1] * bs))


def check_fp8q_args(q, kv_cache, block_table, cache_seqlens, softmax_scale, q_scale, k_scale,
                    head_dim_v, out_dtype):
    """Checks of a decode call with an fp8 query (mla_decode_fp8q); returns head_dim_v."""
    check_tensor("q", q, ndim=4, dtypes=(torch.float8_e4m3fn,))
    for name, t in (("q_scale", q_scale), ("k_scale", k_scale)):
        check_tensor(name, t, dtypes=(torch.float32,))
        if t.numel() != 1:
            raise ValueError(f"{name} must hold one value (per-tensor scale), got shape "
                             f"{tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    if out_dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"out_dtype must be torch.bfloat16 or torch.float16, got {out_dtype}")
    # the rest as mla_decode checks it, with a bf16 stand-in of q's shape (no copy)
    stand_in = torch.empty((1, 1, 1, q.shape[-1]), dtype=torch.bfloat16,
                           device=q.device).expand(*q.shape)
    _, head_dim_v = check_decode_args(stand_in, kv_cache, block_table, cache_seqlens,
                                      softmax_scale, "fp8", k_scale, head_dim_v)
    return head_dim_v
