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
last layer writes the new state back after its attention (mla_ops/hf/step.py: on CUDA a
decode step's plan and its commit are one kernel each; other steps and devices run them
as torch ops). Decode-step shapes depend only on B, so a fixed batch compiles once and
replays in a CUDA graph.

Hybrid models (Kimi Linear: KDA linear-attention layers beside MLA ones, config.layer_types
"linear_attention" / "full_attention"): the paged pool holds the MLA layers only (kv(layer_idx)
maps a model layer to its pool entry), and each linear-attention layer index holds HF's own
LinearAttentionLayer, so HF's KDA layers read and write their conv / recurrent state
through the Cache API as they do on HF's caches. The step's plan is computed by the first
MLA layer and committed by the last.

Eager steps check on the host that they fit before writing (CacheFullError / ValueError).
A decode step does so without a device sync: the first eager decode step after any other
change of the state reads how many decode steps of B rows still fit (one read), and later
ones count down on the host (room_for_decode).
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, LinearAttentionLayer

import lowering

from mla_ops.cache import CacheFullError, PagedLatentCache, mark_static
from mla_ops.hf import step as step_ops
from mla_ops.hf.dsa import index_key_pool
from mla_ops.hf.step import Step

# ----------------------------------------------------------------------------- cache

LINEAR_LAYER_TYPES = ("linear_attention", "conv")     # state-only layers: HF's cache layers


def layer_kinds(config) -> list:
    """Per model layer: True where it holds latents (MLA), False for a linear-attention
    layer (config.layer_types entry in LINEAR_LAYER_TYPES); a config without layer_types
    is all MLA. Other layer kinds with a state of their own are refused."""
    n = config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    if types is None:
        return [True] * n
    types = list(types)[:n]
    bad = sorted({t for t in types if t in ("hybrid", "hybrid_sliding")})
    if bad or len(types) != n:
        raise ValueError(f"PagedMLACache serves MLA layers beside linear-attention ones; "
                         f"config.layer_types has {bad or len(types)} (expected "
                         f"{n} entries, none of hybrid / hybrid_sliding)")
    kinds = [t not in LINEAR_LAYER_TYPES for t in types]
    if not any(kinds):
        raise ValueError("PagedMLACache needs at least one MLA layer; config.layer_types "
                         "holds linear-attention layers only")
    return kinds


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
        return self._owner.seen            # 0-dim tensor: no graph break, no recompile

    def get_max_length(self) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        pass


