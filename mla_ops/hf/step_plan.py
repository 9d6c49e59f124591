"""A step's plan and commit for a bump-allocated paged cache (PagedMLACache's bookkeeping),
one Triton launch each on CUDA:

    mla::decode_step_plan(lens, block_table, num_used, batch, block_size, num_blocks,
                          max_len, bound) -> (pack, slots)
    mla::prefill_step_plan(lens, block_table, num_used, batch, tokens, block_size,
                           num_blocks, max_len) -> (pack, slots, room)
    mla::decode_step_commit(block_table!, lens!, num_used!, seen!, pack, batch, tokens) -> ()

decode_step_plan: a step of one new token per row (decode); prefill_step_plan: `tokens`
real tokens per row (an eager prefill without pads), and `room` [6] int64, what the
cache's room check reads on the host (step_plan_kernel.py), so the plan and its check are
one launch and one copy. pack's fields are step_layout.py's (step_layout(batch,
block_table.shape[1], bound); a prefill's unbound). The commit takes either plan.
mla_ops/hf/step.py computes the same plan in torch ops for every other step and device;
compiled, Inductor made four to five kernels of the plan and four of the commit, and an
eager prefill's plan took ~60 op calls (about 1.5 ms of host time on an H200 host).
Defined with torch.library.triton_op, so Inductor sees the kernels in the graph.
"""
from __future__ import annotations

import torch
import triton

from mla_ops.hf.step_commit_kernel import decode_commit_kernel
from mla_ops.hf.step_layout import PackLayout, step_layout
from mla_ops.hf.step_plan_kernel import step_plan_kernel

# The kernels' tile caps: a program loops over the batch / the table's columns in tiles
# of at most this many (tests set them small to loop over several tiles).
CONFIGS = {"plan_block_b": 1024, "plan_block_m": 1024, "plan_block_s": 1024,
           "commit_block_m": 1024}


def _check_state(lens, block_table, num_used, batch):
    for name, t, dt, dim in (("lens", lens, torch.int32, 1),
                             ("block_table", block_table, torch.int32, 2),
                             ("num_used", num_used, torch.int64, 0)):
        if not isinstance(t, torch.Tensor) or t.dtype != dt or t.dim() != dim:
            raise TypeError(f"{name} must be a {dim}-dim {dt} tensor, got "
                            f"{getattr(t, 'dtype', type(t).__name__)} "
                            f"{tuple(getattr(t, 'shape', ()))}")
        if t.device != lens.device:
            raise ValueError(f"{name} is on {t.device}, lens on {lens.device}")
    if not lens.is_contiguous() or not block_table.is_contiguous():
        raise ValueError("lens and block_table must be contiguous")
    if not 1 <= batch <= min(lens.shape[0], block_table.shape[0]):
        raise ValueError(f"batch={batch} must be in [1, {min(lens.shape[0], block_table.shape[0])}] "
                         f"(the rows of lens and block_table)")


def _block(n: int, cap: str) -> int:
    return min(CONFIGS[cap], triton.next_power_of_2(n))


def launch_plan(lens, block_table, num_used, batch, block_size, num_blocks, max_len, bound,
                pack, slots, tokens=1, room=None):
    """Run step_plan_kernel for `tokens` new tokens per row: pack [step_layout(batch, M,
    bound).size] int32, slots [batch * tokens] int64, room (None, or [6] int64)."""
    M = block_table.shape[1]
    at = step_layout(batch, M, bound).offsets
    torch.library.wrap_triton(step_plan_kernel)[(batch,)](
        lens, block_table, num_used, pack, slots, slots if room is None else room,
        batch, M, tokens, num_blocks, max_len,
        at["table"], at["seq_lens"], at["query_start_loc"], at.get("bounded_table", 0),
        at.get("bounded_lens", 0), at["taken"], BS=block_size, BOUND=bound,
        ROOM=room is not None, BLOCK_B=_block(batch, "plan_block_b"),
        BLOCK_M=_block(M, "plan_block_m"), BLOCK_S=_block(tokens, "plan_block_s"), num_warps=4)


