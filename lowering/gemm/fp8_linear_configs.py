"""The fp8 decode GEMMs' launch configs, as data (lowering/gemm/fp8_linear.py launches them):
the tuned entries per DeepSeek-V3 decode shape, the default tile and K split for other
shapes, and the split a launch may take."""
from __future__ import annotations

import triton

MAX_ROWS = 64

# (mode, N, K, rows <= 16) -> (BLOCK_N, num_warps, num_stages, SPLIT_K[, PRE_QUANT]); PRE_QUANT
# (True when absent): the activations quantized once by act_quant_kernel before the GEMM,
# else by every program (docs/notes/probe_fp8_prequant.py: once is 1.6x faster for the
# dense gate + up, 1.04-1.12x for q_b, o_proj and down; the small shared-expert GEMMs and
# the 1-row q_a + kv_a are 1-7 % faster without the extra launch). BLOCK_K is the
# scale group, N is N1 + N2 for mode 1 and the gate's rows for mode 2. DeepSeek-V3's
# decode shapes; `python benchmarks/bench_fp8_weights.py --sweep` times candidates per
# shape on the GPU and prints the entries to put here. A shape without an entry takes
# DEFAULT_TILE and default_split_k's split.
# H200, torch 2.11, triton 3.6 (2026-12-02), the sweep's winners (µs of the op, the
# reduce included; the bf16 decode GEMM op reading twice the bytes beside it):
CONFIGS: dict[tuple, tuple] = {
    (1, 2112, 7168, True): (64, 4, 3, 8, False),  # q_a + kv_a, M=1: 20.3 us, bf16 26.7
    (1, 2112, 7168, False): (64, 4, 4, 4),      # q_a + kv_a, M=32: 24.6 us, bf16 32.2
    (0, 24576, 1536, True): (64, 4, 3, 1),      # q_b, M=1: 22.6 us, bf16 29.3
    (0, 24576, 1536, False): (128, 4, 3, 1),    # q_b, M=32: 23.3 us, bf16 38.4
    (0, 7168, 16384, True): (128, 4, 4, 4),     # o_proj, M=1: 52.0 us, bf16 69.9
    (0, 7168, 16384, False): (128, 4, 4, 4),    # o_proj, M=32: 52.9 us, bf16 68.4
    (2, 18432, 7168, True): (64, 4, 4, 1),      # dense gate + up, M=1: 81.1 us (131.5 quantizing
    #                                               in every program), bf16 136.0
    (2, 18432, 7168, False): (64, 4, 3, 1),     # dense gate + up, M=32: 91.9 us (145.8), bf16 139.7
    (0, 7168, 18432, True): (128, 4, 4, 4),     # dense down, M=1: 57.2 us, bf16 76.7
    (0, 7168, 18432, False): (128, 4, 4, 4),    # dense down, M=32: 58.3 us, bf16 75.4
    (2, 2048, 7168, True): (128, 4, 3, 8, False),  # shared expert gate + up, M=1: 21.8 us, bf16 28.1
    (2, 2048, 7168, False): (128, 4, 3, 8, False),  # shared expert gate + up, M=32: 22.3 us, bf16 32.9
    (0, 7168, 2048, True): (128, 4, 3, 4, False),  # shared expert down, M=1: 14.8 us, bf16 16.3
    (0, 7168, 2048, False): (128, 4, 3, 4, False),  # shared expert down, M=32: 15.9 us, bf16 17.3
}
DEFAULT_TILE = (64, 4, 4)        # (BLOCK_N, num_warps, num_stages)
SMS = 132                        # the H200's SMs, which default_split_k fills
PROGRAMS_PER_SM = 4              # default_split_k's target grid: up to this many per SM
MIN_GROUPS_PER_SPLIT = 4         # default_split_k: scale groups of K per split, at least
MAX_PARTIAL_BYTES = 16 << 20     # the fp32 partials of one call, at most


def n_programs(mode: int, N: int, block_n: int, split_k: int) -> int:
    """Programs along N of a launch for (mode, N) (mode 1: N = N1 + N2, one block of
    rounding up taken as one; mode 2 split: the gate's and up's rows)."""
    return triton.cdiv(N, block_n) * (2 if mode == 2 and split_k > 1 else 1)


def default_split_k(mode: int, N: int, K: int, block_n: int, group_k: int = 128,
                    sms: int = SMS) -> int:
    """The K splits for a shape without a CONFIGS entry: the largest power of two whose
    grid stays within PROGRAMS_PER_SM programs per SM with at least MIN_GROUPS_PER_SPLIT
    scale groups per split (1 where the unsplit grid already fills that many). Mode 2
    splits only where its unsplit grid leaves SMs idle (the split form runs gate and up
    as separate programs, each quantizing x again)."""
    if mode == 2 and triton.cdiv(N, block_n) >= sms:
        return 1
    groups = triton.cdiv(K, group_k)
    split = 1
    while (2 * split * MIN_GROUPS_PER_SPLIT <= groups
           and n_programs(mode, N, block_n, 2 * split) * 2 * split <= PROGRAMS_PER_SM * sms):
        split *= 2
    return split


def pick_config(mode: int, N: int, K: int, M: int,
                group_k: int = 128) -> tuple[int, int, int, int]:
    """(BLOCK_N, num_warps, num_stages, SPLIT_K) for (mode, N, K) at M rows: CONFIGS, else
    DEFAULT_TILE and default_split_k. The split the launch takes is split_k_for's."""
    cfg = CONFIGS.get((mode, N, K, bool(M <= 16)))
    if cfg is None:
        cfg = (*DEFAULT_TILE, default_split_k(mode, N, K, DEFAULT_TILE[0], group_k))
    return cfg


def pre_quant_of(config: tuple) -> bool:
    """Whether a launch of config quantizes the activations once first (its fifth entry,
    True when absent)."""
    return bool(config[4]) if len(config) > 4 else True


def split_k_for(config: tuple, mode: int, M: int, N: int, K: int, group_k: int) -> int:
    """The K splits a launch of config takes for x [M, K] and N output columns (mode 1:
    N1 + N2; mode 2: the gate's N): the config's fourth entry (1 when absent), at most one
    per scale group of K and at most what keeps the fp32 partials [SPLIT_K, M, N] (mode 2:
    [SPLIT_K, M, 2N]) within MAX_PARTIAL_BYTES at the most rows the kernel serves
    (MAX_ROWS, not M: the split, a shape of the partials, stays one value when a compiled
    step's row count is symbolic)."""
    split = config[3] if len(config) > 3 else 1
    row_bytes = MAX_ROWS * N * 4 * (2 if mode == 2 else 1)
    return max(1, min(split, triton.cdiv(K, group_k), MAX_PARTIAL_BYTES // max(1, row_bytes)))
