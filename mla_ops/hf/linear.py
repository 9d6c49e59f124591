"""A converted layer's weight GEMMs through the decode GEMM ops (lowering/gemm/linear.py), and
the attention prologue after the q_a + kv_a GEMM (V2 without q_lora: q_proj + kv_a)
through lowering/fused/prologue.py's ops (for V3's decode rows the query's q_b, RoPE and
absorption as lowering/fused/q_absorb.py's).

A decode step reads each weight once for a few rows, so the layer's GEMMs are weight
copies: q_a_proj + kv_a_proj_with_mqa share their input and run as one launch, gate_proj +
up_proj + SiLU x up as one launch (the dense MLPs and shared experts), o_proj and down_proj
as single launches, and so does the model's output head (lm_head). The ops take the HF
modules' own weights (no copies); at more rows, on CPU or in fp32 they run exactly what the
modules would (F.linear, F.silu). HF's FP8 block-quantized linears (DeepSeek's FP8
checkpoints) run the fp8 decode GEMM ops (mla_ops/hf/fp8_linear.py). Any other module that
is not a plain bias-free nn.Linear (other quantized linears, biases) keeps its own call, and
so does every module while autograd would need its weight's gradient.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from lowering import config as mla_config
from lowering.fused import norm as _norm  # noqa: F401  (registers mla::residual_rms_norm)
from lowering.fused import prologue  # noqa: F401  (registers mla::decode_qkv_prologue)
from lowering.fused import q_rope  # noqa: F401  (registers mla::decode_q_rope)
from lowering.fused.decode_rows import decode_rows_unmet, row_kernels_unmet
from lowering.fused.q_absorb import (q_absorb_unmet, q_kv_absorb_unmet,  # and their ops
                                     rope_width, w8a8_unmet)
from lowering.fused.q_rope import q_rope_any
from lowering.gemm import linear as gemm  # registers the mla::decode_* GEMM ops
from mla_ops.hf import fp8_linear as fp8
from mla_ops.hf.families import V2Rotary


def _plain(*mods) -> bool:
    return all(type(m) is nn.Linear and m.bias is None for m in mods)


def _needs_grad(*mods) -> bool:
    return torch.is_grad_enabled() and any(m.weight.requires_grad for m in mods)


def use_ops(*mods) -> bool:
    """Whether the modules' GEMMs run on the decode GEMM ops.

    lowering.config.linear_impl = "torch" keeps the modules' own calls; deciding here, in
    the traced Python, makes the choice part of the compiled graph (torch.compile guards
    on the setting and recompiles when it changes). The ops are for inference (no autograd
    formulas): with grad enabled for the weights, the modules' own differentiable calls
    run instead (same numerics off the GPU kernel path)."""
    return mla_config.linear_impl != "torch" and _plain(*mods) and not _needs_grad(*mods)


def decode_linear(x: torch.Tensor, w: torch.Tensor, residual=None) -> torch.Tensor:
    """x @ w.T (plus residual) on the decode GEMM ops; where the kernel's config splits K,
    the fp32 partial sums (and the residual) are added here, in the traced graph (Inductor
    fuses the sum into the consumer)."""
    split_k = gemm.linear_split_k(x, w)
    if split_k > 1:
        y = torch.ops.mla.decode_linear_partials(x, w, split_k).sum(0).to(x.dtype)
        return y if residual is None else residual + y
    if residual is not None:
        return torch.ops.mla.decode_linear_residual(x, w, residual)
    return torch.ops.mla.decode_linear(x, w)


def linear_residual_norm(mod, x: torch.Tensor, residual: torch.Tensor, norm):
    """(h, norm(h)) with h = residual + mod(x): a converted decoder layer's attention output
    projection, its residual add and its post-attention RMSNorm. Where mod's decode GEMM
    (16-bit, or an FP8 checkpoint's) splits K and norm is a converted RMSNorm
    (mla_ops/hf/layer.py), the partials' sum, the add and the norm are one launch
    (mla::residual_rms_norm), else linear() then norm. Where the norm's output feeds fp8
    GEMMs (norm.mla_quant_group > 0, set by convert_layers), that launch also quantizes it
    for them (mla::residual_rms_norm_fp8) and the result is (h, norm(h), (y_q, y_s))."""
    if (getattr(norm, "mla_converted", False)
            and not (torch.is_grad_enabled() and norm.weight.requires_grad)):
        parts = None
        if fp8.uses_fp8_ops(mod):                       # an FP8 checkpoint's o_proj
            parts = fp8.fp8_partials(mod, x)                                  # [S, ..., N]
        elif use_ops(mod):
            split_k = gemm.linear_split_k(x, mod.weight)
            if split_k > 1:
                parts = torch.ops.mla.decode_linear_partials(x, mod.weight, split_k)
        if parts is not None:
            eps, group = float(norm.variance_epsilon), getattr(norm, "mla_quant_group", 0)
            if group:
                h, y, y_q, y_s = torch.ops.mla.residual_rms_norm_fp8(parts, residual,
                                                                     norm.weight, eps, group)
                return h, y, (y_q, y_s)
            return torch.ops.mla.residual_rms_norm(parts, residual, norm.weight, eps)
    h = linear(mod, x, residual)
    return h, norm(h)


def linear(mod, x: torch.Tensor, residual=None, x_quant=None) -> torch.Tensor:
    """mod(x) (+ residual) for an HF linear module; mla::decode_linear(_residual) when it
    is a plain nn.Linear (mla::decode_linear_fp8 for HF's FP8 linears; x_quant: x quantized
    for it by the kernel that produced x)."""
    if fp8.uses_fp8_ops(mod):
        return fp8.fp8_linear(mod, x, residual, x_quant)
    if use_ops(mod):
        return decode_linear(x, mod.weight, residual)
    return mod(x) if residual is None else residual + mod(x)


def linear_pair(m1, m2, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(m1(x), m2(x)) in one launch when both are plain nn.Linear.

    Where the kernel's config splits K, the op returns fp32 partial sums and the sum is
    taken here, in the traced graph, so Inductor fuses it into the ops that read the
    result (the q_a / kv_a norms) instead of launching a reduce kernel.
    """
    if fp8.uses_fp8_ops(m1, m2):
        return fp8.fp8_linear_pair(m1, m2, x)
    if not use_ops(m1, m2):
        return linear(m1, x), linear(m2, x)
    w1, w2 = m1.weight, m2.weight
    split_k = gemm.pair_split_k(x, w1, w2)
    if split_k > 1:
        parts = torch.ops.mla.decode_linear_pair_partials(x, w1, w2, split_k)  # [S, ..., N1+N2] fp32
        p1, p2 = parts.split([w1.shape[0], w2.shape[0]], dim=-1)
        return p1.sum(0).to(x.dtype), p2.sum(0).to(x.dtype)     # one sum per consumer
    return torch.ops.mla.decode_linear_pair(x, w1, w2)


def hf_rms_norm(m) -> bool:
    """An HF DeepSeek RMSNorm module whose forward is HF's own (weight [H], variance_epsilon)."""
    return (type(m).__name__ in ("DeepseekV3RMSNorm", "DeepseekV2RMSNorm", "DeepseekV32RMSNorm")
            and m.weight.dim() == 1 and type(m).__module__.startswith("transformers."))


def rope_rows(position_embeddings, B: int, S: int):
    """HF's rotary rows ((cos, sin) [b, s, R] each, or V2's complex freqs_cis [b, s, R/2])
    with their leading dims expanded to the step's [B, S] (HF computes them for position
    ids of batch 1 when a forward is called without position_ids); the fused ops take one
    row per token. Views, no copies; anything else is returned as it is."""
    def rows(t):
        if isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[:2] != (B, S):
            return t.expand(B, S, t.shape[-1])
        return t
    if isinstance(position_embeddings, V2Rotary):
        return V2Rotary(*(rows(t) for t in position_embeddings))
    if isinstance(position_embeddings, (tuple, list)):
        return tuple(rows(t) for t in position_embeddings)
    return rows(position_embeddings)


def rope_angles(attn, position_embeddings):
    """(cos, sin, rope) for the fused ops (lowering/fused/q_rope.py's ROPES) of a
    DeepSeek-V3 attention (HF's rows, rope 1 / 0 by config.rope_interleave) or a V2 one
    (its complex freqs_cis as real and imaginary parts, rope 2: V2Rotary's, made once per
    forward, after convert()); None for other families."""
    pe = position_embeddings
    if attn.mla_family == "v3" and isinstance(pe, (tuple, list)):
        return pe[0], pe[1], int(bool(attn.config.rope_interleave))
    if attn.mla_family == "v2" and isinstance(pe, V2Rotary):
        return pe.cos, pe.sin, 2
    if attn.mla_family == "v2" and isinstance(pe, torch.Tensor) and pe.is_complex():
        return pe.real, pe.imag, 2
    return None


def rope_query(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope: int):
    """The query heads q [*lead, N, P + R] with RoPE on their last R columns (rope_angles'
    layout): mla::decode_q_rope for HF's rows, HF's complex product for V2's."""
    if rope == 2:
        return q_rope_any(q, cos, sin, rope)
    return torch.ops.mla.decode_q_rope(q, cos, sin, bool(rope))


def prefill_part(m1, m2, x: torch.Tensor, *norms):
    """[1, *lead, N1 + N2]: the two modules' outputs on x [*lead, H] (cuBLAS, exactly their
    own calls) side by side, the one "partial" the prologue ops take for a prefill's rows:
    more rows than the decode GEMM kernels take, on a device and dtype the per-row kernels
    serve, with the norms after them in x's dtype (the ops' output dtype). None otherwise
    (decode rows, CPU, fp32, modules that keep their own calls)."""
    if (x.numel() // x.shape[-1] <= gemm.MAX_ROWS or not use_ops(m1, m2)
            or row_kernels_unmet(x.device, x.dtype) is not None
            or any(n.weight.dtype != x.dtype for n in norms)):
        return None
    return torch.cat([m1(x), m2(x)], dim=-1).unsqueeze(0)


def qkv_a_prologue(attn, x: torch.Tensor, position_embeddings, x_quant=None):
    """(q_a_layernorm(q_a), [kv_a_layernorm(kv_c) | RoPE(k_pe)], q_a_quant) of a DeepSeek-V3
    (or V2 with q_lora) attention module for hidden states x [B, S, H]: the q_a + kv_a
    GEMM's split-K partials (a prefill's rows: the two modules' outputs, prefill_part),
    then one op (mla::decode_qkv_prologue) for both norms and the key's RoPE. None where
    that path does not apply (no q_lora, another family, other norms, or decode rows whose
    pair config has no split-K: then the caller runs the modules). HF's FP8 linears: the
    fp8 pair kernel's fp32 partials (its config's K splits, maybe one) where it serves x
    (mla::decode_linear_pair_fp8_partials); with an fp8 q_b_proj too, the prologue also
    quantizes q_a for q_b's GEMM (mla::decode_qkv_prologue_fp8: q_a_quant = (q_q, q_s),
    else None). x_quant: (x_q, x_s), x quantized by the layer's input norm for the fp8
    pair."""
    angles = rope_angles(attn, position_embeddings)
    if angles is None or attn.q_lora_rank is None:
        return None
    m1, m2 = attn.q_a_proj, attn.kv_a_proj_with_mqa
    fp8_pair = fp8.uses_fp8_ops(m1, m2)
    if (not (use_ops(m1, m2) or fp8_pair)
            or not (hf_rms_norm(attn.q_a_layernorm) and hf_rms_norm(attn.kv_a_layernorm))):
        return None
    if fp8_pair:                         # FP8 weights: the fp8 kernel's split-K partials
        parts = fp8.fp8_pair_partials(m1, m2, x, x_quant)                 # [K, B, S, NQ+L+R]
        if parts is None:
            return None
    else:
        parts = prefill_part(m1, m2, x, attn.q_a_layernorm, attn.kv_a_layernorm)
        if parts is None:                                                 # decode rows
            w1, w2 = m1.weight, m2.weight
            split_k = gemm.pair_split_k(x, w1, w2)
            if split_k <= 1:
                return None
            parts = torch.ops.mla.decode_linear_pair_partials(x, w1, w2, split_k)  # [K, B, S, ..]
    cos, sin, rope = angles                                   # [B, S, R] (V2: R / 2) each
    nq, nkv = attn.q_a_layernorm, attn.kv_a_layernorm
    args = (parts, nq.weight, nkv.weight, cos, sin, float(nq.variance_epsilon),
            float(nkv.variance_epsilon), rope)
    if fp8_pair and fp8.uses_fp8_ops(attn.q_b_proj):   # q_a quantized for q_b's fp8 GEMM
        q_a, kv_row, q_q, q_s = torch.ops.mla.decode_qkv_prologue_fp8(
            *args, fp8.groups(attn.q_b_proj)[1])
        return q_a, kv_row, (q_q, q_s)
    return (*torch.ops.mla.decode_qkv_prologue(*args), None)


def q_kv_rope_prologue(attn, x: torch.Tensor, position_embeddings, decode: bool = False):
    """(q with RoPE [B, S, N, P + R], [kv_a_layernorm(kv_c) | RoPE(k_pe)] [B, S, L + R],
    None) of a DeepSeek-V2 attention without q_lora for the rows x [B, S, H]: the q_proj +
    kv_a GEMM's fp32 partials for decode rows (its config's K splits, maybe one), the two
    modules' outputs for a prefill's (prefill_part), then one op (mla::decode_q_kv_rope)
    for the key norm and both RoPEs on V2's complex pairs. With decode (every row a decode
    row) where its kernel serves: (None, the cache row, the absorbed decode query
    [B * S, N, L + R]), the query absorbed in the same launch (mla::decode_q_kv_absorb).
    None where that path does not apply (another family, q_lora, a GEMM or rows the decode
    kernels do not serve: then the caller runs the modules)."""
    angles = rope_angles(attn, position_embeddings)
    if angles is None or angles[2] != 2 or attn.q_lora_rank is not None:
        return None
    m1, m2 = attn.q_proj, attn.kv_a_proj_with_mqa
    if not use_ops(m1, m2) or not hf_rms_norm(attn.kv_a_layernorm):
        return None
    parts = prefill_part(m1, m2, x, attn.kv_a_layernorm)                  # [1, B, S, NQ+L+R]
    if parts is None:                                                     # decode rows
        if (gemm.linear_unmet(x, m1.weight, m2.weight) is not None
                or decode_rows_unmet(x.device, x.dtype, x.numel() // x.shape[-1]) is not None):
            return None
        split_k = gemm.pair_split_k(x, m1.weight, m2.weight)
        parts = torch.ops.mla.decode_linear_pair_partials(x, m1.weight, m2.weight, split_k)
    cos, sin, _ = angles                                      # [B, S, R/2] each (freqs_cis)
    nkv, mla = attn.kv_a_layernorm, attn.mla_attn
    args = (parts, nkv.weight, cos, sin, float(nkv.variance_epsilon), mla.num_heads)
    if (decode and mla.q_scale is None and mla.W_UK_T.dtype == x.dtype
            and q_kv_absorb_unmet(parts, mla.W_UK_T, 2 * cos.shape[-1]) is None):
        decode_q, kv_row = torch.ops.mla.decode_q_kv_absorb(parts, nkv.weight, mla.W_UK_T,
                                                            *args[2:])
        return None, kv_row, decode_q
    return (*torch.ops.mla.decode_q_kv_rope(*args), None)


def absorbed_decode_query(attn, q_a: torch.Tensor, position_embeddings, q_a_quant=None):
    """The absorbed decode query [T, N, L + R] = [q_nope @ W_UK_T | RoPE(q_pe)] of a
    converted DeepSeek-V3 (or V2 with q_lora) attention, from q_a_layernorm's output q_a
    [B, S, q_lora]: q_b_proj, the query's RoPE and the absorption in one launch (mla::decode_q_absorb; with an fp8
    decode query, mla::decode_q_absorb_fp8, quantized with the layer's q_scale). An FP8
    checkpoint's q_b_proj: mla::decode_q_absorb_w8a8, from q_a_quant = (q_q, q_s), q_a
    quantized by the prologue (qkv_a_prologue). Call it for decode rows only. None where
    its kernel does not serve the call (then the caller runs q_b_proj and the attention op
    absorbs)."""
    mla = attn.mla_attn
    angles = rope_angles(attn, position_embeddings)
    if angles is None:
        return None
    w, (cos, sin, rope) = attn.q_b_proj.weight, angles        # cos / sin [B, S, R] (V2: R/2)
    if q_a_quant is not None and fp8.uses_fp8_ops(attn.q_b_proj):       # fp8 weights, W8A8
        gn, gk = fp8.groups(attn.q_b_proj)
        if (mla.W_UK_T.dtype != q_a.dtype
                or w8a8_unmet(q_a, w, mla.W_UK_T, rope_width(cos, rope), gk) is not None):
            return None
        return torch.ops.mla.decode_q_absorb_w8a8(q_a, *q_a_quant, w,
                                                  attn.q_b_proj.weight_scale_inv, mla.W_UK_T,
                                                  cos, sin, rope, gn, gk, mla.q_scale)
    if not use_ops(attn.q_b_proj):
        return None
    if (w.dtype != q_a.dtype or mla.W_UK_T.dtype != q_a.dtype
            or q_absorb_unmet(q_a, w, mla.W_UK_T, rope_width(cos, rope)) is not None):
        return None
    if mla.q_scale is not None:            # an fp8 decode query: quantized in the same launch
        return torch.ops.mla.decode_q_absorb_fp8(q_a, w, mla.W_UK_T, cos, sin, rope,
                                                 mla.q_scale)
    return torch.ops.mla.decode_q_absorb(q_a, w, mla.W_UK_T, cos, sin, rope)


# ------------------------------------------------------------------------- MLP


def _hf_mlp_classes():
    out = []
    for mod, cls in (("deepseek_v3", "DeepseekV3MLP"), ("deepseek_v2", "DeepseekV2MLP"),
                     ("deepseek_v32", "DeepseekV32MLP")):
        try:
            m = __import__(f"transformers.models.{mod}.modeling_{mod}", fromlist=[cls])
            out.append(getattr(m, cls))
        except (ImportError, AttributeError):
            pass
    return tuple(out)


def fusable_mlp(m) -> bool:
    """An HF DeepSeek MLP (dense layer or shared experts) with SiLU and plain linears."""
    classes = _hf_mlp_classes()
    return (bool(classes) and isinstance(m, classes)
            and getattr(m.config, "hidden_act", None) in ("silu", "swish")
            and (_plain(m.gate_proj, m.up_proj, m.down_proj)
                 or fp8.fp8_mlp_served(m))
            and m.gate_proj.weight.shape == m.up_proj.weight.shape)


def _mlp_forward(self, x, residual=None, x_quant=None):
    """down_proj(silu(gate_proj(x)) * up_proj(x)) (+ residual, the decoder layer's add, in
    down_proj's epilogue): x [..., H] -> [..., H]. FP8 linears: the fp8 ops (x_quant: x
    quantized by the norm before them, mla_ops/hf/layer.py)."""
    if fp8.uses_fp8_ops(self.gate_proj, self.up_proj, self.down_proj):
        return fp8.fp8_mlp(self, x, residual, x_quant)
    if mla_config.linear_impl == "torch" or _needs_grad(self.gate_proj, self.up_proj,
                                                         self.down_proj):
        y = self.hf_forward(x)
        return y if residual is None else residual + y
    h = torch.ops.mla.decode_gate_up(x, self.gate_proj.weight, self.up_proj.weight)   # [..., I]
    return decode_linear(h, self.down_proj.weight, residual)             # split-K per CONFIGS


_CLASSES: dict = {}


def converted_class(cls, prefix: str, forward):
    """The subclass of cls whose forward is `forward` (HF's kept as hf_forward), made once."""
    key = (cls, prefix)
    if key not in _CLASSES:
        _CLASSES[key] = type(f"{prefix}{cls.__name__}", (cls,), {
            "forward": forward, "hf_forward": cls.forward, "mla_converted": True,
            "__module__": __name__})
    return _CLASSES[key]


def fused_mlp_class(cls):
    return converted_class(cls, "Fused", _mlp_forward)


# ------------------------------------------------------------------------- output head


def _head_forward(self, x):
    """lm_head(x): [..., H] -> [..., vocab] on the decode GEMM op (the module's own
    F.linear with grad enabled or lowering.config.linear_impl = "torch")."""
    if mla_config.linear_impl == "torch" or _needs_grad(self):
        return self.hf_forward(x)
    return decode_linear(x, self.weight)


def decode_head_class(cls):
    """A subclass of the (plain nn.Linear) output head whose forward runs the decode op."""
    return converted_class(cls, "Decode", _head_forward)


def convertible_head(model):
    """The model's output head when it is a plain bias-free nn.Linear, else None."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head if head is not None and _plain(head) else None
