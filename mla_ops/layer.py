"""The MLA attention layer: weight absorption once, then the two custom ops per step.

Given the model's post-RoPE q [T, N, P+R], kv_c_normed [T, L] and k_pe [T, 1, R],
it writes the latents to the paged cache (mla::kv_cache_update) and computes
attention into a preallocated [T, N*V] output (mla::attention_with_output):
decode rows as absorbed MQA over the 576-wide latent, prefill rows as MHA.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from lowering.decode.flashmla import FP8Schedule

from mla_ops import no_backward, ops, quant_ops  # noqa: F401  (register torch.ops.mla.*)
from mla_ops.attention import build_decode_query
from mla_ops.metadata import MLAMetadata
from mla_ops.quant import FP8, dequantize_block_fp8


def yarn_mscale(factor: float, mscale_all_dim: float) -> float:
    """YaRN's attention magnitude correction: 0.1 * m * ln(factor) + 1 (1 when factor <= 1)."""
    if factor <= 1 or not mscale_all_dim:
        return 1.0
    return 0.1 * mscale_all_dim * math.log(factor) + 1.0


def mla_softmax_scale(qk_head_dim: int, rope_scaling: dict | None = None) -> float:
    """The model's scale: (P+R)^-0.5, times mscale^2 under YaRN. Never (L+R)^-0.5."""
    scale = qk_head_dim ** -0.5
    if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) == "yarn":
        m = yarn_mscale(float(rope_scaling.get("factor", 1.0)),
                        float(rope_scaling.get("mscale_all_dim", 0) or 0))
        scale = scale * m * m
    return scale


def split_kv_b_proj(weight: torch.Tensor, num_heads: int, qk_nope_head_dim: int, v_head_dim: int,
                    *, weight_scale_inv: torch.Tensor | None = None, dtype=None):
    """kv_b_proj weight [N*(P+V), L] -> W_UK_T [N, P, L], W_UV [N, L, V].

    An fp8 block-quantized weight is dequantized first (weight_scale_inv, 128x128 blocks).
    """
    if weight.dtype == FP8:
        if weight_scale_inv is None:
            raise ValueError("kv_b_proj weight is fp8: pass weight_scale_inv to dequantize it")
        weight = dequantize_block_fp8(weight, weight_scale_inv, dtype=dtype or torch.bfloat16)
    N, P, V = num_heads, qk_nope_head_dim, v_head_dim
    if weight.dim() != 2 or weight.shape[0] != N * (P + V):
        raise ValueError(f"kv_b_proj weight must be [N*(P+V)={N * (P + V)}, L], got {tuple(weight.shape)}")
    L = weight.shape[1]
    w = weight.detach().t().reshape(L, N, P + V)                        # [L, N, P + V]
    W_UK, W_UV = w.split([P, V], dim=-1)                                # [L, N, P], [L, N, V]
    dtype = dtype or weight.dtype
    return (W_UK.permute(1, 2, 0).contiguous().to(dtype),              # [N, P, L]
            W_UV.transpose(0, 1).contiguous().to(dtype))               # [N, L, V]


