"""The FP8 quant custom ops (the numerics every pass and kernel must reproduce).

    mla::quant_fp8_static(Tensor x, Tensor scale) -> Tensor
        fp8(x / scale) saturated to +-448; scale one-element fp32 (per-tensor, static).
    mla::quant_fp8_group(Tensor x, int group_size, bool pow2) -> (Tensor, Tensor)
        dynamic per-token-group: x [T, C] -> (fp8 [T, C], scales [T, C // group_size] fp32),
        scale = amax(|group|) / 448 (rounded up to a power of two when pow2).
    mla::concat_quant_fp8_static(Tensor a, Tensor b, Tensor scale) -> Tensor
        the fused op Pass A inserts: fp8(cat([a, b], -1) / scale) in one pass.

Scales are dequantization scales (value = stored * scale). Each op has a torch reference
(CPU, and the definition of the numerics; mla_ops/quant.py) and a Triton implementation
(lowering/fused/static_quant.py, group_quant.py, concat_quant.py: CUDA; on CPU only when
lowering.config.quant_impl is "triton", as the tests set it under TRITON_INTERPRET=1). The
ops are opaque to the compiler, so the setting is read at each call. What a quantization
is, as data (QuantKey), lives with the passes in passes/quant.py.
"""
from __future__ import annotations

import torch

from lowering import config as mla_config
from mla_ops.quant import FP8, group_scales, quant_fp8_group, quant_fp8_static


def quant_kernel_unmet(x: torch.Tensor) -> str | None:
    """None when the Triton quant kernels serve a quant of x (lowering.config.quant_impl
    "auto" on CUDA, or "triton"), else the unmet condition (the torch reference runs)."""
    impl = mla_config.quant_impl
    if impl == "triton":
        return None
    if impl == "torch":
        return "lowering.config.quant_impl is 'torch'"
    return None if x.is_cuda else f"x is on {x.device}: quant_impl 'auto' runs the kernels on CUDA"


# ------------------------------------------------------------------ torch references

def ref_static(x, scale):
    return quant_fp8_static(x, scale)


def ref_group(x, group_size, pow2):
    s = group_scales(x, group_size, pow2=pow2)
    return quant_fp8_group(x, s), s


def ref_concat_static(a, b, scale):
    return quant_fp8_static(torch.cat([a, b], dim=-1), scale)


# ------------------------------------------------------------------ custom ops

def _check_scale(scale):
    if scale.dtype != torch.float32 or scale.numel() != 1:
        raise ValueError(f"scale must be one fp32 value, got {scale.dtype} {tuple(scale.shape)}")


@torch.library.custom_op("mla::quant_fp8_static", mutates_args=())
def quant_fp8_static_op(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    _check_scale(scale)
    if quant_kernel_unmet(x) is None:
        from lowering.fused.static_quant import static_quant
        return static_quant(x, scale)
    return ref_static(x, scale)


@quant_fp8_static_op.register_fake
def _(x, scale):
    return torch.empty_like(x, dtype=FP8, memory_format=torch.contiguous_format)


@torch.library.custom_op("mla::quant_fp8_group", mutates_args=())
def quant_fp8_group_op(x: torch.Tensor, group_size: int,
                       pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dim() != 2 or x.shape[1] % group_size:
        raise ValueError(f"x must be [T, C] with C divisible by {group_size}, got {tuple(x.shape)}")
    if quant_kernel_unmet(x) is None and group_size & (group_size - 1) == 0:
        from lowering.fused.group_quant import group_quant
        return group_quant(x, group_size, pow2)
    return ref_group(x, group_size, pow2)


@quant_fp8_group_op.register_fake
def _(x, group_size, pow2):
    T, C = x.shape
    return (x.new_empty((T, C), dtype=FP8),
            x.new_empty((T, C // group_size), dtype=torch.float32))


@torch.library.custom_op("mla::concat_quant_fp8_static", mutates_args=())
def concat_quant_fp8_static_op(a: torch.Tensor, b: torch.Tensor,
                               scale: torch.Tensor) -> torch.Tensor:
    _check_scale(scale)
    if a.dim() != 3 or b.dim() != 3 or a.shape[:2] != b.shape[:2]:
        raise ValueError(f"a and b must be [t, H, *] alike, got {tuple(a.shape)}, {tuple(b.shape)}")
    if quant_kernel_unmet(a) is None:
        from lowering.fused.concat_quant import concat_quant
        return concat_quant(a, b, scale)
    return ref_concat_static(a, b, scale)


@concat_quant_fp8_static_op.register_fake
def _(a, b, scale):
    t, H, LA = a.shape
    return a.new_empty((t, H, LA + b.shape[-1]), dtype=FP8)
