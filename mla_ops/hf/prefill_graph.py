"""Prefill chunks of a converted model replayed from CUDA graphs, one graph per shape bucket.

    prefill = mla_ops.hf.PrefillGraph(model, cache)
    logits = prefill(new_ids)              # [B, S] tokens after what the cache holds
    #  -> [B, 1, vocab]: each row's logits at its last new token (clone to keep them)

Why. A chunk of a few hundred new tokens over a cached context (a chat's next turn) costs
the GPU a few ms, but its eager forward spends several times that on the host: Python,
op dispatch and ~50 us per Triton launch over ~5,000 calls a forward
(docs/notes/NOTES-prefill-host.md). A replay costs tens of microseconds of host time.

Buckets. A graph has fixed shapes, a chat's turns do not, so each call is padded to a
bucket: B rows, new tokens rounded up to a power of two (at least MIN_TOKENS, at most
max_cache_len) and the longest cached row rounded up likewise (at least MIN_CONTEXT;
0 without context). The pads are left pads of each row, the form HF's own batches use:
the step orders each row's real tokens first, never writes a pad to the cache, and no
real token attends to one (mla_ops/hf/cache.py), so the real tokens' logits are those of
the unpadded chunk. The context bound becomes the prefill rows' shape
(MLAMetadata.prefill_shape): every context window up to the bound is gathered and
attended, and each row's real length hides the rest. So a bucket costs at most twice the
new-token and context work of the chunk; in exchange a chat meets a new bucket only when
a length doubles.

Per call: one host read of the cache state (the room check, as an eager prefill makes,
and the bucket), the inputs copied into the bucket's buffers, one replay, and the padded
length HF counts (PagedMLACache.seen) put back to the call's. The first call of a bucket
runs the padded chunk eagerly (its result is the call's; it also warms every kernel) and
then captures the bucket's graph, which runs nothing; later calls replay it. All graphs of
a runner share one memory pool: the logits returned are valid until the next call.

Chunks of more than max_tokens tokens (B x bucket) run eagerly, unpadded: their kernels
outlast the host time. Without CUDA, or with graph=False, every call runs the padded
chunk eagerly (the same computation; the CPU tests run it so).

generate(): a PrefillGraph registers itself on its cache, and generate() called with that
cache (cache= / past_key_values=, a chat's next turn) runs its prefill through it where
generate() replays its decode steps from a graph (convert(generate_graph=True), the
default; mla_ops/hf/generate_graph.py).

DeepSeek V2 / V3 layouts only (Kimi K2 loads as V3): a model whose layers read the
attention mask themselves (linear-attention layers) or whose attention differs (V3.2's
indexer) is refused.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from mla_ops.hf.cache import PagedMLACache
from mla_ops.hf.convert import is_converted
from mla_ops.hf.generate import cache_kwargs
from mla_ops.hf.graph import capturing
from mla_ops.hf.step import raise_if_no_room, valid_tokens

__all__ = ["PrefillGraph", "bucket", "ATTR"]

ATTR = "mla_prefill_graph"          # the PagedMLACache attribute that holds its runner

MIN_TOKENS = 16
MIN_CONTEXT = 256
MODEL_TYPES = ("deepseek_v2", "deepseek_v3")


def bucket(n: int, least: int, most: int) -> int:
    """n rounded up to a power of two, at least `least` and at most `most`; 0 stays 0."""
    if n <= 0:
        return 0
    return min(max(least, 1 << (n - 1).bit_length()), most)


class _Chunk:
    """One bucket's input buffers and, once captured, its graph and output."""

    def __init__(self, B: int, S: int, device):
        self.ids = torch.zeros(B, S, dtype=torch.long, device=device)     # [B, S] left-padded
        self.valid = torch.zeros(B, S, dtype=torch.bool, device=device)   # [B, S] real tokens
        self.graph = None
        self.logits = None
        self.eager = False            # capture failed: this bucket runs eagerly


