"""Backend table: what each decode backend needs, and the function that runs it.

A backend is a run function plus a capability check that returns None when the
backend can serve a call, or a sentence naming the unmet condition.
"""
from __future__ import annotations

from .reference import mla_decode_reference


class BackendUnavailable(RuntimeError):
    """The requested decode backend cannot serve this call (the message says why)."""


def _reference_unmet(q, kv_cache, kind):
    return None


# name -> run(q, kv_cache, block_table, cache_seqlens, scale, *, causal, kind, k_scale, head_dim_v)
BACKENDS = {"reference": mla_decode_reference}
# name -> unmet(q, kv_cache, kind) -> str | None
CAPABILITY = {"reference": _reference_unmet}
# Order tried by backend="auto": fastest first.
BACKEND_ORDER = ["reference"]


def register_backend(name, run, unmet, *, priority: int):
    """Add a backend; lower priority numbers are tried first by backend='auto'."""
    BACKENDS[name] = run
    CAPABILITY[name] = unmet
    if name not in BACKEND_ORDER:
        BACKEND_ORDER.insert(min(priority, len(BACKEND_ORDER)), name)


def unmet_condition(name, q, kv_cache, kind):
    return CAPABILITY[name](q, kv_cache, kind)
