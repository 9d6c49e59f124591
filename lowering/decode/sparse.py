"""Sparse MLA decode: MQA over a token-granular list of cache slots per query row.

    mla_sparse_decode(q [T, H, L+R], kv_cache [num_blocks, block_size, L+R],
                      indices [T, K] int32 (cache slots, -1 = no token), softmax_scale, *,
                      kv_cache_dtype="auto", k_scale=None, head_dim_v=None, backend="auto")
        -> (out [T, H, L] in q's dtype, lse [T, H] float32, natural log)

Each query row t attends to the cache rows at slots indices[t, :] (slot = block_id *
block_size + offset, as the cache write takes them), whatever their order; -1 (and any
slot outside the cache) is no token. This is DeepSeek Sparse Attention's attention:
the indexer picks the top-k tokens of each query's causal prefix and the attention
reads only those (K fixed, so shapes stay static). A row without a token gives a zero
output and lse -inf.

Routes:
  "triton": the split-KV decode kernel (triton_decode.py) reads the cache as pages of
            one token, [num_blocks * block_size, 1, L+R], each row's slot list
            standing in for its block table: the list sorted so that its tokens come
            first and their count as the length. bf16 / fp16 query; cache the same
            dtype or fp8 e4m3 with k_scale.
  "reference": pure torch in float32 (any device, any float dtype).
"auto" takes "triton" on CUDA where it serves, else "reference".

The public function checks its arguments once; the op mla::sparse_decode (a custom op:
one opaque node for torch.compile, fullgraph, graph-capturable: no host syncs) takes
checked ones, which is how a converted model calls it.
"""
from __future__ import annotations

import torch

from lowering import config
from lowering.checks import (FLOAT_DTYPES, FP8_DTYPES, check_kv_cache_dtype_pair,
                             check_tensor)
from lowering.decode.reference import dequant_cache
from lowering.decode.triton_decode import set_wrap_triton_enabled, triton_decode

SPARSE_BACKENDS = ("auto", "triton", "reference")


