"""Decode kernels behind one entry with FlashMLA's contract.

    mla_decode(q [B, s_q, H, L+R], kv_cache [num_blocks, block_size, L+R],
               block_table [B, max_blocks] int32, cache_seqlens [B] int32,
               softmax_scale, *, causal=True, kv_cache_dtype="auto",
               k_scale=None, backend="auto", head_dim_v=None, schedule=None, bounded=False,
               validate=None)
        -> (out [B, s_q, H, L], lse [B, H, s_q] float32, natural log)

    decode_schedule(kv_cache, block_table, cache_seqlens, num_heads=H, fp8q=False) -> schedule
        FlashMLA's per-step work split, computed once and shared by every layer's call
        (uses_flashmla() says whether the calls will read it); fp8q=True: the split of
        FlashMLA's fp8 kernel, for mla_decode_fp8q.

    mla_decode_fp8q(q8, kv_cache8, block_table, cache_seqlens, softmax_scale, *, q_scale,
                    k_scale, causal=True, head_dim_v=None, out_dtype=bf16, backend="auto",
                    schedule=None, bounded=False, validate=None)
        fp8 e4m3 query and cache (true values = stored * scale), fp8 tensor-core dots:
        on Hopper FlashMLA's dense fp8 kernel or our Gluon kernel where one serves the
        call, else the Triton kernel.

    bound_decode_inputs(kv_cache, block_table, cache_seqlens) -> (block_table, cache_seqlens)
        Clamped to what a kernel may read. Every call bounds its inputs unless its
        route's kernels do so in-kernel (triton, gluon); a caller that bounds once per
        step passes mla_decode(..., bounded=True) and the calls skip it.

With s_q > 1 and causal, query i sees cache positions [0, cache_seqlens - s_q + i].

Routes (registry.py): one table for both entries, each route with a priority and an
unmet(call, auto) -> None | reason. backend="auto" takes the first route of the entry's
query kind that serves the call (mla_decode: flashmla, gluon, triton, reference =
BACKENDS, flashmla below 64 heads only past SMALL_DECODE_POSITIONS positions a call, from
64 heads only past FEW_REQUESTS requests where gluon serves; mla_decode_fp8q: flashmla,
gluon, triton = FP8Q_BACKENDS; in the batch-invariant mode, lowering.config.batch_invariant,
the Triton kernels); an explicit backend that cannot serve a call raises
BackendUnavailable naming the unmet condition. Eager calls are counted per route in
`backend_choices`.

Checks (lowering.checks): shapes, dtypes and devices always; the values (lengths and
block ids in range) of CPU inputs always, of CUDA inputs with validate=True or
lowering.config.validate (MLA_VALIDATE=1), as they cost a device->host sync.
"""
from lowering.decode.entry import (BACKENDS, FP8Q_BACKENDS, BackendUnavailable,  # noqa: F401
                                   backend_choices, bound_decode_inputs, decode_schedule,
                                   flashmla_pays, mla_decode, mla_decode_fp8q, record_choice,
                                   select_backend, uses_flashmla)
