"""The DeepSeek-V3.2 adapter of convert(): DeepseekV32Attention's converted forward.

V3.2's attention is V3's MLA (q_lora, interleaved RoPE on q_pe / k_pe, the same absorbed
weights) plus DeepSeek Sparse Attention: a lightning indexer (mla_ops/hf/dsa.py) picks
each query token's top index_topk tokens of its causal prefix, and HF's attention masks
every other key. Here, on a PagedMLACache:

  - the latent rows go to the paged cache as for V3, and the indexer's keys to the
    cache's side pool (cache.index_keys[layer]: same block table and slots), in the
    same step;
  - where no sequence can hold more than index_topk tokens (the cache's max length) or,
    for a step of several tokens in eager mode, where HF's padded length is at most
    index_topk, the selection is every token of the prefix: the V3 path runs (dense);
  - otherwise the indexer's slot lists [T, K] feed mla::sparse_decode
    (lowering/decode/sparse.py): MQA over the selected latent rows with the absorbed
    query [q_nope @ W_UK_T | q_pe], for decode and prefill rows alike, then @ W_UV.
    A decode step always takes this branch (static shapes: K fixed), so it compiles
    to one graph and captures in DecodeGraph.

The projections are HF's own modules (q_a + kv_a as one decode GEMM op, as for V3).

A.X K2 (axk2): the row's query gives the query and an output gate from one projection,
its output_gate applies that gate before o_proj.

GLM-5 (glm_moe_dsa; the family row's index_rope_fn and shares_topk): the indexer's RoPE is
interleaved, and a layer without an indexer (config.indexer_types "shared") reads the
previous layer's selection, which HF's decoder layers hand on as the attention's third
output (prev_topk_indices). Here that output is the step's slot lists [T, K] (every layer
reads the same block table, so a slot list holds for the next layer as is), None where
the step runs dense.
"""
from __future__ import annotations

import torch

from mla_ops.attention import build_decode_query
from mla_ops.hf.cache import PagedMLACache
from mla_ops.hf.fallback import paged_or_hf
from mla_ops.hf.dsa import indexer_qkw, select_slots, write_index_keys
from mla_ops.hf.linear import linear, linear_pair, linear_residual_norm
from mla_ops.layer import MLAAttention
import lowering.decode.sparse  # noqa: F401  (registers mla::sparse_decode)


def selects(cache: PagedMLACache, S: int, topk: int) -> bool:
    """Whether this step's attention must read the indexer's selection (else: dense)."""
    if cache.max_blocks * cache.block_size <= topk:      # no prefix can exceed top-k
        return False
    if S == 1 or torch.compiler.is_compiling():
        return True
    return int(cache.seen) + S > topk                    # HF's key count (a host read)


def sparse_attention(mla: MLAAttention, q, kv_c, k_pe, kv_cache, k_scale, kind: str,
                     slot_mapping, slots) -> torch.Tensor:
    """q [T, N, P+R] over the cache rows at slots [T, K] -> [T, N*V]; this step's latent
    rows are written first."""
    torch.ops.mla.kv_cache_update(kv_c, k_pe, kv_cache, slot_mapping, kind, k_scale)
    q_abs = build_decode_query(q, mla.W_UK_T)                              # [T, N, L+R]
    o, _ = torch.ops.mla.sparse_decode(q_abs, kv_cache, slots, mla.softmax_scale, kind,
                                       k_scale, mla.kv_lora_rank, "auto")  # [T, N, L]
    out = torch.bmm(o.transpose(0, 1), mla.W_UV)                           # [N, T, V]
    return out.transpose(0, 1).reshape(q.shape[0], -1)                     # [T, N*V]


