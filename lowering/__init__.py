"""Kernels for MLA, in rooms by what they do, and their choice by capability.

    lowering.decode  the absorbed-MLA decode entry (mla_decode, mla_decode_fp8q) and its routes
    lowering.gemm    weight-streaming GEMMs of a decode step (the HF linears, the head GEMMs)
    lowering.fused   fused small ops: the attention prologue, RoPE, RMSNorm, fp8 quant
    lowering.checks  argument checks of the public entries (run once per call there)
    lowering.config  the settings a user may choose (validate, batch_invariant, ...)

The public decode entry points are re-exported here.
"""
from lowering.decode.entry import (BACKENDS, FP8Q_BACKENDS, BackendUnavailable,  # noqa: F401
                                   backend_choices, bound_decode_inputs, decode_schedule,
                                   flashmla_pays, mla_decode, mla_decode_fp8q, record_choice,
                                   select_backend, uses_flashmla)

__all__ = ["mla_decode", "mla_decode_fp8q", "BACKENDS", "FP8Q_BACKENDS", "BackendUnavailable",
           "select_backend", "backend_choices", "decode_schedule", "uses_flashmla", "flashmla_pays",
           "bound_decode_inputs"]
