"""Pass B: fold an FP8 quantization of the attention output into mla::attention_with_output.

Search (post-grad, functionalized):
    r = auto_functionalized_v2(mla.attention_with_output, ..., output_scale=None,
                               _output_base_index=0, _output_block_scale_base_index=None,
                               _all_bases=[output])             # v1: output=..., no bases
    y, s = mla.quant_fp8_group(r[1], g, pow2)        or   y = mla.quant_fp8_static(r[1], scale)
Replace:
    the same attention call writing an fp8 output (and, per group, its scales) itself:
    output_block_scale=<new [T, N*V/g] fp32 buffer>   or   output_scale=scale.

Every other argument is passed through untouched, kv_cache_dep included: the cache
write stays a data dependency of the attention read (checked after the pass by
manager.verify_kv_cache_dependency).

Conditions (each failing one is recorded as the reason the candidate did not fuse):
  * the attention output has no other user than the quant op (else the bf16 output is
    still needed and fusing would compute attention twice);
  * the output is [T, N*V] in bf16 or fp16 (the fused writer quantizes from a 16-bit
    GEMM result; fp32 attention is not a quantized-inference configuration);
  * a per-group size divides V, so a group never straddles two heads (the group's amax
    is then local to one head's W_UV GEMM tile);
  * a static scale is one fp32 value.
pow2 scales are matched but not folded: the op writes plain amax/448 scales (recorded
as a reason), so a pow2 quant stays separate rather than changing numerics.
"""
from __future__ import annotations

import torch
from torch._higher_order_ops.auto_functionalize import auto_functionalized, auto_functionalized_v2
from torch._inductor.pattern_matcher import Match, fwd_only, register_replacement

from passes.quant import QuantKey

ATTN = torch.ops.mla.attention_with_output.default
FP8 = torch.float8_e4m3fn
# Placeholder scalar values for tracing; the matcher turns them into wildcards
# (never 0/1, group sizes or the default workspace, which appear as real constants).
SCALARS = {"num_decode_tokens": 7919, "softmax_scale": 0.0123457, "workspace_rows": 8191}
TENSOR_ARGS = ("q", "kv_c_normed", "k_pe", "kv_cache", "W_UK_T", "W_UV", "block_table",
               "seq_lens", "query_start_loc", "k_scale", "kv_cache_dep", "output")


def _attn(v2: bool, t: dict, scalars: dict, strings: dict, output_bases, output_scale=None):
    """Call the attention op through auto_functionalized(_v2); return the HOP result."""
    kw = dict(q=t["q"], kv_c_normed=t["kv_c_normed"], k_pe=t["k_pe"], kv_cache=t["kv_cache"],
              W_UK_T=t["W_UK_T"], W_UV=t["W_UV"], block_table=t["block_table"],
              seq_lens=t["seq_lens"], query_start_loc=t["query_start_loc"],
              num_decode_tokens=scalars["num_decode_tokens"],
              softmax_scale=scalars["softmax_scale"], kv_cache_dtype=strings["kv_cache_dtype"],
              k_scale=t["k_scale"], kv_cache_dep=t["kv_cache_dep"])
    extra = dict(decode_q=None, decode_q_scale=None, decode_schedule=None, decode_splits=None)
    extra.update({k: t[v] for k, v in strings.get("extra", {}).items()})
    out, block = output_bases
    if v2:
        kw.update(output_scale=output_scale, workspace_rows=scalars["workspace_rows"],
                  backend=strings["backend"], **extra, _output_base_index=0,
                  _output_block_scale_base_index=None if block is None else 1,
                  _all_bases=[out] if block is None else [out, block])
        return auto_functionalized_v2(ATTN, **kw)
    kw.update(output=out, output_scale=output_scale, output_block_scale=block,
              workspace_rows=scalars["workspace_rows"], backend=strings["backend"], **extra)
    return auto_functionalized(ATTN, **kw)


def _example_inputs():
    f, i = torch.float16, torch.int32
    T, N, P, R, L, V = 2, 2, 16, 16, 32, 64
    ex = dict(q=torch.empty(T, N, P + R, dtype=f), kv_c_normed=torch.empty(T, L, dtype=f),
              k_pe=torch.empty(T, 1, R, dtype=f), kv_cache=torch.empty(4, 4, L + R, dtype=f),
              W_UK_T=torch.empty(N, P, L, dtype=f), W_UV=torch.empty(N, L, V, dtype=f),
              block_table=torch.empty(T, 2, dtype=i), seq_lens=torch.empty(T, dtype=i),
              query_start_loc=torch.empty(T + 1, dtype=i), k_scale=torch.empty(1),
              kv_cache_dep=torch.empty(0, dtype=f), output=torch.empty(T, N * V, dtype=f))
    return ex


def _out_shape(t):
    """[T, N*V] from q and W_UV (not from the old buffer, which then becomes dead)."""
    N, _, V = t["W_UV"].shape
    return (t["q"].shape[0], N * V)


