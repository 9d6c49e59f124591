"""The MLA families convert() takes: one row each (HF's modeling module, attention class,
RoPE, any extra query scale, which forward), and the helpers that read the table.

Each row's attention computes what DeepseekV3Attention computes, up to config values and
what the row names:

  deepseek_v3     V3 (also Kimi K2): RoPE interleaved or not (config.rope_interleave)
  deepseek_v2     V2: complex RoPE (apply_rotary_emb on freqs_cis)
  deepseek_v32    V3.2: V3's MLA + DSA (its own forward: mla_ops/hf/v32.py)
  glm4_moe_lite   GLM-4.7-Flash: V3's forward line for line
  youtu           Youtu-LLM: V3's forward line for line
  minicpm3        MiniCPM3: V3's forward with the plain cos / sin RoPE always (no
                  rope_interleave in its config)
  mistral4        Mistral 4: V3's forward, then the query (all P + R columns) times
                  HF's Llama-4 position scale 1 + beta * log(1 + floor(pos / orig_max))

Only the attention is swapped for the families past V3.2: their decoder layers, MLPs,
MoE blocks and norms run HF's code (mla_ops/hf/layer.py, linear.py and moe.py fuse the
DeepSeek classes only).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable

import torch


def rope_per_config(self, q_rot, k_rot, position_embeddings):
    """HF's cos / sin RoPE of this layer: q_rot [B, N, S, R], k_rot [B, 1, S, R];
    interleaved where the family has that variant and config.rope_interleave is set."""
    cos, sin = position_embeddings                                         # [B, S, R]
    if self._mla_rope_interleave is not None and self.config.rope_interleave:
        return self._mla_rope_interleave(q_rot, k_rot, cos, sin)
    return self._mla_rope(q_rot, k_rot, cos, sin)


def rope_complex(self, q_rot, k_rot, position_embeddings):
    """DeepSeek-V2's complex RoPE: position_embeddings are its freqs_cis."""
    return self._mla_rope(q_rot, k_rot, position_embeddings.to(q_rot.device))


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
    rope_fn: str = "apply_rotary_pos_emb"
    rope_interleave_fn: str | None = "apply_rotary_pos_emb_interleave"
    query_scale: Callable | None = None   # (attn, forward kwargs) -> [B, S], or None
    sparse: bool = False         # DSA: the V3.2 forward


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
)

FAMILY_NAMES = tuple(f.module for f in FAMILIES)


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


def class_attributes(cls, fam: Family) -> dict:
    """The attributes a converted class of `cls` (an HF attention class of row `fam`) takes
    from the row: HF's own RoPE functions from the class's modeling file, the row's RoPE
    and query scale."""
    mod = sys.modules[cls.__module__]
    inter = fam.rope_interleave_fn
    return {"mla_family": fam.tag, "_mla_module": mod,
            "_mla_rope": staticmethod(getattr(mod, fam.rope_fn)),
            "_mla_rope_interleave": staticmethod(getattr(mod, inter)) if inter else None,
            "mla_rope": fam.rope, "mla_query_scale": fam.query_scale}