class PrefillGraph:
    """Prefill chunks of a converted DeepSeek V2 / V3 model on a PagedMLACache."""

    def __init__(self, model, cache: PagedMLACache, *, max_tokens: int = 2048,
                 graph: bool | None = None):
        if not isinstance(model, torch.nn.Module) or not is_converted(model):
            raise TypeError("PrefillGraph needs a model converted with mla_ops.hf.convert(model)")
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        if model_type not in MODEL_TYPES:
            raise TypeError(f"PrefillGraph serves DeepSeek V2 / V3 layouts ({', '.join(MODEL_TYPES)}), "
                            f"not {model_type!r}: run that model's prefill as model(...)")
        if not isinstance(cache, PagedMLACache):
            raise TypeError(f"cache must be a mla_ops.hf.PagedMLACache, got {type(cache).__name__}")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < MIN_TOKENS:
            raise ValueError(f"max_tokens must be an int >= {MIN_TOKENS}, got {max_tokens!r}")
        self.model, self.cache, self.max_tokens = model, cache, max_tokens
        self.device = cache.device
        self.graph_enabled = (self.device.type == "cuda") if graph is None else bool(graph)
        if self.graph_enabled and self.device.type != "cuda":
            raise ValueError(f"graph=True needs a CUDA cache, this one is on {self.device}")
        self.pool = torch.cuda.graph_pool_handle() if self.graph_enabled else None
        self.chunks: dict = {}              # (B, tokens bucket, context bucket) -> _Chunk
        setattr(cache, ATTR, self)          # generate() on this cache uses it (see above)

    # -- the chunk ---------------------------------------------------------------------
    def _forward(self, ids, valid, context_bound):
        """ids, valid [B, S] (left pads) -> logits [B, 1, V] at the last column."""
        c = self.cache
        B, S = ids.shape
        lens = c.lens[:B, None].long()                               # [B, 1] tokens stored
        pos = torch.maximum(lens + valid.long().cumsum(1) - 1, lens)  # [B, S] (pads: any)
        mask = valid[:, None, None, :].expand(B, 1, S, S)  # 4D: HF passes it on as is; the
        # converted attention reads its diagonal only (which tokens are real)
        return self.model.forward(input_ids=ids, attention_mask=mask, position_ids=pos,
                                  use_cache=True, logits_to_keep=1,
                                  mla_context_bound=context_bound,
                                  **cache_kwargs(self.model, c)).logits

    def _capture(self, chunk: _Chunk, context_bound: int) -> None:
        g = torch.cuda.CUDAGraph()
        try:
            with capturing(g, pool=self.pool):
                chunk.logits = self._forward(chunk.ids, chunk.valid, context_bound)
        except RuntimeError as exc:
            self.cache._step = None                   # (a plan left by the failed forward)
            chunk.eager = True
            warnings.warn(f"PrefillGraph: chunks of shape {tuple(chunk.ids.shape)} run eagerly, "
                          f"their forward cannot be captured in a CUDA graph "
                          f"({str(exc).splitlines()[0]}); PrefillGraph(..., graph=False) "
                          f"skips the attempt", RuntimeWarning, stacklevel=3)
            return
        chunk.graph = g

    # -- calls -------------------------------------------------------------------------
    def _check(self, input_ids, attention_mask) -> torch.Tensor:
        """The call's arguments -> the new tokens' validity [B, S] bool (or None: all real)."""
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"input_ids must be a torch.Tensor, got {type(input_ids).__name__}")
        if input_ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"input_ids must be int64 or int32 token ids, got {input_ids.dtype}")
        if input_ids.dim() != 2 or input_ids.shape[1] < 1:
            raise ValueError(f"input_ids must be [B, S] new tokens, got {tuple(input_ids.shape)}")
        B, S = input_ids.shape
        if not 1 <= B <= self.cache.max_batch_size:
            raise ValueError(f"input_ids has {B} rows; the cache holds 1 to max_batch_size="
                             f"{self.cache.max_batch_size}")
        if attention_mask is None:
            return None
        if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4:
            return valid_tokens(attention_mask, B, S, self.cache.seen)     # HF's 4D form
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
            raise ValueError("attention_mask must be a [B, K] tensor (1: real token, 0: pad) "
                             "whose last S columns cover the new tokens, HF's 4D mask, or None")
        if attention_mask.shape[0] != B or attention_mask.shape[1] < S:
            raise ValueError(f"attention_mask is {tuple(attention_mask.shape)}; it must be "
                             f"[B={B}, K >= S={S}]")
        return attention_mask[:, -S:].to(device=self.device, dtype=torch.bool)

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
        """Prefill input_ids [B, S] (new tokens of rows [0, B), after the tokens the cache
        holds) -> logits [B, 1, vocab] at each row's last column. attention_mask: [B, K]
        with K >= S, HF's 2D form, whose last S columns say which new tokens are real (left
        pads, as HF pads; every row needs one real token), or the 4D mask HF builds from it. From a graph the logits live
        in its output buffer, overwritten by the next call: clone them to keep them."""
        valid = self._check(input_ids, attention_mask)
        c = self.cache
        B, S = input_ids.shape
        # One host read: each row's stored tokens, the blocks taken, and its real new tokens.
        real = (torch.full((B,), S, dtype=torch.long, device=self.device) if valid is None
                else valid.sum(1))
        host = torch.cat((c.lens[:B].long(), real, c.num_used.view(1))).tolist()
        lens, new, used = host[:B], host[B:2 * B], host[2 * B]
        if min(new) < 1:
            raise ValueError(f"row {new.index(min(new))} has no real token in attention_mask; "
                             f"every row of a prefill chunk needs one")
        ends = [a + n for a, n in zip(lens, new)]
        bs = c.block_size
        blocks = sum(-(-e // bs) - (-(-a // bs)) for a, e in zip(lens, ends))
        raise_if_no_room(c, max(ends), ends.index(max(ends)), blocks, used)
        Sb = bucket(S, MIN_TOKENS, c.max_cache_len)
        Cb = bucket(max(lens), MIN_CONTEXT, c.max_cache_len)
        if B * Sb > self.max_tokens:                       # long chunks: eager, unpadded
            if valid is None:
                valid = torch.ones(B, S, dtype=torch.bool, device=self.device)
            return self._forward(input_ids.to(self.device), valid, None)
        key = (B, Sb, Cb)
        chunk = self.chunks.get(key)
        if chunk is None:
            chunk = self.chunks[key] = _Chunk(B, Sb, self.device)
        pad = Sb - S
        chunk.ids.copy_(F.pad(input_ids.to(self.device, torch.long), (pad, 0)))
        if valid is None:
            chunk.valid[:, :pad] = False
            chunk.valid[:, pad:] = True
        else:
            chunk.valid.copy_(F.pad(valid, (pad, 0)))
        c.forget_room()
        if chunk.graph is not None:
            chunk.graph.replay()
            logits = chunk.logits
            c.version += 1                       # the state changed unseen by the host
        else:
            logits = self._forward(chunk.ids, chunk.valid, Cb)
            if self.graph_enabled and not chunk.eager:
                self._capture(chunk, Cb)          # runs nothing: the state stays as it is
        if pad:
            c.seen.sub_(pad)                     # HF's padded length: the call's S, not Sb
        return logits
