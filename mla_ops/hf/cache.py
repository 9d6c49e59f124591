"""PagedMLACache: a transformers Cache backed by the paged latent cache (see mla_ops.hf).

PagedMLACache keeps all bookkeeping in device tensors updated in place, so a decode
step traces to one graph with no host syncs: per row, the number of real (non-pad)
tokens stored; a block table handed out by a bump allocator (blocks are taken only
when a row crosses a block boundary and are returned all at once by reset()).

Padding: in a step of S > 1 tokens, a token is padding when HF's mask hides it from
itself. Each row is reordered so its real tokens come first and its pads last; a row is
then one request of S tokens whose trailing pads are never written to the cache and
which no real token attends to (causality), so their output rows are discarded. A
one-token step (decode) needs no mask: every row's token is real, as in generate().
Pads take no cache room, so row b's positions count its real tokens only, which is
what HF's position_ids (cumsum of the mask) already assume.

The first layer derives the step's plan (slots, block table, lengths, and where the
layers use FlashMLA, its schedule and the block table and lengths bounded once for all
layers' calls) from the cache state as it was before the step, the others reuse it; the
last layer writes the new state back after its attention. On CUDA a decode step's plan
and its commit are one kernel each (mla_ops/hf/step_plan.py); other steps and devices run
them as torch ops. Decode-step shapes depend only on B, so a fixed batch compiles once
and replays in a CUDA graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

import lowering
import mla_ops.hf.step_plan  # noqa: F401  (registers mla::decode_step_plan / _commit)

from mla_ops.cache import CacheFullError, PagedLatentCache, mark_static
from mla_ops.metadata import MLAMetadata

# False: CUDA decode steps plan and commit in torch ops too (to compare against)
PLAN_KERNEL = True

# ----------------------------------------------------------------------------- cache


class _PagedLayer(CacheLayerMixin):
    """Per-layer view HF's Cache API asks for; the data lives in PagedMLACache."""

    is_compileable = True
    is_sliding = False

    def __init__(self, owner: "PagedMLACache"):
        super().__init__()
        self._owner = owner
        self.batch_size = owner.max_batch_size
        self.max_cache_len = owner.max_cache_len
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        raise RuntimeError("PagedMLACache holds paged latents that HF's attention cannot read: "
                           "call mla_ops.hf.convert(model) before using it")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.max_cache_len, 0      # like StaticCache: masks are [B, 1, q, max_cache_len]

    def get_seq_length(self):
        return self._owner._seen           # 0-dim tensor: no graph break, no recompile

    def get_max_length(self) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        pass


@dataclass
class _Step:
    meta: MLAMetadata
    perm: torch.Tensor | None      # [T] token order fed to the ops (real tokens of a row first)
    inv: torch.Tensor | None       # [T] inverse of perm
    lens_new: torch.Tensor         # [B] real tokens per row after the step
    num_new_blocks: torch.Tensor   # [] blocks taken this step
    table: torch.Tensor            # [B, M] block table after the step (-1: no block)
    pack: torch.Tensor | None = None   # set when mla::decode_step_plan made the plan


