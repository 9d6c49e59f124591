"""The decode entry points (documented in lowering/decode/__init__.py)."""
from __future__ import annotations

from collections import Counter

import torch

from lowering.decode.registry import BACKENDS, BACKEND_ORDER, BackendUnavailable, unmet_condition
from lowering.checks import bound_decode_inputs, bound_for_capture, check_decode_args

__all__ = ["mla_decode", "mla_decode_fp8q", "BACKENDS", "BACKEND_ORDER", "BackendUnavailable",
           "select_backend", "backend_choices", "decode_schedule", "uses_flashmla",
           "bound_decode_inputs"]

# backend name -> number of mla_decode calls it served (read by the inspection tool).
backend_choices: Counter = Counter()


def record_choice(name: str) -> None:
    """Count a call served by backend `name`; not while torch.compile traces the caller
    (a count read in the graph would be guarded on and recompile every call)."""
    if not torch.compiler.is_compiling():
        backend_choices[name] += 1
# Backends whose kernels bound the lengths and page ids themselves (see
# checks.bound_for_capture): no clamp kernels in a captured graph for them.
BOUNDED_IN_KERNEL = frozenset({"triton", "gluon"})


def select_backend(q, kv_cache, *, kv_cache_dtype="auto", backend="auto") -> str:
    """Name of the backend that would serve this call (raises if none can)."""
    if backend != "auto":
        if backend not in BACKENDS:
            raise ValueError(f"backend must be 'auto' or one of {sorted(BACKENDS)}, got {backend!r}")
        reason = unmet_condition(backend, q, kv_cache, kv_cache_dtype)
        if reason is not None:
            raise BackendUnavailable(f"backend {backend!r} cannot serve this call: {reason}")
        return backend
    reasons = []
    for name in BACKEND_ORDER:
        reason = unmet_condition(name, q, kv_cache, kv_cache_dtype, auto=True)
        if reason is None:
            return name
        reasons.append(f"{name}: {reason}")
    raise BackendUnavailable("no decode backend can serve this call; " + "; ".join(reasons))


