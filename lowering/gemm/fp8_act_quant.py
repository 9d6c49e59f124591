"""The activations of the fp8 decode GEMMs, quantized per group_k columns as HF's FP8Linear
quantizes them on a GPU (s = amax / 448, the values times the correctly rounded reciprocal
of max(s, 1e-12), rounded to e4m3): the GEMMs' own quant launch (act_quant_kernel, the
numerics of fp8_linear_kernel.py's quant_act_tile), the same in torch, and the checks of a
quantization handed over by the kernel that produced the activations (the norms, the
attention prologue: their x_q, x_s)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import triton

from lowering.gemm.fp8_linear_kernel import act_quant_kernel

FP8 = torch.float8_e4m3fn


def quantize_rows_torch(a: torch.Tensor, group_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """a [..., C] -> (e4m3 [..., C], fp32 scales [..., cdiv(C, group_k)]): the kernels'
    activation quantization (quant_act_tile) in torch ops, bit for bit: per group_k columns
    s = amax / 448, the values times the correctly rounded reciprocal of max(s, 1e-12),
    clamped to +-448 and rounded to e4m3 (ties to even); a partial last group is padded
    with zeros."""
    C = a.shape[-1]
    G = triton.cdiv(C, group_k)
    x = F.pad(a.float(), (0, G * group_k - C)).unflatten(-1, (G, group_k))   # [..., G, gk]
    s = x.abs().amax(-1) / 448.0                                             # [..., G]
    r = 1.0 / s.clamp_min(1e-12)
    q = (x * r[..., None]).clamp(-448.0, 448.0).to(FP8)
    return q.flatten(-2)[..., :C], s


MAX_PRODUCER_GROUP = 1024    # a producer kernel's quant group (a row in registers), at most


def check_producer_group(group_k) -> None:
    """Raise a ValueError unless group_k is a quant group a producer kernel (a norm, the
    prologue) can write: a power of two in [16, MAX_PRODUCER_GROUP]."""
    if not (isinstance(group_k, int) and 16 <= group_k <= MAX_PRODUCER_GROUP
            and group_k & (group_k - 1) == 0):
        raise ValueError(f"group_k must be a power of two in [16, {MAX_PRODUCER_GROUP}] (the "
                         f"fp8 GEMMs' activation group), got {group_k!r}")


def check_quantized(x: torch.Tensor, x_q: torch.Tensor, x_s: torch.Tensor,
                    group_k: int) -> None:
    """Raise a ValueError / TypeError unless (x_q, x_s) can be x's activations quantized per
    group_k columns: e4m3 of x's shape and fp32 scales [*lead, cdiv(K, group_k)], both
    contiguous on x's device (the values themselves are the producer's to get right)."""
    G = triton.cdiv(x.shape[-1], group_k)
    if x_q.dtype != FP8 or tuple(x_q.shape) != tuple(x.shape):
        raise TypeError(f"x_q must be float8_e4m3fn {tuple(x.shape)} (x's shape), got "
                        f"{x_q.dtype} {tuple(x_q.shape)}")
    want = (*x.shape[:-1], G)
    if x_s.dtype != torch.float32 or tuple(x_s.shape) != want:
        raise ValueError(f"x_s must be fp32 {want} (one scale per {group_k} columns of a row), "
                         f"got {x_s.dtype} {tuple(x_s.shape)}")
    for name, t in (("x_q", x_q), ("x_s", x_s)):
        if t.device != x.device or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous on {x.device}")


def quant_buffers(a: torch.Tensor, group_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty (e4m3 [R, C], fp32 scales [R, cdiv(C, group_k)]) for a [R, C]'s quantization."""
    R, C = a.shape
    return (torch.empty((R, C), dtype=FP8, device=a.device),
            torch.empty((R, triton.cdiv(C, group_k)), dtype=torch.float32, device=a.device))


def quantized(a: torch.Tensor, group_k: int, pre_quant: bool, given=None, out=None):
    """(activations, scales, the scales' row stride) for a launch: a [R, C] itself (scales
    unused) or, with pre_quant, act_quant_kernel's e4m3 copy and its fp32 scales
    [R, cdiv(C, group_k)] (one program per row and scale group), written into out
    (quant_buffers(a, group_k)) when given. given: that pair, already made by the kernel
    that produced a (x_q [R, C], x_s [R, G], contiguous): used as it is, whatever
    pre_quant says."""
    if given is not None:
        x_q, x_s = given
        return x_q, x_s, x_s.shape[-1]
    if not pre_quant:
        return a, a, 0
    R, C = a.shape
    G = triton.cdiv(C, group_k)
    aq, s = out if out is not None else quant_buffers(a, group_k)
    torch.library.wrap_triton(act_quant_kernel)[(R, G)](
        a, aq, s, C, a.stride(0), G, BLOCK_K=group_k, NATIVE_CAST=a.is_cuda, num_warps=1)
    return aq, s, G


def given_quant(x: torch.Tensor, x_q: Optional[torch.Tensor], x_s: Optional[torch.Tensor],
           group_k: int):
    """The launch's x_quant from an op's optional (x_q, x_s), checked; None when not given."""
    if x_q is None and x_s is None:
        return None
    if x_q is None or x_s is None:
        raise ValueError("x_q and x_s come together (x quantized by its producer), or neither")
    check_quantized(x, x_q, x_s, group_k)
    K = x.shape[-1]
    return x_q.view(-1, K), x_s.view(-1, x_s.shape[-1])                      # [M, K], [M, G]
