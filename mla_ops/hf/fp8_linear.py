"""A converted layer's FP8 block-quantized linears and routed experts (DeepSeek-V3 / R1
checkpoints loaded by HF's FineGrainedFP8 quantization) on the fp8 decode ops
(lowering/gemm/fp8_linear.py, lowering/moe/fp8_experts.py).

HF's FP8Linear holds weight float8_e4m3fn [N, K], weight_scale_inv fp32
[ceil(N / bn), ceil(K / bk)] and block_size (bn, bk) (128 x 128 for DeepSeek). The ops
take those tensors as they are (no copies): on CUDA at decode sizes the weight-streaming
kernel reads the fp8 weight and quantizes the activation per bk columns as HF's module
does (W8A8, dynamic scales), and a prefill's rows the grouped W8A8 GEMM (the same
numerics); elsewhere they dequantize the weight as HF does when it loads such a
checkpoint where fp8 cannot run (the CPU) and run F.linear.

Served: HF's FP8Linear with a block size, no bias, dynamic activation scales and fp32
scales. Others (per-tensor or static activation scales, ue8m0 scales, biases) keep their
own call, as every module does with lowering.config.linear_impl = "torch" or while
autograd would need the weight's gradient.

HF's FP8Experts (gate_up_proj [E, 2I, H] and down_proj [E, H, I] e4m3 with their
*_scale_inv) in a block converted with fuse_experts: a decode step's routed experts run
mla::moe_experts_decode_fp8 (the chosen experts' fp8 rows, HF's W8A8 numerics); other
batches run HF's experts module where transformers' fp8 kernel loads (CUDA), else the same
op: on CUDA its grouped W8A8 GEMMs over the pairs sorted by expert (lowering/moe/
fp8_prefill.py), on the CPU its reference on the chosen experts' dequantized weights (the
CPU's answer).
"""
from __future__ import annotations

import torch

from lowering import config as mla_config
from lowering.gemm import fp8_linear as fp8_ops   # registers the mla::decode_*_fp8 ops
from lowering.moe import fp8_experts                 # registers mla::moe_experts_decode_fp8

FP8 = torch.float8_e4m3fn


def is_block_fp8(m) -> bool:
    """m is an HF FineGrainedFP8 linear the fp8 ops serve (see the module docstring)."""
    block = getattr(m, "block_size", None)
    scale = getattr(m, "weight_scale_inv", None)
    return (type(m).__name__ == "FP8Linear"
            and type(m).__module__.startswith("transformers.")
            and isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.dtype == FP8
            and isinstance(scale, torch.Tensor) and scale.dtype == torch.float32
            and block is not None and len(block) == 2
            and getattr(m, "bias", None) is None
            and getattr(m, "activation_scheme", "dynamic") == "dynamic")


def groups(m) -> tuple[int, int]:
    """The module's scale block (group_n, group_k)."""
    return int(m.block_size[0]), int(m.block_size[1])


def check_module(name: str, m) -> None:
    """Raise a ValueError / TypeError naming the module unless its weight and scales agree."""
    gn, gk = groups(m)
    fp8_ops.check_fp8_weight(name, m.weight, m.weight_scale_inv, gn, gk)


def is_fp8_experts(m) -> bool:
    """m is HF's FP8Experts with gated (SiLU x up) block-quantized fp32-scaled experts."""
    block = getattr(m, "block_size", None)
    return (type(m).__name__.endswith("FP8Experts")
            and type(m).__module__.startswith("transformers.")
            and getattr(m, "gate_up_proj", None) is not None and m.gate_up_proj.dtype == FP8
            and getattr(m, "has_gate", True) and not getattr(m, "has_bias", False)
            and block is not None and len(block) == 2
            and m.gate_up_proj_scale_inv.dtype == torch.float32
            and getattr(m, "activation_scheme", "dynamic") == "dynamic")


def check_model(model) -> None:
    """Raise a ValueError / TypeError naming the first FP8 linear or experts module whose
    weights and scales disagree (convert() calls it before touching the model)."""
    for name, m in model.named_modules():
        if is_block_fp8(m):
            check_module(name, m)
        elif is_fp8_experts(m):
            gn, gk = groups(m)
            try:
                fp8_experts.check_scales(m.gate_up_proj, m.gate_up_proj_scale_inv,
                                         m.down_proj, m.down_proj_scale_inv, gn, gk)
            except (TypeError, ValueError) as e:
                raise type(e)(f"{name}: {e}") from None


def hf_fp8_kernel_loads() -> bool:
    """Whether transformers' own fp8 kernel loads here (CUDA and the kernels package)."""
    if not torch.cuda.is_available():
        return False
    try:
        from transformers.integrations.finegrained_fp8 import load_finegrained_fp8_kernel
        load_finegrained_fp8_kernel()
    except Exception:        # the kernels package or the hub kernel missing
        return False
    return True


def fp8_routed_experts(block, x: torch.Tensor, topk_idx: torch.Tensor,
                       topk_weight: torch.Tensor) -> torch.Tensor:
    """The FP8 routed experts of a converted MoE block for x [T, H] (see the docstring)."""
    ex = block.experts
    args = (ex.gate_up_proj, ex.gate_up_proj_scale_inv, ex.down_proj, ex.down_proj_scale_inv)
    serves = fp8_experts.kernel_serves(x, *args, groups(ex)[1])
    grad = torch.is_grad_enabled() and (ex.gate_up_proj.requires_grad
                                        or ex.down_proj.requires_grad)
    if mla_config.linear_impl == "torch" or grad or (not serves and x.is_cuda
                                             and getattr(block, "mla_hf_fp8_runs", False)):
        return ex(x, topk_idx, topk_weight)
    return torch.ops.mla.moe_experts_decode_fp8(x, topk_idx, topk_weight, *args, *groups(ex))


