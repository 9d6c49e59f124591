"""What the fused decode-row ops (prologue.py, q_rope.py, q_absorb.py) share: the row
limit of their kernels, when a call is theirs, and the rotary rows they read.

The kernels serve a decode step's few rows on CUDA in bf16 / fp16; any other call runs
HF's own steps in torch ops (bit for bit what its modules and RoPE functions compute).
"""
from __future__ import annotations

import torch

MAX_ROWS = 64


def decode_rows_unmet(device: torch.device, dtype: torch.dtype, tokens: int) -> str | None:
    """None when the fused row kernels serve a call of `tokens` rows in dtype on device,
    else the unmet condition (the torch steps then run)."""
    if device.type != "cuda":
        return f"the tensors are on {device}, the kernels run on CUDA"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"the activations are {dtype}, the kernels take bf16 / fp16"
    if not 0 < tokens <= MAX_ROWS:
        return f"{tokens} rows: the kernels serve 1 to {MAX_ROWS}"
    return None


def check_angles(cos: torch.Tensor, sin: torch.Tensor) -> None:
    """cos / sin must be floating tensors (HF's rotary rows)."""
    for name, c in (("cos", cos), ("sin", sin)):
        if not c.is_floating_point():
            raise TypeError(f"{name} must be a floating tensor (HF's rotary rows), got {c.dtype}")


def angle_rows(cos: torch.Tensor, sin: torch.Tensor, T: int, dtype) -> tuple:
    """cos / sin [*lead, R] as [T, R] rows in dtype with a unit last stride, for a kernel."""
    rows = (a.reshape(T, a.shape[-1]).to(dtype) for a in (cos, sin))
    return tuple(a if a.stride(-1) == 1 else a.contiguous() for a in rows)
