"""Per-step attention metadata: plain tensors, no global forward context.

Requests are ordered decode first (query length <= decode_threshold), prefill
after. Token t of request r sits at sequence position
    seq_lens[r] - (query_start_loc[r + 1] - t)
and attends causally to positions [0, that position].
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from mla_ops.cache import BlockAllocator


@dataclass
class MLAMetadata:
    slot_mapping: torch.Tensor      # [T] int64, -1 = padding
    block_table: torch.Tensor       # [B, max_blocks] int32
    seq_lens: torch.Tensor          # [B] int32, context + this step's tokens
    query_start_loc: torch.Tensor   # [B + 1] int32, cumulative query lengths
    num_decode_tokens: int          # tokens of the leading decode requests
    # Optional FlashMLA work split for the decode requests (lowering.decode_schedule of
    # block_table and seq_lens when every request decodes one token): computed once per
    # step, read by every layer's attention call instead of one scheduler kernel each.
    # With it, block_table and seq_lens must come from lowering.bound_decode_inputs (the
    # calls then skip their own bounding under CUDA-graph capture). A layer with an fp8
    # decode query reads only an fp8 one (decode_schedule(..., fp8q=True): a
    # lowering.decode.flashmla.FP8Schedule), other layers only the 16-bit one; each ignores the other.
    decode_schedule: Optional[tuple] = None
    # The prefill requests' host ints (num_requests, max_query_len, max_context_len,
    # min_context_len) when the caller knows them: the attention op then reads nothing
    # back from the device for its prefill rows (else one device->host copy per call).
    prefill_shape: Optional[tuple] = None

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    @staticmethod
    def build(allocator: BlockAllocator, seq_ids, query_lens, *, decode_threshold: int = 1,
              max_blocks: int | None = None, device=None) -> "MLAMetadata":
        """Reserve cache room for this step's tokens and build the metadata.

        seq_ids / query_lens: one entry per request, decode requests first.
        """
        seq_ids, query_lens = list(seq_ids), [int(n) for n in query_lens]
        if len(seq_ids) != len(query_lens):
            raise ValueError(f"seq_ids ({len(seq_ids)}) and query_lens ({len(query_lens)}) differ in length")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError("seq_ids must be distinct")
        if any(n <= 0 for n in query_lens):
            raise ValueError(f"query_lens must be positive, got {query_lens}")
        is_decode = [n <= decode_threshold for n in query_lens]
        if any(not a and b for a, b in zip(is_decode, is_decode[1:])):
            raise ValueError(
                f"decode requests (query_len <= decode_threshold={decode_threshold}) must come "
                f"before prefill requests; got query_lens {query_lens}")
        need = sum(-(-(allocator.seq_len(s) + n) // allocator.block_size) - len(allocator.blocks(s))
                   for s, n in zip(seq_ids, query_lens))
        if need > allocator.num_free_blocks:
            from mla_ops.cache import CacheFullError
            raise CacheFullError(f"this step needs {need} new blocks, {allocator.num_free_blocks} free")
        slots = []
        for s, n in zip(seq_ids, query_lens):
            slots += allocator.allocate(s, n)
        seq_lens = [allocator.seq_len(s) for s in seq_ids]
        qsl = [0]
        for n in query_lens:
            qsl.append(qsl[-1] + n)
        num_decode_tokens = sum(n for n, d in zip(query_lens, is_decode) if d)
        pre = [(n, L - n) for n, L, d in zip(query_lens, seq_lens, is_decode) if not d]
        prefill_shape = ((len(pre), max(n for n, _ in pre), max(c for _, c in pre),
                          min(c for _, c in pre)) if pre else None)
        return MLAMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_table=allocator.block_table(seq_ids, max_blocks, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
            num_decode_tokens=num_decode_tokens,
            prefill_shape=prefill_shape,
        )
