"""QuantKey: what a quantization is, as data; and quantize(), which applies one.

The FP8 quant custom ops (mla::quant_fp8_static, mla::quant_fp8_group,
mla::concat_quant_fp8_static) are defined with their torch references in
mla_ops/quant_ops.py, their Triton kernels in lowering/fused/ (static_quant.py,
group_quant.py, concat_quant.py); they are re-exported here for the passes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from mla_ops.quant import FP8
from mla_ops.quant_ops import (concat_quant_fp8_static_op, quant_fp8_group_op,  # noqa: F401
                               quant_fp8_static_op, ref_concat_static, ref_group, ref_static)


@dataclass(frozen=True)
class QuantKey:
    """One quantization scheme. group_size None means per-tensor."""
    dtype: torch.dtype = FP8
    static: bool = True
    group_size: Optional[int] = None
    scale_dtype: torch.dtype = torch.float32
    pow2: bool = False

    def __post_init__(self):
        if self.static and self.group_size is not None:
            raise ValueError("static scales are per-tensor here; a group quant is dynamic")
        if not self.static and self.group_size is None:
            raise ValueError("dynamic per-tensor quantization is not supported")
        if self.pow2 and self.static:
            raise ValueError("pow2 applies to dynamic scales only")

    @property
    def per_tensor(self) -> bool:
        return self.group_size is None

    def __str__(self) -> str:
        if self.per_tensor:
            return "fp8_static_tensor"
        return f"fp8_dynamic_group{self.group_size}" + ("_pow2" if self.pow2 else "")


FP8_STATIC_TENSOR = QuantKey()
FP8_GROUP_128 = QuantKey(static=False, group_size=128)
FP8_GROUP_64 = QuantKey(static=False, group_size=64)
FP8_GROUP_128_POW2 = QuantKey(static=False, group_size=128, pow2=True)
FP8_GROUP_64_POW2 = QuantKey(static=False, group_size=64, pow2=True)
QUANT_KEYS = (FP8_STATIC_TENSOR, FP8_GROUP_128, FP8_GROUP_64, FP8_GROUP_128_POW2,
              FP8_GROUP_64_POW2)


def quantize(x: torch.Tensor, key: QuantKey, scale: Optional[torch.Tensor] = None):
    """Apply `key` to x [T, C] through the custom ops; returns (fp8, scale)."""
    if key.per_tensor:
        if scale is None:
            raise ValueError(f"{key} needs a scale")
        return torch.ops.mla.quant_fp8_static(x, scale), scale
    return torch.ops.mla.quant_fp8_group(x, key.group_size, key.pow2)
