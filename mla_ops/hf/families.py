"""The MLA families convert() takes: one row each (HF's modeling module, attention class,
RoPE, which forward, and the row's small adapters: a query scale, constant factors, a query
or output-gate hook), and the helpers that read the table.

Each row's attention computes what DeepseekV3Attention computes, up to config values and
what the row names:

  deepseek_v3     V3 (also Kimi K2, and Kimi K2.5's language model beside its vision
                  tower): RoPE interleaved or not (config.rope_interleave)
  deepseek_v2     V2: complex RoPE (apply_rotary_emb on freqs_cis)
  deepseek_v32    V3.2: V3's MLA + DSA (its own forward: mla_ops/hf/v32.py)
  glm4_moe_lite   GLM-4.7-Flash: V3's forward line for line
  youtu           Youtu-LLM: V3's forward line for line
  minicpm3        MiniCPM3: V3's forward with the plain cos / sin RoPE always (no
                  rope_interleave in its config)
  mistral4        Mistral 4: V3's forward, then the query (all P + R columns) times
                  HF's Llama-4 position scale 1 + beta * log(1 + floor(pos / orig_max))
  longcat_flash   LongCat-Flash: two MLA blocks per decoder layer (HF's layer_idx 2i and
                  2i + 1; config.num_hidden_layers is 2 * num_layers); interleaved RoPE
                  always; the query times mla_scale_q_lora and the normed latent times
                  mla_scale_kv_lora: both constants, folded into the softmax scale and
                  the absorbed weights at conversion (latent_scales)
  kimi_linear     Kimi Linear: MLA with no RoPE at all (the rotary columns pass through)
                  on its full-attention layers; its KDA (linear attention) layers stay
                  HF's and keep their state in HF's cache layers inside PagedMLACache
                  (beside: the attention classes allowed next to the MLA ones)
  glm_moe_dsa     GLM-5: V3.2's forward; the indexer's RoPE is interleaved (V3.2's is
                  half-split), and a layer whose config.indexer_types entry is "shared"
                  has no indexer: it reuses the previous layer's top-k, which the decoder
                  layers pass along as the attention's third output (shares_topk)
  axk1            A.X K1: V3's forward line for line (Q-LoRA always)
  bailing_hybrid  Ling 3 (Bailing hybrid): V3's forward with interleaved RoPE always, the
                  heads' outputs times a per-head gate sigmoid(g_proj(x)) before o_proj
                  (output_gate); KDA layers beside it kept HF's, as for Kimi Linear
  axk2            A.X K2: V3.2's forward and indexer, but no q_b_proj: one projection
                  q_gate_proj([q_a_layernorm(q_a) | q_a]) gives each head's query and a
                  gate [V] (query), and the heads' outputs are multiplied by
                  sigmoid(gate) in fp32 before o_proj (output_gate)

Only the attention is swapped for the families past V3.2: their decoder layers, MLPs,
MoE blocks and norms run HF's code (mla_ops/hf/layer.py, linear.py and moe.py fuse the
DeepSeek classes only).

Refused (REFUSED below, with the reason convert() gives): Mistral Large 4, HY V4 (and
HY V4 VL), dots3 note and GLM-5 Next.
"""
from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch


class V2Rotary(NamedTuple):
    """What a DeepSeek-V2 model's rotary module returns after convert(): HF's complex
    freqs_cis [b, s, R/2], and its real and imaginary parts, cos and sin of HF's angles
    times its attention_scaling, computed in fp32 once per forward without the complex
    tensor (one fused kernel of a compiled step, where freqs_cis, if nothing reads it, is
    dropped). The converted layers' kernels read the parts; HF's own code gets freqs_cis
    back (freqs_cis_of)."""
    freqs_cis: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor


def freqs_cis_of(position_embeddings):
    """HF's form of a layer's position embeddings (V2Rotary -> its freqs_cis)."""
    if isinstance(position_embeddings, V2Rotary):
        return position_embeddings.freqs_cis
    return position_embeddings


def _v2_rotary_forward(self, x, position_ids):
    freqs_cis = self.hf_forward(x, position_ids)         # [b, s, R/2]; HF's rope updates run
    inv_freq = self.inv_freq.to(device=x.device, dtype=torch.float)
    angles = position_ids[..., None].float() * inv_freq                  # HF's, [b, s, R/2]
    scale = self.attention_scaling                       # polar(1, a) * s = (cos a * s, sin a * s)
    return V2Rotary(freqs_cis, torch.cos(angles) * scale, torch.sin(angles) * scale)


