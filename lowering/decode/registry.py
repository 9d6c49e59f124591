"""Backend table: what each decode backend needs, and the function that runs it.

A backend is a run function plus a capability check that returns None when the
backend can serve a call, or a sentence naming the unmet condition.
"""
from __future__ import annotations

import importlib.util

import torch

from lowering.decode.reference import mla_decode_reference


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


# name -> extra unmet(q, kv_cache, kind) checked only when backend="auto" picks
AUTO_CAPABILITY = {}


def register_backend(name, run, unmet, *, priority: int, auto_unmet=None):
    """Add a backend; lower priority numbers are tried first by backend='auto'."""
    BACKENDS[name] = run
    CAPABILITY[name] = unmet
    if auto_unmet is not None:
        AUTO_CAPABILITY[name] = auto_unmet
    if name not in BACKEND_ORDER:
        BACKEND_ORDER.insert(min(priority, len(BACKEND_ORDER)), name)


def unmet_condition(name, q, kv_cache, kind, auto=False):
    reason = CAPABILITY[name](q, kv_cache, kind)
    if reason is None and auto and name in AUTO_CAPABILITY:
        reason = AUTO_CAPABILITY[name](q, kv_cache, kind)
    return reason


# ---- GPU backends, imported lazily so `import lowering` needs neither triton nor flash_mla ----

# Looked up once: torch.compile (torch 2.11) refuses to trace importlib's find_spec, and
# mla_decode's backend choice runs inside compiled code.
_HAVE_TRITON = importlib.util.find_spec("triton") is not None


def _triton_unmet(q, kv_cache, kind):
    import os
    if not _HAVE_TRITON:
        return "the triton package is not installed"
    if q.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"q is on {q.device.type}; the triton backend needs CUDA (or TRITON_INTERPRET=1)"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"the triton backend needs q in bfloat16 or float16, got {q.dtype}"
    return None


def _triton_auto_unmet(q, kv_cache, kind):
    if q.device.type != "cuda":
        return "backend='auto' uses triton only on CUDA (the CPU interpreter is for tests)"
    return None


def _triton_run(*args, **kwargs):
    from lowering.decode.triton_decode import triton_mla_decode
    return triton_mla_decode(*args, **kwargs)


def _flashmla_unmet(q, kv_cache, kind):
    if q.device.type != "cuda":
        return f"q is on {q.device.type}, FlashMLA needs a CUDA device"
    from lowering.decode.flashmla import flashmla_unmet
    return flashmla_unmet(q, kv_cache, kind)


def _flashmla_run(*args, **kwargs):
    from lowering.decode.flashmla import flashmla_decode
    return flashmla_decode(*args, **kwargs)


def _gluon_unmet(q, kv_cache, kind):
    if q.device.type != "cuda":
        return f"q is on {q.device.type}; the gluon backend needs a CUDA device"
    from lowering.decode.gluon_decode import gluon_unmet
    return gluon_unmet(q, kv_cache, kind)


def _gluon_run(*args, **kwargs):
    from lowering.decode.gluon_decode import gluon_mla_decode
    return gluon_mla_decode(*args, **kwargs)


register_backend("triton", _triton_run, _triton_unmet, priority=0, auto_unmet=_triton_auto_unmet)
register_backend("gluon", _gluon_run, _gluon_unmet, priority=0)
register_backend("flashmla", _flashmla_run, _flashmla_unmet, priority=0)