def launch_commit(block_table, lens, num_used, seen, pack, layout: PackLayout, batch, tokens):
    """Run decode_commit_kernel: the state after the plan pack (of that layout)."""
    M = block_table.shape[1]
    at = layout.offsets
    torch.library.wrap_triton(decode_commit_kernel)[(batch,)](
        block_table, lens, num_used, seen, pack, batch, M, tokens, at["table"],
        at["seq_lens"], at["taken"], BLOCK_M=_block(M, "commit_block_m"), num_warps=4)


def _cuda_only(t: torch.Tensor, op: str) -> None:
    if not t.is_cuda:
        raise ValueError(f"mla::{op} runs on CUDA (its Triton kernel); the cache plans other "
                         f"devices in torch ops, got tensors on {t.device}")


def _check_positive(**sizes: int) -> None:
    if any(v <= 0 for v in sizes.values()):
        names = list(sizes)
        raise ValueError(f"{', '.join(names[:-1])} and {names[-1]} must be positive, got "
                         f"{', '.join(str(v) for v in sizes.values())}")


def _plan_buffers(lens, block_table, batch: int, tokens: int, bound: bool):
    """The plan kernel's outputs: pack [step_layout(...).size] int32, slots [batch * tokens]
    int64."""
    pack = torch.empty(step_layout(batch, block_table.shape[1], bound).size, dtype=torch.int32,
                       device=lens.device)
    return pack, torch.empty(batch * tokens, dtype=torch.int64, device=lens.device)


@torch.library.triton_op("mla::decode_step_plan", mutates_args={})
def decode_step_plan(lens: torch.Tensor, block_table: torch.Tensor, num_used: torch.Tensor,
                     batch: int, block_size: int, num_blocks: int, max_len: int,
                     bound: bool) -> tuple[torch.Tensor, torch.Tensor]:
    _check_state(lens, block_table, num_used, batch)
    _cuda_only(lens, "decode_step_plan")
    _check_positive(block_size=block_size, num_blocks=num_blocks, max_len=max_len)
    pack, slots = _plan_buffers(lens, block_table, batch, 1, bound)
    launch_plan(lens, block_table, num_used, batch, block_size, num_blocks, max_len, bound,
                pack, slots)
    return pack, slots


@torch.library.triton_op("mla::prefill_step_plan", mutates_args={})
def prefill_step_plan(lens: torch.Tensor, block_table: torch.Tensor, num_used: torch.Tensor,
                      batch: int, tokens: int, block_size: int, num_blocks: int,
                      max_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_state(lens, block_table, num_used, batch)
    _check_positive(tokens=tokens, block_size=block_size, num_blocks=num_blocks,
                    max_len=max_len)
    _cuda_only(lens, "prefill_step_plan")
    pack, slots = _plan_buffers(lens, block_table, batch, tokens, False)
    room = torch.empty(6, dtype=torch.int64, device=lens.device)
    launch_plan(lens, block_table, num_used, batch, block_size, num_blocks, max_len, False,
                pack, slots, tokens, room)
    return pack, slots, room


@torch.library.triton_op("mla::decode_step_commit",
                         mutates_args={"block_table", "lens", "num_used", "seen"})
def decode_step_commit(block_table: torch.Tensor, lens: torch.Tensor, num_used: torch.Tensor,
                       seen: torch.Tensor, pack: torch.Tensor, batch: int, tokens: int) -> None:
    _check_state(lens, block_table, num_used, batch)
    if seen.dtype != torch.int64 or seen.dim() != 0 or seen.device != lens.device:
        raise TypeError(f"seen must be a 0-dim int64 tensor on {lens.device}")
    M = block_table.shape[1]
    layouts = {lay.size: lay for lay in (step_layout(batch, M, b) for b in (False, True))}
    if (pack.dtype != torch.int32 or pack.dim() != 1 or pack.device != lens.device
            or pack.numel() not in layouts):
        raise ValueError("pack must be the int32 pack of mla::decode_step_plan for this batch")
    _cuda_only(lens, "decode_step_commit")
    launch_commit(block_table, lens, num_used, seen, pack, layouts[pack.numel()], batch, tokens)
