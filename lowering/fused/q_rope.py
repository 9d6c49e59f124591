"""The query's RoPE after q_b as a graph op:

    mla::decode_q_rope(q [*lead, N, P + R], cos [*lead, R], sin [*lead, R], interleave)
        -> q with RoPE applied to its last R columns (a new tensor)

On CUDA one Triton launch (q_rope_kernel.py; any number of tokens); elsewhere HF's
own RoPE in torch ops (rope_torch / q_rope_torch, which the other fused ops' torch paths
share). Defined with torch.library.triton_op, so Inductor sees the kernel in the graph.
"""
from __future__ import annotations

import torch
import triton

from lowering.fused.decode_rows import angle_rows, check_angles, row_kernels_unmet
from lowering.fused.q_rope_kernel import q_rope_kernel

BLOCK_ROWS = 16        # (token, head) rows per program


def rope_torch(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               interleave: bool) -> torch.Tensor:
    """HF's RoPE of the key rows k [..., R] with cos / sin [..., R] (cat(freqs, freqs))."""
    H = k.shape[-1] // 2
    if interleave:
        k1, k2, c2, s2 = k[..., 0::2], k[..., 1::2], cos[..., :H], sin[..., :H]
    else:
        k1, k2, c2, s2 = k[..., :H], k[..., H:], cos[..., H:], sin[..., H:]
    return torch.cat([k1 * cos[..., :H] - k2 * sin[..., :H], k2 * c2 + k1 * s2], dim=-1)


def rope_complex_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V2's RoPE (HF's apply_rotary_emb) of x [..., R] by the angles whose cos / sin
    [..., R / 2] (broadcastable) are its freqs_cis: the complex product in fp32, rounded once."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * torch.complex(cos.float(), sin.float())).flatten(-2).type_as(x)


def q_rope_torch(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool):
    """HF's RoPE of the query heads q [*lead, N, P + R] (last R columns) in torch ops."""
    R = cos.shape[-1]
    c, s = cos.to(q.dtype)[..., None, :], sin.to(q.dtype)[..., None, :]   # [*lead, 1, R]
    return torch.cat([q[..., :-R], rope_torch(q[..., -R:], c, s, interleave)], dim=-1)


# The fused ops' rope layouts: 0 rotate_half and 1 DeepSeek-V3's interleaved pairs (HF's
# rows cos / sin [*lead, R]; a bool interleave means one of these), 2 DeepSeek-V2's complex
# pairs rotated in place (cos / sin: its freqs_cis parts [*lead, R / 2], fp32)
ROPES = (0, 1, 2)


def q_rope_any(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope: int):
    """HF's RoPE of the query heads q [*lead, N, P + R] in torch ops, any ROPES layout."""
    if rope != 2:
        return q_rope_torch(q, cos, sin, bool(rope))
    R = 2 * cos.shape[-1]
    c, s = cos[..., None, :], sin[..., None, :]                          # [*lead, 1, R/2]
    return torch.cat([q[..., :-R], rope_complex_torch(q[..., -R:], c, s)], dim=-1)


def launch(q, cos, sin, interleave, y):
    """Run q_rope_kernel: q, y [T, N, P + R] contiguous, cos / sin [T, R] (last dim
    contiguous)."""
    T, N, W = q.shape
    R = cos.shape[-1]
    kernel = torch.library.wrap_triton(q_rope_kernel)
    kernel[(triton.cdiv(T * N, BLOCK_ROWS),)](
        q, y, cos, sin, T * N, N, cos.stride(0), P=W - R, R=R, BLOCK_ROWS=BLOCK_ROWS,
        BLOCK_P=triton.next_power_of_2(W - R), BLOCK_H=triton.next_power_of_2(R // 2),
        INTERLEAVE=interleave, num_warps=4)


@torch.library.triton_op("mla::decode_q_rope", mutates_args={})
def decode_q_rope(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  interleave: bool) -> torch.Tensor:
    if not q.is_floating_point():
        raise TypeError(f"q must be a floating tensor, got {q.dtype}")
    check_angles(cos, sin)
    if q.dim() < 2 or cos.shape != sin.shape or cos.shape[:-1] != q.shape[:-2]:
        raise ValueError(f"cos and sin must be [*lead, R] for q [*lead, N, P + R]; got q "
                         f"{tuple(q.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)}")
    R = cos.shape[-1]
    if R % 2 or not 0 < R < q.shape[-1]:
        raise ValueError(f"the RoPE width R={R} (cos's last dim) must be even and below q's "
                         f"head size {q.shape[-1]}")
    if cos.device != q.device or sin.device != q.device:
        raise ValueError(f"cos / sin must be on q's device {q.device}")
    tokens = q.numel() // max(1, q.shape[-1] * q.shape[-2])
    if tokens == 0 or row_kernels_unmet(q.device, q.dtype) is not None:
        return q_rope_torch(q, cos, sin, interleave)
    q3 = q.reshape(tokens, q.shape[-2], q.shape[-1]).contiguous()         # [T, N, P + R]
    c, s = angle_rows(cos, sin, tokens, q.dtype)
    y = torch.empty_like(q3)
    launch(q3, c, s, bool(interleave), y)
    return y.view(q.shape)
