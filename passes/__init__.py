"""Inductor fusion passes for MLA (see docs/PASSES.md).

    compile_with_passes(fn, ...)   torch.compile with the MLA fusion passes installed
    MLAFusionPass                  the CustomGraphPass (post-grad) that runs them
    QuantKey, QUANT_KEYS           quantization schemes as data
"""
from passes.quant import (FP8_GROUP_64, FP8_GROUP_128, FP8_STATIC_TENSOR, QUANT_KEYS,  # noqa: F401
                    QuantKey)
from passes.manager import MLAFusionPass, count_ops, verify_kv_cache_dependency  # noqa: F401
from passes.compile import compile_with_passes  # noqa: F401