class PagedMLACache(Cache):
    """A transformers Cache backed by mla_ops.PagedLatentCache (one 576-wide row per token per
    MLA layer).

    max_batch_size rows of at most max_cache_len tokens each (counted with left padding,
    as HF's position bookkeeping does). num_blocks defaults to the worst case
    max_batch_size * ceil(max_cache_len / block_size); blocks are handed to a row only
    when it needs them, so a smaller pool serves batches of shorter sequences.
    schedule_per_step: where the layers run FlashMLA, a decode step's plan computes its
    work split once for all layers (False: each layer's call computes its own).
    num_heads: the query heads each layer runs, for that split (default
    config.num_attention_heads; under tensor parallelism the heads of one rank).
    """

    def __init__(self, config, max_batch_size: int, max_cache_len: int, block_size: int = 64,
                 kv_cache_dtype: str = "auto", device=None, dtype: torch.dtype | None = None,
                 k_scale: float = 1.0, num_blocks: int | None = None,
                 schedule_per_step: bool = True, num_heads: int | None = None):
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
        if num_heads is not None and (not isinstance(num_heads, int) or isinstance(num_heads, bool)
                                      or num_heads <= 0):
            raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
        if dtype is None:
            dtype = getattr(config, "dtype", None)
            dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
            dtype = dtype if isinstance(dtype, torch.dtype) else torch.get_default_dtype()
        self.max_batch_size, self.max_cache_len = max_batch_size, max_cache_len
        self.max_blocks = -(-max_cache_len // block_size)      # block-table width M
        if num_blocks is None:
            num_blocks = max_batch_size * self.max_blocks
        kinds = layer_kinds(config)
        self.mla_layers = tuple(i for i, k in enumerate(kinds) if k)    # model layer indices
        # model layer index -> its pool entry (-1: a linear-attention layer)
        self.pool_index = [self.mla_layers.index(i) if k else -1 for i, k in enumerate(kinds)]
        self.pool = PagedLatentCache(len(self.mla_layers), num_blocks, block_size,
                                     kv_lora_rank=config.kv_lora_rank,
                                     qk_rope_head_dim=config.qk_rope_head_dim, dtype=dtype,
                                     kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, device=device)
        self.kv_cache_dtype = self.pool.kind                     # "auto" | "fp8"
        # DeepSeek Sparse Attention (config.index_topk): the indexer's keys per layer,
        # [num_blocks, block_size, index_head_dim], same slots as the latent rows; else None
        self.index_keys = index_key_pool(config, self.mla_layers, num_blocks, block_size,
                                         dtype, self.pool.kv[0].device)
        self.dtype = dtype
        self.device = self.pool.kv[0].device
        dev, Bm, M = self.device, max_batch_size, self.max_blocks
        self.block_table = torch.full((Bm, M), -1, dtype=torch.int32, device=dev)  # -1 = none
        self.lens = torch.zeros(Bm, dtype=torch.int32, device=dev)       # real tokens per row
        self.num_used = torch.zeros((), dtype=torch.int64, device=dev)   # bump-allocator top
        self.seen = torch.zeros((), dtype=torch.int64, device=dev)       # padded length, HF's view
        self._step: Step | None = None
        # Decode backends ("auto", "flashmla") that will run FlashMLA on this cache: for
        # them a decode step's plan carries FlashMLA's work split, computed once per step
        # (with schedule_per_step); for layers with an fp8 decode query
        # (convert(fp8_decode_query=...)) the split of FlashMLA's fp8 kernel, where it
        # serves them.
        heads = num_heads or getattr(config, "num_attention_heads", None)
        width = config.kv_lora_rank + config.qk_rope_head_dim
        self.num_heads = heads

        def flashmla_backends(q_dtype):
            return frozenset(
                b for b in ("auto", "flashmla")
                if heads and schedule_per_step
                and lowering.uses_flashmla(self.device, q_dtype, heads, width, block_size,
                                           self.kv_cache_dtype, b))
        self._flashmla_backends = flashmla_backends(dtype)
        self._flashmla_fp8q_backends = flashmla_backends(torch.float8_e4m3fn)
        self.version = 0        # bumped by every host-side change of the state (eager steps,
                                # reset, occupy, restore); compiled steps do not bump it
        # (version, B, n): at that version n more decode steps of B rows fit, read at the
        # first eager decode step after any other change, so later eager decode steps
        # need no host read of the state (see prepare)
        self.host_room: tuple | None = None
        if not torch.compiler.is_compiling():   # the pool's tensors are marked by PagedLatentCache
            for t in (self.block_table, self.lens, self.num_used, self.seen):
                mark_static(t)
        layers = [_PagedLayer(self) if k else LinearAttentionLayer(
            number_of_states=getattr(config, "number_of_conv_states", 1)) for k in kinds]
        super().__init__(layers=layers)

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
        """[num_blocks, block_size, L + R] storage of one (MLA) model layer."""
        return self.pool.kv[self._entry(layer_idx)]

    def index_key(self, layer_idx: int) -> torch.Tensor:
        """[num_blocks, block_size, index_head_dim] DSA indexer keys of one model layer (None
        for a layer that reuses the previous layer's selection)."""
        return self.index_keys[self._entry(layer_idx)]

    def _entry(self, layer_idx: int) -> int:
        i = self.pool_index[layer_idx]
        if i < 0:
            raise ValueError(f"layer {layer_idx} is a linear-attention layer: it holds no latents")
        return i

    def linear_states(self) -> list:
        """The linear-attention layers' conv / recurrent state tensors (those initialized)."""
        out = []
        for layer in self.layers:
            if isinstance(layer, LinearAttentionLayer):
                for d in (layer.conv_states, layer.recurrent_states):
                    out += [d[k] for k in sorted(d) if d[k] is not None]
        return out

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
        self.seen.fill_(max(lengths))
        self.version += 1

    def state(self) -> tuple:
        """The bookkeeping tensors, updated in place: block table [Bm, M] int32, lengths
        [Bm] int32, allocator top [] int64, padded length seen [] int64."""
        return (self.block_table, self.lens, self.num_used, self.seen)

    def snapshot(self) -> list:
        """Copies of the bookkeeping (block table, lengths, counters; not the KV rows) and
        of the linear-attention layers' states (a hybrid model's)."""
        return [t.clone() for t in (*self.state(), *self.linear_states())]

    def restore(self, saved) -> None:
        """Put back a snapshot() in place: tokens written since are forgotten (their rows
        lie past the restored lengths), blocks taken since are free again."""
        state = (*self.state(), *self.linear_states())
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
        self.seen.zero_()
        for layer in self.layers:
            if isinstance(layer, LinearAttentionLayer):
                layer.reset()                 # zeroed in place, no previous state
        self._step = None
        self.version += 1

    def _unsupported(self, *args, **kwargs):
        raise NotImplementedError("PagedMLACache supports greedy/sampled decoding only "
                                  "(no beam search, cropping or batch reordering)")

    reorder_cache = crop = batch_repeat_interleave = batch_select_indices = _unsupported

    # -- per-step bookkeeping (called by the converted attention) -----------------------
    def prepare(self, layer_idx: int, B: int, S: int, attention_mask, dtype, device,
                backend: str = "auto", fp8_query: bool = False,
                context_bound: int | None = None) -> Step:
        """This step's plan for one layer; the last layer commits it to the cache state
        (layer_done). backend and fp8_query (the layers' decode query is fp8) decide
        which FlashMLA schedule, if any, the plan carries.

        context_bound (a prefill step, S > 1, of a captured chunk: mla_ops/hf/prefill_graph.py):
        an int at least every row's cached length; the step then reads nothing on the host
        (its caller checked the room) and its prefill rows carry the bounds (B, S,
        context_bound, 0) as their shape.

        The plan is a pure function of the state before the step, so every layer gets
        the same one: layer 0 computes it and later layers reuse it; the last layer's
        commit drops it again. Compiled, the plan's tensors are values inside the one
        graph (the attribute is None again when the step ends, so nothing escapes).
        """
        compiling = torch.compiler.is_compiling()
        first = layer_idx == self.mla_layers[0]
        if first or self._step is None:
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
            valid = None if S == 1 else step_ops.valid_tokens(attention_mask, B, S, self.seen)
            served = self._flashmla_fp8q_backends if fp8_query else self._flashmla_backends
            # "auto": below 64 heads FlashMLA only for calls of many positions, from 64
            # for more than a few requests (shapes and dtype only)
            flashmla = S == 1 and backend in served and (
                fp8_query or backend != "auto"
                or lowering.flashmla_pays(self.num_heads, B, self.max_blocks * self.block_size,
                                          self.dtype))
            check = not compiling and first and context_bound is None
            if check and S == 1 and self.room_for_decode(B):
                check = False                   # known to fit: no host read this step
            self._step = step_ops.plan(self, B, S, valid,                  # valid: [B, S]
                                       check=check,
                                       flashmla=flashmla, fp8q=fp8_query)
            if context_bound is not None and S > 1:
                self._step.meta.prefill_shape = (B, S, context_bound, 0)
        return self._step

    def room_for_decode(self, B: int) -> bool:
        """Whether a one-token step of rows [0, B) is known to fit. Eager decode steps read
        the state on the host once (the first after any other change of it) and count
        down from there; a compiled step changes the state without the host seeing it,
        so callers that run one (DecodeGraph) forget the count (forget_room)."""
        room = self.host_room
        if room is None or room[:2] != (self.version, B):
            room = self.host_room = (self.version, B, step_ops.decode_room(self, B))
        return room[2] >= 1

    def forget_room(self) -> None:
        """Drop the host's count of decode steps that fit (the state changed unseen)."""
        self.host_room = None

    def layer_done(self, layer_idx: int, B: int, S: int) -> None:
        """After a layer's attention ops: the last layer commits the step's plan.

        Committing after the attention, not in prepare, keeps the in-place writes of the
        state after every read of it in the step: compiled, HF's positions (the lengths)
        feed each layer's RoPE, and a write before the last layer's RoPE makes Inductor
        keep those values in buffers of their own, rounding differently from a graph
        without it (DecodeGraph's step against generate()'s).
        """
        if layer_idx == self.mla_layers[-1] and self._step is not None:
            self.commit(self._step, B, S)

    def commit(self, step: Step, B: int, S: int) -> None:
        """Write a step's block table, lengths and counters into the state in place."""
        step_ops.commit(self, step, B, S)
        self._step = None
        if not torch.compiler.is_compiling():
            room = self.host_room
            self.version += 1
            self.host_room = (None if S != 1 or room is None or room[:2] != (self.version - 1, B)
                              else (self.version, B, room[2] - 1))
