"""The decode entry points (documented in lowering/decode/__init__.py).

The public functions check their arguments once (lowering.checks) and hand a DecodeCall
to run_decode(), which the torch.ops.mla.* ops call directly with arguments they have
checked themselves: no second pass through the checks.
"""
from __future__ import annotations

from collections import Counter

import torch

from lowering.checks import (canonical_kv_cache_dtype, check_decode_args, check_decode_values,
                             check_fp8q_args, check_table_and_lengths, check_tensor,
                             wants_value_checks)
from lowering.decode.registry import (BACKENDS, FP8Q_BACKENDS, TABLE, BackendUnavailable,
                                      DecodeCall, choose_route, flashmla_pays, route_for)

__all__ = ["mla_decode", "mla_decode_fp8q", "BACKENDS", "FP8Q_BACKENDS", "BackendUnavailable",
           "DecodeCall", "select_backend", "backend_choices", "decode_schedule",
           "uses_flashmla", "flashmla_pays", "bound_decode_inputs", "run_decode", "record_choice"]

# route name -> number of eager decode calls it served (read by the inspection tool).
backend_choices: Counter = Counter()


def record_choice(name: str) -> None:
    """Count a call served by route `name`; not while torch.compile traces the caller
    (a count read in the graph would be guarded on and recompile every call)."""
    if not torch.compiler.is_compiling():
        backend_choices[name] += 1


def clamp_decode_inputs(kv_cache, block_table, cache_seqlens):
    """(block_table clamped to [0, num_blocks - 1], cache_seqlens to [1, table width x
    block_size]): what a kernel may read, whatever the values (no checks, no sync)."""
    nb, bs, _ = kv_cache.shape
    return (block_table.clamp(0, nb - 1),
            cache_seqlens.clamp(1, block_table.shape[1] * bs))


def bound_decode_inputs(kv_cache, block_table, cache_seqlens):
    """clamp_decode_inputs after checking shapes and types: a caller that bounds once for
    many calls passes the result with bounded=True to mla_decode / mla_decode_fp8q."""
    check_table_and_lengths(kv_cache, block_table, cache_seqlens)
    return clamp_decode_inputs(kv_cache, block_table, cache_seqlens)


def run_decode(call: DecodeCall, query: str = "bf16", backend: str = "auto"):
    """Choose the route of query kind `query` ("bf16" | "fp8q") for an already checked
    call and run it: count it, bound its table and lengths unless the route's kernels do
    or the caller did (call.bounded). Returns (out, lse)."""
    route = route_for(call, query, backend)
    record_choice(route.name)
    if not (route.bounds_in_kernel or call.bounded):
        table, lens = clamp_decode_inputs(call.kv_cache, call.block_table, call.cache_seqlens)
        call = call._replace(block_table=table, cache_seqlens=lens, bounded=True)
    return route.run(call)


def select_backend(q, kv_cache, *, kv_cache_dtype="auto", backend="auto",
                   head_dim_v=None, block_table=None) -> str:
    """Name of the mla_decode backend that would serve a call with this q and cache
    (raises BackendUnavailable if none can). block_table: the call's, whose width and
    batch enter the choice (flashmla_pays); without it that rule is left out."""
    if block_table is not None:
        check_tensor("block_table", block_table, ndim=2)
    kind = canonical_kv_cache_dtype(kv_cache_dtype)
    head_dim_v = q.shape[-1] - 64 if head_dim_v is None else head_dim_v
    call = DecodeCall(q, kv_cache, block_table, None, 1.0, True, kind, None, head_dim_v)
    return choose_route(call, "bf16", backend).backend


def uses_flashmla(device, q_dtype, num_heads: int, width: int, block_size: int,
                  kv_cache_dtype="auto", backend="auto", s_q: int = 1) -> bool:
    """Whether a decode call with these properties (q [B, s_q, num_heads, width] of q_dtype
    over a cache of block_size rows of width) would run on the flashmla backend: for an
    fp8 q (float8_e4m3fn, an mla_decode_fp8q call over an fp8 cache), whether FlashMLA's
    fp8 kernel would run when handed decode_schedule(..., fp8q=True). backend="auto" gives
    a bf16 call to FlashMLA only where flashmla_pays(num_heads, B, max_len, q_dtype) of the
    call's shapes also holds (below 64 heads past a number of cached positions, from 64
    past a few requests; plain arithmetic: ask it per step).

    Plain Python (imports, device queries): call it outside compiled code and keep the
    answer, e.g. when a cache is built.
    """
    q_like = torch.empty((0, s_q, num_heads, width), dtype=q_dtype, device=device)
    kv_like = torch.empty((0, block_size, width), dtype=q_dtype, device=device)
    kind = "auto" if kv_cache_dtype == "auto" else "fp8"
    if q_dtype == torch.float8_e4m3fn:
        if kind != "fp8" or backend not in ("auto", "flashmla"):
            return False
        call = DecodeCall(q_like, kv_like, None, None, 1.0, True, kind, None, width - 64,
                          out_dtype=torch.bfloat16)
        return TABLE["fp8q"]["flashmla"].unmet(call, False) is None
    try:
        return select_backend(q_like, kv_like, kv_cache_dtype=kind, backend=backend) == "flashmla"
    except (BackendUnavailable, ValueError):
        return False


