"""Pass A: decode query concat + static FP8 quantization -> one fused op.

Search (post-grad):   y = mla.quant_fp8_static(aten.cat([ql_nope, q_pe], -1), scale)
Replace:              y = mla.concat_quant_fp8_static(ql_nope, q_pe, scale)

ql_nope is the W_UK absorption output [t, N, L] (a transposed bmm result, read in place
through its strides), q_pe the rope part of q [t, N, R]. The fused op reads both once
and writes the fp8 query [t, N, L+R]: the bf16 concat buffer is never materialized.
Numerics are bitwise those of cat + quant (same fp32 divide, same rounding).

Conditions (recorded as the reason when one fails):
  * cat of exactly two 3-D tensors along the last dim with equal [t, N];
  * the concat result has no other user than the quant;
  * input dtype bf16/fp16/fp32 (both alike); the scale is one fp32 value.
"""
from __future__ import annotations

import torch
from torch._inductor.pattern_matcher import Match, fwd_only, register_replacement

QSTATIC = torch.ops.mla.quant_fp8_static.default
FUSED = torch.ops.mla.concat_quant_fp8_static.default
DIMS = (-1, 2)   # a 3-D concat along the last dim is spelled either way


def consumer_attention(node, depth=4):
    from passes.manager import ATTN, hop_target
    frontier = [node]
    for _ in range(depth):
        nxt = []
        for n in frontier:
            for u in n.users:
                if hop_target(u) == ATTN:
                    return u
                nxt.append(u)
        frontier = nxt
    return None


def why_not(match: Match, dim: int, recorder) -> bool:
    quant = next(n for n in match.nodes if n.target is QSTATIC)
    cat = quant.args[0]
    a, b = (x.meta["val"] for x in cat.args[0])
    sc = quant.args[1].meta["val"]
    reason = ""
    if a.dim() != 3 or b.dim() != 3:
        reason = f"concat inputs must be 3-D [t, N, *], got {a.dim()}-D and {b.dim()}-D"
    elif a.shape[:2] != b.shape[:2]:
        reason = f"concat inputs differ in [t, N]: {tuple(a.shape[:2])} vs {tuple(b.shape[:2])}"
    elif len(cat.users) != 1:
        reason = f"the concat result has {len(cat.users)} users; fusing needs the quant alone"
    elif a.dtype != b.dtype or a.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        reason = f"concat inputs must be one float dtype, got {a.dtype} and {b.dtype}"
    elif sc.dtype != torch.float32 or sc.numel() != 1:
        reason = f"static scale must be one fp32 value, got {sc.dtype} {tuple(sc.shape)}"
    recorder("A", "cat_quant_fp8_static", consumer_attention(quant) or quant, reason, quant=quant)
    return not reason


def make_pattern(dim: int):
    def search(ql_nope, q_pe, scale):
        if dim >= ql_nope.dim():           # retrace on a lower-rank candidate: no match
            raise RuntimeError(f"concat dim {dim} out of range")
        return QSTATIC(torch.ops.aten.cat.default([ql_nope, q_pe], dim), scale)

    def replace(ql_nope, q_pe, scale):
        return FUSED(ql_nope, q_pe, scale)

    f = torch.bfloat16
    example = [torch.empty(2, 3, 32, dtype=f), torch.empty(2, 3, 16, dtype=f), torch.empty(1)]
    return search, replace, example


def register(pm_pass, recorder) -> None:
    for dim in DIMS:
        search, replace, example = make_pattern(dim)
        register_replacement(search, replace, example, fwd_only, pm_pass,
                             extra_check=lambda m, d=dim: why_not(m, d, recorder),
                             skip_duplicates=True)


def explain_candidates(graph, seen_quants) -> list:
    """(quant node, reason) for static quants of a concat that no pattern reached."""
    out = []
    for n in graph.nodes:
        if n.target is not QSTATIC or n in seen_quants:
            continue
        c = n.args[0]
        if getattr(c, "target", None) is not torch.ops.aten.cat.default:
            continue
        ins = c.args[0]
        dim = c.args[1] if len(c.args) > 1 else 0
        nd = ins[0].meta["val"].dim()
        if len(ins) != 2:
            reason = f"concat of {len(ins)} tensors; the fused op takes two"
        elif dim not in (-1, nd - 1):
            reason = f"concat along dim {dim}, not the last dim"
        elif len(c.users) != 1:
            reason = f"the concat result has {len(c.users)} users; fusing needs the quant alone"
        else:
            reason = "the concat + quant did not match the registered pattern"
        out.append((n, reason))
    return out
