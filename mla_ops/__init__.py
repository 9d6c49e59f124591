"""MLA (multi-head latent attention) as torch.compile-friendly custom ops.

model -> MLAAttention (mla_ops.layer) -> torch.ops.mla.* (mla_ops.ops) -> lowering.mla_decode
"""
from mla_ops import ops  # noqa: F401  registers torch.ops.mla.kv_cache_update / attention_with_output
from mla_ops.cache import BlockAllocator, CacheFullError, PagedLatentCache
from mla_ops.layer import MLAAttention, mla_softmax_scale, split_kv_b_proj, yarn_mscale
from mla_ops.metadata import MLAMetadata

__all__ = ["BlockAllocator", "CacheFullError", "PagedLatentCache", "MLAAttention",
           "MLAMetadata", "mla_softmax_scale", "split_kv_b_proj", "yarn_mscale"]
