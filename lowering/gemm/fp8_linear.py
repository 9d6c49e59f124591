"""The decode GEMMs over block-quantized fp8 weights (DeepSeek-V3 / R1 checkpoints, HF's
FineGrainedFP8 FP8Linear: weight float8_e4m3fn [N, K], weight_scale_inv fp32
[ceil(N / group_n), ceil(K / group_k)], value = weight * scale_inv of its block):

    mla::decode_linear_fp8(x [*, K], w, s, group_n, group_k) -> x @ W.T              [*, N]
    mla::decode_linear_fp8_residual(x, w, s, r [*, N], group_n, group_k) -> r + x @ W.T
    mla::decode_linear_pair_fp8(x, w1, s1, w2, s2, group_n, group_k)
        -> (x @ W1.T [*, N1], x @ W2.T [*, N2])                                 one launch
    mla::decode_gate_up_fp8(x, w_gate, s_gate, w_up, s_up, group_n, group_k)
        -> silu(x @ Wg.T) * (x @ Wu.T)                                          one launch
    mla::decode_linear_pair_fp8_partials(x, w1, s1, w2, s2, group_n, group_k)
        -> fp32 [S, *, N1 + N2], summed over dim 0 [x @ W1.T | x @ W2.T], unrounded: the
           form of mla::decode_linear_pair_partials that mla::decode_qkv_prologue reads
    mla::decode_linear_fp8_partials(x, w, s, group_n, group_k)
        -> fp32 [S, *, N] summed over dim 0 x @ W.T, unrounded: what mla::residual_rms_norm
           sums (o_proj, its residual add and the post-attention norm in one launch)

where W is the dequantized weight. decode_linear_fp8, decode_gate_up_fp8 and
decode_linear_pair_fp8_partials also take
x_q, x_s (optional): x already quantized by the kernel that produced it
(fp8_act_quant.py's numerics), which their kernels then read instead of quantizing x
in a launch of their own. On CUDA, bf16 / fp16, at most MAX_ROWS rows, they run
fp8_linear_kernel.py: the weight read as fp8 (half a bf16 weight's bytes), each row of x
quantized per group_k columns in registers, fp8 x fp8 products accumulated in fp32 with
both scales: HF's FP8Linear numerics on a GPU (W8A8, dynamic per-token-group activation
scales), so a converted model computes what HF's module computes. Elsewhere (CPU, fp32,
lowering.config.linear_impl = "torch") the weight is dequantized exactly as
HF dequantizes an FP8 checkpoint it cannot run in fp8 (fp32 product, rounded to x's
dtype) and the op runs F.linear / F.silu: what HF's model computes on the CPU, where it
loads such a checkpoint dequantized; but more rows than the kernel takes on CUDA in bf16 /
fp16 (a prefill) run grouped.py's W8A8 GEMM, HF's FP8Linear numerics on a GPU, from the
fp8 weight (no dequantized copy). Arguments are checked by the caller (the converted
layer reads them off HF's modules, checked once by convert()).

Split-K: where a shape's config (CONFIGS, else default_split_k: fp8_linear_configs.py) splits K, the kernel
writes fp32 partials [S, M, N] over S ranges of whole scale groups and a second small
launch (reduce_partials) sums them, rounds once to x's dtype and applies the op's
epilogue (residual add, SiLU(gate) x up), so a short or long-K weight fills the SMs; the
partials op hands its S partials to the prologue, which sums them itself. The launchers
(launch, reduce_partials, scratch, run) are fp8_launch.py's.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import triton

from lowering import config as mla_config
from lowering.fused.silu_mul import silu_mul
from lowering.gemm.fp8_act_quant import given_quant, quantized
from lowering.gemm.fp8_launch import launch, run
from lowering.gemm.grouped import GROUPS_K, prefill_linear
from lowering.gemm.fp8_linear_configs import MAX_ROWS, pick_config, pre_quant_of, split_k_for

FP8 = torch.float8_e4m3fn


def dequantize(w: torch.Tensor, scale_inv: torch.Tensor, group_n: int, group_k: int,
               dtype: torch.dtype) -> torch.Tensor:
    """W [N, K] in dtype: w (fp8) times its block's scale_inv, in fp32, rounded once (HF's
    Fp8Dequantize; partial edge blocks take their block's scale)."""
    N, K = w.shape
    s = scale_inv.float().repeat_interleave(group_n, 0)[:N].repeat_interleave(group_k, 1)[:, :K]
    return (w.float() * s).to(dtype)


