"""Prefill attention: the new tokens of each request over themselves (causal) and over
the context already in the paged cache, returning the output and the log-sum-exp.

    dense.py         mla::prefill_dense_attention, the padded dense op and its routes
                     (cudnn: torch's cuDNN SDPA; reference: torch float32)
    ragged.py        a ragged batch as a right-padded dense batch and back (device
                     index maps), varlen_attention
    gather_kernel.py the context gather from the paged cache (fp8 dequantized), Triton
    keys_kernel.py   the dense op's keys, [k_nope | k_pe] per head, Triton
    merge_kernel.py  mla::merge_attn_states, the LSE merge of two partial attentions, Triton
    step.py          mla_prefill: a step's prefill rows as kernels and bf16 GEMMs
"""
from lowering.prefill.dense import ROUTES, cudnn_unmet, dense_attention, select_route  # noqa: F401
from lowering.prefill.ragged import RaggedLayout, varlen_attention  # noqa: F401
from lowering.prefill.step import PrefillShape, mla_prefill, prefill_shape  # noqa: F401

__all__ = ["ROUTES", "cudnn_unmet", "dense_attention", "select_route", "RaggedLayout",
           "varlen_attention", "PrefillShape", "mla_prefill", "prefill_shape"]
