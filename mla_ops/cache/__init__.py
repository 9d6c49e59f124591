"""The paged latent KV cache (paged.py) and its CUDA write kernel (write_kernel.py)."""
from mla_ops.cache.paged import (BlockAllocator, CacheFullError, PagedLatentCache,  # noqa: F401
                                 mark_static)