def dequantized_weight(m, dtype: torch.dtype) -> torch.Tensor:
    """The module's weight dequantized to dtype, as HF dequantizes a checkpoint."""
    gn, gk = groups(m)
    return fp8_ops.dequantize(m.weight, m.weight_scale_inv, gn, gk, dtype)


def uses_fp8_ops(*mods) -> bool:
    """Whether these modules' GEMMs run on the fp8 decode ops (decided in traced Python:
    part of a compiled graph's guards, like the 16-bit ops' choice)."""
    return (mla_config.linear_impl != "torch" and all(is_block_fp8(m) for m in mods)
            and not (torch.is_grad_enabled() and any(m.weight.requires_grad for m in mods))
            and len({groups(m) for m in mods}) == 1)


def fp8_pair_partials(m1, m2, x: torch.Tensor, x_quant=None):
    """fp32 partials [S, *lead, N1 + N2] of the fp8 pair (q_a + kv_a), summed over dim 0
    by mla::decode_qkv_prologue (S: the fp8 kernel config's K splits),
    or None where the fp8 kernel does not serve x (then the caller runs the pair op and
    the modules' norms). x_quant: (x_q, x_s), x quantized by the layer's input norm."""
    gn, gk = groups(m1)
    pairs = [(m1.weight, m1.weight_scale_inv), (m2.weight, m2.weight_scale_inv)]
    if fp8_ops.fp8_linear_unmet(x, pairs, gn, gk) is not None:
        return None
    return torch.ops.mla.decode_linear_pair_fp8_partials(x, *pairs[0], *pairs[1], gn, gk,
                                                         *(x_quant or (None, None)))


def decode_rows(x: torch.Tensor) -> bool:
    """x [..., K] holds rows the fp8 decode kernels take (CUDA, bf16 / fp16, at most their
    MAX_ROWS): where a producer's quantized copy of x is read."""
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and 0 < x.numel() // max(1, x.shape[-1]) <= fp8_ops.MAX_ROWS)


def pair_quant_group(attn) -> int:
    """group_k of a converted attention whose q_a + kv_a pair runs the fp8 decode GEMMs (V3,
    V2 with q_lora: they read x quantized per group_k columns), else 0."""
    m1, m2 = getattr(attn, "q_a_proj", None), getattr(attn, "kv_a_proj_with_mqa", None)
    if (getattr(attn, "q_lora_rank", None) is None or not is_block_fp8(m1)
            or not is_block_fp8(m2) or groups(m1) != groups(m2)):
        return 0
    return groups(m1)[1]


def fp8_partials(mod, x: torch.Tensor):
    """fp32 split-K partials [S, *lead, N] of mod(x) for mla::residual_rms_norm where the
    fp8 kernel serves x and splits K (S > 1), else None (the caller runs fp8_linear and
    the norm)."""
    gn, gk = groups(mod)
    if fp8_ops.partial_splits(x, mod.weight, mod.weight_scale_inv, gn, gk) < 2:
        return None
    return torch.ops.mla.decode_linear_fp8_partials(x, mod.weight, mod.weight_scale_inv, gn, gk)


def fp8_mlp_served(mlp) -> bool:
    """An MLP whose gate_proj, up_proj and down_proj are served FP8 linears of one block."""
    mods = (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    return all(is_block_fp8(m) for m in mods) and len({groups(m) for m in mods}) == 1


def fp8_linear(mod, x: torch.Tensor, residual=None, x_quant=None) -> torch.Tensor:
    """mod(x) (+ residual) on mla::decode_linear_fp8(_residual); x_quant: (x_q, x_s), x
    quantized per group_k columns by the kernel that produced it (read without a
    residual: q_b after the prologue)."""
    gn, gk = groups(mod)
    if residual is not None:
        return torch.ops.mla.decode_linear_fp8_residual(x, mod.weight, mod.weight_scale_inv,
                                                        residual, gn, gk)
    return torch.ops.mla.decode_linear_fp8(x, mod.weight, mod.weight_scale_inv, gn, gk,
                                           *(x_quant or (None, None)))


def fp8_linear_pair(m1, m2, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(m1(x), m2(x)) in one launch (q_a_proj + kv_a_proj_with_mqa)."""
    gn, gk = groups(m1)
    return torch.ops.mla.decode_linear_pair_fp8(x, m1.weight, m1.weight_scale_inv,
                                                m2.weight, m2.weight_scale_inv, gn, gk)


def fp8_mlp(mlp, x: torch.Tensor, residual=None, x_quant=None) -> torch.Tensor:
    """down_proj(silu(gate_proj(x)) * up_proj(x)) (+ residual) of an HF MLP whose three
    linears are FP8: gate + up + SiLU x up in one launch, down_proj (and the add) in
    another. x_quant: (x_q, x_s), x quantized per group_k columns by the norm that made
    it (mla::residual_rms_norm_fp8), which gate + up then read."""
    g, u = mlp.gate_proj, mlp.up_proj
    gn, gk = groups(g)
    h = torch.ops.mla.decode_gate_up_fp8(x, g.weight, g.weight_scale_inv, u.weight,
                                         u.weight_scale_inv, gn, gk,
                                         *(x_quant or (None, None)))          # [..., I]
    return fp8_linear(mlp.down_proj, h, residual)


def mlp_quant_group(mlp) -> int:
    """group_k of a converted MLP whose gate + up run the fp8 decode GEMMs (they read x
    quantized per group_k columns), else 0."""
    if (not getattr(mlp, "mla_converted", False) or not hasattr(mlp, "gate_proj")
            or not fp8_mlp_served(mlp)):
        return 0
    return groups(mlp.gate_proj)[1]
