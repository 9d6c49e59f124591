"""One step of PagedMLACache (mla_ops/hf/cache.py): its plan, built from the cache state as
it was before the step, and its commit, which writes the state after it in place.

The plan holds, per row, the block table after the step, the slots of the step's tokens,
the lengths the attention reads, and (where the layers use FlashMLA) its schedule and the
block table and lengths bounded once for all layers' calls; its int32 fields live in one
buffer laid out by step_layout.py. Where its kernels can run (CUDA) a decode step (one
real token per row) is planned and committed by one launch each (mla::decode_step_plan /
mla::decode_step_commit, step_plan.py), and so is an eager prefill step whose tokens are
all real (mla::prefill_step_plan, its room check read back in the same host copy); every
other step, and every step on other devices, in torch ops here. Both give the same values
(tests/test_step_plan.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import lowering
import mla_ops.hf.step_plan  # noqa: F401  (registers mla::decode_step_plan / _commit)

from mla_ops.cache import CacheFullError
from mla_ops.hf.step_layout import PackLayout, step_layout
from mla_ops.metadata import MLAMetadata


@dataclass
class Step:
    meta: MLAMetadata
    perm: torch.Tensor | None      # [T] token order fed to the ops (real tokens of a row first)
    inv: torch.Tensor | None       # [T] inverse of perm
    lens_new: torch.Tensor         # [B] real tokens per row after the step
    num_new_blocks: torch.Tensor   # [] blocks taken this step
    table: torch.Tensor            # [B, M] block table after the step (-1: no block)
    pack: torch.Tensor | None = None   # set when a plan kernel (step_plan.py) made the plan


def plan(cache, B: int, S: int, valid, check: bool, flashmla: bool, fp8q: bool) -> Step:
    """The plan of a step of S tokens for rows [0, B) of cache (valid [B, S] bool: which
    tokens are real, None: all). check: raise first if the step does not fit (a host sync);
    flashmla: carry FlashMLA's schedule (fp8q: its fp8 kernel's) and bounded inputs."""
    if S == 1 and valid is None and cache.device.type == "cuda":
        return _plan_kernel(cache, B, check, flashmla, fp8q)
    if S > 1 and check and cache.device.type == "cuda":
        step = _plan_prefill_kernel(cache, B, S, valid, fp8q)
        if step is not None:
            return step
    return _plan_torch(cache, B, S, valid, check, flashmla, fp8q)


def _plan_kernel(cache, B: int, check: bool, flashmla: bool, fp8q: bool) -> Step:
    """A one-token-per-row step's plan in one launch (mla::decode_step_plan): the same
    values as _plan_torch, and committed by one launch too."""
    pack, slots = torch.ops.mla.decode_step_plan(
        cache.lens, cache.block_table, cache.num_used, B, cache.block_size, cache.num_blocks,
        cache.max_cache_len, flashmla)
    layout = step_layout(B, cache.max_blocks, flashmla)
    f = layout.views(pack)
    lens_new, total = f["seq_lens"], f["taken"][0]                            # [B], []
    if check:                                                                 # a host sync
        check_room(cache, lens_new, total)
    return _step_of(cache, pack, layout, slots, B, 1, flashmla, lens_new, total,
                    kernel=True, fp8q=fp8q)


def _plan_prefill_kernel(cache, B: int, S: int, valid, fp8q: bool) -> Step | None:
    """An eager prefill step's plan in one launch (mla::prefill_step_plan) and its room
    check in one host copy, which also reads whether every token of valid is real. None
    where some are pads: the torch plan orders those (and checks the room counting real
    tokens only)."""
    pack, slots, room = torch.ops.mla.prefill_step_plan(
        cache.lens, cache.block_table, cache.num_used, B, S, cache.block_size,
        cache.num_blocks, cache.max_cache_len)
    if valid is not None:
        room = torch.cat((room, valid.all().view(1).to(torch.int64)))
    host = room.tolist()                                                      # a host sync
    if valid is not None and not host[6]:
        return None
    raise_if_no_room(cache, *host[:4])
    layout = step_layout(B, cache.max_blocks, False)
    f = layout.views(pack)
    return _step_of(cache, pack, layout, slots, B, S, False, f["seq_lens"], f["taken"][0],
                    kernel=True, fp8q=fp8q, prefill_shape=(B, S, host[4], host[5]))


def _plan_torch(cache, B: int, S: int, valid, check: bool, flashmla: bool, fp8q: bool) -> Step:
    dev, bs, M = cache.device, cache.block_size, cache.max_blocks
    lens_old = cache.lens[:B].long()                                         # [B]
    q = (valid.sum(1) if valid is not None
         else torch.full((B,), S, dtype=torch.int64, device=dev))            # [B] real tokens
    lens_new = lens_old + q
    nb_old = (lens_old + bs - 1) // bs
    nb_new = (torch.clamp(lens_new, max=cache.max_cache_len) + bs - 1) // bs
    need = nb_new - nb_old                                                   # [B] new blocks
    prefill_shape = None
    if check:          # one host sync: the room, and the host ints of the prefill rows
        ctx = check_room(cache, lens_new, need.sum(), lens_old if S > 1 else None)
        prefill_shape = None if ctx is None else (B, S) + ctx
    # Bump allocation: row b takes ids start_b + k for its block columns nb_old_b + k.
    start = cache.num_used + torch.cumsum(need, 0) - need                    # [B]
    col = torch.arange(M, device=dev)[None]                                  # [1, M]
    fresh = (col >= nb_old[:, None]) & (col < nb_new[:, None])               # [B, M]
    ids = start[:, None] + col - nb_old[:, None]
    ids = torch.where(ids < cache.num_blocks, ids, -1)   # pool exhausted (unchecked when
    # compiled): no block, so the token is not written rather than sharing a block
    table = torch.where(fresh, ids.to(torch.int32), cache.block_table[:B])   # [B, M] int32
    # Slots of this step's tokens, in op order (real tokens of a row first).
    j = torch.arange(S, device=dev)
    pos = lens_old[:, None] + j                                              # [B, S]
    blk = table.gather(1, (pos // bs).clamp(max=M - 1)).long()
    real = (j[None] < q[:, None]) & (pos < cache.max_cache_len) & (blk >= 0)
    slots = torch.where(real, blk * bs + pos % bs, -1).reshape(-1)           # [T]
    seq_lens = (lens_old + S).to(torch.int32)            # trailing pads count, never read
    qsl = (torch.arange(B + 1, device=dev) * S).to(torch.int32)             # [B + 1]
    fields = dict(table=table, seq_lens=seq_lens, query_start_loc=qsl, taken=need.sum())
    if flashmla:   # the decode calls' inputs bounded once per step, not once per call
        fields["bounded_table"], fields["bounded_lens"] = lowering.bound_decode_inputs(
            cache.pool.kv[0], table, seq_lens)
    layout = step_layout(B, M, flashmla)
    pack = layout.pack(**fields)
    perm = inv = None
    if valid is not None:
        rows = torch.arange(B, device=dev)[:, None]
        order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)   # [B, S]
        perm = (order + rows * S).reshape(-1)                                 # [T]
        inv = torch.argsort(perm)
    return _step_of(cache, pack, layout, slots, B, S, flashmla, lens_old + q, need.sum(),
                    perm, inv, fp8q=fp8q, prefill_shape=prefill_shape)


def _step_of(cache, pack, layout: PackLayout, slots, B, S, flashmla, lens_new, num_new,
             perm=None, inv=None, kernel=False, fp8q=False, prefill_shape=None) -> Step:
    """The step from its int32 pack (fields of layout) and slots; with flashmla,
    FlashMLA's schedule for the layers' query kind (fp8q: its fp8 kernel's)."""
    M = cache.max_blocks
    f = layout.views(pack)
    table = f["table"].view(B, M)
    attn_table, attn_lens, sched = table, f["seq_lens"], None
    if flashmla:                                         # one scheduler kernel per step
        attn_table, attn_lens = f["bounded_table"].view(B, M), f["bounded_lens"]
        sched = lowering.decode_schedule(cache.pool.kv[0], attn_table, attn_lens,
                                         num_heads=cache.num_heads, bounded=True, fp8q=fp8q)
    meta = MLAMetadata(
        slot_mapping=slots,
        block_table=attn_table,
        seq_lens=attn_lens,
        query_start_loc=f["query_start_loc"],
        num_decode_tokens=B if S == 1 else 0,
        decode_schedule=sched,
        prefill_shape=prefill_shape)
    return Step(meta, perm, inv, lens_new, num_new, table, pack if kernel else None)


def check_room(cache, lens_new: torch.Tensor, total: torch.Tensor,
               context: torch.Tensor | None = None) -> tuple | None:
    """Raise before a step whose rows outgrow max_cache_len or the free blocks; one
    device->host copy. context: the rows' cached lengths before a prefill step, whose
    (longest, shortest) come back with the same copy (else None)."""
    vals = [lens_new.max(), lens_new.argmax(), total, cache.num_used]
    if context is not None:
        vals += [context.max(), context.min()]
    host = torch.stack([v.to(torch.int64) for v in vals]).tolist()
    raise_if_no_room(cache, *host[:4])
    return None if context is None else tuple(host[4:])


def raise_if_no_room(cache, longest: int, row: int, total: int, used: int) -> None:
    """Raise where the step's longest row (row) outgrows max_cache_len or its total new
    blocks exceed the free ones (used: taken before the step)."""
    if longest > cache.max_cache_len:
        raise ValueError(f"sequence {row} would hold {longest} tokens, more than the "
                         f"cache's max_cache_len={cache.max_cache_len} (prompt too long "
                         f"or too many new tokens); build PagedMLACache with a larger one")
    free = cache.num_blocks - used
    if total > free:
        raise CacheFullError(f"this step needs {total} more blocks of {cache.block_size} "
                             f"tokens, {free} of {cache.num_blocks} free; build "
                             f"PagedMLACache with more num_blocks or call reset()")


def decode_room(cache, B: int) -> int:
    """How many more one-token-per-row steps of rows [0, B) fit in cache: within
    max_cache_len counted as HF counts (the padded length seen, which bounds every row)
    and within the free blocks. One host read of the state."""
    state = torch.cat((cache.lens[:B].long(), cache.num_used.view(1),
                       cache.seen.view(1))).tolist()
    lens, used, seen = state[:B], state[B], state[B + 1]
    bs, free = cache.block_size, cache.num_blocks - used

    def blocks_needed(k):
        return sum(-(-(n + k) // bs) - (-(-n // bs)) for n in lens)
    lo, hi = 0, max(cache.max_cache_len - seen, 0)
    while lo < hi:                            # the largest k with blocks_needed(k) <= free
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if blocks_needed(mid) <= free else (lo, mid - 1)
    return lo


def commit(cache, step: Step, B: int, S: int) -> None:
    """Write the step's block table, lengths and counters into cache's state in place."""
    if step.pack is not None:                    # planned by a kernel of step_plan.py
        torch.ops.mla.decode_step_commit(cache.block_table, cache.lens, cache.num_used,
                                         cache.seen, step.pack, B, S)
    else:
        cache.block_table[:B] = step.table
        cache.lens[:B] = step.lens_new.to(torch.int32)
        cache.num_used.add_(step.num_new_blocks)
        cache.seen.add_(S)


def valid_tokens(attention_mask, B: int, S: int, past):
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
