"""Input checks of the public entries (the torch.ops.mla.* ops, lowering.mla_decode,
mla_decode_fp8q, decode_schedule, bound_decode_inputs), run once per call there; what
they call inside takes the checked arguments as they are.

Two kinds, both naming the argument that is wrong:
  shape / dtype / device checks: host-only, always on.
  value checks (lengths, block ids, slots in range): they read tensor data on the host.
    CPU tensors: always (no device sync). CUDA tensors: only when asked for, with
    lowering.config.validate (MLA_VALIDATE=1) or validate=True on the entry, and never
    while torch.compile traces or a CUDA graph captures the call. Without them a bad
    value gives wrong rows, never an out-of-bounds access: every decode kernel bounds
    the lengths and block ids it reads (in-kernel, or clamped before the launch), and
    the cache write drops out-of-range slots.
"""
from __future__ import annotations

import torch

from lowering import config

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


def wants_value_checks(t: torch.Tensor, validate=None) -> bool:
    """Whether the value checks run for a call on t's device: always for CPU tensors, for
    CUDA ones when validate (None: lowering.config.validate) says so; never while
    torch.compile traces the call or a CUDA graph is being captured (no host reads)."""
    if torch.compiler.is_compiling():
        return False
    if t.device.type == "cpu":
        return True
    if not (config.validate if validate is None else validate):
        return False
    return not (t.is_cuda and torch.cuda.is_current_stream_capturing())


def check_decode_args(q, kv_cache, block_table, cache_seqlens, softmax_scale, kv_cache_dtype,
                      k_scale, head_dim_v, q_dtypes=FLOAT_DTYPES):
    """Shapes, dtypes and devices of a decode call (host-only); returns (kind, head_dim_v)
    with kind "auto" | "fp8" and head_dim_v resolved (default L + R - 64)."""
    check_tensor("q", q, ndim=4, dtypes=q_dtypes)
    check_tensor("kv_cache", kv_cache, ndim=3, dtypes=FLOAT_DTYPES + FP8_DTYPES, contiguous=True)
    check_tensor("block_table", block_table, ndim=2, dtypes=(torch.int32,), contiguous=True)
    check_tensor("cache_seqlens", cache_seqlens, ndim=1, dtypes=(torch.int32,), contiguous=True)
    B, s_q, H, D = q.shape
    if D != kv_cache.shape[2]:
        raise ValueError(f"q head size {D} must equal the cache row width "
                         f"kv_cache.shape[-1]={kv_cache.shape[2]} (L+R)")
    if q.stride(-1) != 1:
        raise ValueError("q must be contiguous in its last dim")
    if block_table.shape[0] != B:
        raise ValueError(f"block_table has {block_table.shape[0]} rows, q has batch {B}")
    if cache_seqlens.shape[0] != B:
        raise ValueError(f"cache_seqlens has {cache_seqlens.shape[0]} entries, q has batch {B}")
    device = q.device
    for name, t in (("kv_cache", kv_cache), ("block_table", block_table),
                    ("cache_seqlens", cache_seqlens)):
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, q on {device}")
    if not isinstance(softmax_scale, (float, int)) or not softmax_scale > 0:
        raise ValueError(f"softmax_scale must be a positive float, got {softmax_scale!r}")
    if head_dim_v is None:
        head_dim_v = D - 64
    if not 0 < head_dim_v < D:
        raise ValueError(f"head_dim_v must be in (0, {D}), got {head_dim_v}")
    ref_dtype = q.dtype if q.dtype not in FP8_DTYPES else kv_cache.dtype
    kind = check_kv_cache_dtype_pair(kv_cache, kv_cache_dtype, k_scale, ref_dtype, "q")
    return kind, head_dim_v


def check_decode_values(kv_cache, block_table, cache_seqlens, s_q: int,
                        lens_name: str = "cache_seqlens") -> None:
    """The value checks of a decode call (host reads; see wants_value_checks): each length
    in [s_q, table width x block_size], each block id within a length in [0, num_blocks)."""
    if block_table.shape[0] == 0:
        return
    nb, bs, _ = kv_cache.shape
    max_blocks = block_table.shape[1]
    lens = cache_seqlens.to("cpu")                                        # [B]
    if (lens < s_q).any():
        raise ValueError(f"{lens_name} must be >= s_q={s_q} (the query tokens are in the "
                         f"cache), got {lens.tolist()}")
    if (lens > max_blocks * bs).any():
        raise ValueError(
            f"{lens_name} {lens.max().item()} exceeds the blocks given: block_table has "
            f"{max_blocks} blocks of {bs}")
    needed = (lens + bs - 1) // bs                                        # [B]
    used = torch.arange(max_blocks)[None, :] < needed[:, None]            # [B, max_blocks]
    ids = block_table.to("cpu")[used]
    if ids.numel() and (ids.min() < 0 or ids.max() >= nb):
        raise ValueError(f"block_table holds block ids outside [0, {nb}) within {lens_name}")


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


def check_fp8q_args(q, kv_cache, block_table, cache_seqlens, softmax_scale, q_scale, k_scale,
                    head_dim_v, out_dtype) -> int:
    """Shapes, dtypes and devices of a decode call with an fp8 query over an fp8 cache
    (mla_decode_fp8q); returns head_dim_v."""
    check_tensor("q", q, ndim=4, dtypes=FP8_DTYPES)
    for name, t in (("q_scale", q_scale), ("k_scale", k_scale)):
        check_tensor(name, t, dtypes=(torch.float32,))
        if t.numel() != 1:
            raise ValueError(f"{name} must hold one value (per-tensor scale), got shape "
                             f"{tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    if out_dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"out_dtype must be torch.bfloat16 or torch.float16, got {out_dtype}")
    _, head_dim_v = check_decode_args(q, kv_cache, block_table, cache_seqlens, softmax_scale,
                                      "fp8", k_scale, head_dim_v, q_dtypes=FP8_DTYPES)
    return head_dim_v
