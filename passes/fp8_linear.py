"""A small FP8 block-quantized linear, as DeepSeek's FP8 checkpoints use.

Weight: float8_e4m3fn [O, I] with weight_scale_inv [ceil(O/128), ceil(I/128)] fp32 (one
dequantization scale per 128x128 block). Activations: dynamic per-token-group quant
(group 128 by default) through mla::quant_fp8_group, so the quant is a graph op that
Pass B can fold into the attention op when this is o_proj.

The matmul dequantizes both operands and multiplies in fp32 (a reference; a GPU build
would call a block-scaled fp8 GEMM here).
"""
from __future__ import annotations

import torch
from torch import nn

from mla_ops.quant import FP8, FP8_MAX, dequantize_block_fp8

from passes.quant import FP8_GROUP_128, QuantKey, quantize


def quantize_weight_blocks(w: torch.Tensor, block=(128, 128)):
    """w [O, I] -> (fp8 [O, I], scale_inv [ceil(O/bo), ceil(I/bi)] fp32), amax/448 per block."""
    O, I = w.shape
    bo, bi = block
    po, pi = -(-O // bo) * bo, -(-I // bi) * bi
    wp = torch.zeros(po, pi, dtype=torch.float32, device=w.device)
    wp[:O, :I] = w.float()
    blocks = wp.view(po // bo, bo, pi // bi, bi)
    s = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX          # [O/bo, I/bi]
    q = (blocks / s[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(po, pi)[:O, :I].contiguous(), s


class Fp8BlockLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, weight_scale_inv: torch.Tensor, bias=None, *,
                 act_key: QuantKey = FP8_GROUP_128, out_dtype=torch.bfloat16, block=(128, 128)):
        super().__init__()
        if weight.dtype != FP8:
            raise TypeError(f"weight must be float8_e4m3fn, got {weight.dtype}")
        if act_key.per_tensor:
            raise ValueError("Fp8BlockLinear quantizes activations per token group")
        if weight.shape[1] % act_key.group_size:
            raise ValueError(f"in_features {weight.shape[1]} must be a multiple of "
                             f"{act_key.group_size}")
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale_inv", weight_scale_inv.float())
        self.register_buffer("bias", bias)
        self.act_key, self.out_dtype, self.block = act_key, out_dtype, block
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    @classmethod
    def from_linear(cls, linear: nn.Linear, **kw) -> "Fp8BlockLinear":
        w, s = quantize_weight_blocks(linear.weight.detach(), kw.get("block", (128, 128)))
        b = None if linear.bias is None else linear.bias.detach().clone()
        kw.setdefault("out_dtype", linear.weight.dtype)
        return cls(w, s, b, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)                                 # [T, I]
        xq, xs = quantize(x2, self.act_key)                                   # fp8 [T, I], [T, I/g]
        g = self.act_key.group_size
        xd = (xq.float().view(xq.shape[0], -1, g) * xs[..., None]).view(xq.shape[0], -1)
        wd = dequantize_block_fp8(self.weight, self.weight_scale_inv, self.block, torch.float32)
        y = xd @ wd.t()
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(self.out_dtype).view(*lead, self.out_features)