@functools.cache
def _v2_rotary_class(cls):
    return type(cls.__name__, (cls,), {"forward": _v2_rotary_forward, "hf_forward": cls.forward,
                                       "mla_converted": True, "__module__": __name__})


def convert_v2_rotary(model) -> None:
    """Swap the class of every HF DeepseekV2RotaryEmbedding in model (in place) for one
    whose forward returns V2Rotary."""
    for m in model.modules():
        cls = type(m)
        if (cls.__name__ == "DeepseekV2RotaryEmbedding" and cls.__module__.startswith("transformers.")
                and not getattr(m, "mla_converted", False)):
            m.__class__ = _v2_rotary_class(cls)


def rope_per_config(self, q_rot, k_rot, position_embeddings):
    """HF's cos / sin RoPE of this layer: q_rot [B, N, S, R], k_rot [B, 1, S, R];
    interleaved where the family has that variant and config.rope_interleave is set."""
    cos, sin = position_embeddings                                         # [B, S, R]
    if self._mla_rope_interleave is not None and self.config.rope_interleave:
        return self._mla_rope_interleave(q_rot, k_rot, cos, sin)
    return self._mla_rope(q_rot, k_rot, cos, sin)


def rope_complex(self, q_rot, k_rot, position_embeddings):
    """DeepSeek-V2's complex RoPE: position_embeddings are its freqs_cis (or V2Rotary)."""
    return self._mla_rope(q_rot, k_rot, freqs_cis_of(position_embeddings).to(q_rot.device))


def rope_interleaved(self, q_rot, k_rot, position_embeddings):
    """Interleaved RoPE whatever the config says (LongCat-Flash has no rope_interleave)."""
    cos, sin = position_embeddings                                         # [B, S, R]
    return self._mla_rope_interleave(q_rot, k_rot, cos, sin)


def rope_none(self, q_rot, k_rot, position_embeddings):
    """No RoPE (Kimi Linear's MLA): the rotary columns pass through as projected."""
    return q_rot, k_rot


def longcat_latent_scales(attn) -> tuple[float, float]:
    """LongCat-Flash's constant factors: (query, normed latent) = (mla_scale_q_lora,
    mla_scale_kv_lora). The query's (all P + R columns) goes into the softmax scale, the
    latent's into W_UK_T and W_UV (the latent feeds keys and values only through kv_b_proj;
    the rotary key k_pe is not scaled)."""
    return float(attn.mla_scale_q_lora), float(attn.mla_scale_kv_lora)


def head_gate(self, x: torch.Tensor, out: torch.Tensor, gate=None) -> torch.Tensor:
    """Ling 3's output gate: out [B, S, N*V] (the heads' outputs) times sigmoid(g_proj(x)),
    one gate per head [B, S, N] computed in fp32 and cast back, as HF does."""
    B, S, _ = x.shape
    g = torch.sigmoid(self.g_proj(x).float()).to(x.dtype)                  # [B, S, N]
    return (out.view(B, S, g.shape[-1], -1) * g[..., None]).view(B, S, -1)


def q_gate_query(self, q_a: torch.Tensor, q_resid: torch.Tensor):
    """A.X K2's query: q_gate_proj([q_resid | q_a]) [B, S, N, P+R+V], split per head into
    the query [B, S, N*(P+R)] and the output gate [B, S, N*V]."""
    B, S, _ = q_a.shape
    N, PR, V = self.num_heads, self.qk_head_dim, self.v_head_dim
    qg = self.q_gate_proj(torch.cat([q_resid, q_a], dim=-1)).view(B, S, N, PR + V)
    q, gate = torch.split(qg, [PR, V], dim=-1)
    return q.reshape(B, S, N * PR), gate.reshape(B, S, N * V)


def channel_gate(self, x: torch.Tensor, out: torch.Tensor, gate) -> torch.Tensor:
    """A.X K2's output gate: out [B, S, N*V] times sigmoid(gate [B, S, N*V]) in fp32, cast
    back to out's dtype, as HF does."""
    return (out * torch.sigmoid(gate.float())).to(out.dtype)


