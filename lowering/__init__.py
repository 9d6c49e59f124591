"""Decode kernels behind one entry with FlashMLA's contract.

    mla_decode(q [B, s_q, H, L+R], kv_cache [num_blocks, block_size, L+R],
               block_table [B, max_blocks] int32, cache_seqlens [B] int32,
               softmax_scale, *, causal=True, kv_cache_dtype="auto",
               k_scale=None, backend="auto")
        -> (out [B, s_q, H, L], lse [B, H, s_q] float32, natural log)

With s_q > 1 and causal, query i sees cache positions [0, cache_seqlens - s_q + i].
Backends are tried in the order of BACKEND_ORDER for backend="auto"; an explicit
backend that cannot serve a call raises BackendUnavailable naming the unmet
condition. The last choice per call site is recorded in `backend_choices`.
"""
from __future__ import annotations

from collections import Counter

from .backends import BACKENDS, BACKEND_ORDER, BackendUnavailable, unmet_condition
from .checks import bound_for_capture, check_decode_args

__all__ = ["mla_decode", "BACKENDS", "BACKEND_ORDER", "BackendUnavailable",
           "select_backend", "backend_choices"]

# backend name -> number of mla_decode calls it served (read by the inspection tool).
backend_choices: Counter = Counter()


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


def mla_decode(q, kv_cache, block_table, cache_seqlens, softmax_scale, *, causal=True,
               kv_cache_dtype="auto", k_scale=None, backend="auto", head_dim_v=None):
    """Absorbed-MLA decode over a paged latent cache (see the module docstring).

    head_dim_v (default L+R-64) is the width of the latent value part, L.
    """
    kind, head_dim_v = check_decode_args(q, kv_cache, block_table, cache_seqlens, softmax_scale,
                                         kv_cache_dtype, k_scale, head_dim_v)
    block_table, cache_seqlens = bound_for_capture(q, kv_cache, block_table, cache_seqlens)
    name = select_backend(q, kv_cache, kv_cache_dtype=kind, backend=backend)
    backend_choices[name] += 1
    return BACKENDS[name](q, kv_cache, block_table, cache_seqlens, float(softmax_scale),
                          causal=bool(causal), kind=kind, k_scale=k_scale, head_dim_v=head_dim_v)
