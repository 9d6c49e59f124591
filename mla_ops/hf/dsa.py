"""DeepSeek Sparse Attention (DSA) over the paged cache: the lightning indexer's keys, one
row per cache slot beside the latent rows, and its top-k selection as cache slots.

HF's DeepseekV32Indexer (transformers' modeling_deepseek_v32.py), for a token at position
p of its sequence, with the layer's input x and q_resid = q_a_layernorm(q_a_proj(x)):

    q = RoPE(wq_b(q_resid))            [Hi, Di]  (RoPE on the first R dims, half-split)
    k = RoPE(k_norm(wk(x)))            [Di]      cached per token
    w = weights_proj(x) * Hi^-0.5      [Hi]      fp32
    score(j) = sum_h w_h * relu(Di^-0.5 * q_h . k_j)         for j <= p (the causal prefix)

and the attention of that token reads the top-k positions by score (all of them where the
prefix holds at most k tokens). The same numbers here, in the same torch ops, over the
paged rows of the row's sequence: positions past a token's prefix (or not yet written)
score -inf and are not selected; a selected position becomes its cache slot
(block_table[b, j // block_size] * block_size + j % block_size), -1 where fewer than k
tokens qualify. The slot lists feed mla::sparse_decode (lowering/decode/sparse.py).
The scores come from the same math in torch ops over the gathered keys, or from
a Triton kernel that reads each key once straight through the block table
(mla::indexer_scores, lowering/decode/indexer.py): select_slots' default route on CUDA.
"""
from __future__ import annotations

import torch

from lowering.decode.indexer import indexer_scores_op, indexer_scores_reference, indexer_unmet
from mla_ops.cache import mark_static


def index_key_pool(config, layers, num_blocks: int, block_size: int, dtype,
                   device) -> list | None:
    """Per MLA layer (model layer indices `layers`) [num_blocks, block_size, index_head_dim]
    zeros, for a config with a DSA indexer (index_topk and index_head_dim set); None for
    other configs. A layer without an indexer of its own (config.indexer_types "shared":
    GLM-5) gets None."""
    dim, topk = getattr(config, "index_head_dim", None), getattr(config, "index_topk", None)
    if not dim or not topk:
        return None
    kinds = getattr(config, "indexer_types", None) or ["full"] * config.num_hidden_layers
    pool = [None if kinds[i] == "shared" else
            torch.zeros(num_blocks, block_size, dim, dtype=dtype, device=device)
            for i in layers]
    if not torch.compiler.is_compiling():
        for t in pool:
            if t is not None:
                mark_static(t)
    return pool


def indexer_qkw(indexer, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, rope):
    """HF's indexer projections: (q [B, S, Hi, Di], k [B, S, Di], weights [B, S, Hi] fp32)
    for x [B, S, hidden] and q_resid [B, S, q_lora]; rope is HF's apply_rotary_pos_emb."""
    B, S, _ = x.shape
    Hi, Di, R = indexer.n_heads, indexer.head_dim, indexer.qk_rope_head_dim
    q = indexer.wq_b(q_resid).view(B, S, Hi, Di)                            # [B, S, Hi, Di]
    q_rot, q_pass = torch.split(q, [R, Di - R], dim=-1)
    k = indexer.k_norm(indexer.wk(x)).unsqueeze(2)                          # [B, S, 1, Di]
    k_rot, k_pass = torch.split(k, [R, Di - R], dim=-1)
    q_rot, k_rot = rope(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1)                                  # [B, S, Hi, Di]
    k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)                       # [B, S, Di]
    w = indexer.weights_proj(x.to(indexer.weights_proj.weight.dtype)).float() * Hi ** -0.5
    return q, k, w                                                          # w [B, S, Hi]


def write_index_keys(pool: torch.Tensor, k: torch.Tensor, slots: torch.Tensor,
                     k_scale: torch.Tensor) -> torch.Tensor:
    """k [T, Di] into pool [num_blocks, block_size, Di] at slots [T] (-1: not written),
    through the cache-write op (any row width: the row is passed as two halves)."""
    h = k.shape[-1] // 2
    return torch.ops.mla.kv_cache_update(k[:, :h], k[:, h:], pool, slots, "auto", k_scale)


# Scores of at most this many fp32 values at once: a step's query tokens are scored in
# chunks of c (HF scores all S at once: [B, S, Hi, T]); the torch path holds the per-head
# scores [B, c, Hi, n], the kernel the summed ones [B, c, n].
SCORE_ELEMENTS = 1 << 28
INDEXER_BACKENDS = ("auto", "triton", "torch")


def indexer_route(q: torch.Tensor, w: torch.Tensor, pool: torch.Tensor, backend: str) -> str:
    """"triton" (lowering/decode/indexer.py's kernel) or "torch" for select_slots.
    "triton" must serve (CPU: the interpreter); "auto" takes the kernel on CUDA where
    indexer_unmet is None (it picks the torch path's slots except at near-ties, where the
    summation order may decide), the torch path elsewhere."""
    if backend not in INDEXER_BACKENDS:
        raise ValueError(f"backend must be one of {INDEXER_BACKENDS}, got {backend!r}")
    if backend == "torch":
        return "torch"
    why = indexer_unmet(q, w, pool)
    if backend == "auto":
        return "triton" if q.device.type == "cuda" and why is None else "torch"
    if why is not None:
        raise ValueError(f"backend='triton' cannot serve this call: {why}")
    return "triton"


def select_slots(q: torch.Tensor, w: torch.Tensor, pool: torch.Tensor,
                 block_table: torch.Tensor, seq_lens: torch.Tensor, lens_new: torch.Tensor,
                 topk: int, scale: float, backend: str = "auto") -> torch.Tensor:
    """The indexer's top-k cache slots [B * S, K] int32 (-1: none), K = min(topk, M * bs).

    q [B, S, Hi, Di] (token i of row b at position seq_lens[b] - S + i, the step's
    layout), w [B, S, Hi] fp32, pool [num_blocks, bs, Di] holding the step's keys already,
    block_table [B, M] int32 (-1: no block, its positions never selected), seq_lens [B]
    (this step's tokens included, trailing pads too), lens_new [B] real tokens per row
    after the step (keys past it were not written). backend: see indexer_route.
    """
    B, S, Hi, Di = q.shape
    bs = pool.shape[1]
    n = block_table.shape[1] * bs                                           # key positions
    route = indexer_route(q, w, pool, backend)
    scores = indexer_scores_op if route == "triton" else indexer_scores_reference
    table = block_table.long()                                              # [B, M]
    pos = seq_lens.long()[:, None] - S + torch.arange(S, device=q.device)   # [B, S]
    limit = torch.minimum(pos, lens_new.long()[:, None] - 1)                # [B, S]
    k = min(topk, n)
    per_token = B * n * (1 if route == "triton" else Hi)
    c = max(1, min(S, SCORE_ELEMENTS // max(1, per_token)))                 # tokens a chunk
    out = []
    for i in range(0, S, c):
        # HF: relu(q . k * scale), the heads summed with weights; -inf past the prefix
        index = scores(q[:, i:i + c], w[:, i:i + c], pool, block_table,
                       limit[:, i:i + c], scale)                                # [B, c, n]
        best, at = index.topk(k, dim=-1)                                        # [B, c, k]
        slot = table.gather(1, (at // bs).reshape(B, -1)).reshape(at.shape) * bs + at % bs
        out.append(torch.where(best > float("-inf"), slot, -1))
    slot = out[0] if len(out) == 1 else torch.cat(out, dim=1)                   # [B, S, k]
    return slot.reshape(B * S, k).to(torch.int32)
