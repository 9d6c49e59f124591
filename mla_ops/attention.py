"""Implementation of mla::attention_with_output.

Tokens [0, num_decode_tokens) are decode rows: absorbed MQA over the latent
cache, one row per token with its own causal length (so multi-token decode is
causal within the request). The rest are prefill rows: MHA on up-projected K/V
with chunked context (mla_ops/prefill.py).
"""
from __future__ import annotations

import torch

from lowering.checks import (FLOAT_DTYPES, check_decode_values, check_kv_cache_dtype_pair,
                             check_tensor, wants_value_checks)
from lowering.decode.entry import run_decode
from lowering.decode.registry import HAVE_TRITON, DecodeCall
from lowering.gemm.head_gemm import absorb_output, absorb_query
from lowering.prefill.step import PrefillShape, prefill_shape as measure_prefill_shape
from mla_ops.prefill import prefill_attention
from mla_ops.quant import FP8, quant_fp8_group, quant_fp8_static, group_scales


def check_attention_args(q, kv_c_normed, k_pe, kv_cache, W_UK_T, W_UV, block_table, seq_lens,
                         query_start_loc, num_decode_tokens, softmax_scale, kv_cache_dtype,
                         k_scale, kv_cache_dep, output, output_scale, output_block_scale,
                         workspace_rows, backend):
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    T, N, PR = q.shape
    check_tensor("kv_c_normed", kv_c_normed, ndim=2, dtypes=(q.dtype,))
    check_tensor("k_pe", k_pe, dtypes=(q.dtype,))
    check_tensor("W_UK_T", W_UK_T, ndim=3, dtypes=(q.dtype,))
    check_tensor("W_UV", W_UV, ndim=3, dtypes=(q.dtype,))
    check_tensor("block_table", block_table, ndim=2, dtypes=(torch.int32,), contiguous=True)
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=(torch.int32,), contiguous=True)
    check_tensor("query_start_loc", query_start_loc, ndim=1, dtypes=(torch.int32,), contiguous=True)
    check_tensor("kv_cache_dep", kv_cache_dep)
    check_tensor("output", output, ndim=2, contiguous=True)
    Nw, P, L = W_UK_T.shape
    R = PR - P
    V = W_UV.shape[-1]
    if Nw != N or W_UV.shape[:2] != (N, L):
        raise ValueError(f"W_UK_T {tuple(W_UK_T.shape)} and W_UV {tuple(W_UV.shape)} must be "
                         f"[N={N}, P, L] and [N, L, V]")
    if R <= 0:
        raise ValueError(f"q head size {PR} must exceed qk_nope_head_dim {P}")
    if kv_c_normed.shape != (T, L):
        raise ValueError(f"kv_c_normed must be [T={T}, L={L}], got {tuple(kv_c_normed.shape)}")
    if k_pe.reshape(k_pe.shape[0], -1).shape != (T, R):
        raise ValueError(f"k_pe must be [T={T}, R={R}] or [T, 1, R], got {tuple(k_pe.shape)}")
    if kv_cache.dim() != 3 or kv_cache.shape[-1] != L + R:
        raise ValueError(f"kv_cache must be [num_blocks, block_size, L+R={L + R}], got {tuple(kv_cache.shape)}")
    if output.shape != (T, N * V):
        raise ValueError(f"output must be [T={T}, N*V={N * V}], got {tuple(output.shape)}")
    if output_scale is not None and output_block_scale is not None:
        raise ValueError("pass output_scale or output_block_scale, not both")
    if output_scale is not None or output_block_scale is not None:
        if output.dtype != FP8:
            raise TypeError(f"output must be float8_e4m3fn when an output scale is given, got {output.dtype}")
    elif output.dtype != q.dtype:
        raise TypeError(f"output dtype {output.dtype} must equal q dtype {q.dtype}")
    if output_scale is not None:
        check_tensor("output_scale", output_scale, dtypes=(torch.float32,))
        if output_scale.numel() != 1:
            raise ValueError("output_scale must hold one value (static per-tensor scale)")
    if output_block_scale is not None:
        check_tensor("output_block_scale", output_block_scale, ndim=2, dtypes=(torch.float32,),
                     contiguous=True)
        G = output_block_scale.shape[1]
        if output_block_scale.shape[0] != T or G == 0 or (N * V) % G:
            raise ValueError(f"output_block_scale must be [T={T}, N*V/group], got "
                             f"{tuple(output_block_scale.shape)}")
    B = block_table.shape[0]
    if seq_lens.shape[0] != B or query_start_loc.shape[0] != B + 1:
        raise ValueError(f"seq_lens must be [B={B}] and query_start_loc [B+1={B + 1}], got "
                         f"{tuple(seq_lens.shape)} and {tuple(query_start_loc.shape)}")
    if not 0 <= num_decode_tokens <= T:
        raise ValueError(f"num_decode_tokens must be in [0, T={T}], got {num_decode_tokens}")
    if not softmax_scale > 0:
        raise ValueError(f"softmax_scale must be positive, got {softmax_scale}")
    if workspace_rows <= 0:
        raise ValueError(f"workspace_rows must be positive, got {workspace_rows}")
    for name, t in (("kv_c_normed", kv_c_normed), ("k_pe", k_pe), ("kv_cache", kv_cache),
                    ("W_UK_T", W_UK_T), ("W_UV", W_UV), ("block_table", block_table),
                    ("seq_lens", seq_lens), ("query_start_loc", query_start_loc),
                    ("output", output)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    check_kv_cache_dtype_pair(kv_cache, kv_cache_dtype, k_scale, q.dtype, "q")
    if wants_value_checks(q):
        qsl = query_start_loc.tolist()
        lens = seq_lens.tolist()
        if qsl[0] != 0 or qsl[-1] != T or any(b < a for a, b in zip(qsl, qsl[1:])):
            raise ValueError(f"query_start_loc must rise from 0 to T={T}, got {qsl}")
        if any(s < b - a for s, a, b in zip(lens, qsl, qsl[1:])):
            raise ValueError(f"seq_lens {lens} must be >= each request's query length")
        if num_decode_tokens not in qsl:
            raise ValueError(f"num_decode_tokens={num_decode_tokens} must fall on a request "
                             f"boundary of query_start_loc {qsl}")
        decode_requests = qsl.index(num_decode_tokens)    # the decode rows' requests
        check_decode_values(kv_cache, block_table[:decode_requests],
                            seq_lens[:decode_requests], 0, "seq_lens")


def check_prefill_shape(shape, q, seq_lens, query_start_loc, num_decode_tokens) -> None:
    """A caller's prefill_shape: four ints >= 0 (a list), or None. With the value checks
    on (lowering.config.validate; always on CPU), num_requests must equal what the tensors
    say, max_query_len and max_context_len must bound theirs from above and
    min_context_len from below (a captured prefill chunk passes its bucket's bounds)."""
    if shape is None:
        return
    if (not isinstance(shape, (list, tuple)) or len(shape) != 4
            or any(isinstance(v, bool) or not isinstance(v, (int, torch.SymInt)) for v in shape)):
        raise TypeError(f"prefill_shape must be [num_requests, max_query_len, max_context_len, "
                        f"min_context_len] (ints) or None, got {shape!r}")
    if num_decode_tokens == q.shape[0]:
        return                                           # no prefill rows: not read
    if wants_value_checks(q):
        want = measure_prefill_shape(query_start_loc, seq_lens, num_decode_tokens)
        got = PrefillShape(*(int(v) for v in shape))
        if (got.num_requests != want.num_requests or got.max_query_len < want.max_query_len
                or got.max_context_len < want.max_context_len
                or not 0 <= got.min_context_len <= want.min_context_len):
            raise ValueError(f"prefill_shape {list(shape)} does not fit the step's tensors "
                             f"{[want.num_requests, want.max_query_len, want.max_context_len, want.min_context_len]}: "
                             f"num_requests must be equal, the two max_ bounds at least and "
                             f"min_context_len at most (and >= 0) the tensors' values")


def _quant_impl(x: torch.Tensor):
    """mla_ops.quant_ops (Triton kernels on CUDA, one launch per quant) when triton is
    importable and selected for x; None means the torch reference here."""
    try:
        from mla_ops import quant_ops as pq
        import triton  # noqa: F401  (the quant kernels need it)
    except ImportError:
        return None
    return pq if pq.quant_kernel_unmet(x) is None else None


def _write_output(out: torch.Tensor, dst: torch.Tensor, output_scale, block_scale) -> None:
    """Write out [t, N*V] into dst, quantizing to fp8 when a scale is given.

    Quantized outputs here are a 16-bit temporary plus one quant pass: the prefill path
    (its output is final only after the last context chunk is merged), and decode rows
    the fused W_UV epilogue (decode_output) cannot serve.
    """
    if output_scale is None and block_scale is None:
        dst.copy_(out)
        return
    pq = _quant_impl(out)
    if output_scale is not None:
        dst.copy_(pq.quant_fp8_static_op(out, output_scale) if pq else
                  quant_fp8_static(out, output_scale))
        return
    g = out.shape[1] // block_scale.shape[1]
    if pq:
        y, s = pq.quant_fp8_group_op(out, g, False)
    else:
        s = group_scales(out, g)
        y = quant_fp8_group(out, s)
    block_scale.copy_(s)
    dst.copy_(y)


def decode_output(out_latent, W_UV, dst, output_scale, block_scale) -> None:
    """dst [t, N*V] = out_latent [t, N, L] @ W_UV, quantized when a scale is given.

    With an output quant and Triton selected (CUDA), the quant runs in the W_UV GEMM's
    epilogue: one kernel writes the fp8 output (and its group scales), no 16-bit
    temporary. Otherwise: bmm, then _write_output.
    """
    t = out_latent.shape[0]
    if output_scale is not None or block_scale is not None:
        pq = _quant_impl(out_latent)
        g = None if block_scale is None else dst.shape[1] // block_scale.shape[1]
        if pq is not None:
            from lowering.fused.wuv_quant import wuv_quant, wuv_quant_unmet
            if wuv_quant_unmet(out_latent, W_UV, g) is None:
                wuv_quant(out_latent, W_UV, scale=output_scale, group_size=g, out=dst,
                          block_scale=block_scale)
                return
    if output_scale is None and block_scale is None and dst.dtype == out_latent.dtype:
        absorb_output(out_latent, W_UV, dst)
        return
    out = torch.bmm(out_latent.transpose(0, 1), W_UV)                    # [N, t, V]
    _write_output(out.transpose(0, 1).reshape(t, -1), dst, output_scale, block_scale)


def check_decode_query(decode_q, decode_q_scale, q, W_UK_T, num_decode_tokens):
    """A prebuilt decode query: [num_decode_tokens, N, L + R], q's dtype or fp8 + scale."""
    if decode_q is None:
        if decode_q_scale is not None:
            raise ValueError("decode_q_scale given without decode_q")
        return
    check_tensor("decode_q", decode_q, ndim=3, dtypes=(q.dtype, FP8))
    N, P, L = W_UK_T.shape
    want = (num_decode_tokens, N, L + q.shape[-1] - P)
    if tuple(decode_q.shape) != want:
        raise ValueError(f"decode_q must be [num_decode_tokens, N, L+R]={want}, got {tuple(decode_q.shape)}")
    if decode_q.stride(-1) != 1:
        raise ValueError("decode_q must be contiguous in its last dim")
    if decode_q.device != q.device:
        raise ValueError(f"decode_q is on {decode_q.device}, q on {q.device}")
    if decode_q.dtype == FP8:
        if decode_q_scale is None:
            raise ValueError("decode_q is float8_e4m3fn: pass decode_q_scale")
        check_tensor("decode_q_scale", decode_q_scale, dtypes=(torch.float32,))
        if decode_q_scale.numel() != 1:
            raise ValueError("decode_q_scale must hold one value (per-tensor scale)")
    elif decode_q_scale is not None:
        raise ValueError("decode_q_scale applies to an fp8 decode_q only")


def build_decode_query(q, W_UK_T):
    """q [t, N, P+R] -> the absorbed MQA query [t, N, L + R]: [q_nope @ W_UK_T | q_pe].

    Functional (bmm + cat), for traced code: the layer builds the fp8 decode query with
    it in the graph, where Pass A matches the cat.
    """
    P = W_UK_T.shape[1]
    q_nope, q_pe = q.split([P, q.shape[-1] - P], dim=-1)
    ql_nope = torch.bmm(q_nope.transpose(0, 1), W_UK_T)                   # [N, t, L]
    return torch.cat([ql_nope.transpose(0, 1), q_pe], dim=-1)            # [t, N, L + R]


def _fp8_query_decode(q8, q_scale, kv_cache, block_table, lens, softmax_scale, kind, k_scale,
                      backend, L, out_dtype, schedule=None):
    """Decode with an fp8 query: the fp8 x fp8 routes (FlashMLA's or our Gluon kernel on
    Hopper, else Triton) over an fp8 cache, else any backend on the dequantized query
    (fp32, exact: stored * scale). schedule: FlashMLA's fp8 table and splits for these
    (bounded) inputs, from lowering.decode_schedule(..., fp8q=True), or None.
    Arguments checked by the op."""
    if (kind == "fp8" and q8.is_cuda and HAVE_TRITON and out_dtype in FP8Q_OUT_DTYPES
            and backend in ("auto", "flashmla", "gluon", "triton")):
        from lowering.decode.flashmla import FP8Schedule
        sched = None if schedule is None else FP8Schedule(*schedule)
        call = DecodeCall(q8, kv_cache, block_table, lens, float(softmax_scale), True, kind,
                          k_scale, L, q_scale=q_scale, out_dtype=out_dtype, schedule=sched,
                          bounded=sched is not None)
        return run_decode(call, "fp8q", backend)
    q_deq = q8.float() * q_scale.float().reshape(())
    call = DecodeCall(q_deq, kv_cache, block_table, lens, float(softmax_scale), True, kind,
                      k_scale, L)
    return run_decode(call, "bf16", backend)


FP8Q_OUT_DTYPES = (torch.bfloat16, torch.float16)


def decode_attention(q, kv_cache, W_UK_T, W_UV, block_table, seq_lens, query_start_loc,
                     softmax_scale, kind, k_scale, backend, decode_q=None, decode_q_scale=None,
                     one_token_per_request=False, schedule=None):
    """Absorbed MQA for decode tokens q [t, N, P+R] -> latent output [t, N, L] (W_UV dtype);
    decode_output then applies W_UV (and the output quant).

    one_token_per_request: the step is t requests of one token each (plain decode), so
    token i is request i and sees its whole sequence: no per-token gathers are needed.

    decode_q, when given, is the prebuilt query [t, N, L + R] (q's dtype, or fp8 with
    decode_q_scale), built outside the op so graph passes can see and fuse it.

    schedule: lowering.decode_schedule() of (block_table, seq_lens), computed once per
    step by the caller from inputs bounded with lowering.bound_decode_inputs (so the
    decode launches no clamp kernels of its own); with an fp8 decode_q, the one from
    decode_schedule(..., fp8q=True). It describes one query token per request, so other
    steps (several tokens of a request) drop it and the kernel schedules itself.
    """
    t, N, _ = q.shape
    P, L = W_UK_T.shape[1:]
    q_mqa = absorb_query(q, W_UK_T) if decode_q is None else decode_q           # [t, N, L+R]
    if one_token_per_request:
        bt, lens = block_table, seq_lens
    else:
        schedule = None
        tok = torch.arange(t, device=q.device)
        req = torch.searchsorted(query_start_loc[1:], tok.to(torch.int32), right=True)  # [t]
        # Position of each token in its sequence; it sees positions [0, pos].
        pos = seq_lens[req].long() - (query_start_loc[req + 1].long() - tok)
        bt, lens = block_table[req].contiguous(), (pos + 1).to(torch.int32)
    if q_mqa.dtype == FP8:
        out_latent, _ = _fp8_query_decode(q_mqa[:, None], decode_q_scale, kv_cache, bt, lens,
                                          softmax_scale, kind, k_scale, backend, L, W_UV.dtype,
                                          schedule=schedule)
        out_latent = out_latent.to(W_UV.dtype)
    else:
        call = DecodeCall(q_mqa[:, None], kv_cache, bt, lens, float(softmax_scale), True, kind,
                          k_scale, L, schedule=schedule, bounded=schedule is not None)
        out_latent, _ = run_decode(call, "bf16", backend)                # [t, 1, N, L]
    return out_latent[:, 0]                                              # [t, N, L]


def run_attention(q, kv_c_normed, k_pe, kv_cache, W_UK_T, W_UV, block_table, seq_lens,
                  query_start_loc, num_decode_tokens, softmax_scale, kv_cache_dtype, k_scale,
                  output, output_scale, output_block_scale, workspace_rows, backend,
                  decode_q=None, decode_q_scale=None, schedule=None, prefill_shape=None):
    kind = "auto" if kv_cache_dtype == "auto" else "fp8"
    T = q.shape[0]
    nd = num_decode_tokens

    def scale_rows(a, b):
        return None if output_block_scale is None else output_block_scale[a:b]

    if nd > 0:
        lat = decode_attention(q[:nd], kv_cache, W_UK_T, W_UV, block_table, seq_lens,
                               query_start_loc, softmax_scale, kind, k_scale, backend,
                               decode_q, decode_q_scale,
                               one_token_per_request=(T == nd == block_table.shape[0]),
                               schedule=schedule)
        decode_output(lat, W_UV, output[:nd], output_scale, scale_rows(0, nd))
    if nd < T:
        out = prefill_attention(q, kv_c_normed, k_pe.reshape(T, -1), kv_cache, W_UK_T, W_UV,
                                block_table, seq_lens, query_start_loc, nd, softmax_scale,
                                kind, k_scale, workspace_rows,
                                None if prefill_shape is None else PrefillShape(*prefill_shape))
        _write_output(out, output[nd:], output_scale, scale_rows(nd, T))