class PagedMLACache(Cache):
    """A transformers Cache backed by mla_ops.PagedLatentCache (one 576-wide row per token per layer).

    max_batch_size rows of at most max_cache_len tokens each (counted with left padding,
    as HF's position bookkeeping does). num_blocks defaults to the worst case
    max_batch_size * ceil(max_cache_len / block_size); blocks are handed to a row only
    when it needs them, so a smaller pool serves batches of shorter sequences.
    """

    def __init__(self, config, max_batch_size: int, max_cache_len: int, block_size: int = 64,
                 kv_cache_dtype: str = "auto", device=None, dtype: torch.dtype | None = None,
                 k_scale: float = 1.0, num_blocks: int | None = None):
        config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        missing = [k for k in ("kv_lora_rank", "qk_rope_head_dim", "num_hidden_layers")
                   if getattr(config, k, None) is None]
        if missing:
            raise ValueError(f"PagedMLACache needs an MLA config (DeepSeek V2/V3); "
                             f"{type(config).__name__} lacks {missing}")
        for name, v in (("max_batch_size", max_batch_size), ("max_cache_len", max_cache_len),
                        ("block_size", block_size)):
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if dtype is None:
            dtype = getattr(config, "dtype", None)
            dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
            dtype = dtype if isinstance(dtype, torch.dtype) else torch.get_default_dtype()
        self.max_batch_size, self.max_cache_len = max_batch_size, max_cache_len
        self.max_blocks = -(-max_cache_len // block_size)      # block-table width M
        if num_blocks is None:
            num_blocks = max_batch_size * self.max_blocks
        self.pool = PagedLatentCache(config.num_hidden_layers, num_blocks, block_size,
                                     kv_lora_rank=config.kv_lora_rank,
                                     qk_rope_head_dim=config.qk_rope_head_dim, dtype=dtype,
                                     kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, device=device)
        self.kv_cache_dtype = self.pool.kind                     # "auto" | "fp8"
        self.dtype = dtype
        self.device = self.pool.kv[0].device
        dev, Bm, M = self.device, max_batch_size, self.max_blocks
        self.block_table = torch.full((Bm, M), -1, dtype=torch.int32, device=dev)  # -1 = none
        self.lens = torch.zeros(Bm, dtype=torch.int32, device=dev)       # real tokens per row
        self.num_used = torch.zeros((), dtype=torch.int64, device=dev)   # bump-allocator top
        self._seen = torch.zeros((), dtype=torch.int64, device=dev)      # padded length (HF's view)
        self._step: _Step | None = None
        # Decode backends ("auto", "flashmla") that will run FlashMLA on this cache: for
        # them a decode step's plan carries FlashMLA's work split, computed once per step;
        # for layers with an fp8 decode query (convert(fp8_decode_query=...)) the split of
        # FlashMLA's fp8 kernel, where it serves them.
        heads = getattr(config, "num_attention_heads", None)
        width = config.kv_lora_rank + config.qk_rope_head_dim
        self._num_heads = heads

        def flashmla_backends(q_dtype):
            return frozenset(
                b for b in ("auto", "flashmla")
                if heads and lowering.uses_flashmla(self.device, q_dtype, heads, width,
                                                    block_size, self.kv_cache_dtype, b))
        self._flashmla_backends = flashmla_backends(dtype)
        self._flashmla_fp8q_backends = flashmla_backends(torch.float8_e4m3fn)
        self.version = 0        # bumped by every host-side change of the state (eager steps,
                                # reset, occupy, restore); compiled steps do not bump it
        if not torch.compiler.is_compiling():   # the pool's tensors are marked by PagedLatentCache
            for t in (self.block_table, self.lens, self.num_used, self._seen):
                mark_static(t)
        super().__init__(layers=[_PagedLayer(self) for _ in range(config.num_hidden_layers)])

    # -- introspection ---------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def k_scale(self) -> torch.Tensor:
        return self.pool.k_scale

    def kv(self, layer_idx: int) -> torch.Tensor:
        """[num_blocks, block_size, L + R] storage of one layer."""
        return self.pool.kv[layer_idx]

    def bytes_per_token_per_layer(self) -> int:
        return self.pool.bytes_per_token_per_layer()

    def blocks_in_use(self) -> int:
        return int(self.num_used)

    def bytes_in_use(self) -> int:
        """Cache bytes of the blocks handed out so far, all layers."""
        return (self.blocks_in_use() * self.block_size * self.bytes_per_token_per_layer()
                * len(self.pool.kv))

    def seq_lens(self) -> list:
        """Real (non-pad) tokens stored per row."""
        return self.lens.tolist()

    def occupy(self, lengths) -> None:
        """Mark rows 0.. as holding lengths[b] tokens (blocks taken, contents as they are).

        For benchmarks and tests that need a long context without running its prefill.
        """
        lengths = [int(n) for n in lengths]
        if len(lengths) > self.max_batch_size or any(not 0 <= n <= self.max_cache_len
                                                      for n in lengths):
            raise ValueError(f"lengths {lengths} do not fit max_batch_size={self.max_batch_size}"
                             f", max_cache_len={self.max_cache_len}")
        need = [-(-n // self.block_size) for n in lengths]
        if sum(need) > self.num_blocks - self.blocks_in_use() or int(self.lens.max()) > 0:
            raise CacheFullError("occupy() needs an empty cache with enough free blocks")
        nxt = self.blocks_in_use()
        for b, k in enumerate(need):
            self.block_table[b, :k] = torch.arange(nxt, nxt + k, dtype=torch.int32)
            nxt += k
        self.lens[:len(lengths)] = torch.tensor(lengths, dtype=torch.int32)
        self.num_used.fill_(nxt)
        self._seen.fill_(max(lengths))
        self.version += 1

    def _state(self):
        return (self.block_table, self.lens, self.num_used, self._seen)

    def snapshot(self) -> list:
        """Copies of the bookkeeping (block table, lengths, counters; not the KV rows)."""
        return [t.clone() for t in self._state()]

    def restore(self, saved) -> None:
        """Put back a snapshot() in place: tokens written since are forgotten (their rows
        lie past the restored lengths), blocks taken since are free again."""
        state = self._state()
        if (not isinstance(saved, (list, tuple)) or len(saved) != len(state)
                or any(not isinstance(v, torch.Tensor) or v.shape != t.shape or v.dtype != t.dtype
                       for t, v in zip(state, saved))):
            raise ValueError("restore() takes what snapshot() of this cache returned")
        for t, v in zip(state, saved):
            t.copy_(v)
        self._step = None
        self.version += 1

    # -- HF Cache API ------------------------------------------------------------------
    def reset(self):
        """Forget every sequence and return all blocks (in place: addresses stay put)."""
        self.block_table.fill_(-1)
        self.lens.zero_()
        self.num_used.zero_()
        self._seen.zero_()
        self._step = None
        self.version += 1

    def _unsupported(self, *args, **kwargs):
        raise NotImplementedError("PagedMLACache supports greedy/sampled decoding only "
                                  "(no beam search, cropping or batch reordering)")

    reorder_cache = crop = batch_repeat_interleave = batch_select_indices = _unsupported

    # -- per-step bookkeeping (called by the converted attention) -----------------------
    def _prepare(self, layer_idx: int, B: int, S: int, attention_mask, dtype, device,
                 backend: str = "auto", fp8_query: bool = False) -> _Step:
        """This step's plan for one layer; the last layer commits it to the cache state
        (_layer_done). backend and fp8_query (the layers' decode query is fp8) decide
        which FlashMLA schedule, if any, the plan carries.

        The plan is a pure function of the state before the step, so every layer gets
        the same one: layer 0 computes it and later layers reuse it; the last layer's
        commit drops it again. Compiled, the plan's tensors are values inside the one
        graph (the attribute is None again when the step ends, so nothing escapes).
        """
        compiling = torch.compiler.is_compiling()
        if layer_idx == 0 or self._step is None:
            if B > self.max_batch_size:
                raise ValueError(f"batch of {B} sequences exceeds the cache's max_batch_size="
                                 f"{self.max_batch_size}; build PagedMLACache with a larger one")
            if S > self.max_cache_len:
                raise ValueError(f"{S} tokens in one step exceed the cache's max_cache_len="
                                 f"{self.max_cache_len}; build PagedMLACache with a larger one")
            if dtype != self.dtype:
                raise TypeError(f"model activations are {dtype} but the cache was built for "
                                f"{self.dtype}; pass dtype= to PagedMLACache")
            if device != self.device:
                raise ValueError(f"model runs on {device} but the cache lives on {self.device}; "
                                 f"pass device= to PagedMLACache")
            valid = None if S == 1 else _valid_tokens(attention_mask, B, S, self._seen)  # [B, S]
            step = self._plan(B, S, valid, check=not compiling and layer_idx == 0,
                              backend=backend, fp8_query=fp8_query)
            self._step = step
        else:
            step = self._step
        return step

    def _layer_done(self, layer_idx: int, B: int, S: int) -> None:
        """After a layer's attention ops: the last layer commits the step's plan.

        Committing after the attention, not in _prepare, keeps the in-place writes of the
        state after every read of it in the step: compiled, HF's positions (the lengths)
        feed each layer's RoPE, and a write before the last layer's RoPE makes Inductor
        keep those values in buffers of their own, rounding differently from a graph
        without it (DecodeGraph's step against generate()'s).
        """
        if layer_idx == len(self.layers) - 1 and self._step is not None:
            self._commit(self._step, B, S)

    def _plan(self, B: int, S: int, valid, check: bool, backend: str = "auto",
              fp8_query: bool = False) -> _Step:
        served = self._flashmla_fp8q_backends if fp8_query else self._flashmla_backends
        flashmla = S == 1 and backend in served
        if S == 1 and valid is None and self.device.type == "cuda" and PLAN_KERNEL:
            return self._decode_plan(B, check, flashmla, fp8_query)
        dev, bs, M = self.device, self.block_size, self.max_blocks
        lens_old = self.lens[:B].long()                                      # [B]
        q = (valid.sum(1) if valid is not None
             else torch.full((B,), S, dtype=torch.int64, device=dev))        # [B] real tokens
        lens_new = lens_old + q
        nb_old = (lens_old + bs - 1) // bs
        nb_new = (torch.clamp(lens_new, max=self.max_cache_len) + bs - 1) // bs
        need = nb_new - nb_old                                               # [B] new blocks
        if check:                                                            # needs a host sync
            self._check_room(lens_new, need.sum())
        # Bump allocation: row b takes ids start_b + k for its block columns nb_old_b + k.
        start = self.num_used + torch.cumsum(need, 0) - need                 # [B]
        col = torch.arange(M, device=dev)[None]                              # [1, M]
        fresh = (col >= nb_old[:, None]) & (col < nb_new[:, None])           # [B, M]
        ids = start[:, None] + col - nb_old[:, None]
        ids = torch.where(ids < self.num_blocks, ids, -1)   # pool exhausted (unchecked when
        # compiled): no block, so the token is not written rather than sharing a block
        table = torch.where(fresh, ids.to(torch.int32), self.block_table[:B])   # [B, M] int32
        # Slots of this step's tokens, in op order (real tokens of a row first).
        j = torch.arange(S, device=dev)
        pos = lens_old[:, None] + j                                          # [B, S]
        blk = table.gather(1, (pos // bs).clamp(max=M - 1)).long()
        real = (j[None] < q[:, None]) & (pos < self.max_cache_len) & (blk >= 0)
        slots = torch.where(real, blk * bs + pos % bs, -1).reshape(-1)       # [T]
        seq_lens = (lens_old + S).to(torch.int32)            # trailing pads count, never read
        qsl = (torch.arange(B + 1, device=dev) * S).to(torch.int32)         # [B + 1]
        # Views of one buffer: compiled, Inductor recomputes a small computed tensor for
        # every custom op that reads it (a copy per call); views of a realized buffer are
        # passed as they are, so the plan's metadata is computed once per step.
        parts = [table.reshape(-1), seq_lens, qsl]                           # [B*M + 2B + 1]
        if flashmla:   # the decode calls' inputs bounded once per step, not once per call
            parts += [t.reshape(-1) for t in
                      lowering.bound_decode_inputs(self.pool.kv[0], table, seq_lens)]
        pack = torch.cat(parts)
        perm = inv = None
        if valid is not None:
            rows = torch.arange(B, device=dev)[:, None]
            order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)   # [B, S]
            perm = (order + rows * S).reshape(-1)                                 # [T]
            inv = torch.argsort(perm)
        return self._step_of(pack, slots, B, S, flashmla, lens_old + q, need.sum(), perm, inv,
                             fp8q=fp8_query)

    def _decode_plan(self, B: int, check: bool, flashmla: bool, fp8q: bool = False) -> _Step:
        """A one-token-per-row step's plan in one launch (mla::decode_step_plan, CUDA):
        the same values as _plan's torch ops, and committed by one launch too."""
        pack, slots = torch.ops.mla.decode_step_plan(
            self.lens, self.block_table, self.num_used, B, self.block_size, self.num_blocks,
            self.max_cache_len, flashmla)
        M = self.max_blocks
        lens_new, total = pack[B * M:B * M + B], pack[-1]                   # [B], []
        if check:                                                            # needs a host sync
            self._check_room(lens_new, total)
        return self._step_of(pack, slots, B, 1, flashmla, lens_new, total, kernel=True,
                             fp8q=fp8q)

    def _step_of(self, pack, slots, B, S, flashmla, lens_new, num_new, perm=None, inv=None,
                 kernel=False, fp8q=False) -> _Step:
        """The step from its int32 pack (block table | seq_lens | query_start_loc, then
        with flashmla the bounded table and lengths) and slots; with flashmla, FlashMLA's
        schedule for the layers' query kind (fp8q: its fp8 kernel's)."""
        M = self.max_blocks
        n = B * M + 2 * B + 1
        table = pack[:B * M].view(B, M)
        seq_lens, qsl = pack[B * M:B * M + B], pack[B * M + B:n]
        attn_table, attn_lens, sched = table, seq_lens, None
        if flashmla:                                         # one scheduler kernel per step
            attn_table, attn_lens = pack[n:n + B * M].view(B, M), pack[n + B * M:n + B * M + B]
            sched = lowering.decode_schedule(self.pool.kv[0], attn_table, attn_lens,
                                             num_heads=self._num_heads, bounded=True,
                                             fp8q=fp8q)
        meta = MLAMetadata(
            slot_mapping=slots,
            block_table=attn_table,
            seq_lens=attn_lens,
            query_start_loc=qsl,
            num_decode_tokens=B if S == 1 else 0,
            decode_schedule=sched)
        return _Step(meta, perm, inv, lens_new, num_new, table, pack if kernel else None)

    def _check_room(self, lens_new: torch.Tensor, total: torch.Tensor) -> None:
        """Raise before a step whose rows outgrow max_cache_len or the free blocks."""
        longest, total = int(lens_new.max()), int(total)
        if longest > self.max_cache_len:
            row = int(lens_new.argmax())
            raise ValueError(f"sequence {row} would hold {longest} tokens, more than the "
                             f"cache's max_cache_len={self.max_cache_len} (prompt too long "
                             f"or too many new tokens); build PagedMLACache with a larger one")
        free = self.num_blocks - int(self.num_used)
        if total > free:
            raise CacheFullError(f"this step needs {total} more blocks of {self.block_size} "
                                 f"tokens, {free} of {self.num_blocks} free; build "
                                 f"PagedMLACache with more num_blocks or call reset()")

    def _commit(self, step: _Step, B: int, S: int) -> None:
        """Write the step's block table, lengths and counters into the cache state in place."""
        if step.pack is not None:                    # planned by mla::decode_step_plan
            torch.ops.mla.decode_step_commit(self.block_table, self.lens, self.num_used,
                                             self._seen, step.pack, B, S)
        else:
            self.block_table[:B] = step.table
            self.lens[:B] = step.lens_new.to(torch.int32)
            self.num_used.add_(step.num_new_blocks)
            self._seen.add_(S)
        self._step = None
        if not torch.compiler.is_compiling():
            self.version += 1


def _valid_tokens(attention_mask, B: int, S: int, past):
    """[B, S] bool: which of this step's tokens are real, read from HF's mask (None: all).

    A 4D mask [B, 1, S, K] (bool: True = attend; float: 0 = attend) has key column
    past + i for new token i; the token is padding iff it cannot attend to itself.
    A 2D mask [B, K] covers the new tokens in its last S columns.
    """
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"converted attention supports tensor masks (eager / sdpa), got "
                        f"{type(attention_mask).__name__}")
    m = attention_mask
    if m.dim() == 2:
        return m[:, -S:].to(torch.bool).expand(B, S)
    if m.dim() != 4:
        raise ValueError(f"attention mask must be 2D or 4D, got shape {tuple(m.shape)}")
    i = torch.arange(S, device=m.device)
    cols = (past + i).clamp(max=m.shape[-1] - 1) if m.shape[-1] > S else i
    diag = m[:, 0, i, cols].expand(B, S)                                 # [B, S]
    return diag if diag.dtype == torch.bool else diag == 0