def uses_flashmla(device, q_dtype, num_heads: int, width: int, block_size: int,
                  kv_cache_dtype="auto", backend="auto", s_q: int = 1) -> bool:
    """Whether a decode call with these properties (q [B, s_q, num_heads, width] of q_dtype
    over a cache of block_size rows of width) would run on the flashmla backend: for an
    fp8 q (float8_e4m3fn, an mla_decode_fp8q call over an fp8 cache), whether FlashMLA's
    fp8 kernel would run when handed decode_schedule(..., fp8q=True).

    Plain Python (imports, device queries): call it outside compiled code and keep the
    answer, e.g. when a cache is built.
    """
    q_like = torch.empty((0, s_q, num_heads, width), dtype=q_dtype, device=device)
    kv_like = torch.empty((0, block_size, width), dtype=q_dtype, device=device)
    kind = "auto" if kv_cache_dtype == "auto" else "fp8"
    if q_dtype == torch.float8_e4m3fn:
        if kind != "fp8" or backend not in ("auto", "flashmla"):
            return False
        return _fp8q_unmet("flashmla", q_like, kv_like, width - 64, torch.bfloat16) is None
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
    """
    from lowering.checks import check_table_and_lengths
    from lowering.decode.flashmla import flashmla_schedule
    check_table_and_lengths(kv_cache, block_table, cache_seqlens)
    for name, v in (("num_heads", num_heads), ("s_q", s_q)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    return flashmla_schedule(block_table, cache_seqlens, kv_cache.shape[1], num_heads, s_q,
                             bounded=bounded, fp8=bool(fp8q))


def mla_decode(q, kv_cache, block_table, cache_seqlens, softmax_scale, *, causal=True,
               kv_cache_dtype="auto", k_scale=None, backend="auto", head_dim_v=None,
               schedule=None, bounded=False):
    """Absorbed-MLA decode over a paged latent cache (see the module docstring).

    head_dim_v (default L+R-64) is the width of the latent value part, L.
    schedule: decode_schedule()'s result for these block_table / cache_seqlens (used by
    the flashmla backend, ignored by the others), or None.
    bounded: the caller has passed block_table / cache_seqlens through
    bound_decode_inputs(), so a captured call launches no clamp kernels of its own.
    """
    kind, head_dim_v = check_decode_args(q, kv_cache, block_table, cache_seqlens, softmax_scale,
                                         kv_cache_dtype, k_scale, head_dim_v)
    name = select_backend(q, kv_cache, kv_cache_dtype=kind, backend=backend)
    if name not in BOUNDED_IN_KERNEL and not bounded:
        block_table, cache_seqlens = bound_for_capture(q, kv_cache, block_table, cache_seqlens)
    record_choice(name)
    extra = {"schedule": schedule} if name == "flashmla" and schedule is not None else {}
    return BACKENDS[name](q, kv_cache, block_table, cache_seqlens, float(softmax_scale),
                          causal=bool(causal), kind=kind, k_scale=k_scale, head_dim_v=head_dim_v,
                          **extra)


def mla_decode_fp8q(q, kv_cache, block_table, cache_seqlens, softmax_scale, *, q_scale, k_scale,
                    causal=True, head_dim_v=None, out_dtype=torch.bfloat16, backend="auto",
                    schedule=None, bounded=False):
    """Decode with an fp8 query over an fp8 cache (see the module docstring).

    backend: "flashmla" (FlashMLA's dense fp8 kernel: SM90, H a multiple of 16 up to 128,
    block_size 64, bf16 out), "gluon" (SM90; H a multiple of 64, block_size a multiple of
    32, bf16 out), "triton", or "auto". auto takes flashmla where it serves the call and
    either a schedule is given or gluon cannot serve it (FlashMLA's scheduler in the call
    costs 9-32 µs on an H200, which at one request makes it slower than gluon), else gluon
    where it serves, else triton; flashmla and gluon only while the batch-invariant mode
    is off.
    schedule: decode_schedule(..., fp8q=True) of these lengths (read by flashmla only).
    bounded: as for mla_decode (read by flashmla only; the other kernels bound in-kernel).
    Eager calls are counted in backend_choices as "flashmla-fp8q" / "gluon-fp8q" /
    "triton-fp8q".
    """
    from lowering.checks import check_fp8q_args
    from lowering.decode.triton_decode import batch_invariant_enabled
    from lowering.decode.triton_decode import triton_fp8q_checked
    if backend not in ("auto", "flashmla", "gluon", "triton"):
        raise ValueError(f"backend must be 'auto', 'flashmla', 'gluon' or 'triton', got "
                         f"{backend!r}")
    head_dim_v = check_fp8q_args(q, kv_cache, block_table, cache_seqlens, softmax_scale,
                                 q_scale, k_scale, head_dim_v, out_dtype)
    reasons = {}
    for name in ("flashmla", "gluon"):
        if backend in ("auto", name):
            reasons[name] = _fp8q_unmet(name, q, kv_cache, head_dim_v, out_dtype)
            if backend == "auto" and reasons[name] is None and batch_invariant_enabled():
                reasons[name] = "the batch-invariant mode is on (the Triton kernel provides it)"
    if backend in ("flashmla", "gluon") and reasons[backend] is not None:
        raise BackendUnavailable(f"backend {backend!r} cannot serve this call: "
                                 f"{reasons[backend]}")
    pick = backend
    if backend == "auto":
        flash_first = schedule is not None or reasons["gluon"] is not None
        order = ("flashmla", "gluon") if flash_first else ("gluon", "flashmla")
        pick = next((n for n in order if reasons[n] is None), "triton")
    if pick == "flashmla":
        record_choice("flashmla-fp8q")
        from lowering.decode.flashmla import flashmla_fp8q_decode
        return flashmla_fp8q_decode(q, kv_cache, block_table, cache_seqlens, softmax_scale,
                                    q_scale=q_scale, k_scale=k_scale, causal=causal,
                                    schedule=schedule, bounded=bounded)
    if pick == "gluon":
        record_choice("gluon-fp8q")
        from lowering.decode.gluon_decode import gluon_decode_fp8q_op
        return gluon_decode_fp8q_op(q, kv_cache, block_table, cache_seqlens,
                                    q_scale.reshape(1), k_scale.reshape(1),
                                    float(softmax_scale), bool(causal))
    return triton_fp8q_checked(q, kv_cache, block_table, cache_seqlens, softmax_scale, q_scale,
                               k_scale, causal, head_dim_v, out_dtype)


def _fp8q_unmet(name, q, kv_cache, head_dim_v, out_dtype):
    """Why route `name` of mla_decode_fp8q cannot serve this call, or None."""
    if q.device.type != "cuda":
        return "q is not on a CUDA device"
    if name == "flashmla":
        from lowering.decode.flashmla import flashmla_fp8q_unmet
        return flashmla_fp8q_unmet(q, kv_cache, head_dim_v, out_dtype)
    from lowering.decode.gluon_decode import gluon_fp8q_unmet
    return gluon_fp8q_unmet(q, kv_cache, head_dim_v, out_dtype)