def fp8_linear_unmet(x: torch.Tensor, pairs, group_n: int, group_k: int) -> Optional[str]:
    """None when the kernel serves x @ W.T for these (weight, scale_inv) pairs, else the
    unmet condition (the dequantizing torch path then serves). Shapes, dtypes, devices and
    the setting only, so traced code can branch on it."""
    if mla_config.linear_impl == "torch":
        return "lowering.config.linear_impl is 'torch'"
    if not x.is_cuda:
        return f"x is on {x.device}, the kernel runs on CUDA"
    if x.dtype not in (torch.bfloat16, torch.float16):
        return f"x is {x.dtype}, the kernel takes bf16 / fp16"
    rows = x.numel() // max(1, x.shape[-1])
    if not 0 < rows <= MAX_ROWS:
        return f"x has {rows} rows, the kernel serves 1 to {MAX_ROWS}"
    if group_k not in (16, 32, 64, 128, 256) or group_n < 1:
        return f"scale groups ({group_n}, {group_k}): group_k must be a power of two in [16, 256]"
    for w, s in pairs:
        if w.dtype != FP8 or not w.is_contiguous() or w.device != x.device:
            return "every weight must be a contiguous float8_e4m3fn tensor on x's device"
        if s.dtype != torch.float32 or not s.is_contiguous() or s.device != x.device:
            return "every scale_inv must be a contiguous fp32 tensor on x's device"
    return None


def check_fp8_weight(name: str, w: torch.Tensor, s: torch.Tensor, group_n: int,
                     group_k: int) -> None:
    """Raise a ValueError / TypeError naming `name` unless w is an fp8 [N, K] weight with
    scale_inv [ceil(N / group_n), ceil(K / group_k)] fp32 on its device."""
    if w.dtype != FP8 or w.dim() != 2:
        raise TypeError(f"{name}.weight must be a 2-D float8_e4m3fn tensor, got {w.dtype} "
                        f"{tuple(w.shape)}")
    if not (isinstance(group_n, int) and isinstance(group_k, int) and group_n > 0 and group_k > 0):
        raise ValueError(f"{name}: block size must be two positive ints, got "
                         f"({group_n}, {group_k})")
    N, K = w.shape
    want = (triton.cdiv(N, group_n), triton.cdiv(K, group_k))
    if s.dtype != torch.float32 or tuple(s.shape) != want:
        raise ValueError(f"{name}.weight_scale_inv must be fp32 {want} for weight {(N, K)} in "
                         f"({group_n}, {group_k}) blocks, got {s.dtype} {tuple(s.shape)}")
    if s.device != w.device:
        raise ValueError(f"{name}.weight_scale_inv is on {s.device}, its weight on {w.device}")


def _rows(x: torch.Tensor, K: int) -> torch.Tensor:
    x2 = x.reshape(-1, K)                                                     # [M, K]
    return x2 if x2.stride(1) == 1 else x2.contiguous()


def _prefill_serves(x: torch.Tensor, pairs, group_k: int) -> bool:
    """Whether the grouped W8A8 GEMM (grouped.py) takes rows the decode kernel does
    not: CUDA, 16-bit x, more than MAX_ROWS rows, contiguous weights and scales."""
    return (mla_config.linear_impl != "torch" and x.is_cuda
            and x.dtype in (torch.bfloat16, torch.float16)
            and x.numel() // max(1, x.shape[-1]) > MAX_ROWS and group_k in GROUPS_K
            and all(w.dtype == FP8 and w.is_contiguous() and s.is_contiguous()
                    and s.dtype == torch.float32 for w, s in pairs))


def _unserved(x: torch.Tensor, w, s, group_n: int, group_k: int, prefill: bool):
    """x @ W.T where the decode kernel does not serve x: with prefill (_prefill_serves) the
    grouped W8A8 GEMM (HF's FP8Linear numerics on a GPU), else W dequantized as HF
    dequantizes a checkpoint it cannot run in fp8, and F.linear (what it computes on the
    CPU)."""
    if prefill:
        y = prefill_linear(_rows(x, x.shape[-1]), w, s, group_n, group_k)
        return y.view(*x.shape[:-1], w.shape[0])
    return F.linear(x, dequantize(w, s, group_n, group_k, x.dtype))


