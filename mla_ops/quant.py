"""FP8 e4m3 quantization math shared by the cache, the attention op and the passes.

Scales are dequantization scales: value = stored * scale.
"""
from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def quant_fp8_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp8(x / scale), saturated to +-448; scale is a one-element fp32 tensor."""
    return (x.float() / scale.float().reshape(())).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def group_scales(x: torch.Tensor, group_size: int, pow2: bool = False) -> torch.Tensor:
    """Per-token-group scales: amax(|x|) / 448 over each run of group_size columns.

    x [T, C] -> [T, C // group_size] fp32. pow2 rounds each scale up to a power of two.
    """
    T, C = x.shape
    amax = x.float().reshape(T, C // group_size, group_size).abs().amax(-1)
    # divide by a tensor on amax's device: CUDA turns division by a Python scalar into a
    # multiply by its reciprocal, which is not the correctly rounded quotient
    scale = amax.clamp(min=1e-10) / amax.new_full((), FP8_MAX)
    if pow2:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    return scale


def quant_fp8_group(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp8(x / scale[group]) for per-token-group scales scale [T, C // g]."""
    T, C = x.shape
    g = C // scale.shape[1]
    y = x.float().reshape(T, C // g, g) / scale[..., None]
    return y.clamp(-FP8_MAX, FP8_MAX).to(FP8).reshape(T, C)


def dequantize_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block=(128, 128),
                         dtype=torch.bfloat16) -> torch.Tensor:
    """Dequantize a block-quantized fp8 weight [O, I] with scale_inv [ceil(O/bo), ceil(I/bi)]."""
    O, I = weight.shape
    bo, bi = block
    s = scale_inv.float().repeat_interleave(bo, 0)[:O].repeat_interleave(bi, 1)[:, :I]
    return (weight.float() * s).to(dtype)
