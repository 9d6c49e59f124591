"""Which decode calls the "gluon" backend (gluon_decode.py) serves, as sentences that say
why not: gluon_unmet() for lowering.mla_decode's calls (bf16 and fp8 caches),
gluon_fp8q_unmet() for lowering.mla_decode_fp8q's. Shapes, dtypes and this triton's
Gluon API only (no kernel is imported), so lowering/decode/registry.py reads them before
it picks a backend, and compiled code traces a constant for IMPORT_ERROR.
"""
from __future__ import annotations

import torch

from lowering.decode.gluon_decode import (BF16Q_CONFIG, CONFIG, FP8_CONFIGS, ROWS_MAX,
                                          rows_config)


def _gluon_import_error():
    """None if this triton has what the kernel uses, else a sentence saying what is missing."""
    try:
        import triton.experimental.gluon.nvidia.hopper  # noqa: F401  (TensorDescriptor)
        from lowering.decode import gluon_common  # noqa: F401
    except Exception as exc:  # ImportError, or an API this triton lacks
        return f"triton's Gluon Hopper API is unavailable here ({type(exc).__name__}: {exc})"
    return None


# Probed once at import (this module is imported only for CUDA tensors), so the
# capability check that compiled code traces reads a constant.
IMPORT_ERROR = _gluon_import_error()


def _kernel_unmet(q, kv_cache, block_n):
    """What both Gluon kernels need beside an SM90 GPU: Gluon's API, rows of 576, H a
    multiple of 64, pages of whole block_n-key tiles. None if all hold."""
    if IMPORT_ERROR is not None:
        return IMPORT_ERROR
    if q.shape[-1] != 576:
        return f"the gluon backend needs q/cache rows of 576 (512 + 64), got {q.shape[-1]}"
    if q.shape[2] % 64:
        return f"the gluon backend needs the head count to be a multiple of 64, got {q.shape[2]}"
    if kv_cache.shape[1] % block_n:
        return (f"the gluon backend needs block_size to be a multiple of {block_n}, "
                f"kv_cache has block_size {kv_cache.shape[1]}")
    return None


def gluon_unmet(call):
    """None if a Gluon kernel serves this mla_decode DecodeCall (the bf16 kernels, or the
    few-rows kernel over an fp8 cache for kind "fp8"), else why not."""
    if call.kind == "fp8":
        return fp8_cache_unmet(call)
    if call.kind != "auto":
        return f"the gluon backend serves kv_cache_dtype 'auto' or 'fp8', got {call.kind!r}"
    if call.q.dtype != torch.bfloat16:
        return f"the gluon backend needs q in bfloat16, got {call.q.dtype}"
    if call.head_dim_v != 512:
        return f"the gluon backend needs head_dim_v 512, got {call.head_dim_v}"
    if call.q.shape[1] * call.q.shape[2] <= ROWS_MAX:
        if IMPORT_ERROR is not None:
            return IMPORT_ERROR
        if call.q.shape[-1] != 576:
            return (f"the gluon backend needs q/cache rows of 576 (512 + 64), got "
                    f"{call.q.shape[-1]}")
        return _rows_page_unmet(call.q, call.kv_cache, False, "the gluon backend")
    return _kernel_unmet(call.q, call.kv_cache, CONFIG["BN"])


def _rows_page_unmet(q, kv_cache, fp8: bool, what: str):
    """The few-rows kernel's page condition (whole tiles of its config's BN keys), named
    for `what`; None if it holds."""
    bn = rows_config(q.shape[1] * q.shape[2], fp8)[1]["BN"]
    if kv_cache.shape[1] % bn:
        return (f"{what} needs block_size to be a multiple of {bn}, "
                f"kv_cache has block_size {kv_cache.shape[1]}")
    return None


def fp8_cache_unmet(call):
    """None if a Gluon kernel serves this DecodeCall over an fp8 cache (kind "fp8", bf16 q):
    the few-rows kernel up to ROWS_MAX query rows, past them (H a multiple of 64) the pair
    kernel's FP8 mode (pages a multiple of 64) or the fp8 kernel's BF16Q mode (pages a
    multiple of 32); else why not."""
    q, kv_cache = call.q, call.kv_cache
    if IMPORT_ERROR is not None:
        return IMPORT_ERROR
    if q.dtype != torch.bfloat16:
        return f"the gluon fp8-cache kernel needs q in bfloat16, got {q.dtype}"
    if q.shape[-1] != 576 or call.head_dim_v != 512:
        return (f"the gluon fp8-cache kernel needs q/cache rows of 576 (512 + 64) and "
                f"head_dim_v 512, got {q.shape[-1]} and {call.head_dim_v}")
    rows = q.shape[1] * q.shape[2]
    if rows > ROWS_MAX:
        if q.shape[2] % 64:
            return (f"the gluon fp8-cache kernels serve up to {ROWS_MAX} query rows (s_q x "
                    f"heads), or a head count that is a multiple of 64; got {rows} rows of "
                    f"{q.shape[2]} heads")
        return _kernel_unmet(q, kv_cache, BF16Q_CONFIG["BN"])
    return _rows_page_unmet(q, kv_cache, True, "the gluon fp8-cache kernel")


def gluon_fp8q_unmet(call):
    """None if the fp8 Gluon kernel serves this mla_decode_fp8q DecodeCall, else why not."""
    if call.head_dim_v != 512:
        return f"the gluon fp8 kernel needs head_dim_v 512, got {call.head_dim_v}"
    if call.out_dtype != torch.bfloat16:
        return f"the gluon fp8 kernel writes bfloat16 only, out_dtype is {call.out_dtype}"
    return _kernel_unmet(call.q, call.kv_cache, FP8_CONFIGS[-1]["BN"])