def llama4_query_scale(self, kwargs: dict) -> torch.Tensor:
    """Mistral 4's per-token query scale [B, S] (HF's get_llama_4_attn_scale on the call's
    position_ids, with the config's llama_4_scaling_beta and original_max_position_embeddings)."""
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        raise ValueError("a converted Mistral 4 attention needs position_ids (its query scale "
                         "depends on each token's position)")
    rp = self.config.rope_parameters
    scale = self._mla_module.get_llama_4_attn_scale(
        position_ids, rp.get("llama_4_scaling_beta"), rp.get("original_max_position_embeddings"))
    return scale[:, 0, :, 0]                                                 # [B, S]


@dataclass(frozen=True)
class Family:
    tag: str                     # the converted module's mla_family
    module: str                  # transformers.models.<module>.modeling_<module>
    attention: str               # the attention class in that module
    rope: Callable               # (attn, q_rot, k_rot, position_embeddings) -> (q_rot, k_rot)
    rope_fn: str | None = "apply_rotary_pos_emb"
    rope_interleave_fn: str | None = "apply_rotary_pos_emb_interleave"
    query_scale: Callable | None = None   # (attn, forward kwargs) -> [B, S], or None
    latent_scales: Callable | None = None  # (attn) -> (query, latent) constants, or None
    # (attn, x [B,S,H], out [B,S,N*V], the query's gate or None) -> [B,S,N*V]
    output_gate: Callable | None = None
    # sparse forward: (attn, q_a, q_resid [B,S,q_lora]) -> (q [B,S,N*(P+R)], gate or None)
    query: Callable | None = None
    sparse: bool = False         # DSA: the V3.2 forward
    index_rope_fn: str = "apply_rotary_pos_emb"   # the DSA indexer's RoPE
    shares_topk: bool = False    # DSA layers may reuse the previous layer's top-k
    beside: tuple = ()           # other attention classes the model may hold (kept HF's)

    def __post_init__(self):
        if self.query is not None and not self.sparse:
            raise ValueError(f"family {self.tag}: a query hook is read by the sparse forward only")


FAMILIES = (
    Family("v3", "deepseek_v3", "DeepseekV3Attention", rope_per_config),
    Family("v2", "deepseek_v2", "DeepseekV2Attention", rope_complex,
           rope_fn="apply_rotary_emb", rope_interleave_fn=None),
    Family("v32", "deepseek_v32", "DeepseekV32Attention", rope_per_config, sparse=True),
    Family("glm4_moe_lite", "glm4_moe_lite", "Glm4MoeLiteAttention", rope_per_config),
    Family("youtu", "youtu", "YoutuAttention", rope_per_config),
    Family("minicpm3", "minicpm3", "MiniCPM3Attention", rope_per_config,
           rope_interleave_fn=None),
    Family("mistral4", "mistral4", "Mistral4Attention", rope_per_config,
           query_scale=llama4_query_scale),
    Family("longcat_flash", "longcat_flash", "LongcatFlashMLA", rope_interleaved,
           rope_fn=None, latent_scales=longcat_latent_scales),
    Family("kimi_linear", "kimi_linear", "KimiLinearAttention", rope_none, rope_fn=None,
           rope_interleave_fn=None, beside=("KimiLinearDeltaAttention",)),
    Family("glm_moe_dsa", "glm_moe_dsa", "GlmMoeDsaAttention", rope_interleaved,
           rope_fn=None, sparse=True, index_rope_fn="apply_rotary_pos_emb_interleave",
           shares_topk=True),
    Family("axk1", "axk1", "AXK1Attention", rope_per_config),
    Family("bailing_hybrid", "bailing_hybrid", "BailingHybridAttention", rope_interleaved,
           rope_fn=None, output_gate=head_gate, beside=("BailingHybridDeltaAttention",)),
    Family("axk2", "axk2", "AXK2Attention", rope_interleaved, sparse=True,
           query=q_gate_query, output_gate=channel_gate),
)

FAMILY_NAMES = tuple(f.module for f in FAMILIES)

