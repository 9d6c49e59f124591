"""Dense (padded) attention of prefill, with its log-sum-exp: the registered op and its routes.

    mla::prefill_dense_attention(q [B, N, Sq, D], k [B, N, Sk, D], v [B, N, Sk, V],
                                 key_lens [B] | None, scale, causal, route)
        -> out [B, Sq, N, V] (q dtype), lse [B, N, Sq] fp32 (natural log)

q, k, v may be strided views (e.g. [B, S, N, D].transpose(1, 2)); the last dim must be
contiguous. causal: query i sees keys j <= i (top-left aligned: the ragged layout puts
each request's tokens first, so a real query never sees a pad key). key_lens: keys
j >= key_lens[b] are hidden from every query of batch b (the context chunks of
requests with different context lengths); a row that sees no key gets lse -inf (its
out is undefined and must be weighted 0, which merge_attn_states does).

Routes, chosen by capability like the decode entry (ROUTES, in order for "auto"):
    cudnn      torch's cuDNN SDPA (aten._scaled_dot_product_cudnn_attention, which returns
               the LSE): the fastest kernel for q/k 192 with v 128 on Hopper (612 / 562 /
               570 / 529 TFLOP/s at (B, H, S) = (1,128,8192) / (8,128,2048) / (1,16,8192)
               / (8,16,2048) on an H200). Key padding is an additive bias of a large
               finite negative (not -inf: a row of pad keys only must stay finite).
    reference  torch in float32, queries chunked so one score block holds at most
               SCORE_BUDGET elements; any device and dtype (the CPU route).
An explicit route that cannot serve the call raises a ValueError naming why.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

ROUTES = ("auto", "cudnn", "reference")
MIN_CUDNN_VERSION = 90100          # cuDNN SDPA with q/k and v of different head sizes
CUDNN_DTYPES = (torch.bfloat16, torch.float16)
SCORE_BUDGET = 1 << 26             # fp32 elements of one reference score block (256 MiB)


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple:
    return torch.cuda.get_device_capability(index)


def cudnn_unmet(q: torch.Tensor, v: torch.Tensor) -> Optional[str]:
    """Why the cuDNN route cannot serve (q, v), or None when it can."""
    if not hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention"):
        return "this torch has no aten._scaled_dot_product_cudnn_attention"
    if not q.is_cuda:
        return f"q is on {q.device}, the cuDNN route needs CUDA"
    if q.dtype not in CUDNN_DTYPES:
        return f"q is {q.dtype}, the cuDNN route needs bfloat16 or float16"
    if not torch.backends.cudnn.is_available():
        return "cuDNN is not available"
    if (torch.backends.cudnn.version() or 0) < MIN_CUDNN_VERSION:
        return f"cuDNN {torch.backends.cudnn.version()} < {MIN_CUDNN_VERSION}"
    if _capability(q.device.index if q.device.index is not None else
                   torch.cuda.current_device()) < (8, 0):
        return "the cuDNN route needs compute capability >= 8.0"
    D, V = q.shape[-1], v.shape[-1]
    if D > 256 or V > 256 or D % 8 or V % 8:
        return f"head sizes q/k {D}, v {V} must be multiples of 8 and at most 256"
    return None


def unmet(route: str, q: torch.Tensor, v: torch.Tensor) -> Optional[str]:
    if route == "cudnn":
        return cudnn_unmet(q, v)
    if route == "reference":
        return None
    return f"route must be one of {ROUTES}, got {route!r}"


def select_route(route: str, q: torch.Tensor, v: torch.Tensor) -> str:
    """The route that runs: the first of ROUTES[1:] that serves for "auto"."""
    if route == "auto":
        return next(r for r in ROUTES[1:] if unmet(r, q, v) is None)
    why = unmet(route, q, v)
    if why is not None:
        raise ValueError(f"prefill attention route {route!r} cannot serve this call: {why}")
    return route


def key_bias(key_lens: torch.Tensor, Sk: int, dtype) -> torch.Tensor:
    """[B] lengths -> additive bias [B, 1, 1, Sk]: 0 for a key, a large negative past it.
    Rows are allocated 8 elements aligned (16 bytes), as the fused kernels want them."""
    pad = -(-Sk // 8) * 8
    hidden = torch.arange(pad, device=key_lens.device)[None, :] >= key_lens[:, None].long()
    neg = torch.finfo(dtype).min / 2
    return torch.where(hidden, neg, 0.0).to(dtype)[:, None, None, :Sk]


def cudnn_dense(q, k, v, key_lens, scale: float, causal: bool):
    B, N, Sq, _ = q.shape
    bias = None
    if key_lens is not None:       # broadcast over heads and queries (stride 0), as SDPA does
        bias = key_bias(key_lens, k.shape[2], q.dtype).expand(B, 1, Sq, k.shape[2])
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, bias, True, 0.0, causal, False, scale=scale)
    out, lse = res[0], res[1]                                    # [B, N, Sq, V], [B, N, Sq(, 1)]
    return out.transpose(1, 2), lse.reshape(B, N, Sq).float()


def reference_dense(q, k, v, key_lens, scale: float, causal: bool):
    B, N, Sq, _ = q.shape
    Sk, V = k.shape[2], v.shape[-1]
    kf = k.float().transpose(-1, -2)                             # [B, N, D, Sk]
    vf = v.float()                                               # [B, N, Sk, V]
    out = torch.empty(B, Sq, N, V, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, N, Sq, dtype=torch.float32, device=q.device)
    keys = torch.arange(Sk, device=q.device)
    step = max(1, SCORE_BUDGET // max(1, B * N * Sk))
    for q0 in range(0, Sq, step):
        q1 = min(q0 + step, Sq)
        s = torch.matmul(q[:, :, q0:q1].float(), kf) * scale    # [B, N, s, Sk]
        if key_lens is not None:
            hidden = keys[None, :] >= key_lens[:, None].long()   # [B, Sk]
            s = s.masked_fill(hidden[:, None, None, :], float("-inf"))
        if causal:
            later = keys[None, :] > torch.arange(q0, q1, device=q.device)[:, None]  # [s, Sk]
            s = s.masked_fill(later, float("-inf"))
        l = torch.logsumexp(s, dim=-1)                           # [B, N, s]
        p = torch.exp(s - l[..., None]).nan_to_num(0.0)
        out[:, q0:q1] = torch.matmul(p, vf).transpose(1, 2).to(q.dtype)
        lse[:, :, q0:q1] = l
    return out, lse


@torch.library.custom_op("mla::prefill_dense_attention", mutates_args=())
def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    key_lens: Optional[torch.Tensor], scale: float, causal: bool,
                    route: str) -> tuple[torch.Tensor, torch.Tensor]:
    """See the module docstring: -> out [B, Sq, N, V] (q dtype), lse [B, N, Sq] fp32."""
    chosen = select_route(route, q, v)
    run = cudnn_dense if chosen == "cudnn" else reference_dense
    out, lse = run(q, k, v, key_lens, scale, causal)
    if key_lens is not None:         # rows that saw no key: weight 0 when merged
        lse = lse.masked_fill((key_lens <= 0)[:, None, None], float("-inf"))
    return out.contiguous(), lse.contiguous()


@dense_attention.register_fake
def _(q, k, v, key_lens, scale, causal, route):
    B, N, Sq, _ = q.shape
    return (q.new_empty(B, Sq, N, v.shape[-1]),
            q.new_empty(B, N, Sq, dtype=torch.float32))
