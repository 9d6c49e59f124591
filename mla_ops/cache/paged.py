"""Paged latent KV cache: one KV head, rows of [kv_c_normed | k_pe].

Storage per layer: [num_blocks, block_size, L + R] (576 for DeepSeek V2/V3).
slot = block_id * block_size + offset; slot -1 is padding (nothing written).
"""
from __future__ import annotations

import torch

from lowering.checks import FLOAT_DTYPES, canonical_kv_cache_dtype


def mark_static(t: torch.Tensor) -> None:
    """Tell torch.compile the tensor lives at a fixed address (no guard on identity).

    CUDA graphs then keep reading and writing the cache in place instead of refusing a
    graph that mutates one of its inputs.
    """
    torch._dynamo.mark_static_address(t, guard=False)


class CacheFullError(RuntimeError):
    """The block pool has no free block left for a request."""


class BlockAllocator:
    """Hands out fixed-size blocks to sequences and frees them.

    Every change is checked first and applied whole: a request that does not
    fit raises CacheFullError and leaves the allocator as it was.
    """

    def __init__(self, num_blocks: int, block_size: int):
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._blocks: dict = {}   # seq_id -> [block ids]
        self._lens: dict = {}     # seq_id -> tokens stored

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def seq_len(self, seq_id) -> int:
        return self._lens.get(seq_id, 0)

    def blocks(self, seq_id) -> list:
        return list(self._blocks.get(seq_id, []))

    def allocate(self, seq_id, num_new_tokens: int) -> list:
        """Reserve room for num_new_tokens more tokens of seq_id; return their slots."""
        if not isinstance(num_new_tokens, int) or num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be a non-negative int, got {num_new_tokens!r}")
        start = self.seq_len(seq_id)
        end = start + num_new_tokens
        have = self._blocks.get(seq_id, [])
        need = -(-end // self.block_size) - len(have)
        if need > len(self._free):
            raise CacheFullError(
                f"cache is full: sequence {seq_id!r} needs {need} more blocks of {self.block_size} "
                f"tokens, {len(self._free)} free of {self.num_blocks}; free finished sequences or "
                f"build the cache with more blocks")
        blocks = have + [self._free.pop() for _ in range(max(need, 0))]
        self._blocks[seq_id] = blocks
        self._lens[seq_id] = end
        bs = self.block_size
        return [blocks[p // bs] * bs + p % bs for p in range(start, end)]

    def free(self, seq_id) -> None:
        if seq_id not in self._blocks:
            raise KeyError(f"unknown sequence {seq_id!r}")
        self._free.extend(reversed(self._blocks.pop(seq_id)))
        self._lens.pop(seq_id)

    def block_table(self, seq_ids, max_blocks: int | None = None, device=None) -> torch.Tensor:
        """[len(seq_ids), max_blocks] int32, padded with -1."""
        rows = [self._blocks.get(s, []) for s in seq_ids]
        width = max([len(r) for r in rows] + [1]) if max_blocks is None else max_blocks
        if any(len(r) > width for r in rows):
            raise ValueError(f"max_blocks={width} is smaller than a sequence's block count")
        table = torch.full((len(rows), width), -1, dtype=torch.int32)
        for i, r in enumerate(rows):
            table[i, :len(r)] = torch.tensor(r, dtype=torch.int32)
        return table.to(device) if device is not None else table


class PagedLatentCache:
    """Per-layer paged latent cache tensors plus the shared block allocator.

    kv_cache_dtype "auto" stores in `dtype`; "fp8" stores float8_e4m3fn with a
    per-tensor fp32 dequantization scale k_scale (value = stored * k_scale).
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, *,
                 kv_lora_rank: int = 512, qk_rope_head_dim: int = 64,
                 dtype: torch.dtype = torch.bfloat16, kv_cache_dtype: str = "auto",
                 k_scale: float = 1.0, device=None):
        if not isinstance(num_layers, int) or num_layers <= 0:
            raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
        if dtype not in FLOAT_DTYPES:
            raise TypeError(f"dtype must be one of {FLOAT_DTYPES}, got {dtype}")
        for name, v in (("kv_lora_rank", kv_lora_rank), ("qk_rope_head_dim", qk_rope_head_dim)):
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if not float(k_scale) > 0:
            raise ValueError(f"k_scale must be positive, got {k_scale!r}")
        self.kind = canonical_kv_cache_dtype(kv_cache_dtype)
        self.kv_cache_dtype = self.kind
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.dtype = dtype
        store = torch.float8_e4m3fn if self.kind == "fp8" else dtype
        width = kv_lora_rank + qk_rope_head_dim
        # [num_blocks, block_size, L + R] per layer; zeroed so no read of an unwritten
        # row can ever see NaN/inf bit patterns
        self.kv = [torch.zeros(num_blocks, block_size, width, dtype=store, device=device)
                   for _ in range(num_layers)]
        self.k_scale = torch.tensor([float(k_scale)], dtype=torch.float32, device=device)
        for t in self.kv + [self.k_scale]:
            mark_static(t)

    @property
    def block_size(self) -> int:
        return self.allocator.block_size

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    def bytes_per_token_per_layer(self) -> int:
        return self.kv[0].shape[-1] * self.kv[0].element_size()