# MLA families convert() refuses: (HF module, attention class, why)
REFUSED = (
    ("mistral_large4", "MistralLarge4TextAttention",
     "Mistral Large 4's DSA differs from DeepSeek-V3.2's beyond one adapter: layers share "
     "latent KV across layers (config.kv_sharing_modes 'reuse' / 'store': a layer reads "
     "another layer's cache), no-RoPE layers change the head split (qk_rope_head_dim 0, "
     "nope P + R), the query has no LoRA and a per-position softmax scaling, and the "
     "indexer's query comes from a LayerNorm of the hidden states (not q_resid)"),
    ("hy_v4", "HYV4Attention",
     "HY V4's attention adds learned attention sinks (s_aux) to the softmax and a per-channel "
     "sigmoid output gate, and its DSA indexer rotates the last qk_rope_head_dim columns with "
     "a float32 k_norm (V3.2's: the first ones)"),
    ("hy_v4_vl", "HYV4VLAttention",
     "HY V4 VL's language model has HY V4's attention (learned attention sinks, a sigmoid "
     "output gate, an indexer rotating the last rotary columns)"),
    ("dots3_note", "Dots3NoteTextAttention",
     "dots3 note's attention norms the rotary key (k_rope_only_layernorm), has sliding-window "
     "layers and a per-head output gate, and its DSA layers are mixed per layer_types"),
    ("glm5_next", "Glm5NextTextAttention",
     "GLM-5 Next's DSA indexer scores pools of index_kpool keys (gated pooling with learned "
     "offsets) and expands the chosen pools (and the tail) to tokens, where V3.2's scores "
     "every token; its MLA applies no RoPE, beside linear-attention layers"),
)


def hf_classes() -> list:
    """(Family, class) of the rows whose attention class the installed transformers has."""
    out = []
    for fam in FAMILIES:
        try:
            m = __import__(f"transformers.models.{fam.module}.modeling_{fam.module}",
                           fromlist=[fam.attention])
            out.append((fam, getattr(m, fam.attention)))
        except (ImportError, AttributeError):
            pass
    return out


def family_of(module) -> Family | None:
    for fam, cls in hf_classes():
        if isinstance(module, cls):
            return fam
    return None


def _named_classes(items) -> list:
    """(item, class) for (module, class name, item) triples the installed transformers has."""
    out = []
    for mod, name, item in items:
        try:
            m = __import__(f"transformers.models.{mod}.modeling_{mod}", fromlist=[name])
            out.append((item, getattr(m, name)))
        except (ImportError, AttributeError):
            pass
    return out


@functools.cache
def _refused_classes() -> list:
    return _named_classes(REFUSED)


@functools.cache
def _beside_classes() -> list:
    return _named_classes((f.module, c, f) for f in FAMILIES for c in f.beside)


def refusal_of(module) -> str | None:
    """Why convert() refuses this attention module (an MLA family it cannot take), or None."""
    for why, cls in _refused_classes():
        if isinstance(module, cls):
            return why
    return None


def beside_of(module) -> Family | None:
    """The family row whose models may hold this (non-MLA) attention module, or None."""
    for fam, cls in _beside_classes():
        if isinstance(module, cls):
            return fam
    return None


def class_attributes(cls, fam: Family) -> dict:
    """The attributes a converted class of `cls` (an HF attention class of row `fam`) takes
    from the row: HF's own RoPE functions from the class's modeling file, the row's RoPE,
    query scale, query and output gate hooks, and whether it hands on its top-k."""
    mod = sys.modules[cls.__module__]

    def fn(name):
        return staticmethod(getattr(mod, name)) if name else None
    attrs = {"mla_family": fam.tag, "_mla_module": mod, "_mla_rope": fn(fam.rope_fn),
             "_mla_rope_interleave": fn(fam.rope_interleave_fn),
             "mla_rope": fam.rope, "mla_query_scale": fam.query_scale,
             "mla_output_gate": fam.output_gate, "mla_query": fam.query,
             "mla_shares_topk": fam.shares_topk}
    if fam.sparse:
        attrs["_mla_index_rope"] = fn(fam.index_rope_fn)
    return attrs


MLA_PARTS = ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")


def layout_unmet(attn, fam: Family) -> str | None:
    """Why an HF attention module of row `fam` lacks the MLA layout the converted forward
    reads (V3's: q_lora_rank with q_proj, or q_a_proj / q_a_layernorm and q_b_proj unless
    the row's query hook builds the query; the kv_a, kv_b and o projections), or None.
    Another transformers version may lay a family out differently (Ling 3 in 5.23: no
    q_lora_rank)."""
    missing = [p for p in MLA_PARTS if not hasattr(attn, p)]
    if not hasattr(attn, "q_lora_rank"):
        missing.append("q_lora_rank")
    elif attn.q_lora_rank is None:
        missing += [p for p in ("q_proj",) if not hasattr(attn, p)]
    else:
        parts = ("q_a_proj", "q_a_layernorm") + (("q_b_proj",) if fam.query is None else ())
        missing += [p for p in parts if not hasattr(attn, p)]
    return f"has no {', '.join(missing)}" if missing else None