class MLAAttention(nn.Module):
    """Attention over the paged latent cache for one layer (holds W_UK_T and W_UV only)."""

    def __init__(self, num_heads: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
                 v_head_dim: int, kv_lora_rank: int, softmax_scale: float, *,
                 kv_cache_dtype: str = "auto", workspace_rows: int = 8192, backend: str = "auto"):
        super().__init__()
        self.num_heads = num_heads
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.kv_lora_rank = kv_lora_rank
        self.softmax_scale = float(softmax_scale)
        self.kv_cache_dtype = kv_cache_dtype
        self.workspace_rows = workspace_rows
        self.backend = backend
        self.register_buffer("W_UK_T", None, persistent=False)
        self.register_buffer("W_UV", None, persistent=False)
        self.register_buffer("q_scale", None, persistent=False)

    def enable_fp8_decode_query(self, q_scale: float | torch.Tensor = 1.0) -> None:
        """Build the 576-wide decode query in the layer and quantize it to fp8 (static
        per-tensor q_scale) for fp8 x fp8 decode; forward then needs an fp8 cache.

        The absorption, the cat with q_pe and the quant are then graph ops (Pass A
        fuses cat + quant); the attention op receives them as decode_q / decode_q_scale.
        """
        s = torch.as_tensor(q_scale, dtype=torch.float32).reshape(1)
        if not s.item() > 0:
            raise ValueError(f"q_scale must be positive, got {s.item()}")
        self.q_scale = s.to(self.W_UK_T.device) if self.W_UK_T is not None else s

    def absorb(self, kv_b_weight: torch.Tensor, *, weight_scale_inv=None, dtype=None) -> None:
        """Split kv_b_proj into the absorbed weights (call once after loading)."""
        W_UK_T, W_UV = split_kv_b_proj(kv_b_weight, self.num_heads, self.qk_nope_head_dim,
                                       self.v_head_dim, weight_scale_inv=weight_scale_inv,
                                       dtype=dtype)
        if W_UK_T.shape[-1] != self.kv_lora_rank:
            raise ValueError(f"kv_b_proj input width {W_UK_T.shape[-1]} != kv_lora_rank {self.kv_lora_rank}")
        self.W_UK_T, self.W_UV = W_UK_T, W_UV

    def forward(self, q: torch.Tensor | None, kv_c_normed: torch.Tensor, k_pe: torch.Tensor,
                kv_cache: torch.Tensor, k_scale: torch.Tensor, meta: MLAMetadata,
                kv_cache_dtype: str | None = None,
                decode_q: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, N, P+R], kv_c_normed [T, L], k_pe [T, 1, R] -> [T, N * V].

        kv_cache_dtype (default: the layer's) says how kv_cache stores rows: "auto"|"fp8".
        decode_q: the absorbed query of the decode rows [nd, N, L+R] in q's dtype, when the
        caller built it (mla::decode_q_absorb); q's decode rows are then not read, and q
        may be None when every row is a decode row. With enable_fp8_decode_query, decode_q
        is the query quantized with the layer's q_scale (mla::decode_q_absorb_fp8).
        """
        if self.W_UK_T is None:
            raise RuntimeError("call absorb(kv_b_proj.weight) before forward")
        kind = self.kv_cache_dtype if kv_cache_dtype is None else kv_cache_dtype
        fp8_given = decode_q is not None and decode_q.dtype == FP8
        if decode_q is not None and self.q_scale is not None and not fp8_given:
            raise ValueError("pass a 16-bit decode_q or enable_fp8_decode_query, not both (with "
                             "an fp8 query, decode_q is float8_e4m3fn quantized with q_scale)")
        if fp8_given and self.q_scale is None:
            raise ValueError("an fp8 decode_q needs enable_fp8_decode_query(q_scale): the "
                             "scale it was quantized with")
        if self.q_scale is not None and kind == "auto":
            raise ValueError("an fp8 decode query (enable_fp8_decode_query) needs an fp8 KV "
                             "cache: kv_cache_dtype='fp8'")
        T = kv_c_normed.shape[0]
        if q is None:
            if decode_q is None or decode_q.shape[0] != T:
                raise ValueError("q may be None only when decode_q holds every row's query")
            # the op reads q's decode rows only without decode_q: a view of decode_q stands
            # in for their shape and dtype (no copy, no kernel); for an fp8 one, an
            # unwritten buffer in the activations' dtype
            PR = self.qk_nope_head_dim + self.qk_rope_head_dim
            q = (kv_c_normed.new_empty((T, self.num_heads, PR)) if fp8_given
                 else decode_q[..., :PR])
        dep = torch.ops.mla.kv_cache_update(kv_c_normed, k_pe, kv_cache, meta.slot_mapping,
                                            kind, k_scale)                  # [0]
        out = q.new_empty(T, self.num_heads * self.v_head_dim)              # [T, N * V]
        decode_q_scale = None
        nd = meta.num_decode_tokens
        if self.q_scale is not None and nd > 0:
            if decode_q is None:
                q_mqa = build_decode_query(q[:nd], self.W_UK_T)            # [nd, N, L + R]
                decode_q = torch.ops.mla.quant_fp8_static(q_mqa, self.q_scale)
            decode_q_scale = self.q_scale
        # FlashMLA's 16-bit and fp8 kernels have schedules of their own: pass the kind
        # this layer's query runs on (the op cannot tell them apart), else none
        sched = meta.decode_schedule
        if sched is not None and isinstance(sched, FP8Schedule) != (decode_q_scale is not None):
            sched = None
        torch.ops.mla.attention_with_output(
            q, kv_c_normed, k_pe, kv_cache, self.W_UK_T, self.W_UV, meta.block_table,
            meta.seq_lens, meta.query_start_loc, meta.num_decode_tokens, self.softmax_scale,
            kind, k_scale, dep, out, None, None, self.workspace_rows, self.backend,
            decode_q, decode_q_scale, *(sched if sched is not None else (None, None)),
            meta.prefill_shape)
        return no_backward.guard(out, q, kv_c_normed, k_pe)   # autograd: a clear error
