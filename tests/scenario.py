"""A batch step built from random sequences, for layer tests (shared by several test files)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from mla_ops import MLAAttention, MLAMetadata, PagedLatentCache
from mla_ops.quant import quant_fp8_static
from mla_reference import dense_mla_reference


@dataclass
class Dims:
    N: int = 3
    P: int = 24
    R: int = 16
    V: int = 20
    L: int = 32


def make_layer(d: Dims, dtype, kv_cache_dtype="auto", workspace_rows=8192, seed=0):
    g = torch.Generator().manual_seed(seed)
    kv_b = torch.randn(d.N * (d.P + d.V), d.L, generator=g) / d.L ** 0.5
    layer = MLAAttention(d.N, d.P, d.R, d.V, d.L, (d.P + d.R) ** -0.5,
                         kv_cache_dtype=kv_cache_dtype, workspace_rows=workspace_rows)
    layer.absorb(kv_b.to(dtype))
    return layer, kv_b.to(dtype)


class Step:
    """Sequences with `contexts[i]` cached tokens and `query_lens[i]` new tokens."""

    def __init__(self, d: Dims, contexts, query_lens, *, block_size=4, dtype=torch.float32,
                 kv_cache_dtype="auto", k_scale=0.05, num_blocks=None, decode_threshold=1, seed=1):
        g = torch.Generator().manual_seed(seed)
        self.d, self.dtype = d, dtype
        totals = [c + n for c, n in zip(contexts, query_lens)]
        nb = num_blocks or sum(-(-t // block_size) for t in totals) + 3
        self.cache = PagedLatentCache(1, nb, block_size, kv_lora_rank=d.L, qk_rope_head_dim=d.R,
                                      dtype=dtype, kv_cache_dtype=kv_cache_dtype, k_scale=k_scale)
        kv = self.cache.kv[0]
        # Fill the whole cache with random rows (never zeros) so unwritten reads show up.
        kv.copy_((torch.randn(kv.shape, generator=g) * 3).to(kv.dtype))
        self.kv_c = [torch.randn(t, d.L, generator=g).to(dtype) for t in totals]   # [S, L]
        self.k_pe = [torch.randn(t, d.R, generator=g).to(dtype) for t in totals]   # [S, R]
        self.q = [torch.randn(n, d.N, d.P + d.R, generator=g).to(dtype) for n in query_lens]
        alloc = self.cache.allocator
        for i, c in enumerate(contexts):      # the context is already cached
            if c:
                slots = torch.tensor(alloc.allocate(i, c))
                rows = torch.cat([self.kv_c[i][:c], self.k_pe[i][:c]], -1)
                if self.cache.kind == "fp8":
                    rows = quant_fp8_static(rows, self.cache.k_scale)
                kv.view(-1, kv.shape[-1])[slots] = rows.to(kv.dtype)
        self.meta = MLAMetadata.build(alloc, range(len(contexts)), query_lens,
                                      decode_threshold=decode_threshold)
        self.contexts, self.query_lens = list(contexts), list(query_lens)

    def inputs(self):
        """q [T, N, P+R], kv_c_normed [T, L], k_pe [T, 1, R] for this step's tokens."""
        q = torch.cat(self.q)
        kv_c = torch.cat([k[c:] for k, c in zip(self.kv_c, self.contexts)])
        k_pe = torch.cat([k[c:] for k, c in zip(self.k_pe, self.contexts)])[:, None]
        return q, kv_c, k_pe

    def run_on_cuda(self, layer):
        """Move this step's cache and `layer` to the GPU and run the layer on the step's
        tokens: [T, N*V] on the GPU."""
        self.cache.kv[0] = self.cache.kv[0].cuda()
        self.cache.k_scale = self.cache.k_scale.cuda()
        layer.cuda()
        m = self.meta
        meta = MLAMetadata(m.slot_mapping.cuda(), m.block_table.cuda(), m.seq_lens.cuda(),
                           m.query_start_loc.cuda(), m.num_decode_tokens,
                           prefill_shape=m.prefill_shape)
        q, kv_c, k_pe = (t.cuda() for t in self.inputs())
        return layer(q, kv_c, k_pe, self.cache.kv[0], self.cache.k_scale, meta)

    def reference(self, kv_b, scale):
        """Expected [T, N*V] float64; an fp8 cache is read back dequantized, as the op does."""
        d, outs = self.d, []
        for i, (c, n) in enumerate(zip(self.contexts, self.query_lens)):
            kv_c, k_pe = self.kv_c[i], self.k_pe[i]
            if self.cache.kind == "fp8":
                rows = torch.cat([kv_c, k_pe], -1)
                deq = quant_fp8_static(rows, self.cache.k_scale).double() * self.cache.k_scale.double()
                kv_c, k_pe = deq[:, :d.L], deq[:, d.L:]
            outs.append(dense_mla_reference(self.q[i], kv_c, k_pe, kv_b, d.N, d.P, d.V, scale,
                                            list(range(c, c + n)), c + n))
        return torch.cat(outs)
