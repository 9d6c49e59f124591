"""The weight GEMMs of a decode step as graph ops (Triton on CUDA for a few rows, torch else).

    mla::decode_linear(x [*, K], w [N, K]) -> x @ w.T                      [*, N]
    mla::decode_linear_residual(x [*, K], w [N, K], r [*, N]) -> r + x @ w.T   [*, N]
    mla::decode_linear_pair(x [*, K], w1 [N1, K], w2 [N2, K])
        -> (x @ w1.T [*, N1], x @ w2.T [*, N2])                            one launch
    mla::decode_gate_up(x [*, K], w_gate [N, K], w_up [N, K])
        -> silu(x @ w_gate.T) * (x @ w_up.T)                               [*, N], one launch
    mla::decode_linear_partials(x, w, split_k)
        -> fp32 [split_k, *, N] partial sums over split_k ranges of K (split-K for a small
           weight; the caller sums them: linear_split_k says when CONFIGS asks)
    mla::decode_linear_pair_partials(x, w1, w2, split_k)
        -> fp32 [split_k, *, N1 + N2], the same for a pair (pair_split_k)

At most MAX_ROWS rows of x on CUDA in bf16 / fp16 run the weight-streaming kernel of
linear_kernel.py (a decode step: each weight byte read once); anything else (prefill, CPU,
fp32, non-contiguous weights, or lowering.config.linear_impl = "torch": see linear_unmet)
runs exactly what nn.Linear / the HF MLP would (F.linear, F.silu), so converting a model
changes no numerics off the GPU's decode path. Defined with torch.library.triton_op, so
Inductor sees the kernel (and, at more rows, plain aten.mm).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F
import triton

from lowering import config as mla_config
from lowering.fused.silu_mul import silu_mul
from lowering.gemm.linear_kernel import decode_linear_kernel

MAX_ROWS = 64

# (mode, N, K, rows <= 16) -> (BLOCK_N, BLOCK_K, num_warps, num_stages[, SPLIT_K]), or None
# where cuBLAS (the torch path) was faster; measured on an H200 with
# benchmarks/bench_layer_gemms.py (DeepSeek-V3 layer shapes, alone, L2 flushed; cuBLAS in
# brackets). N is N1 + N2 for mode 1. Gate + up was then chosen inside the model's decode
# step (captured steps A/B in one process, bench_hf_decode.py): alone and in the step
# rank configs differently there.
CONFIGS: dict[tuple, Optional[tuple[int, ...]]] = {
    (1, 2112, 7168, True): (64, 128, 4, 4, 4),   # q_a + kv_a, split-K (unsplit 19.6 µs; cuBLAS 22.7)
    (0, 24576, 1536, True): (64, 128, 4, 5),     # q_b             29.1 µs (30.3)
    (0, 7168, 16384, True): (64, 256, 4, 4),     # o_proj          66.2 µs (74.0)
    (2, 18432, 7168, True): (64, 64, 4, 3),      # gate + up       129.2 µs (145.4 + SiLU x up),
    #                                             kernel timer; in the step 0.98x of (32, 256, 4, 4)
    (0, 7168, 18432, True): (64, 256, 4, 4),     # down_proj       72.7 µs (78.1)
    (1, 2112, 7168, False): (64, 128, 4, 4, 4),  # 32 rows: q_a + kv_a, split-K 16.8 µs (25.9)
    (0, 24576, 1536, False): None,               # q_b             30.4 µs (30.0)
    (0, 7168, 16384, False): (64, 128, 4, 6),    # o_proj          67.6 µs (75.6)
    (2, 18432, 7168, False): (64, 64, 8, 3),     # gate + up       132.1 µs (145.4 + SiLU x up),
    #                                             kernel timer; in the step 0.97x of cuBLAS + SiLU
    (0, 7168, 18432, False): (64, 128, 4, 6),    # down_proj       74.2 µs (82.0)
    # the output head (lm_head): V3's vocabulary, and a 2048-token one (split-K)
    (0, 129280, 7168, True): (64, 128, 4, 6),    # 1 row:          414.2 µs (428.4)
    (0, 129280, 7168, False): (64, 128, 4, 2),   # 32 rows:        434.4 µs (467.4)
    (0, 2048, 7168, True): (64, 128, 4, 4, 4),   # 1 row, split-K  15.1 µs (18.0)
    (0, 2048, 7168, False): (64, 128, 4, 4, 4),  # 32 rows, split-K 15.5 µs (18.5)
    # DeepSeek-V2-Lite (hidden 2048, 16 heads, no q_lora), 1 row (32 rows within 5 %);
    # benchmarks/bench_layer_gemms.py --model v2-lite --timer kernel, H200, 2026-12-02
    (1, 3648, 2048, True): (64, 128, 4, 4, 2),   # q_proj + kv_a   6.9 µs (cuBLAS 14.5)
    (0, 2048, 2048, True): (64, 128, 4, 4, 4),   # o_proj, head    5.0 µs (6.4)
    (2, 10944, 2048, True): (64, 128, 4, 3),     # gate + up       30.7 µs (35.5)
    (0, 2048, 10944, True): (64, 128, 4, 4, 4),  # down_proj       17.1 µs (19.7)
    (2, 2816, 2048, True): (32, 256, 4, 4),      # shared gate+up  10.9 µs (15.2)
    (0, 2048, 2816, True): (64, 128, 4, 4, 4),   # shared down     6.0 µs (8.1)
    (1, 3648, 2048, False): (64, 128, 4, 4, 2),  # 32 rows         7.3 µs (14.2)
    (0, 2048, 2048, False): (64, 128, 4, 4, 4),  #                 5.1 µs (6.6)
    (2, 10944, 2048, False): (128, 128, 8, 3),   #                 31.6 µs (35.8; swept as 4
    #                                             stages, which fit_stages trims to these 3)
    (0, 2048, 10944, False): (64, 128, 4, 4, 4), #                 17.6 µs (19.1)
    (2, 2816, 2048, False): (32, 256, 4, 4),     #                 11.6 µs (16.0; swept as 6, run as 4)
    (0, 2048, 2816, False): (64, 128, 4, 4, 4),  #                 6.2 µs (8.5)
    # DeepSeek-V2 / V2.5 (hidden 5120, 128 heads, q_lora 1536); q_b_proj is V3's shape
    # (its entries above stand); --model v2 --timer kernel, H200, 2026-12-03
    (1, 2112, 5120, True): (64, 128, 4, 4, 4),   # q_a + kv_a, split-K 9.0 µs (17.7)
    (0, 5120, 16384, True): (64, 128, 4, 4, 2),  # o_proj          47.7 µs (53.2)
    (2, 12288, 5120, True): (64, 128, 4, 3),     # gate + up       67.6 µs (77.0)
    (0, 5120, 12288, True): (64, 128, 4, 4, 2),  # down_proj       38.6 µs (41.9)
    (2, 3072, 5120, True): (32, 256, 4, 4),      # shared gate+up  22.9 µs (30.7)
    (0, 5120, 3072, True): (64, 128, 4, 6),      # shared down     12.4 µs (13.1)
    (1, 2112, 5120, False): (64, 128, 4, 4, 4),  # 32 rows         9.4 µs (19.2)
    (0, 5120, 16384, False): (64, 128, 4, 4, 2), #                 49.2 µs (52.4)
    (2, 12288, 5120, False): (128, 128, 8, 3),   #                 68.7 µs (77.2; swept as 4)
    (0, 5120, 12288, False): (64, 128, 4, 4, 2), #                 40.2 µs (42.0)
    (2, 3072, 5120, False): (32, 256, 4, 4),     #                 24.4 µs (31.8; swept as 6)
    (0, 5120, 3072, False): (64, 128, 4, 6),     #                 12.8 µs (13.0)
}
DEFAULT_CONFIG = (32, 256, 4, 4)


def pick_config(mode: int, N: int, K: int, M: int) -> Optional[tuple[int, ...]]:
    return CONFIGS.get((mode, N, K, M <= 16), DEFAULT_CONFIG)


def _config(mode, x, w1, w2=None):
    """The kernel config for this call, or None when torch (cuBLAS) serves it."""
    if linear_unmet(x, *(w for w in (w1, w2) if w is not None)) is not None:
        return None
    N = w1.shape[0] + (w2.shape[0] if mode == 1 else 0)
    return pick_config(mode, N, x.shape[-1], x.numel() // x.shape[-1])


def _rows(x: torch.Tensor, K: int) -> torch.Tensor:
    x2 = x.reshape(-1, K)                                                     # [M, K]
    return x2 if x2.stride(1) == 1 else x2.contiguous()


def linear_unmet(x: torch.Tensor, *ws: torch.Tensor) -> Optional[str]:
    """None when the Triton kernel serves x @ w.T for these tensors, else the unmet
    condition (torch then serves the call). Shapes, dtypes, devices and the setting
    only, so traced code can branch on it."""
    if mla_config.linear_impl == "torch":
        return "lowering.config.linear_impl is 'torch'"
    if x.dim() < 1 or any(w.dim() != 2 or w.shape[1] != x.shape[-1] for w in ws):
        return "the weights must be [N, K] for x [..., K]"
    if not x.is_cuda:
        return f"x is on {x.device}, the kernel runs on CUDA"
    if x.dtype not in (torch.bfloat16, torch.float16):
        return f"x is {x.dtype}, the kernel takes bf16 / fp16"
    if not 0 < x.numel() // max(1, x.shape[-1]) <= MAX_ROWS:
        return f"x has {x.numel() // max(1, x.shape[-1])} rows, the kernel serves 1 to {MAX_ROWS}"
    if any(w.dtype != x.dtype or not w.is_contiguous() or w.device != x.device for w in ws):
        return "every weight must be contiguous, of x's dtype, on x's device"
    return None


@functools.lru_cache(maxsize=None)
def max_shared_bytes(device_index: int) -> int:
    """Shared memory one program may take on this CUDA device (Triton's own limit)."""
    return triton.runtime.driver.active.utils.get_device_properties(device_index)["max_shared_mem"]


def fit_stages(stages: int, mode: int, block_m: int, block_n: int, block_k: int,
               elem_bytes: int, limit: int) -> int:
    """The most pipeline stages, up to `stages`, whose buffers fit in `limit` bytes.

    Per stage the kernel buffers an x tile [BLOCK_K, BLOCK_M] and one weight tile
    [BLOCK_N, BLOCK_K] (two in mode 2); mode 1 compiles a copy of the loop for each
    weight, so its buffers count twice (an upper bound: on an H200 with triton 3.6 mode 1
    took 1.5-2x of one copy's buffers, modes 0 and 2 exactly one copy's). The
    configs were chosen at <= 32 rows; at up to 64 rows (a short prefill) the x tile
    doubles, so a config may need fewer stages there.
    """
    per_stage = (block_m + block_n * (2 if mode == 2 else 1)) * block_k * elem_bytes
    per_stage *= 2 if mode == 1 else 1
    return max(1, min(stages, limit // per_stage))


def split_k_of(config) -> int:
    """K splits of a config: its optional fifth entry (1 when absent)."""
    return config[4] if config is not None and len(config) > 4 else 1


def launch(x2: torch.Tensor, w1: torch.Tensor, w2: Optional[torch.Tensor], mode: int,
           y1: torch.Tensor, y2: Optional[torch.Tensor], config: tuple, *,
           y2_col0: int = 0, residual: Optional[torch.Tensor] = None) -> None:
    """Run decode_linear_kernel with config (BLOCK_N, BLOCK_K, num_warps, num_stages[,
    SPLIT_K]): x2 [M, K] (K contiguous), w1/w2 [N, K] contiguous; y1/y2 [M, N], or with
    SPLIT_K > 1 fp32 partials [SPLIT_K, M, N]. Mode 1 with y2=None and y2_col0 > 0
    writes x @ w2.T into y1 from column y2_col0 on: one output tensor (Inductor would copy
    views of one buffer passed as two outputs, or lose one of them). Mode 0 without
    split-K may add residual [M, N] (last dim contiguous) in the epilogue."""
    M, K = x2.shape
    N1 = w1.shape[0]
    N2 = w2.shape[0] if w2 is not None else 0
    block_n, block_k, warps, stages = config[:4]
    split_k = split_k_of(config)
    if split_k > 1 and (mode == 2 or y1.dim() != 3 or y1.shape[0] != split_k):
        raise ValueError(f"SPLIT_K={split_k} needs mode 0 or 1 and y of [{split_k}, M, N]")
    if mode == 1 and y2 is None and not (0 < y2_col0 and y2_col0 + N2 <= y1.shape[-1]):
        raise ValueError(f"mode 1 without y2 needs y2_col0 > 0 and y1 of y2_col0 + {N2} "
                         f"columns; got y2_col0={y2_col0}, y1 {tuple(y1.shape)}")
    if residual is not None and (mode != 0 or split_k > 1 or residual.shape != y1.shape
                                 or residual.stride(-1) != 1):
        raise ValueError(f"a residual needs mode 0 without split-K and the shape of y "
                         f"{tuple(y1.shape)} with a contiguous last dim")
    block_m = max(16, triton.next_power_of_2(M))
    if x2.is_cuda:
        stages = fit_stages(stages, mode, block_m, block_n, block_k, x2.element_size(),
                            max_shared_bytes(x2.device.index))
    n1_blocks = triton.cdiv(N1, block_n)
    grid = (n1_blocks + (triton.cdiv(N2, block_n) if mode == 1 else 0), split_k)
    kernel = torch.library.wrap_triton(decode_linear_kernel)
    w2_ = w2 if w2 is not None else w1
    y2_ = y2 if y2 is not None else x2     # unused then; x2 is never written
    kernel[grid](
        x2, w1, w2_, y1, y2_, M, N1, N2, K,
        x2.stride(0), w1.stride(0), w2_.stride(0), y1.stride(-2), y2_.stride(-2),
        y1.stride(0) if split_k > 1 else 0, n1_blocks,
        residual if residual is not None else x2, residual.stride(0) if residual is not None else 0,
        MODE=mode, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, EVEN_K=K % (block_k * split_k) == 0, DOT_F32=not x2.is_cuda,
        SPLIT_K=split_k, Y2_COL0=y2_col0 if (mode == 1 and y2 is None) else 0,
        HAS_RES=residual is not None, num_warps=warps, num_stages=stages)


def _check(x: torch.Tensor, *ws: torch.Tensor) -> int:
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension (its last is K)")
    K = x.shape[-1]
    for i, w in enumerate(ws):
        if w.dim() != 2 or w.shape[1] != K:
            raise ValueError(f"weight {i} must be [N, {K}] to match x [..., {K}]; got {tuple(w.shape)}")
        if w.dtype != x.dtype:
            raise TypeError(f"weight {i} is {w.dtype}, x is {x.dtype}: they must match")
        if w.device != x.device:
            raise ValueError(f"weight {i} is on {w.device}, x on {x.device}")
    return K


@torch.library.triton_op("mla::decode_linear", mutates_args={})
def decode_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    K = _check(x, w)
    cfg = _config(0, x, w)
    if cfg is None:
        return F.linear(x, w)
    x2 = _rows(x, K)
    y = torch.empty((x2.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)   # [M, N]
    launch(x2, w, None, 0, y, None, cfg[:4])
    return y.view(*x.shape[:-1], w.shape[0])


@torch.library.triton_op("mla::decode_linear_residual", mutates_args={})
def decode_linear_residual(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """residual + x @ w.T, the product rounded to x's dtype first (HF's `residual +
    o_proj(h)` / `residual + mlp(h)`); on the kernel path the add is the GEMM's epilogue.
    Where the kernel's config splits K the caller adds (see linear_split_k)."""
    K = _check(x, w)
    want = (*x.shape[:-1], w.shape[0])
    if tuple(residual.shape) != want:
        raise ValueError(f"residual must be {want} (x @ w.T's shape), got {tuple(residual.shape)}")
    if residual.dtype != x.dtype or residual.device != x.device:
        raise TypeError(f"residual must be {x.dtype} on {x.device}, got {residual.dtype} on "
                        f"{residual.device}")
    cfg = _config(0, x, w)
    if cfg is None or split_k_of(cfg) > 1:
        return residual + F.linear(x, w)
    x2 = _rows(x, K)
    r2 = _rows(residual, w.shape[0])
    y = torch.empty((x2.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)   # [M, N]
    launch(x2, w, None, 0, y, None, cfg[:4], residual=r2)
    return y.view(want)


@torch.library.triton_op("mla::decode_linear_pair", mutates_args={})
def decode_linear_pair(x: torch.Tensor, w1: torch.Tensor,
                       w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    K = _check(x, w1, w2)
    cfg = _config(1, x, w1, w2)
    if cfg is None:
        return F.linear(x, w1), F.linear(x, w2)
    x2 = _rows(x, K)
    M = x2.shape[0]
    y1 = torch.empty((M, w1.shape[0]), dtype=x.dtype, device=x.device)        # [M, N1]
    y2 = torch.empty((M, w2.shape[0]), dtype=x.dtype, device=x.device)        # [M, N2]
    launch(x2, w1, w2, 1, y1, y2, cfg[:4])   # whole K (the partials op serves split-K)
    lead = x.shape[:-1]
    return y1.view(*lead, w1.shape[0]), y2.view(*lead, w2.shape[0])


def linear_split_k(x: torch.Tensor, w: torch.Tensor) -> int:
    """K splits the kernel uses for decode_linear's shapes (1: none). Shapes, dtypes and
    devices only, so traced code can branch on it."""
    return split_k_of(_config(0, x, w))


def pair_split_k(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> int:
    """K splits the kernel uses for decode_linear_pair's shapes (1: none)."""
    return split_k_of(_config(1, x, w1, w2))


def _partials(x: torch.Tensor, ws: tuple, split_k: int) -> torch.Tensor:
    """fp32 [split_k, *lead, sum of N] partial sums of x @ [w.T for w in ws] (one or two
    weights, one launch); off the kernel path the whole product in partial 0."""
    K = _check(x, *ws)
    if not isinstance(split_k, int) or split_k < 1:
        raise ValueError(f"split_k must be a positive int, got {split_k!r}")
    lead, Ns = x.shape[:-1], [w.shape[0] for w in ws]
    mode = len(ws) - 1                                   # 0: one weight, 1: a pair
    cfg = _config(mode, x, *ws)
    if cfg is None:                       # torch: the whole sum in partial 0, zeros after
        out = x.new_zeros((split_k, *lead, sum(Ns)), dtype=torch.float32)
        out[0] = torch.cat([F.linear(x, w) for w in ws], dim=-1)
        return out
    x2 = _rows(x, K)
    out = torch.empty((split_k, x2.shape[0], sum(Ns)), dtype=torch.float32, device=x.device)
    w2 = ws[1] if mode == 1 else None                    # [S, M, sum(Ns)]
    launch(x2, ws[0], w2, mode, out, None, (*cfg[:4], split_k), y2_col0=Ns[0] if mode else 0)
    return out.view(split_k, *lead, sum(Ns))


@torch.library.triton_op("mla::decode_linear_partials", mutates_args={})
def decode_linear_partials(x: torch.Tensor, w: torch.Tensor, split_k: int) -> torch.Tensor:
    """fp32 partial sums [split_k, *lead, N] whose sum over dim 0 is x @ w.T:
    decode_linear with split-K, the sum left to the caller (in a graph, Inductor fuses it
    into what reads the result)."""
    return _partials(x, (w,), split_k)


@torch.library.triton_op("mla::decode_linear_pair_partials", mutates_args={})
def decode_linear_pair_partials(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                                split_k: int) -> torch.Tensor:
    """fp32 partial sums [split_k, *lead, N1 + N2] whose sum over dim 0 is
    [x @ w1.T | x @ w2.T]: decode_linear_pair with split-K."""
    return _partials(x, (w1, w2), split_k)


@torch.library.triton_op("mla::decode_gate_up", mutates_args={})
def decode_gate_up(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    K = _check(x, w_gate, w_up)
    if w_gate.shape != w_up.shape:
        raise ValueError(f"w_gate {tuple(w_gate.shape)} and w_up {tuple(w_up.shape)} must match")
    cfg = _config(2, x, w_gate, w_up)
    if cfg is None:                  # (a prefill's rows: the two passes after it in one)
        return silu_mul(F.linear(x, w_gate), F.linear(x, w_up))
    x2 = _rows(x, K)
    y = torch.empty((x2.shape[0], w_gate.shape[0]), dtype=x.dtype, device=x.device)  # [M, N]
    launch(x2, w_gate, w_up, 2, y, None, cfg)
    return y.view(*x.shape[:-1], w_gate.shape[0])