def v32_forward(self, hidden_states, position_embeddings=None, attention_mask=None,
                past_key_values=None, **kwargs):
    """Converted DeepseekV32Attention.forward: hidden_states [B, S, H] -> ([B, S, H], None);
    with mla_residual [B, S, H] (a converted decoder layer) the output is mla_residual +
    o_proj(...), and with mla_post_norm the pair (that, its norm) as in convert.py's
    _paged_forward. Caches other than PagedMLACache run HF's forward."""
    post_norm = kwargs.pop("mla_post_norm", None)
    kwargs.pop("mla_x_quant", None)           # (its fp8 q_a + kv_a quantize their input)
    residual, cache, hf_result = paged_or_hf(self, hidden_states, position_embeddings,
                                             attention_mask, past_key_values, kwargs)
    if hf_result is not None:
        return hf_result
    if cache.index_keys is None:
        raise ValueError("this PagedMLACache has no pool for the indexer's keys: build it "
                         "from the DeepSeek-V3.2 model's config (one with index_topk)")
    mla: MLAAttention = self.mla_attn
    B, S, _ = hidden_states.shape
    N, P, R, L = mla.num_heads, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.kv_lora_rank
    T = B * S
    indexer = self.indexer                          # None: a GLM-5 "shared" layer
    topk = indexer.index_topk if indexer is not None else self.config.index_topk
    sparse = selects(cache, S, topk)                # the same for every layer
    # (a sparse step reads no FlashMLA schedule: the plan then computes none)
    step = cache.prepare(self.layer_idx, B, S, attention_mask, hidden_states.dtype,
                         hidden_states.device, backend="triton" if sparse else mla.backend)
    cos, sin = position_embeddings                                           # [B, S, R]
    q_a, kv = linear_pair(self.q_a_proj, self.kv_a_proj_with_mqa, hidden_states)
    q_resid = self.q_a_layernorm(q_a)                                        # [B, S, q_lora]
    gate = None
    if self.mla_query is None:
        q = linear(self.q_b_proj, q_resid)
    else:                                         # A.X K2: the query and an output gate
        q, gate = self.mla_query(q_a, q_resid)
    q = q.view(B, S, N, P + R)                                               # [B, S, N, P+R]
    kv_c, k_rot = torch.split(kv, [L, R], dim=-1)                            # kv [B, S, L+R]
    kv_c = self.kv_a_layernorm(kv_c)                                         # [B, S, L]
    q_rot, k_rot = self._mla_rope_interleave(q[..., P:].transpose(1, 2),
                                             k_rot.reshape(B, 1, S, R), cos, sin)
    q[..., P:] = q_rot.transpose(1, 2)
    kv_row = torch.cat((kv_c.reshape(T, L), k_rot.reshape(T, R)), dim=-1)    # [T, L+R]
    q = q.reshape(T, N, P + R)
    meta, kv_cache, slots = step.meta, cache.kv(self.layer_idx), None
    if indexer is not None:
        iq, ik, iw = indexer_qkw(indexer, hidden_states, q_resid, cos, sin, self._mla_index_rope)
        ik, iq, iw = ik.reshape(T, -1), iq.reshape(T, *iq.shape[2:]), iw.reshape(T, -1)
        if step.perm is not None:                                 # real tokens of a row first
            q, kv_row, ik, iq, iw = (t[step.perm] for t in (q, kv_row, ik, iq, iw))
        pool = cache.index_key(self.layer_idx)
        write_index_keys(pool, ik, meta.slot_mapping, cache.k_scale)
        if sparse:
            slots = select_slots(iq.view(B, S, *iq.shape[1:]), iw.view(B, S, -1), pool,
                                 meta.block_table, meta.seq_lens, step.lens_new,
                                 topk, indexer.softmax_scale)                   # [T, K]
    else:
        if step.perm is not None:
            q, kv_row = q[step.perm], kv_row[step.perm]
        slots = kwargs.get("prev_topk_indices") if sparse else None
        if sparse and slots is None:
            raise ValueError(f"layer {self.layer_idx} reuses the previous layer's top-k "
                             f"(config.indexer_types 'shared') but got none: the layer "
                             f"before it must be a converted attention on the same cache")
    kv_c, k_pe = kv_row[:, :L], kv_row[:, None, L:]                          # [T, L], [T, 1, R]
    if sparse:
        out = sparse_attention(mla, q, kv_c, k_pe, kv_cache, cache.k_scale,
                               cache.kv_cache_dtype, meta.slot_mapping, slots)
    else:
        out = mla(q, kv_c, k_pe, kv_cache, cache.k_scale, meta,
                  kv_cache_dtype=cache.kv_cache_dtype)                       # [T, N*V]
    cache.layer_done(self.layer_idx, B, S)
    if step.inv is not None:
        out = out[step.inv]
    out = out.view(B, S, -1)
    if self.mla_output_gate is not None:
        out = self.mla_output_gate(hidden_states, out, gate)
    out = (linear(self.o_proj, out, residual) if post_norm is None
           else linear_residual_norm(self.o_proj, out, residual, post_norm))
    return (out, None, slots) if self.mla_shares_topk else (out, None)
