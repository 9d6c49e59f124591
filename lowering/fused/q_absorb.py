"""q_b, the query's RoPE and its absorption in one launch, as graph ops:

    mla::decode_q_absorb(q_a [*lead, Q], w [N * (P + R), Q], W_UK_T [N, P, L],
                         cos, sin, rope)
        -> the absorbed decode query [T, N, L + R] = [q_nope @ W_UK_T | RoPE(q_pe)]
           of q = q_a @ w.T (q_b_proj), T = prod(lead)

    mla::decode_q_absorb_fp8(..., rope, q_scale [1] fp32)
        -> the same query quantized to float8_e4m3fn with the static scale, in that launch

    mla::decode_q_absorb_w8a8(q_a, q_q, q_s, w e4m3, w_scale, W_UK_T, cos, sin, rope,
                              group_n, group_k, q_scale=None)
        -> the same for an FP8 checkpoint's q_b_proj (w float8_e4m3fn with fp32 scale_inv
           [ceil(N (P + R) / group_n), Q / group_k]): q = q_a @ w.T as the fp8 decode GEMM
           computes it (W8A8 from q_a's quantization q_q, q_s, which the prologue wrote:
           mla::decode_qkv_prologue_fp8), then RoPE and the absorption as above (with
           q_scale, quantized as decode_q_absorb_fp8's)

    mla::decode_q_kv_absorb(part [S, *lead, N (P + R) + L + R] fp32, w_kv [L], W_UK_T,
                            cos, sin, eps_kv, num_heads)
        -> (the absorbed decode query [T, N, L + R], the cache row [*lead, L + R])
           DeepSeek-V2 without q_lora (V2-Lite): prologue.py's mla::decode_q_kv_rope and
           the absorption in one launch (q_kv_absorb_kernel.py), from the q_proj + kv_a
           GEMM's split-K partials; cos / sin V2's freqs_cis parts [*lead, R / 2]

rope (ROPES): 0 rotate_half, 1 DeepSeek-V3's interleaved pairs (cos / sin HF's rows
[*lead, R]; a bool interleave means these two); 2 DeepSeek-V2's complex pairs, rotated in
place (cos / sin the real and imaginary parts of its freqs_cis, [*lead, R / 2], in fp32).

On CUDA one Triton launch of q_absorb_kernel.py where q_absorb_unmet says it serves;
elsewhere q_b_proj, HF's RoPE and lowering.gemm.head_gemm.absorb_query in torch ops.
Defined with torch.library.triton_op, so Inductor sees the kernel in the graph.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton

from lowering.fused.decode_rows import MAX_ROWS, angle_rows, check_angles, decode_rows_unmet
from lowering.fused.q_absorb_kernel import q_absorb_kernel
from lowering.fused.q_kv_absorb_kernel import q_kv_absorb_kernel
from lowering.fused.q_rope import ROPES, q_rope_any
from lowering.gemm import fp8_linear
from lowering.gemm.fp8_act_quant import check_quantized
from lowering.gemm.head_gemm import absorb_query

# q_absorb_kernel's launch: rows <= 16 -> (BLOCK_K, BLOCK_L, num_warps, num_stages); the
# fastest alone at DeepSeek-V3's query on an H200 (benchmarks/bench_q_absorb.py: 30.7 µs
# at 1 row, 31.4 at 32, against 32.9 / 32.3 for (64, 128, 4, 4); in the decode step
# 0.994x of that at both)
CONFIGS = {True: (128, 128, 8, 3), False: (128, 128, 8, 3)}
# the W8A8 form (an FP8 checkpoint's q_b), its BLOCK_K the scale group whatever the entry
# says: the fastest on an H200 (`bench_q_absorb.py --weights fp8`: 25.8 µs at 1 row, 26.8
# at 32, against 29.1 / 32.3 for the fp8 GEMM + RoPE + absorption it replaces)
W8A8_CONFIGS = {True: (128, 128, 4, 3), False: (128, 128, 4, 3)}


def rope_width(cos: torch.Tensor, rope: int) -> int:
    """R, the rotated columns of a query head, from the angle rows of a `rope` layout."""
    if rope not in ROPES:
        raise ValueError(f"rope must be one of {ROPES} (rotate_half, V3's interleaved pairs, "
                         f"V2's complex pairs), got {rope!r}")
    width = cos.shape[-1] if cos.dim() else 0
    return 2 * width if rope == 2 else width


def _q_absorb_shape(q_a, w, W_UK_T, cos, sin, rope, w_dtype=None):
    """(Q, N, P, R, L) of a decode_q_absorb call, after its checks (w of w_dtype: q_a's
    by default)."""
    for name, t in (("q_a", q_a), ("w", w), ("W_UK_T", W_UK_T)):
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating tensor, got {t.dtype}")
    check_angles(cos, sin)
    if w.dtype != (w_dtype or q_a.dtype) or W_UK_T.dtype != q_a.dtype:
        raise TypeError(f"w must be {w_dtype or q_a.dtype} and W_UK_T of q_a's dtype "
                        f"{q_a.dtype}, got {w.dtype} and {W_UK_T.dtype}")
    if q_a.dim() < 1 or w.dim() != 2 or W_UK_T.dim() != 3 or w.shape[1] != q_a.shape[-1]:
        raise ValueError(f"need q_a [*lead, Q], w [N * (P + R), Q] and W_UK_T [N, P, L]; got "
                         f"q_a {tuple(q_a.shape)}, w {tuple(w.shape)}, W_UK_T "
                         f"{tuple(W_UK_T.shape)}")
    Q = q_a.shape[-1]
    N, P, L = W_UK_T.shape
    R = rope_width(cos, rope)
    if R <= 0 or R % 2 or w.shape[0] != N * (P + R):
        raise ValueError(f"w must be [N * (P + R)={N} * ({P} + {R}), Q] with an even RoPE "
                         f"width R (cos's last dim), got {tuple(w.shape)}")
    want = (*q_a.shape[:-1], cos.shape[-1])
    for name, c in (("cos", cos), ("sin", sin)):
        if tuple(c.shape) != want:
            raise ValueError(f"{name} must be {want} (one row per token), got {tuple(c.shape)}")
    for name, t in (("w", w), ("W_UK_T", W_UK_T), ("cos", cos), ("sin", sin)):
        if t.device != q_a.device:
            raise ValueError(f"{name} is on {t.device}, q_a on {q_a.device}")
    return Q, N, P, R, L


def _pow2(v: int) -> bool:
    return v >= 16 and not v & (v - 1)


def _fit(block: int, n: int) -> int:
    """block halved (not below 16) until it divides n."""
    while block > 16 and n % block:
        block //= 2
    return block


def q_absorb_config(T: int, Q: int, L: int):
    """(BLOCK_K, BLOCK_L, num_warps, num_stages) for T rows, fitted to Q and L."""
    bk, bl, warps, stages = CONFIGS[T <= 16]
    return _fit(bk, Q), _fit(bl, L), warps, stages


def q_absorb_unmet(q_a, w, W_UK_T, R: int) -> str | None:
    """None when q_absorb_kernel runs a decode_q_absorb call of these tensors (R: the RoPE
    width), else the unmet condition (the torch steps then run)."""
    Q = q_a.shape[-1]
    N, P, L = W_UK_T.shape
    T = q_a.numel() // max(1, Q)
    rows = decode_rows_unmet(q_a.device, q_a.dtype, T)
    if rows is not None:
        return rows
    bk, bl = q_absorb_config(max(T, 1), Q, L)[:2]
    if not (_pow2(P) and _pow2(R // 2)):
        return f"P={P} and R/2={R // 2} must be powers of two >= 16"
    if not (Q % bk == 0 and Q >= 16 and L % bl == 0 and L >= 16):
        return f"Q={Q} and L={L} must be >= 16 and divide into the config's blocks ({bk}, {bl})"
    if not (w.is_contiguous() and W_UK_T.is_contiguous()):
        return "w and W_UK_T must be contiguous"
    return None


def launch(q_a, w, W_UK_T, cos, sin, rope, y, *, config=None, q_scale=None, w8a8=None):
    """Run q_absorb_kernel: q_a [T, Q] (last dim contiguous), w [N * (P + R), Q] and
    W_UK_T [N, P, L] contiguous, cos / sin [T, R] ([T, R / 2] with rope 2; last dim
    contiguous), y [T, N, L + R] contiguous (float8_e4m3fn with q_scale [1] fp32: the
    quantized query). config: (BLOCK_K, BLOCK_L, num_warps, num_stages), by default
    q_absorb_config's. w8a8 = (w_scale, q_s, group_n): w is e4m3 with its fp32 scale_inv
    [rows / group_n, Q / BLOCK_K] (contiguous), q_a the e4m3 rows [T, Q] of the 16-bit
    q_a (contiguous) and q_s their scales [T, Q / BLOCK_K]; BLOCK_K must be the scale
    group."""
    T, Q = q_a.shape
    N, P, L = W_UK_T.shape
    R = rope_width(cos, int(rope))
    bk, bl, warps, stages = config or q_absorb_config(T, Q, L)
    block_t = max(16, triton.next_power_of_2(min(T, MAX_ROWS)))
    ws, xs, gn = w8a8 if w8a8 is not None else (None, None, 1)
    kernel = torch.library.wrap_triton(q_absorb_kernel)
    kernel[(N, triton.cdiv(T, block_t))](
        q_a, w, W_UK_T, cos, sin, y, cos if q_scale is None else q_scale, T, N, q_a.stride(0),
        cos.stride(0), Q=Q, P=P, R=R, L=L, BLOCK_T=block_t, BLOCK_K=bk, BLOCK_L=bl,
        ROPE=int(rope), DOT_F32=not q_a.is_cuda, QUANT=q_scale is not None,
        ws_ptr=ws, xs_ptr=xs, W8A8=w8a8 is not None, GROUP_N=gn,
        num_warps=warps, num_stages=stages)


def _angles(cos, sin, T, dtype, rope):
    """The kernel's [T, R] angle rows: in the activation dtype, or fp32 for V2's (rope 2)."""
    return angle_rows(cos, sin, T, torch.float32 if rope == 2 else dtype)


@torch.library.triton_op("mla::decode_q_absorb", mutates_args={})
def decode_q_absorb(q_a: torch.Tensor, w: torch.Tensor, W_UK_T: torch.Tensor,
                    cos: torch.Tensor, sin: torch.Tensor, rope: int) -> torch.Tensor:
    Q, N, P, R, L = _q_absorb_shape(q_a, w, W_UK_T, cos, sin, rope)
    T = q_a.numel() // Q
    if q_absorb_unmet(q_a, w, W_UK_T, R) is not None:
        q = torch.nn.functional.linear(q_a, w).view(*q_a.shape[:-1], N, P + R)
        return absorb_query(q_rope_any(q, cos, sin, rope).reshape(T, N, P + R),
                            W_UK_T)                                      # [T, N, L + R]
    a = q_a.reshape(T, Q)
    if a.stride(-1) != 1:
        a = a.contiguous()
    c, s = _angles(cos, sin, T, q_a.dtype, rope)
    y = torch.empty((T, N, L + R), dtype=q_a.dtype, device=q_a.device)
    launch(a, w, W_UK_T, c, s, int(rope), y)
    return y


@torch.library.triton_op("mla::decode_q_absorb_fp8", mutates_args={})
def decode_q_absorb_fp8(q_a: torch.Tensor, w: torch.Tensor, W_UK_T: torch.Tensor,
                        cos: torch.Tensor, sin: torch.Tensor, rope: int,
                        q_scale: torch.Tensor) -> torch.Tensor:
    """decode_q_absorb's query quantized to float8_e4m3fn with the static scale q_scale
    (one fp32 value): fp8(clamp(y / q_scale, -448, 448)), in the same launch."""
    Q, N, P, R, L = _q_absorb_shape(q_a, w, W_UK_T, cos, sin, rope)
    if not isinstance(q_scale, torch.Tensor) or q_scale.dtype != torch.float32 \
            or q_scale.numel() != 1 or q_scale.device != q_a.device:
        raise TypeError(f"q_scale must be a one-element float32 tensor on {q_a.device}")
    T = q_a.numel() // Q
    if q_absorb_unmet(q_a, w, W_UK_T, R) is not None:
        y = decode_q_absorb(q_a, w, W_UK_T, cos, sin, rope)              # [T, N, L + R]
        return (y.float() / q_scale.reshape(())).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    a = q_a.reshape(T, Q)
    if a.stride(-1) != 1:
        a = a.contiguous()
    c, s = _angles(cos, sin, T, q_a.dtype, rope)
    y = torch.empty((T, N, L + R), dtype=torch.float8_e4m3fn, device=q_a.device)
    launch(a, w, W_UK_T, c, s, int(rope), y, q_scale=q_scale.reshape(1))
    return y


def w8a8_unmet(q_a, w, W_UK_T, R: int, group_k: int) -> str | None:
    """None when q_absorb_kernel runs a decode_q_absorb_w8a8 call (its K steps are the
    scale groups), else the unmet condition (the fp8 decode GEMM and the torch steps then
    run)."""
    Q = q_a.shape[-1]
    if group_k not in (32, 64, 128, 256) or Q % group_k:
        return f"group_k={group_k} must be 32, 64, 128 or 256 and divide Q={Q}"
    return q_absorb_unmet(q_a, w, W_UK_T, R)


def w8a8_config(T: int, Q: int, L: int, group_k: int):
    """(group_k, BLOCK_L, num_warps, num_stages) for T rows: W8A8_CONFIGS' entry, its K
    step the scale group and BLOCK_L fitted to L."""
    _, bl, warps, stages = W8A8_CONFIGS[T <= 16]
    return group_k, _fit(bl, L), warps, stages


@torch.library.triton_op("mla::decode_q_absorb_w8a8", mutates_args={})
def decode_q_absorb_w8a8(q_a: torch.Tensor, q_q: torch.Tensor, q_s: torch.Tensor,
                         w: torch.Tensor, w_scale: torch.Tensor, W_UK_T: torch.Tensor,
                         cos: torch.Tensor, sin: torch.Tensor, rope: int, group_n: int,
                         group_k: int, q_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    Q, N, P, R, L = _q_absorb_shape(q_a, w, W_UK_T, cos, sin, rope,
                                    w_dtype=torch.float8_e4m3fn)
    fp8_linear.check_fp8_weight("w", w, w_scale, group_n, group_k)
    check_quantized(q_a, q_q, q_s, group_k)
    if q_scale is not None and (q_scale.dtype != torch.float32 or q_scale.numel() != 1
                                or q_scale.device != q_a.device):
        raise TypeError(f"q_scale must be a one-element float32 tensor on {q_a.device}")
    T = q_a.numel() // Q
    if w8a8_unmet(q_a, w, W_UK_T, R, group_k) is not None:
        q = torch.ops.mla.decode_linear_fp8(q_a, w, w_scale, group_n, group_k, q_q, q_s)
        q = q.view(*q_a.shape[:-1], N, P + R)
        y = absorb_query(q_rope_any(q, cos, sin, rope).reshape(T, N, P + R), W_UK_T)
        if q_scale is None:
            return y                                                         # [T, N, L + R]
        return (y.float() / q_scale.reshape(())).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    c, s = _angles(cos, sin, T, q_a.dtype, rope)
    out_dtype = q_a.dtype if q_scale is None else torch.float8_e4m3fn
    y = torch.empty((T, N, L + R), dtype=out_dtype, device=q_a.device)
    launch(q_q.reshape(T, Q), w, W_UK_T, c, s, int(rope), y,
           config=w8a8_config(T, Q, L, group_k),
           q_scale=None if q_scale is None else q_scale.reshape(1),
           w8a8=(w_scale, q_s.reshape(T, -1), group_n))
    return y


# q_kv_absorb_kernel's launch: (BLOCK_L, L_SPLIT, num_warps, num_stages); each query head's
# absorption split in L_SPLIT programs of L / L_SPLIT columns (V2-Lite's L = 512: one
# 128-column block each). The fastest at V2-Lite's one row on an H200 (`bench_q_absorb.py
# --model v2-lite`: 7.4 µs against 10.9 unfused; at 32 rows (64, 8, 8, 1) led, 8.2 µs)
Q_KV_CONFIG = (128, 4, 8, 1)


def q_kv_absorb_unmet(part, W_UK_T, R: int) -> str | None:
    """None when q_kv_absorb_kernel runs a decode_q_kv_absorb call, else the unmet
    condition (mla::decode_q_kv_rope and the absorbed GEMM then run)."""
    N, P, L = W_UK_T.shape
    T = part[0].numel() // max(1, part.shape[-1])
    rows = decode_rows_unmet(part.device, W_UK_T.dtype, T)
    if rows is not None:
        return rows
    if not (_pow2(P) and _pow2(R // 2)):
        return f"P={P} and R/2={R // 2} must be powers of two >= 16"
    if L < 16 or L % (_fit(Q_KV_CONFIG[0], L) * _l_split(L)):
        return f"L={L} must be >= 16 and a multiple of 16"
    if not W_UK_T.is_contiguous():
        return "W_UK_T must be contiguous"
    return None


@torch.library.triton_op("mla::decode_q_kv_absorb", mutates_args={})
def decode_q_kv_absorb(part: torch.Tensor, w_kv: torch.Tensor, W_UK_T: torch.Tensor,
                       cos: torch.Tensor, sin: torch.Tensor, eps_kv: float,
                       num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    from lowering.fused.prologue import _check_v2
    NQ, L, R = _check_v2(part, w_kv, cos, sin, num_heads)
    N, P = num_heads, NQ // num_heads - R
    if (W_UK_T.dim() != 3 or tuple(W_UK_T.shape) != (N, P, L) or W_UK_T.dtype != w_kv.dtype
            or W_UK_T.device != part.device):
        raise ValueError(f"W_UK_T must be [num_heads={N}, P={P}, L={L}] of w_kv's dtype on "
                         f"{part.device}, got {W_UK_T.dtype} {tuple(W_UK_T.shape)} on "
                         f"{W_UK_T.device}")
    lead = part.shape[1:-1]
    T = part[0].numel() // part.shape[-1]
    if q_kv_absorb_unmet(part, W_UK_T, R) is not None:
        q, kv_row = torch.ops.mla.decode_q_kv_rope(part, w_kv, cos, sin, eps_kv, num_heads)
        return absorb_query(q.reshape(T, N, P + R), W_UK_T), kv_row        # [T, N, L + R]
    p = part.reshape(part.shape[0], T, part.shape[-1]).contiguous()       # [S, T, NQ+L+R]
    c, s = angle_rows(cos, sin, T, torch.float32)                          # [T, R / 2] fp32
    y = torch.empty((T, N, L + R), dtype=w_kv.dtype, device=part.device)
    kv_out = torch.empty((T, L + R), dtype=w_kv.dtype, device=part.device)
    launch_q_kv(p, w_kv, W_UK_T, c, s, float(eps_kv), y, kv_out)
    return y, kv_out.view(*lead, L + R)


def launch_q_kv(part, w_kv, W_UK_T, cos, sin, eps_kv: float, y, kv_out,
                config=None) -> None:
    """Run q_kv_absorb_kernel: part [S, T, N (P + R) + L + R] fp32 contiguous, W_UK_T
    [N, P, L] contiguous, cos / sin [T, R / 2] fp32 (equal strides), y [T, N, L + R] and
    kv_out [T, L + R] contiguous in W_UK_T's dtype. config: (BLOCK_L, L_SPLIT, num_warps,
    num_stages), Q_KV_CONFIG by default (both fitted to L)."""
    S, T, _ = part.shape
    N, P, L = W_UK_T.shape
    R = y.shape[-1] - L
    config = config or Q_KV_CONFIG
    _, _, warps, stages = config
    block_t = max(16, triton.next_power_of_2(min(T, MAX_ROWS)))
    block_l, split = _fit(config[0], L), _l_split(L, config)
    kernel = torch.library.wrap_triton(q_kv_absorb_kernel)
    kernel[(N * split + block_t, triton.cdiv(T, block_t))](
        part, w_kv, W_UK_T, cos, sin, y, kv_out, T, N, part.stride(0), cos.stride(0),
        cos.stride(1), eps_kv, P=P, R=R, L=L, SPLIT=S, BLOCK_T=block_t,
        BLOCK_L=block_l, BLOCK_LK=triton.next_power_of_2(L),
        BLOCK_H=triton.next_power_of_2(R // 2), ROPE=2, DOT_F32=not part.is_cuda,
        L_SPLIT=split, num_warps=warps, num_stages=stages)


def _l_split(L: int, config=Q_KV_CONFIG) -> int:
    """config's L_SPLIT, lowered until the split parts are whole BLOCK_L blocks."""
    block, split = _fit(config[0], L), config[1]
    while split > 1 and L % (block * split):
        split //= 2
    return split
