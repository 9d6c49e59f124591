"""The attention prologue of a decode step as graph ops: after the q_a + kv_a GEMM's
split-K partials, and the query's RoPE after q_b.

    mla::decode_qkv_prologue(part [S, *lead, NQ + L + R] fp32, w_q [NQ], w_kv [L],
                             cos [*lead, R], sin [*lead, R], eps_q, eps_kv, interleave)
        -> (q_out [*lead, NQ], kv_row [*lead, L + R])   in w_q's dtype

    q_out  = RMSNorm(sum(part)[..., :NQ]) * w_q                            (q_a_layernorm)
    kv_row = [RMSNorm(sum(part)[..., NQ:NQ+L]) * w_kv | RoPE(sum(part)[..., NQ+L:])]

    mla::decode_q_rope(q [*lead, N, P + R], cos [*lead, R], sin [*lead, R], interleave)
        -> q with RoPE applied to its last R columns (a new tensor)

    mla::decode_q_absorb(q_a [*lead, Q], w [N * (P + R), Q], W_UK_T [N, P, L],
                         cos [*lead, R], sin [*lead, R], interleave)
        -> the absorbed decode query [T, N, L + R] = [q_nope @ W_UK_T | RoPE(q_pe)]
           of q = q_a @ w.T (q_b_proj), T = prod(lead): q_b, the query's RoPE and the
           absorption in one launch

    mla::decode_q_absorb_fp8(..., interleave, q_scale [1] fp32)
        -> the same query quantized to float8_e4m3fn with the static scale, in that launch

On CUDA one Triton launch each (at most MAX_ROWS tokens; roundings in
prologue_kernel.py); elsewhere HF's own steps in torch ops, bit for bit what its modules
and RoPE functions compute. Defined with torch.library.triton_op, so Inductor sees the
kernels in the graph.
"""
from __future__ import annotations

import torch
import triton

from lowering.gemm.head_gemm import absorb_query
from lowering.fused.prologue_kernel import qkv_prologue_kernel
from lowering.fused.q_absorb_kernel import q_absorb_kernel
from lowering.fused.q_rope_kernel import q_rope_kernel

