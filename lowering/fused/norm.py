"""RMSNorm as a graph op: the decoder layers' norms of a decode step.

    mla::rms_norm(x [*, N], weight [N], eps) -> weight * rms_normalized(x)     [*, N]
    mla::rms_norm_fp8(x, weight, eps, group_k)
        -> (rms_norm(x), its e4m3 quantization per group_k columns [*, N], fp32 scales
           [*, cdiv(N, group_k)]) for the fp8 GEMMs after a layer's input norm
    mla::residual_rms_norm(parts [S, *, N] fp32, residual [*, N], weight [N], eps)
        -> (h = residual + sum(parts).to(dtype), rms_norm(h))      a split-K GEMM's output,
           the residual add and the norm after it (residual_norm_kernel.py), one launch
    mla::residual_rms_norm_fp8(parts, residual, weight, eps, group_k)
        -> (h, y, y_q, y_s)   the same, and y quantized per group_k columns as the fp8
           decode GEMMs quantize their activations (e4m3 [*, N], fp32 [*, cdiv(N, group_k)]),
           for an FP8 checkpoint's MLP or MoE block after the norm (same launch)

On CUDA (bf16 / fp16, N <= MAX_N) one Triton launch, one program per row
(rms_norm_kernel.py); elsewhere HF's own DeepseekV3RMSNorm.forward in torch ops, bit for
bit. Inductor compiles HF's norm as a looped reduction fused with the residual adds
before it, recomputed from the embedding in every later norm; with the adds in the GEMMs'
epilogues (mla::decode_linear_residual) the norm reads one tensor, and a single pass over
a register-resident row is what a few rows want. Defined with torch.library.triton_op, so
Inductor sees the kernel in the graph.
"""
from __future__ import annotations

import torch
import triton

from lowering.fused.residual_norm_kernel import residual_rms_norm_kernel
from lowering.fused.rms_norm_kernel import rms_norm_kernel
from lowering.gemm.fp8_act_quant import check_producer_group, quantize_rows_torch

MAX_N = 16384          # a row in registers: 16384 fp32 over 8 warps is 64 per thread


