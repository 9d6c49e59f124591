"""DeepSeek-V3.2's lightning-indexer scores over the paged key pool, as the op
mla::indexer_scores (the Triton kernel of indexer_kernel.py).

    indexer_scores(q [B, S, Hi, Di], w [B, S, Hi] fp32, pool [num_blocks, bs, Di],
                   block_table [B, M] int32, limit [B, S] int32 / int64, scale)
        -> index [B, S, M * bs] fp32

index[b, s, j] = sum_h w[b, s, h] * relu(scale * q[b, s, h] . key_j) with key_j the pool
row at block_table[b, j // bs], offset j % bs, for j <= limit[b, s]; -inf past the limit
and where the table entry is -1 (HF's DeepseekV32Indexer, w holding its Hi^-0.5 factor).
The kernel reads each key once per group of TOKENS query tokens, straight through the
block table; its products of 16-bit values are exact in fp32, so it differs from the
fp32 torch reference (indexer_scores_reference) only in summation order.

indexer_unmet(q, w, pool) -> None where the kernel serves the call, else why not. The
public function checks its arguments; the op (a custom op: one opaque node for
torch.compile, fullgraph, graph-capturable: no host syncs) takes checked ones, which is
how select_slots calls it.
"""
from __future__ import annotations

import torch
import triton

from lowering.checks import check_tensor
from lowering.decode.indexer_kernel import indexer_scores_kernel
from lowering.decode.registry import sm_count

# ---- configs as data ------------------------------------------------------------------
# key: "gpu" | "cpu" (the interpreter). BLOCK_N key positions a tile, the most tiles a
# program (MAX_TILES), programs aimed at per SM (fewer tiles a program while the grid is
# smaller), query rows (tokens x padded heads) a program at most, warps, stages.
# "gpu": python benchmarks/bench_indexer.py on an H200 (BENCHMARKS.md), one query token.
CONFIGS = {
    "gpu": dict(BLOCK_N=64, MAX_TILES=8, programs_per_sm=4, max_rows=128,
                num_warps=4, num_stages=2),
    "cpu": dict(BLOCK_N=16, MAX_TILES=2, programs_per_sm=1, max_rows=64,
                num_warps=4, num_stages=1),
}
CPU_SM_COUNT = 4
MAX_HEADS, MAX_DIM = 128, 256         # the kernel's largest head count and head width
KEY_DTYPES = (torch.bfloat16, torch.float16)


def padded(x: int) -> int:
    """A power of two of at least 16 (tl.dot's smallest side)."""
    return max(16, triton.next_power_of_2(x))


