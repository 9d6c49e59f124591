"""The start of every converted attention forward: the step runs on the MLA ops only with a
PagedMLACache; with any other cache (or none) the layer runs HF's own forward."""
from __future__ import annotations

from mla_ops.hf.cache import PagedMLACache
from mla_ops.hf.families import freqs_cis_of


def paged_or_hf(self, hidden_states, position_embeddings, attention_mask, past_key_values,
                kwargs: dict):
    """(mla_residual, cache, None) when this call's cache is a PagedMLACache; else
    (None, None, HF's (output, weights, ...)) with the residual of a converted decoder layer
    added. transformers < 5.24 passes the cache as past_key_values, later versions as
    cache. Pops mla_residual from kwargs."""
    residual = kwargs.pop("mla_residual", None)
    cache = past_key_values if past_key_values is not None else kwargs.get("cache")
    if isinstance(cache, PagedMLACache):
        return residual, cache, None
    if past_key_values is not None:
        kwargs["past_key_values"] = past_key_values
    if position_embeddings is not None:       # (Kimi Linear's MLA takes none)
        kwargs["position_embeddings"] = freqs_cis_of(position_embeddings)
    out, *rest = self.hf_forward(hidden_states=hidden_states, attention_mask=attention_mask,
                                 **kwargs)          # (GLM-5's: a third output, its top-k)
    return None, None, ((out if residual is None else residual + out), *rest)