def rms_norm_torch(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's DeepseekV3RMSNorm.forward on x in w's dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def rms_norm_unmet(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """None when the Triton kernel computes rms_norm(x, weight), else the unmet condition
    (the torch path, rms_norm_torch, then runs)."""
    if not x.is_cuda:
        return f"x is on {x.device}, the kernel runs on CUDA"
    if x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x.dtype:
        return f"x and weight must both be bf16 or fp16, got {x.dtype} and {weight.dtype}"
    if not weight.is_contiguous():
        return "weight must be contiguous"
    if not (0 < x.shape[-1] <= MAX_N and x.numel() > 0):
        return f"rows of {x.shape[-1]} (of {x.numel()} values): the kernel serves 1 to {MAX_N}"
    return None


def _check(x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise ValueError("x must be a tensor of at least one dimension (its last is normalized)")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight must be [{x.shape[-1]}] to match x [..., {x.shape[-1]}]; "
                         f"got {tuple(weight.shape)}")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device}, x on {x.device}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")


def launch(x2: torch.Tensor, weight: torch.Tensor, eps: float, y: torch.Tensor, quant=None,
           group_k: int = 0) -> None:
    """y [T, N] = rms_norm(x2 [T, N] (last dim contiguous)) * weight; with quant = (y_q
    [T, N] e4m3, y_s [T, cdiv(N, group_k)] fp32) also y quantized per group_k columns."""
    T, N = x2.shape
    block = triton.next_power_of_2(max(N, group_k))
    yq, ys = quant if quant is not None else (y, y)
    # every argument passed: torch 2.11's wrap_triton does not fill a kernel's defaults
    kernel = torch.library.wrap_triton(rms_norm_kernel)
    kernel[(T,)](x2, weight, y, N, x2.stride(0), float(eps), yq, ys, ys.shape[-1], BLOCK=block,
                 QUANT_K=group_k if quant is not None else 0, NATIVE_CAST=y.is_cuda,
                 num_warps=8 if block >= 4096 else 4)


def _rms_norm(x, weight, eps, group_k: int = 0):
    """Both rms_norm ops' body: y, or (y, y_q, y_s) with group_k."""
    _check(x, weight, eps)
    if rms_norm_unmet(x, weight) is not None:
        y = rms_norm_torch(x, weight, eps)
        return (y, *quantize_rows_torch(y, group_k)) if group_k else y
    N = x.shape[-1]
    x2 = x.reshape(-1, N)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    T = x2.shape[0]
    y = torch.empty((T, N), dtype=x.dtype, device=x.device)                    # [T, N]
    if not group_k:
        launch(x2, weight, eps, y)
        return y.view(x.shape)
    quant = (torch.empty((T, N), dtype=torch.float8_e4m3fn, device=x.device),
             torch.empty((T, triton.cdiv(N, group_k)), dtype=torch.float32, device=x.device))
    launch(x2, weight, eps, y, quant, group_k)
    return (y.view(x.shape), quant[0].view(x.shape), quant[1].view(*x.shape[:-1], -1))


@torch.library.triton_op("mla::rms_norm", mutates_args={})
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _rms_norm(x, weight, eps)


@torch.library.triton_op("mla::rms_norm_fp8", mutates_args={})
def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 group_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_producer_group(group_k)
    return _rms_norm(x, weight, eps, group_k)


def residual_rms_norm_torch(parts: torch.Tensor, residual: torch.Tensor, w: torch.Tensor,
                            eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The same in torch: HF's `residual + linear(x)` with the linear's output the partials'
    sum rounded once, then HF's RMSNorm."""
    h = residual + parts.sum(0).to(residual.dtype)
    return h, rms_norm_torch(h, w, eps)


def launch_residual(parts: torch.Tensor, r2: torch.Tensor, weight: torch.Tensor, eps: float,
                    h: torch.Tensor, y: torch.Tensor, quant=None, group_k: int = 0) -> None:
    """h, y [T, N] from parts [S, T, N] (contiguous fp32) and r2 [T, N] (last dim
    contiguous): residual_norm_kernel.py, one program per row; with quant = (y_q [T, N]
    e4m3, y_s [T, cdiv(N, group_k)] fp32) also y quantized per group_k columns."""
    S, T, N = parts.shape
    block = triton.next_power_of_2(max(N, group_k))
    yq, ys = quant if quant is not None else (h, h)
    kernel = torch.library.wrap_triton(residual_rms_norm_kernel)
    kernel[(T,)](parts, r2, weight, h, y, yq, ys, T, N, ys.shape[-1], r2.stride(0), float(eps),
                 S=S, BLOCK=block, QUANT_K=group_k if quant is not None else 0,
                 NATIVE_CAST=h.is_cuda, num_warps=8 if block >= 4096 else 4)


def _check_parts(parts: torch.Tensor, residual: torch.Tensor) -> None:
    if (parts.dim() != residual.dim() + 1 or tuple(parts.shape[1:]) != tuple(residual.shape)
            or parts.dtype != torch.float32 or parts.device != residual.device):
        raise ValueError(f"parts must be fp32 [S, {', '.join(map(str, residual.shape))}] on "
                         f"{residual.device} (residual's shape after the splits); got "
                         f"{parts.dtype} {tuple(parts.shape)} on {parts.device}")


def _residual_launch(parts, residual, weight, eps, group_k: int = 0):
    """The kernel path of both residual ops: (h, y[, y_q, y_s]) in residual's shape."""
    N = residual.shape[-1]
    p3 = parts.reshape(parts.shape[0], -1, N)
    p3 = p3 if p3.is_contiguous() else p3.contiguous()
    r2 = residual.reshape(-1, N)
    r2 = r2 if r2.stride(-1) == 1 else r2.contiguous()
    T = r2.shape[0]
    h = torch.empty((T, N), dtype=residual.dtype, device=residual.device)           # [T, N]
    y = torch.empty_like(h)                                                          # [T, N]
    quant = None
    if group_k:
        quant = (torch.empty((T, N), dtype=torch.float8_e4m3fn, device=h.device),   # [T, N]
                 torch.empty((T, triton.cdiv(N, group_k)), dtype=torch.float32,
                             device=h.device))                                      # [T, G]
    launch_residual(p3, r2, weight, eps, h, y, quant, group_k)
    out = (h.view(residual.shape), y.view(residual.shape))
    if quant is None:
        return out
    return (*out, quant[0].view(residual.shape), quant[1].view(*residual.shape[:-1], -1))


@torch.library.triton_op("mla::residual_rms_norm", mutates_args={})
def residual_rms_norm(parts: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    _check(residual, weight, eps)
    _check_parts(parts, residual)
    if rms_norm_unmet(residual, weight) is not None or parts.shape[0] < 1:
        return residual_rms_norm_torch(parts, residual, weight, eps)
    return _residual_launch(parts, residual, weight, eps)


@torch.library.triton_op("mla::residual_rms_norm_fp8", mutates_args={})
def residual_rms_norm_fp8(parts: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                          eps: float, group_k: int) -> tuple[torch.Tensor, torch.Tensor,
                                                             torch.Tensor, torch.Tensor]:
    _check(residual, weight, eps)
    _check_parts(parts, residual)
    check_producer_group(group_k)
    if rms_norm_unmet(residual, weight) is not None or parts.shape[0] < 1:
        h, y = residual_rms_norm_torch(parts, residual, weight, eps)
        return (h, y, *quantize_rows_torch(y, group_k))
    return _residual_launch(parts, residual, weight, eps, group_k)