def sparse_decode_reference(q, kv_cache, indices, softmax_scale: float, kind: str, k_scale,
                            head_dim_v: int):
    """float32 torch: (out [T, H, L] q.dtype, lse [T, H] fp32)."""
    nb, bs, D = kv_cache.shape
    n = nb * bs
    valid = (indices >= 0) & (indices < n)                                  # [T, K]
    flat = dequant_cache(kv_cache, kind, k_scale).reshape(n, D)             # [n, D]
    kv = flat[indices.long().clamp(0, n - 1)]                               # [T, K, D]
    kv = kv.masked_fill(~valid[..., None], 0.0)
    scores = torch.einsum("thd,tkd->thk", q.float(), kv) * softmax_scale    # [T, H, K]
    scores = scores.masked_fill(~valid[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)                                   # [T, H]
    p = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("thk,tkv->thv", p, kv[..., :head_dim_v])             # [T, H, L]
    return out.to(q.dtype), lse


def sparse_decode_triton(q, kv_cache, indices, softmax_scale: float, kind: str, k_scale,
                         head_dim_v: int):
    """The Triton decode kernel over pages of one token: (out [T, H, L], lse [T, H])."""
    nb, bs, D = kv_cache.shape
    n = nb * bs
    idx = torch.where((indices >= 0) & (indices < n), indices.to(torch.int32), -1)
    idx = torch.sort(idx, dim=-1, descending=True).values                  # tokens first
    lens = (idx >= 0).sum(-1, dtype=torch.int32)                           # [T]
    pages = kv_cache.view(n, 1, D)                                         # one token a page
    args = (q[:, None], pages, idx, lens, None,
            k_scale.reshape(1) if kind == "fp8" else None, softmax_scale, False, head_dim_v,
            1 if kind == "fp8" else 0, config.batch_invariant, q.dtype)
    if set_wrap_triton_enabled is None:
        out, lse = triton_decode(*args)
    else:
        with set_wrap_triton_enabled(False):     # inside the op: launch directly
            out, lse = triton_decode(*args)
    out, lse = out[:, 0], lse[..., 0]                                      # [T, H, L], [T, H]
    empty = (lens == 0)[:, None]                                           # [T, 1]
    # the kernel reads at least one key (a length of 0 is clamped to 1): no token, no output
    return (out.masked_fill(empty[..., None], 0.0),
            lse.masked_fill(empty, float("-inf")))


def triton_unmet(q, kv_cache, kind: str) -> str | None:
    """None where the Triton route serves the call, else the unmet condition in words."""
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"the Triton route takes a bf16 / fp16 query, got {q.dtype}"
    if kind == "auto" and kv_cache.dtype != q.dtype:
        return "the Triton route takes a cache of the query's dtype (or fp8)"
    return None


def resolve_backend(q, kv_cache, kind: str, backend: str) -> str:
    if backend == "reference":
        return backend
    why = triton_unmet(q, kv_cache, kind)
    if backend == "triton":
        if why is not None:
            raise ValueError(f"backend='triton' cannot serve this call: {why}")
        return backend
    return "triton" if why is None and q.is_cuda else "reference"


@torch.library.custom_op("mla::sparse_decode", mutates_args=())
def sparse_decode_op(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor,
                     softmax_scale: float, kv_cache_dtype: str, k_scale: torch.Tensor,
                     head_dim_v: int, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Checked arguments (mla_sparse_decode checks them); kv_cache_dtype "auto" | "fp8"."""
    route = resolve_backend(q, kv_cache, kv_cache_dtype, backend)
    run = sparse_decode_triton if route == "triton" else sparse_decode_reference
    return run(q, kv_cache, indices, softmax_scale, kv_cache_dtype, k_scale, head_dim_v)


@sparse_decode_op.register_fake
def _(q, kv_cache, indices, softmax_scale, kv_cache_dtype, k_scale, head_dim_v, backend):
    T, H, _ = q.shape
    return (q.new_empty((T, H, head_dim_v)),
            q.new_empty((T, H), dtype=torch.float32))


def check_sparse_args(q, kv_cache, indices, softmax_scale, kv_cache_dtype, k_scale,
                      head_dim_v, backend) -> tuple[str, int, torch.Tensor]:
    """(kind, head_dim_v, k_scale) after checking every argument; raises naming the bad one."""
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("kv_cache", kv_cache, ndim=3, dtypes=FLOAT_DTYPES + FP8_DTYPES, contiguous=True)
    check_tensor("indices", indices, ndim=2, dtypes=(torch.int32, torch.int64))
    if not isinstance(softmax_scale, (int, float)) or isinstance(softmax_scale, bool) \
            or not softmax_scale > 0:
        raise ValueError(f"softmax_scale must be a positive float, got {softmax_scale!r}")
    if backend not in SPARSE_BACKENDS:
        raise ValueError(f"backend must be one of {SPARSE_BACKENDS}, got {backend!r}")
    T, H, D = q.shape
    if kv_cache.shape[-1] != D:
        raise ValueError(f"kv_cache row width {kv_cache.shape[-1]} must equal q's width {D}")
    if indices.shape[0] != T:
        raise ValueError(f"indices has {indices.shape[0]} rows, q has {T}")
    for name, t in (("kv_cache", kv_cache), ("indices", indices)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    if head_dim_v is None:
        head_dim_v = D - 64
    if not isinstance(head_dim_v, int) or not 0 < head_dim_v <= D:
        raise ValueError(f"head_dim_v must be an int in (0, {D}], got {head_dim_v!r}")
    kind = check_kv_cache_dtype_pair(kv_cache, kv_cache_dtype, k_scale, q.dtype, "q")
    if k_scale is None:
        k_scale = torch.ones(1, dtype=torch.float32, device=q.device)
    resolve_backend(q, kv_cache, kind, backend)             # an explicit backend must serve
    return kind, head_dim_v, k_scale


def mla_sparse_decode(q, kv_cache, indices, softmax_scale, *, kv_cache_dtype: str = "auto",
                      k_scale=None, head_dim_v: int | None = None, backend: str = "auto"):
    """Public entry (see the module docstring): checks once, then mla::sparse_decode."""
    kind, head_dim_v, k_scale = check_sparse_args(q, kv_cache, indices, softmax_scale,
                                                  kv_cache_dtype, k_scale, head_dim_v, backend)
    return torch.ops.mla.sparse_decode(q, kv_cache, indices, float(softmax_scale), kind,
                                       k_scale, head_dim_v, backend)
