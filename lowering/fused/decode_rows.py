"""What the fused row ops (prologue.py, q_rope.py, q_absorb.py) share: when a call is
their kernels', and the rotary rows they read.

The kernels run on CUDA in bf16 / fp16: prologue.py's and q_rope.py's for any number of
rows (a decode step's, a prefill's), q_absorb.py's for a decode step's few (MAX_ROWS);
any other call runs HF's own steps in torch ops (bit for bit what its modules and RoPE
functions compute).
"""
from __future__ import annotations

import torch

MAX_ROWS = 64


def row_kernels_unmet(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when the per-row kernels (one program per token or row block: prologue.py's and
    q_rope.py's) serve a call in dtype on device, of any number of rows (prefill's too),
    else the unmet condition (the torch steps then run)."""
    if device.type != "cuda":
        return f"the tensors are on {device}, the kernels run on CUDA"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"the activations are {dtype}, the kernels take bf16 / fp16"
    return None


def decode_rows_unmet(device: torch.device, dtype: torch.dtype, tokens: int) -> str | None:
    """None when the fused decode-row kernels (q_absorb.py's, which hold all rows in one
    program) serve a call of `tokens` rows in dtype on device, else the unmet condition."""
    why = row_kernels_unmet(device, dtype)
    if why is not None:
        return why
    if not 0 < tokens <= MAX_ROWS:
        return f"{tokens} rows: the kernels serve 1 to {MAX_ROWS}"
    return None


def check_angles(cos: torch.Tensor, sin: torch.Tensor) -> None:
    """cos / sin must be floating tensors (HF's rotary rows)."""
    for name, c in (("cos", cos), ("sin", sin)):
        if not c.is_floating_point():
            raise TypeError(f"{name} must be a floating tensor (HF's rotary rows), got {c.dtype}")


def angle_rows(cos: torch.Tensor, sin: torch.Tensor, T: int, dtype,
               strided: bool = False) -> tuple:
    """cos / sin [*lead, R] as [T, R] rows in dtype, for a kernel: with a unit last stride,
    or (strided: for kernels that take a column stride) as they are where both are views
    of the same strides, e.g. V2's freqs_cis.real / .imag, so no copy runs per layer."""
    c, s = (a.reshape(T, a.shape[-1]).to(dtype) for a in (cos, sin))
    if strided and c.stride() == s.stride():
        return c, s
    return tuple(a if a.stride(-1) == 1 else a.contiguous() for a in (c, s))
