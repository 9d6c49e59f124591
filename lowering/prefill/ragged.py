"""A ragged batch of prefill requests as a dense, right-padded batch, and back.

Tokens of B requests lie packed in [T, ...] with cumulative offsets cu_seqlens [B + 1]
(int32, on the device). The dense kernels want [B, max_len, ...]: request b's tokens
first, then pad rows (copies of token 0, so they are finite). With causal attention a
real query never sees a pad key (pads come after it), and the pad queries' outputs are
dropped on the way back. Both index maps are computed on the device from cu_seqlens;
max_len is a host int (the longest request, as FlashAttention's max_seqlen), so nothing
here reads device data on the host.

When T == B * max_len every request has max_len tokens: the padded batch is a reshape,
no copy (the fast path of a batch of equal prompts).
"""
from __future__ import annotations

import torch

from lowering.checks import check_tensor
from lowering.prefill.dense import dense_attention


def is_uniform(T: int, B: int, max_len: int) -> bool:
    return T == B * max_len


def pad_index(cu_seqlens: torch.Tensor, max_len: int, T: int) -> torch.Tensor:
    """Padded slot (b, j) -> packed token index [B * max_len] int64 (pads -> token 0)."""
    start = cu_seqlens[:-1].long()                               # [B]
    n = cu_seqlens[1:].long() - start                            # [B]
    j = torch.arange(max_len, device=cu_seqlens.device)          # [max_len]
    tok = start[:, None] + j[None, :]                            # [B, max_len]
    tok = torch.where(j[None, :] < n[:, None], tok, 0)
    return tok.clamp(0, max(T - 1, 0)).reshape(-1)


def unpad_index(cu_seqlens: torch.Tensor, max_len: int, T: int) -> torch.Tensor:
    """Packed token t -> its padded slot b * max_len + (t - cu_seqlens[b]) [T] int64."""
    cu = cu_seqlens.long()
    t = torch.arange(T, device=cu.device)                        # [T]
    b = torch.searchsorted(cu[1:], t, right=True)                # [T] request of each token
    b = b.clamp(max=cu.shape[0] - 2)
    slot = b * max_len + (t - cu[b])
    return slot.clamp(0, max((cu.shape[0] - 1) * max_len - 1, 0))


def to_padded(x: torch.Tensor, index, B: int, max_len: int) -> torch.Tensor:
    """x [T, ...] -> [B, max_len, ...] (a view when index is None: the uniform case)."""
    if index is None:
        return x.reshape(B, max_len, *x.shape[1:])
    return x.index_select(0, index).reshape(B, max_len, *x.shape[1:])


def from_padded(y: torch.Tensor, index, T: int) -> torch.Tensor:
    """y [B, max_len, ...] -> [T, ...] (a view when index is None)."""
    flat = y.reshape(-1, *y.shape[2:])
    return flat if index is None else flat.index_select(0, index)


class RaggedLayout:
    """The two index maps of one ragged batch (None: uniform, reshape only)."""

    def __init__(self, cu_seqlens: torch.Tensor, max_len: int, T: int):
        self.B, self.max_len, self.T = cu_seqlens.shape[0] - 1, max_len, T
        uniform = is_uniform(T, self.B, max_len)
        self.pad = None if uniform else pad_index(cu_seqlens, max_len, T)
        self.unpad = None if uniform else unpad_index(cu_seqlens, max_len, T)

    def padded(self, x: torch.Tensor) -> torch.Tensor:
        """[T, N, D] -> [B, N, max_len, D] (strided view of a [B, max_len, N, D] tensor)."""
        return to_padded(x, self.pad, self.B, self.max_len).transpose(1, 2)

    def packed(self, y: torch.Tensor) -> torch.Tensor:
        """[B, max_len, ...] -> [T, ...]."""
        return from_padded(y, self.unpad, self.T)


def varlen_attention(q, k, v, cu_seqlens, max_len: int, scale: float, route: str = "auto"):
    """Causal attention of each request's tokens over themselves.

    q, k [T, N, D]; v [T, N, V]; cu_seqlens [B + 1] int32 (device); max_len: the longest
    request (host int). -> out [T, N, V] (q dtype), lse [T, N] fp32 natural log.
    Shapes, dtypes and devices are checked here (host only); the lengths are not read.
    """
    check_varlen_args(q, k, v, cu_seqlens, max_len)
    T = q.shape[0]
    lay = RaggedLayout(cu_seqlens, max_len, T)
    out, lse = dense_attention(lay.padded(q), lay.padded(k), lay.padded(v), None, scale,
                               True, route)                      # [B, S, N, V], [B, N, S]
    return lay.packed(out), lay.packed(lse.transpose(1, 2))


def check_varlen_args(q, k, v, cu_seqlens, max_len) -> None:
    check_tensor("q", q, ndim=3)
    check_tensor("k", k, ndim=3, dtypes=(q.dtype,))
    check_tensor("v", v, ndim=3, dtypes=(q.dtype,))
    check_tensor("cu_seqlens", cu_seqlens, ndim=1, dtypes=(torch.int32,))
    T, N, D = q.shape
    if k.shape != (T, N, D) or v.shape[:2] != (T, N):
        raise ValueError(f"k must be [T, N, D]={tuple(q.shape)} and v [T, N, V], got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    if cu_seqlens.shape[0] < 2:
        raise ValueError("cu_seqlens must hold B + 1 >= 2 offsets")
    if not isinstance(max_len, int) or isinstance(max_len, bool) or max_len < 1:
        raise ValueError(f"max_len must be a positive int (the longest request), got {max_len!r}")
    for name, t in (("k", k), ("v", v), ("cu_seqlens", cu_seqlens)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