def launch_shape(B: int, S: int, Hi: int, n: int, cfg: dict, sms: int) -> dict:
    """TOKENS (query tokens a program), TILES (key tiles a program) and the grid."""
    HP = padded(Hi)
    tokens = max(1, min(triton.next_power_of_2(S), cfg["max_rows"] // HP))
    tiles = triton.cdiv(n, cfg["BLOCK_N"])
    groups = B * triton.cdiv(S, tokens)
    per = triton.cdiv(groups * tiles, sms * cfg["programs_per_sm"])
    per = max(1, min(cfg["MAX_TILES"], per))
    return dict(HP=HP, TOKENS=tokens, TILES=per,
                grid=(triton.cdiv(tiles, per), B, triton.cdiv(S, tokens)))


def indexer_scores_launch(q: torch.Tensor, w: torch.Tensor, pool: torch.Tensor,
                          block_table: torch.Tensor, limit: torch.Tensor,
                          scale: float) -> torch.Tensor:
    """The kernel launch: index [B, S, M * bs] fp32. Host logic from shapes only."""
    B, S, Hi, Di = q.shape
    nb, bs, _ = pool.shape
    n = block_table.shape[1] * bs
    q, w, limit = q.contiguous(), w.contiguous(), limit.contiguous()
    block_table = block_table.contiguous()                                  # [B, M], rows dense
    on_gpu = q.device.type == "cuda"
    cfg = CONFIGS["gpu" if on_gpu else "cpu"]
    shape = launch_shape(B, S, Hi, n, cfg, sm_count(q.device) if on_gpu else CPU_SM_COUNT)
    out = torch.empty((B, S, n), dtype=torch.float32, device=q.device)
    torch.library.wrap_triton(indexer_scores_kernel)[shape["grid"]](
        q, w, pool, block_table, limit, out,
        scale, S, n, nb, pool.stride(0), pool.stride(1), block_table.stride(0),
        HI=Hi, DI=Di, BS=bs, HP=shape["HP"], DP=padded(Di), TOKENS=shape["TOKENS"],
        BLOCK_N=cfg["BLOCK_N"], TILES=shape["TILES"], DOT_F32=not on_gpu,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out


try:      # torch's switch between wrap_triton's traced op and a direct launch
    from torch._library.triton import set_wrap_triton_enabled
except ImportError:
    set_wrap_triton_enabled = None


@torch.library.custom_op("mla::indexer_scores", mutates_args=())
def indexer_scores_op(q: torch.Tensor, w: torch.Tensor, pool: torch.Tensor,
                      block_table: torch.Tensor, limit: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """Checked arguments (indexer_scores checks them): index [B, S, M * bs] fp32."""
    if set_wrap_triton_enabled is None:
        return indexer_scores_launch(q, w, pool, block_table, limit, scale)
    with set_wrap_triton_enabled(False):             # inside the op: launch directly
        return indexer_scores_launch(q, w, pool, block_table, limit, scale)


@indexer_scores_op.register_fake
def _(q, w, pool, block_table, limit, scale):
    B, S = q.shape[:2]
    return q.new_empty((B, S, block_table.shape[1] * pool.shape[1]), dtype=torch.float32)


def indexer_scores_reference(q, w, pool, block_table, limit, scale: float) -> torch.Tensor:
    """fp32 torch, the same numbers: index [B, S, M * bs] (the keys gathered first)."""
    B, S, Hi, Di = q.shape
    nb, bs, _ = pool.shape
    M = block_table.shape[1]
    n = M * bs
    table = block_table.long()
    keys = pool[table.clamp(0, nb - 1)].reshape(B, n, Di)                   # [B, n, Di]
    keys = keys.transpose(-1, -2).float().unsqueeze(1)                      # [B, 1, Di, n]
    scores = torch.relu(torch.matmul(q.float(), keys) * scale)              # [B, S, Hi, n]
    index = torch.matmul(w.float().unsqueeze(-2), scores).squeeze(-2)       # [B, S, n]
    j = torch.arange(n, device=q.device)
    has_key = (table >= 0).repeat_interleave(bs, dim=1)                     # [B, n]
    seen = (j <= limit.long()[..., None]) & has_key[:, None]                # [B, S, n]
    return torch.where(seen, index, float("-inf"))


def indexer_unmet(q: torch.Tensor, w: torch.Tensor, pool: torch.Tensor) -> str | None:
    """None where the kernel serves these inputs (any device: CPU runs the interpreter),
    else the unmet condition in words."""
    if q.dtype not in KEY_DTYPES:
        return f"the kernel takes a bf16 / fp16 query, got {q.dtype}"
    if pool.dtype != q.dtype:
        return f"the kernel takes a key pool of the query's dtype, got {pool.dtype}"
    if w.dtype != torch.float32:
        return f"the kernel takes fp32 head weights, got {w.dtype}"
    if q.shape[2] > MAX_HEADS or q.shape[3] > MAX_DIM:
        return f"the kernel takes at most {MAX_HEADS} heads of {MAX_DIM}, got {q.shape[2:]}"
    if pool.stride(-1) != 1:
        return "the kernel takes a pool with contiguous rows"
    return None


def check_indexer_args(q, w, pool, block_table, limit, scale) -> None:
    check_tensor("q", q, ndim=4)
    check_tensor("w", w, ndim=3)
    check_tensor("pool", pool, ndim=3)
    check_tensor("block_table", block_table, ndim=2, dtypes=(torch.int32,))
    check_tensor("limit", limit, ndim=2, dtypes=(torch.int32, torch.int64))
    B, S, Hi, Di = q.shape
    if tuple(w.shape) != (B, S, Hi):
        raise ValueError(f"w must have shape {(B, S, Hi)}, got {tuple(w.shape)}")
    if pool.shape[-1] != Di:
        raise ValueError(f"pool row width {pool.shape[-1]} must equal q's head dim {Di}")
    if block_table.shape[0] != B:
        raise ValueError(f"block_table has {block_table.shape[0]} rows, q has {B}")
    if tuple(limit.shape) != (B, S):
        raise ValueError(f"limit must have shape {(B, S)}, got {tuple(limit.shape)}")
    for name, t in (("w", w), ("pool", pool), ("block_table", block_table), ("limit", limit)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not scale > 0:
        raise ValueError(f"scale must be a positive float, got {scale!r}")
    why = indexer_unmet(q, w, pool)
    if why is not None:
        raise TypeError(f"q / w / pool: {why}")


def indexer_scores(q, w, pool, block_table, limit, scale: float) -> torch.Tensor:
    """Public entry (see the module docstring): checks once, then the kernel."""
    check_indexer_args(q, w, pool, block_table, limit, scale)
    return indexer_scores_op(q, w, pool, block_table, limit, float(scale))