def decode_schedule(kv_cache, block_table, cache_seqlens, *, num_heads, s_q=1, bounded=False,
                    fp8q=False):
    """FlashMLA's work split for decode calls over these lengths: (table, splits).

    Computed once per step and passed as mla_decode(..., schedule=) to every layer's call
    over the same block_table and cache_seqlens, it replaces one scheduler kernel per
    call. Only the flashmla backend reads it (check with uses_flashmla first); it must be
    recomputed whenever the lengths change (a graph op: captured graphs recompute it on
    every replay). bounded: cache_seqlens come from bound_decode_inputs() (no clamp kernel).
    fp8q: the split for FlashMLA's dense fp8 kernel instead, for mla_decode_fp8q(...,
    schedule=) (it has a scheduler of its own; the two are not interchangeable).
    The tensors are written on a side stream that the decode calls join before reading
    them (lowering/decode/flashmla.py, Overlap); read them elsewhere only after
    torch.cuda.synchronize() or waiting on that stream.
    """
    check_table_and_lengths(kv_cache, block_table, cache_seqlens)
    for name, v in (("num_heads", num_heads), ("s_q", s_q)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    from lowering.decode.flashmla import flashmla_schedule
    return flashmla_schedule(block_table, cache_seqlens, kv_cache.shape[1], num_heads, s_q,
                             bounded=bounded, fp8=bool(fp8q))


def mla_decode(q, kv_cache, block_table, cache_seqlens, softmax_scale, *, causal=True,
               kv_cache_dtype="auto", k_scale=None, backend="auto", head_dim_v=None,
               schedule=None, bounded=False, validate=None):
    """Absorbed-MLA decode over a paged latent cache (see the module docstring).

    head_dim_v (default L+R-64) is the width of the latent value part, L.
    schedule: decode_schedule()'s result for these block_table / cache_seqlens (used by
    the flashmla backend, ignored by the others), or None.
    bounded: the caller has passed block_table / cache_seqlens through
    bound_decode_inputs(), so the call launches no clamp kernels of its own.
    validate: run the value checks of CUDA inputs (lengths, block ids; a host sync);
    None: lowering.config.validate. CPU inputs are always checked.
    """
    kind, head_dim_v = check_decode_args(q, kv_cache, block_table, cache_seqlens, softmax_scale,
                                         kv_cache_dtype, k_scale, head_dim_v)
    if wants_value_checks(q, validate):
        check_decode_values(kv_cache, block_table, cache_seqlens, q.shape[1])
    call = DecodeCall(q, kv_cache, block_table, cache_seqlens, float(softmax_scale),
                      bool(causal), kind, k_scale, head_dim_v, schedule=schedule,
                      bounded=bool(bounded))
    return run_decode(call, "bf16", backend)


def mla_decode_fp8q(q, kv_cache, block_table, cache_seqlens, softmax_scale, *, q_scale, k_scale,
                    causal=True, head_dim_v=None, out_dtype=torch.bfloat16, backend="auto",
                    schedule=None, bounded=False, validate=None):
    """Decode with an fp8 query over an fp8 cache (see the module docstring).

    backend: "flashmla" (FlashMLA's dense fp8 kernel: SM90, H a multiple of 16 up to 128,
    block_size 64, bf16 out), "gluon" (SM90; H a multiple of 64, block_size a multiple of
    32, bf16 out), "triton", or "auto". auto takes flashmla where it serves the call and
    either a schedule is given or gluon cannot serve it (FlashMLA's scheduler in the call
    costs 9-32 µs on an H200, which at one request makes it slower than gluon), else gluon
    where it serves, else triton; flashmla and gluon only while the batch-invariant mode
    (lowering.config.batch_invariant) is off.
    schedule: decode_schedule(..., fp8q=True) of these lengths (read by flashmla only).
    bounded, validate: as for mla_decode.
    Eager calls are counted in backend_choices as "flashmla-fp8q" / "gluon-fp8q" /
    "triton-fp8q".
    """
    if backend != "auto" and backend not in FP8Q_BACKENDS:
        raise ValueError(f"backend must be 'auto', 'flashmla', 'gluon' or 'triton', got "
                         f"{backend!r}")
    head_dim_v = check_fp8q_args(q, kv_cache, block_table, cache_seqlens, softmax_scale,
                                 q_scale, k_scale, head_dim_v, out_dtype)
    if wants_value_checks(q, validate):
        check_decode_values(kv_cache, block_table, cache_seqlens, q.shape[1])
    call = DecodeCall(q, kv_cache, block_table, cache_seqlens, float(softmax_scale),
                      bool(causal), "fp8", k_scale, head_dim_v, q_scale=q_scale,
                      out_dtype=out_dtype, schedule=schedule, bounded=bool(bounded))
    return run_decode(call, "fp8q", backend)