MAX_ROWS = 64
# q_absorb_kernel's launch: rows <= 16 -> (BLOCK_K, BLOCK_L, num_warps, num_stages); the
# fastest alone at DeepSeek-V3's query on an H200 (benchmarks/bench_q_absorb.py: 30.7 µs
# at 1 row, 31.4 at 32, against 32.9 / 32.3 for (64, 128, 4, 4); in the decode step
# 0.994x of that at both)
Q_ABSORB_CONFIGS = {True: (128, 128, 8, 3), False: (128, 128, 8, 3)}


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's DeepseekV3RMSNorm.forward on x in w's dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def _rope(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """HF's RoPE of the key rows k [..., R] with cos / sin [..., R] (cat(freqs, freqs))."""
    H = k.shape[-1] // 2
    if interleave:
        k1, k2, c2, s2 = k[..., 0::2], k[..., 1::2], cos[..., :H], sin[..., :H]
    else:
        k1, k2, c2, s2 = k[..., :H], k[..., H:], cos[..., H:], sin[..., H:]
    return torch.cat([k1 * cos[..., :H] - k2 * sin[..., :H], k2 * c2 + k1 * s2], dim=-1)


def _q_rope(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool):
    """HF's RoPE of the query heads q [*lead, N, P + R] (last R columns) in torch ops."""
    R = cos.shape[-1]
    c, s = cos.to(q.dtype)[..., None, :], sin.to(q.dtype)[..., None, :]   # [*lead, 1, R]
    return torch.cat([q[..., :-R], _rope(q[..., -R:], c, s, interleave)], dim=-1)


def _check_angles(cos, sin):
    for name, c in (("cos", cos), ("sin", sin)):
        if not c.is_floating_point():
            raise TypeError(f"{name} must be a floating tensor (HF's rotary rows), got {c.dtype}")


def _check(part, w_q, w_kv, cos, sin):
    _check_angles(cos, sin)
    if part.dim() < 2 or part.dtype != torch.float32:
        raise TypeError(f"part must be fp32 [split, *lead, NQ + L + R] partial sums, got "
                        f"{part.dtype} {tuple(part.shape)}")
    for name, w in (("w_q", w_q), ("w_kv", w_kv)):
        if w.dim() != 1 or w.dtype != w_q.dtype or w.device != part.device:
            raise ValueError(f"{name} must be 1-D, of w_q's dtype, on {part.device}; got "
                             f"{w.dtype} {tuple(w.shape)} on {w.device}")
    NQ, L = w_q.shape[0], w_kv.shape[0]
    R = part.shape[-1] - NQ - L
    if R <= 0 or R % 2:
        raise ValueError(f"part's last dim {part.shape[-1]} must be NQ={NQ} + L={L} + an even R")
    want = (*part.shape[1:-1], R)
    for name, c in (("cos", cos), ("sin", sin)):
        if tuple(c.shape) != want or c.device != part.device:
            raise ValueError(f"{name} must be {want} on {part.device} (one row per token), got "
                             f"{tuple(c.shape)} on {c.device}")
    return NQ, L, R


def kernel_serves(device: torch.device, dtype: torch.dtype, tokens: int) -> bool:
    """Whether the Triton kernels run a call (else the torch steps do)."""
    return (device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
            and 0 < tokens <= MAX_ROWS)


def _angle_rows(cos, sin, T: int, dtype):
    """cos / sin [*lead, R] as [T, R] rows in dtype with a unit last stride, for a kernel."""
    rows = (a.reshape(T, a.shape[-1]).to(dtype) for a in (cos, sin))
    return tuple(a if a.stride(-1) == 1 else a.contiguous() for a in rows)


def launch(part, w_q, w_kv, cos, sin, eps_q, eps_kv, interleave, q_out, kv_out, *, wrap=True):
    """Run qkv_prologue_kernel: part [S, T, NQ + L + R] fp32 contiguous, cos / sin [T, R]
    (last dim contiguous), q_out [T, NQ], kv_out [T, L + R] contiguous."""
    S, T, _ = part.shape
    NQ, L = w_q.shape[0], w_kv.shape[0]
    R = part.shape[-1] - NQ - L
    kernel = torch.library.wrap_triton(qkv_prologue_kernel) if wrap else qkv_prologue_kernel
    kernel[(T, 2)](
        part, w_q, w_kv, cos, sin, q_out, kv_out,
        part.stride(0), cos.stride(0), eps_q, eps_kv,
        SPLIT=S, NQ=NQ, L=L, R=R, BLOCK_Q=triton.next_power_of_2(NQ),
        BLOCK_L=triton.next_power_of_2(L), BLOCK_H=triton.next_power_of_2(R // 2),
        INTERLEAVE=interleave, num_warps=4)


@torch.library.triton_op("mla::decode_qkv_prologue", mutates_args={})
def decode_qkv_prologue(part: torch.Tensor, w_q: torch.Tensor, w_kv: torch.Tensor,
                        cos: torch.Tensor, sin: torch.Tensor, eps_q: float, eps_kv: float,
                        interleave: bool) -> tuple[torch.Tensor, torch.Tensor]:
    NQ, L, R = _check(part, w_q, w_kv, cos, sin)
    lead = part.shape[1:-1]
    if not kernel_serves(part.device, w_q.dtype, part[0].numel() // part.shape[-1]):
        x = part.sum(0).to(w_q.dtype)                                     # [*lead, NQ+L+R]
        q, kv, k = x.split([NQ, L, R], dim=-1)
        kv_row = torch.cat([_norm(kv, w_kv, eps_kv),
                            _rope(k, cos.to(x.dtype), sin.to(x.dtype), interleave)], dim=-1)
        return _norm(q, w_q, eps_q), kv_row
    p = part.reshape(part.shape[0], -1, part.shape[-1]).contiguous()      # [S, T, NQ+L+R]
    T = p.shape[1]
    c, s = _angle_rows(cos, sin, T, w_q.dtype)
    q_out = torch.empty((T, NQ), dtype=w_q.dtype, device=part.device)
    kv_out = torch.empty((T, L + R), dtype=w_q.dtype, device=part.device)
    launch(p, w_q, w_kv, c, s, float(eps_q), float(eps_kv), bool(interleave), q_out, kv_out)
    return q_out.view(*lead, NQ), kv_out.view(*lead, L + R)


def launch_q_rope(q, cos, sin, interleave, y, *, wrap=True, block_rows=16):
    """Run q_rope_kernel: q, y [T, N, P + R] contiguous, cos / sin [T, R] (last dim
    contiguous)."""
    T, N, W = q.shape
    R = cos.shape[-1]
    kernel = torch.library.wrap_triton(q_rope_kernel) if wrap else q_rope_kernel
    kernel[(triton.cdiv(T * N, block_rows),)](
        q, y, cos, sin, T * N, N, cos.stride(0), P=W - R, R=R, BLOCK_ROWS=block_rows,
        BLOCK_P=triton.next_power_of_2(W - R), BLOCK_H=triton.next_power_of_2(R // 2),
        INTERLEAVE=interleave, num_warps=4)


@torch.library.triton_op("mla::decode_q_rope", mutates_args={})
def decode_q_rope(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  interleave: bool) -> torch.Tensor:
    if not q.is_floating_point():
        raise TypeError(f"q must be a floating tensor, got {q.dtype}")
    _check_angles(cos, sin)
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
    if not kernel_serves(q.device, q.dtype, tokens):
        return _q_rope(q, cos, sin, interleave)
    q3 = q.reshape(tokens, q.shape[-2], q.shape[-1]).contiguous()         # [T, N, P + R]
    c, s = _angle_rows(cos, sin, tokens, q.dtype)
    y = torch.empty_like(q3)
    launch_q_rope(q3, c, s, bool(interleave), y)
    return y.view(q.shape)


def _q_absorb_shape(q_a, w, W_UK_T, cos, sin):
    """(Q, N, P, R, L) of a decode_q_absorb call, after its checks."""
    for name, t in (("q_a", q_a), ("w", w), ("W_UK_T", W_UK_T)):
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating tensor, got {t.dtype}")
    _check_angles(cos, sin)
    if w.dtype != q_a.dtype or W_UK_T.dtype != q_a.dtype:
        raise TypeError(f"w and W_UK_T must have q_a's dtype {q_a.dtype}, got {w.dtype} and "
                        f"{W_UK_T.dtype}")
    if q_a.dim() < 1 or w.dim() != 2 or W_UK_T.dim() != 3 or w.shape[1] != q_a.shape[-1]:
        raise ValueError(f"need q_a [*lead, Q], w [N * (P + R), Q] and W_UK_T [N, P, L]; got "
                         f"q_a {tuple(q_a.shape)}, w {tuple(w.shape)}, W_UK_T "
                         f"{tuple(W_UK_T.shape)}")
    Q = q_a.shape[-1]
    N, P, L = W_UK_T.shape
    R = cos.shape[-1] if cos.dim() else 0
    if R <= 0 or R % 2 or w.shape[0] != N * (P + R):
        raise ValueError(f"w must be [N * (P + R)={N} * ({P} + {R}), Q] with an even RoPE "
                         f"width R (cos's last dim), got {tuple(w.shape)}")
    want = (*q_a.shape[:-1], R)
    for name, c in (("cos", cos), ("sin", sin)):
        if tuple(c.shape) != want:
            raise ValueError(f"{name} must be {want} (one row per token), got {tuple(c.shape)}")
    for name, t in (("w", w), ("W_UK_T", W_UK_T), ("cos", cos), ("sin", sin)):
        if t.device != q_a.device:
            raise ValueError(f"{name} is on {t.device}, q_a on {q_a.device}")
    return Q, N, P, R, L


def _pow2(v: int) -> bool:
    return v >= 16 and not v & (v - 1)


def q_absorb_config(T: int, Q: int, L: int):
    """(BLOCK_K, BLOCK_L, num_warps, num_stages) for T rows, fitted to Q and L."""
    bk, bl, warps, stages = Q_ABSORB_CONFIGS[T <= 16]
    while bk > 16 and Q % bk:
        bk //= 2
    while bl > 16 and L % bl:
        bl //= 2
    return bk, bl, warps, stages


def q_absorb_serves(q_a, w, W_UK_T, R: int) -> bool:
    """Whether q_absorb_kernel runs a decode_q_absorb call (else the torch steps do)."""
    Q = q_a.shape[-1]
    N, P, L = W_UK_T.shape
    T = q_a.numel() // max(1, Q)
    bk, bl = q_absorb_config(max(T, 1), Q, L)[:2]
    return (kernel_serves(q_a.device, q_a.dtype, T) and _pow2(P) and _pow2(R // 2)
            and Q % bk == 0 and Q >= 16 and L % bl == 0 and L >= 16
            and w.is_contiguous() and W_UK_T.is_contiguous())


def launch_q_absorb(q_a, w, W_UK_T, cos, sin, interleave, y, *, wrap=True, config=None,
                    q_scale=None):
    """Run q_absorb_kernel: q_a [T, Q] (last dim contiguous), w [N * (P + R), Q] and
    W_UK_T [N, P, L] contiguous, cos / sin [T, R] (last dim contiguous), y [T, N, L + R]
    contiguous (float8_e4m3fn with q_scale [1] fp32: the quantized query)."""
    T, Q = q_a.shape
    N, P, L = W_UK_T.shape
    R = cos.shape[-1]
    bk, bl, warps, stages = config or q_absorb_config(T, Q, L)
    block_t = max(16, triton.next_power_of_2(min(T, MAX_ROWS)))
    kernel = torch.library.wrap_triton(q_absorb_kernel) if wrap else q_absorb_kernel
    kernel[(N, triton.cdiv(T, block_t))](
        q_a, w, W_UK_T, cos, sin, y, cos if q_scale is None else q_scale, T, N, q_a.stride(0),
        cos.stride(0), Q=Q, P=P, R=R, L=L, BLOCK_T=block_t, BLOCK_K=bk, BLOCK_L=bl,
        INTERLEAVE=interleave, DOT_F32=not q_a.is_cuda, QUANT=q_scale is not None,
        num_warps=warps, num_stages=stages)


@torch.library.triton_op("mla::decode_q_absorb", mutates_args={})
def decode_q_absorb(q_a: torch.Tensor, w: torch.Tensor, W_UK_T: torch.Tensor,
                    cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    Q, N, P, R, L = _q_absorb_shape(q_a, w, W_UK_T, cos, sin)
    T = q_a.numel() // Q
    if not q_absorb_serves(q_a, w, W_UK_T, R):
        q = torch.nn.functional.linear(q_a, w).view(*q_a.shape[:-1], N, P + R)
        return absorb_query(_q_rope(q, cos, sin, interleave).reshape(T, N, P + R),
                            W_UK_T)                                      # [T, N, L + R]
    a = q_a.reshape(T, Q)
    if a.stride(-1) != 1:
        a = a.contiguous()
    c, s = _angle_rows(cos, sin, T, q_a.dtype)
    y = torch.empty((T, N, L + R), dtype=q_a.dtype, device=q_a.device)
    launch_q_absorb(a, w, W_UK_T, c, s, bool(interleave), y)
    return y


@torch.library.triton_op("mla::decode_q_absorb_fp8", mutates_args={})
def decode_q_absorb_fp8(q_a: torch.Tensor, w: torch.Tensor, W_UK_T: torch.Tensor,
                        cos: torch.Tensor, sin: torch.Tensor, interleave: bool,
                        q_scale: torch.Tensor) -> torch.Tensor:
    """decode_q_absorb's query quantized to float8_e4m3fn with the static scale q_scale
    (one fp32 value): fp8(clamp(y / q_scale, -448, 448)), in the same launch."""
    Q, N, P, R, L = _q_absorb_shape(q_a, w, W_UK_T, cos, sin)
    if not isinstance(q_scale, torch.Tensor) or q_scale.dtype != torch.float32 \
            or q_scale.numel() != 1 or q_scale.device != q_a.device:
        raise TypeError(f"q_scale must be a one-element float32 tensor on {q_a.device}")
    T = q_a.numel() // Q
    if not q_absorb_serves(q_a, w, W_UK_T, R):
        y = decode_q_absorb(q_a, w, W_UK_T, cos, sin, interleave)        # [T, N, L + R]
        return (y.float() / q_scale.reshape(())).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    a = q_a.reshape(T, Q)
    if a.stride(-1) != 1:
        a = a.contiguous()
    c, s = _angle_rows(cos, sin, T, q_a.dtype)
    y = torch.empty((T, N, L + R), dtype=torch.float8_e4m3fn, device=q_a.device)
    launch_q_absorb(a, w, W_UK_T, c, s, bool(interleave), y, q_scale=q_scale.reshape(1))
    return y
