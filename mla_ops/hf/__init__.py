"""HuggingFace DeepSeek V2 / V3 / V3.2 on the MLA ops (V3.2: mla_ops/hf/v32.py).

    import mla_ops.hf
    model = mla_ops.hf.convert(model)                      # in place; returns the model
    out = model.generate(ids, attention_mask=mask, max_new_tokens=n)   # on a PagedMLACache

generate() with no cache argument builds a PagedMLACache sized from the call
(mla_ops/hf/generate.py); a cache passed as cache= (transformers >= 5.24) or
past_key_values= is used as is: cache_kwargs(model, cache) names the argument the
installed transformers takes.

convert() keeps every HF attention module (and its parameters) and swaps its class
for a subclass whose forward computes q / kv_c_normed / k_pe exactly as HF does,
then calls mla::kv_cache_update and mla::attention_with_output with the absorbed
weights W_UK_T [N, P, L] and W_UV [N, L, V] (the only new tensors; non-persistent
buffers, so state_dict is unchanged). With any other cache (or none) the layer runs
HF's own forward. The layer's projections, the SiLU MLPs (fuse_mlp) and the output head
(decode_head) run on the decode GEMM ops of mla_ops/hf/linear.py with the modules' own
weights; the decoder layers' residual adds and norms (fuse_norms) on those GEMMs'
epilogues and mla::rms_norm (mla_ops/hf/layer.py).

PagedMLACache (mla_ops/hf/cache.py) is a real transformers Cache over the paged latent
cache; the converted layers ask it for each step's plan. DecodeGraph (mla_ops/hf/graph.py)
captures a converted model's whole decode step in one CUDA graph. shard(model, group)
(mla_ops/hf/tensor_parallel.py; or convert(model, tp_group=group)) splits the model's
heads and MLP / expert slices over a torch.distributed group for tensor parallelism.
"""
import transformers as _transformers

from mla_ops.hf.requirements import check_transformers_version

check_transformers_version(_transformers.__version__)

from mla_ops.hf.convert import CacheFullError, convert, is_converted  # noqa: E402,F401
from mla_ops.hf.cache import PagedMLACache  # noqa: E402,F401
from mla_ops.hf.graph import DecodeGraph  # noqa: E402,F401
from mla_ops.hf.prefill_graph import PrefillGraph  # noqa: E402,F401
from mla_ops.hf.generate import cache_kwargs  # noqa: E402,F401
from mla_ops.hf.tensor_parallel import shard  # noqa: E402,F401

__all__ = ["convert", "PagedMLACache", "DecodeGraph", "PrefillGraph", "is_converted",
           "cache_kwargs", "shard"]
