"""A converted HF DeepSeek decoder layer's norms and residual adds.

HF's decoder layer computes

    h = residual + self_attn(input_layernorm(residual))
    out = h + mlp(post_attention_layernorm(h))

Compiled, Inductor fuses each residual add into the RMSNorm after it and never stores the
sum: every later norm recomputes the chain from the embedding, and a looped reduction
over a few rows of 7168 takes 3-5 µs on an H200. Converted, each add is the epilogue of the
GEMM before it (o_proj, down_proj: mla::decode_linear_residual), and the norms (the
layers' two and the model's final one) run as mla::rms_norm, one pass over a row held in
registers. Where o_proj's decode GEMM splits K (V2-Lite's), its partials' sum, the residual
add and the post-attention norm are one launch, mla::residual_rms_norm. Same roundings as
HF's modules; off the GPU's decode path the ops compute exactly what the modules do.

An FP8 checkpoint's MLP or MoE block quantizes its input per 128 columns for its fp8
GEMMs; where the post-attention norm is that launch (o_proj splits K: DeepSeek-V3's), it
also writes its output quantized (mla::residual_rms_norm_fp8) and the MLP's GEMMs read
that instead of quantizing it in launches of their own (the same values); likewise the
input norm (mla::rms_norm_fp8) for an fp8 q_a + kv_a pair.
"""
from __future__ import annotations

import torch

from lowering import config as mla_config
import lowering.fused.norm  # noqa: F401  (registers mla::rms_norm)

from mla_ops.hf.fp8_linear import decode_rows as fp8_decode_rows
from mla_ops.hf.fp8_linear import mlp_quant_group, pair_quant_group
from mla_ops.hf.linear import converted_class, hf_rms_norm
from mla_ops.hf.moe import block_quant_group

_LAYERS = ("DeepseekV3DecoderLayer", "DeepseekV2DecoderLayer", "DeepseekV32DecoderLayer")


def _on(*params) -> bool:
    # decided in the traced Python, so the choice is part of the compiled graph
    # (convert(fuse_norms=False) leaves the layers' classes as HF's)
    return (mla_config.linear_impl != "torch"
            and not (torch.is_grad_enabled() and any(p.requires_grad for p in params)))


def _norm_forward(self, x):
    """HF's RMSNorm of x [..., H] as mla::rms_norm."""
    if not _on(self.weight):
        return self.hf_forward(x)
    return torch.ops.mla.rms_norm(x, self.weight, float(self.variance_epsilon))


def decode_norm_class(cls):
    return converted_class(cls, "Decode", _norm_forward)


def fusable_layer(layer) -> bool:
    """An HF DeepSeek decoder layer with HF's norms around a converted MLA attention."""
    return (type(layer).__name__ in _LAYERS and type(layer).__module__.startswith("transformers.")
            and getattr(layer.self_attn, "mla_converted", False)
            and hf_rms_norm(layer.input_layernorm)
            and hf_rms_norm(layer.post_attention_layernorm))


def _layer_forward(self, hidden_states, attention_mask=None, position_ids=None,
                   use_cache=False, position_embeddings=None, **kwargs):
    """HF's decoder layer with the residual adds inside o_proj's and down_proj's GEMMs:
    hidden_states [B, S, H] -> [B, S, H]. The cache travels in kwargs under the name the
    caller used (cache from transformers 5.24, past_key_values before)."""
    if not _on(self.input_layernorm.weight, self.post_attention_layernorm.weight):
        return self.hf_forward(hidden_states, attention_mask=attention_mask,
                               position_ids=position_ids, use_cache=use_cache,
                               position_embeddings=position_embeddings, **kwargs)
    residual = hidden_states
    norm, group = self.input_layernorm, getattr(self.input_layernorm, "mla_quant_group", 0)
    if group and fp8_decode_rows(hidden_states):  # an fp8 q_a + kv_a: quantized for it too
        x, x_q, x_s = torch.ops.mla.rms_norm_fp8(hidden_states, norm.weight,
                                                 float(norm.variance_epsilon), group)
        kwargs["mla_x_quant"] = (x_q, x_s)
    else:
        x = norm(hidden_states)
    first = self.self_attn(hidden_states=x, attention_mask=attention_mask,
                           position_ids=position_ids, use_cache=use_cache,
                           position_embeddings=position_embeddings, mla_residual=residual,
                           mla_post_norm=self.post_attention_layernorm, **kwargs)[0]
    x_quant = ()
    if isinstance(first, tuple):      # on the paged cache: (residual + attention, its norm
        h, x, *x_quant = first        # [, the norm quantized for an fp8 MLP])
    else:                             # HF's attention (another cache): residual + attention
        h, x = first, self.post_attention_layernorm(first)
    if getattr(self.mlp, "mla_converted", False):         # the fused SiLU MLP, our MoE block
        return self.mlp(x, h, *x_quant)                               # h + mlp(x)
    return h + self.mlp(x)


def fused_layer_class(cls):
    return converted_class(cls, "Fused", _layer_forward)


def convert_layers(model) -> None:
    """Swap the classes of model's fusable decoder layers, their two norms and the final
    norm (in place; call after the attentions are converted)."""
    layers = [m for m in model.modules() if fusable_layer(m)]
    if not layers:
        return
    norms = [n for l in layers for n in (l.input_layernorm, l.post_attention_layernorm)]
    base = getattr(model, "model", model)
    final = getattr(base, "norm", None)
    if final is not None and hf_rms_norm(final):
        norms.append(final)
    for n in norms:
        n.__class__ = decode_norm_class(type(n))
    for l in layers:
        l.__class__ = fused_layer_class(type(l))
        # an fp8 MLP / MoE block after the post-attention norm: the norm's launch quantizes
        # its output for the fp8 GEMMs (linear_residual_norm)
        group = mlp_quant_group(l.mlp) or block_quant_group(l.mlp)
        if group:
            l.post_attention_layernorm.mla_quant_group = group
        group = pair_quant_group(l.self_attn)         # the input norm, for q_a + kv_a
        if group:
            l.input_layernorm.mla_quant_group = group