def make_pattern(key: QuantKey, v2: bool, strings: dict):
    """(search_fn, replace_fn, example_inputs, scalar_workaround) for one variant."""
    dq = tuple(strings.get("extra", {}))
    names = TENSOR_ARGS + dq + (("scale",) if key.per_tensor else ()) + tuple(SCALARS)

    def split(args):
        d = dict(zip(names, args))
        return d, {k: d[k] for k in SCALARS}

    if key.per_tensor:
        def search(*args):
            t, s = split(args)
            r = _attn(v2, t, s, strings, (t["output"], None))
            return torch.ops.mla.quant_fp8_static.default(r[1], t["scale"])

        def replace(*args):
            t, s = split(args)
            out8 = torch.empty(_out_shape(t), dtype=FP8, device=t["q"].device)
            r = _attn(v2, t, s, strings, (out8, None), output_scale=t["scale"])
            return r[1]
    else:
        g, pow2 = key.group_size, key.pow2

        def search(*args):
            t, s = split(args)
            r = _attn(v2, t, s, strings, (t["output"], None))
            y = torch.ops.mla.quant_fp8_group.default(r[1], g, pow2)
            return y[0], y[1]

        def replace(*args):
            t, s = split(args)
            T, C = _out_shape(t)
            out8 = torch.empty((T, C), dtype=FP8, device=t["q"].device)
            bs = torch.empty((T, C // g), dtype=torch.float32, device=t["q"].device)
            r = _attn(v2, t, s, strings, (out8, bs))
            return r[1], r[2]

    # register_replacement reads parameter names from the signature
    sig_src = ", ".join(names)
    ns = {"_s": search, "_r": replace}
    exec(f"def search({sig_src}): return _s({sig_src})\n"
         f"def replace({sig_src}): return _r({sig_src})", ns)
    ex = _example_inputs()
    if key.per_tensor:
        ex["scale"] = torch.empty(1)
    ex["decode_q"] = torch.empty(2, 2, 48, dtype=FP8)
    ex["decode_q_scale"] = torch.empty(1)
    ex["decode_schedule"] = torch.empty(66, 8, dtype=torch.int32)
    ex["decode_splits"] = torch.empty(3, dtype=torch.int32)
    example = [ex[n] for n in names if n in ex] + [SCALARS[k] for k in SCALARS]
    return ns["search"], ns["replace"], example, dict(SCALARS)


def why_not(match: Match, key: QuantKey, recorder) -> bool:
    """extra_check: True to fuse; else record the first failing condition and return False."""
    out_node = match.kwargs["output"]
    out = out_node.meta.get("val") if hasattr(out_node, "meta") else None
    W_UV = match.kwargs["W_UV"].meta["val"]
    attn = next(n for n in match.nodes if n.target in (auto_functionalized, auto_functionalized_v2))
    quant = next(n for n in match.nodes if n.target in (torch.ops.mla.quant_fp8_group.default,
                                                        torch.ops.mla.quant_fp8_static.default))
    reason = ""
    res = quant.args[0]
    if len(res.users) != 1:
        reason = f"the attention output has {len(res.users)} users; fusing needs the quant alone"
    elif out is None or out.dim() != 2:
        reason = "the attention output buffer has no 2-D fake value"
    elif out.dtype not in (torch.bfloat16, torch.float16):
        reason = f"attention output dtype is {out.dtype}; fusion needs bfloat16 or float16"
    elif key.pow2:
        reason = "power-of-two scales: the op writes amax/448 scales, so the quant stays separate"
    elif not key.per_tensor and W_UV.shape[-1] % key.group_size:
        reason = (f"group size {key.group_size} does not divide v_head_dim {W_UV.shape[-1]}: "
                  f"a group would straddle two heads")
    elif key.per_tensor:
        sc = match.kwargs["scale"].meta["val"]
        if sc.dtype != torch.float32 or sc.numel() != 1:
            reason = f"static scale must be one fp32 value, got {sc.dtype} {tuple(sc.shape)}"
    recorder("B", str(key), attn, reason)
    return not reason


def variant_key(node, v2: bool) -> tuple:
    """(HOP form, kv_cache_dtype, backend, decode-query kind, decode-schedule kind) of one
    attention call."""
    kw = node.kwargs
    dq = "none" if kw.get("decode_q") is None else "tensor"
    sched = "none" if kw.get("decode_schedule") is None else "tensor"
    return (v2, kw["kv_cache_dtype"], kw["backend"], dq, sched)


def optional_extra(dq: str, sched: str) -> dict:
    """The attention call's optional tensor kwargs a variant passes (kwarg -> pattern input)."""
    extra = {} if dq == "none" else {"decode_q": "decode_q", "decode_q_scale": "decode_q_scale"}
    if sched != "none":
        extra.update(decode_schedule="decode_schedule", decode_splits="decode_splits")
    return extra


def register(pm_pass, key: QuantKey, v2: bool, strings: dict, recorder, decode_q="none") -> None:
    search, replace, example, scalars = make_pattern(key, v2, strings)
    register_replacement(search, replace, example, fwd_only, pm_pass,
                         extra_check=lambda m: why_not(m, key, recorder),
                         scalar_workaround=scalars)


QUANT_OPS = (torch.ops.mla.quant_fp8_group.default, torch.ops.mla.quant_fp8_static.default)


def explain(attn) -> tuple:
    """(pattern, reason) for an attention call the patterns did not reach."""
    kw = attn.kwargs
    if kw.get("output_scale") is not None or kw.get("_output_block_scale_base_index") is not None \
            or kw.get("output_block_scale") is not None:
        return "-", "the op already writes a quantized output"
    outs = [u for u in attn.users if u.target.__name__ == "getitem" and u.args[1] == 1]
    users = [w for u in outs for w in u.users]
    quants = [w for w in users if w.target in QUANT_OPS]
    if not quants:
        names = sorted({str(getattr(w.target, "__name__", w.target)) for w in users}) or ["nothing"]
        return "-", f"the attention output feeds {', '.join(names)}, not an FP8 quant op"
    q = quants[0]
    if q.target is QUANT_OPS[1]:
        pattern = "fp8_static_tensor"
    else:
        pattern = f"fp8_dynamic_group{q.args[1]}" + ("_pow2" if q.args[2] else "")
    if len(users) > 1:
        return pattern, f"the attention output has {len(users)} users; fusing needs the quant alone"
    return pattern, f"no registered QuantKey pattern matches {pattern}"