def _kernel_config(mode, x, pairs, group_n, group_k):
    if fp8_linear_unmet(x, pairs, group_n, group_k) is not None:
        return None
    N = sum(w.shape[0] for w, _ in pairs) if mode == 1 else pairs[0][0].shape[0]
    return pick_config(mode, N, x.shape[-1], x.numel() // x.shape[-1], group_k)


@torch.library.triton_op("mla::decode_linear_fp8", mutates_args={})
def decode_linear_fp8(x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor,
                      group_n: int, group_k: int, x_q: Optional[torch.Tensor] = None,
                      x_s: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x_q, x_s: x already quantized per group_k columns by the kernel that produced it (the
    attention prologue's q_a row for q_b): the kernel path reads them instead of
    quantizing x again (the same values; elsewhere they are unused)."""
    K = x.shape[-1]
    given = given_quant(x, x_q, x_s, group_k)
    cfg = _kernel_config(0, x, [(w, scale_inv)], group_n, group_k)
    if cfg is None:
        return _unserved(x, w, scale_inv, group_n, group_k,
                         _prefill_serves(x, [(w, scale_inv)], group_k))
    x2 = _rows(x, K)
    y = torch.empty((x2.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)   # [M, N]
    run(x2, w, scale_inv, None, None, 0, y, None, group_n, group_k, cfg, x_quant=given)
    return y.view(*x.shape[:-1], w.shape[0])


@torch.library.triton_op("mla::decode_linear_fp8_residual", mutates_args={})
def decode_linear_fp8_residual(x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor,
                               residual: torch.Tensor, group_n: int,
                               group_k: int) -> torch.Tensor:
    """residual + x @ W.T, the product rounded to x's dtype first (HF's `residual +
    o_proj(h)`); on the kernel path the add is the GEMM's epilogue."""
    K = x.shape[-1]
    cfg = _kernel_config(0, x, [(w, scale_inv)], group_n, group_k)
    if cfg is None:
        return residual + _unserved(x, w, scale_inv, group_n, group_k,
                                    _prefill_serves(x, [(w, scale_inv)], group_k))
    x2 = _rows(x, K)
    r2 = _rows(residual, w.shape[0])
    y = torch.empty((x2.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)   # [M, N]
    run(x2, w, scale_inv, None, None, 0, y, None, group_n, group_k, cfg, residual=r2)
    return y.view(*x.shape[:-1], w.shape[0])


@torch.library.triton_op("mla::decode_linear_pair_fp8", mutates_args={})
def decode_linear_pair_fp8(x: torch.Tensor, w1: torch.Tensor, s1: torch.Tensor,
                           w2: torch.Tensor, s2: torch.Tensor, group_n: int,
                           group_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    K = x.shape[-1]
    cfg = _kernel_config(1, x, [(w1, s1), (w2, s2)], group_n, group_k)
    if cfg is None:
        prefill = _prefill_serves(x, [(w1, s1), (w2, s2)], group_k)
        return (_unserved(x, w1, s1, group_n, group_k, prefill),
                _unserved(x, w2, s2, group_n, group_k, prefill))
    x2 = _rows(x, K)
    M = x2.shape[0]
    y1 = torch.empty((M, w1.shape[0]), dtype=x.dtype, device=x.device)        # [M, N1]
    y2 = torch.empty((M, w2.shape[0]), dtype=x.dtype, device=x.device)        # [M, N2]
    run(x2, w1, s1, w2, s2, 1, y1, y2, group_n, group_k, cfg)
    lead = x.shape[:-1]
    return y1.view(*lead, w1.shape[0]), y2.view(*lead, w2.shape[0])


@torch.library.triton_op("mla::decode_gate_up_fp8", mutates_args={})
def decode_gate_up_fp8(x: torch.Tensor, w_gate: torch.Tensor, s_gate: torch.Tensor,
                       w_up: torch.Tensor, s_up: torch.Tensor, group_n: int,
                       group_k: int, x_q: Optional[torch.Tensor] = None,
                       x_s: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x_q, x_s: x quantized by its producer (the post-attention norm), as
    decode_linear_fp8's."""
    K = x.shape[-1]
    given = given_quant(x, x_q, x_s, group_k)
    cfg = _kernel_config(2, x, [(w_gate, s_gate), (w_up, s_up)], group_n, group_k)
    if cfg is None:
        if _prefill_serves(x, [(w_gate, s_gate), (w_up, s_up)], group_k):   # x quantized once
            x2 = _rows(x, K)
            xq = quantized(x2, group_k, True)[:2]
            g, u = [prefill_linear(x2, w, s, group_n, group_k, x_quant=xq)
                    for w, s in ((w_gate, s_gate), (w_up, s_up))]
            return silu_mul(g, u).view(*x.shape[:-1], w_gate.shape[0])
        return silu_mul(_unserved(x, w_gate, s_gate, group_n, group_k, False),
                        _unserved(x, w_up, s_up, group_n, group_k, False))
    x2 = _rows(x, K)
    y = torch.empty((x2.shape[0], w_gate.shape[0]), dtype=x.dtype, device=x.device)  # [M, N]
    run(x2, w_gate, s_gate, w_up, s_up, 2, y, None, group_n, group_k, cfg, x_quant=given)
    return y.view(*x.shape[:-1], w_gate.shape[0])


@torch.library.triton_op("mla::decode_linear_pair_fp8_partials", mutates_args={})
def decode_linear_pair_fp8_partials(x: torch.Tensor, w1: torch.Tensor, s1: torch.Tensor,
                                    w2: torch.Tensor, s2: torch.Tensor, group_n: int,
                                    group_k: int, x_q: Optional[torch.Tensor] = None,
                                    x_s: Optional[torch.Tensor] = None) -> torch.Tensor:
    """fp32 [S, *lead, N1 + N2] whose sum over dim 0 is [x @ W1.T | x @ W2.T] (one launch,
    unrounded; S = the config's K splits on the kernel path, else 1), the input
    mla::decode_qkv_prologue sums and rounds: its norms and RoPE then follow the fp8 q_a +
    kv_a GEMM as they follow the 16-bit split-K one. x_q, x_s: x quantized by the layer's
    input norm (mla::rms_norm_fp8), as decode_linear_fp8's."""
    K = x.shape[-1]
    given = given_quant(x, x_q, x_s, group_k)
    lead, N1, N2 = x.shape[:-1], w1.shape[0], w2.shape[0]
    cfg = _kernel_config(1, x, [(w1, s1), (w2, s2)], group_n, group_k)
    if cfg is None:
        y = torch.cat([F.linear(x, dequantize(w, s, group_n, group_k, x.dtype))
                       for w, s in ((w1, s1), (w2, s2))], dim=-1)
        return y.float().unsqueeze(0)
    x2 = _rows(x, K)
    S = split_k_for(cfg, 1, x2.shape[0], N1 + N2, K, group_k)
    out = torch.empty((S, x2.shape[0], N1 + N2), dtype=torch.float32, device=x.device)
    launch(x2, w1, s1, w2, s2, 1, out, None, group_n, group_k, (*cfg[:3], S),
           y2_col0=N1, pre_quant=pre_quant_of(cfg), x_quant=given)          # [S, M, N1+N2]
    return out.view(S, *lead, N1 + N2)


def partial_splits(x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor, group_n: int,
                   group_k: int) -> int:
    """The K splits of x @ W.T's kernel launch (split_k_for of its config), 0 where the
    kernel does not serve x (shapes, dtypes and settings only)."""
    cfg = _kernel_config(0, x, [(w, scale_inv)], group_n, group_k)
    if cfg is None:
        return 0
    return split_k_for(cfg, 0, x.numel() // x.shape[-1], w.shape[0], x.shape[-1], group_k)


@torch.library.triton_op("mla::decode_linear_fp8_partials", mutates_args={})
def decode_linear_fp8_partials(x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor,
                               group_n: int, group_k: int) -> torch.Tensor:
    """fp32 [S, *lead, N] whose sum over dim 0 is x @ W.T (one launch, unrounded; S =
    partial_splits on the kernel path, else 1), the partials mla::residual_rms_norm sums,
    rounds and adds to the residual as the split reduce's residual epilogue does."""
    K, N = x.shape[-1], w.shape[0]
    lead = x.shape[:-1]
    cfg = _kernel_config(0, x, [(w, scale_inv)], group_n, group_k)
    if cfg is None:
        y = F.linear(x, dequantize(w, scale_inv, group_n, group_k, x.dtype))
        return y.float().unsqueeze(0)
    x2 = _rows(x, K)
    S = split_k_for(cfg, 0, x2.shape[0], N, K, group_k)
    out = torch.empty((S, x2.shape[0], N), dtype=torch.float32, device=x.device)  # [S, M, N]
    launch(x2, w, scale_inv, None, None, 0, out if S > 1 else out[0], None, group_n, group_k,
           (*cfg[:3], S), pre_quant=pre_quant_of(cfg))
    return out.view(S, *lead, N)
