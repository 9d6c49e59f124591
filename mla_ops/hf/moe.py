"""A converted DeepSeek V2 / V3 MoE block: HF's router, the routed experts on the MoE decode
op for a decode step's few rows, and the shared experts on the decode GEMM ops.

    out = experts(x, *route(x)) + shared_experts(x)          (+ residual, the decoder layer's add)

route() computes what HF's router module does:

    V3 (DeepseekV3TopkRouter): sigmoid scores; e_score_correction_bias added for the choice
       only; the n_group groups ranked by the sum of their top-2 biased scores, the
       topk_group best kept; top_k experts among them (torch.topk, sorted=False); weights
       gathered from the unbiased scores, divided by their sum (+ 1e-20) with
       norm_topk_prob, times routed_scaling_factor.
    V2 (DeepseekV2TopkRouter): softmax scores; topk_method "greedy" (top_k of all) or
       "group_limited_greedy" (groups ranked by their best score, the others zeroed);
       weights times routed_scaling_factor.

    - decode rows (CUDA, bf16 / fp16, <= 64 tokens, lowering/moe/router.py's kernels serve):
      mla::moe_route, two Triton launches (split-H fp32 logits, then one program per token
      for scores, groups and top_k) in place of HF's ~8 small torch kernels; the same
      experts up to the logits' fp32 summation order (exact ties go to the lower index,
      as torch's CUDA topk does), weights within an ulp or so, in descending order;
    - anything else (CPU, fp32, more rows, grad wanted for the router weight, linear_impl
      "torch"): HF's own torch calls (lowering/moe/router.py's route_torch), so the same
      experts are chosen, ties included, with the same weights.

The routed experts (HF's DeepseekV3Experts / DeepseekV2Experts, weights as stored):
    - decode rows (lowering/moe/experts.py's kernels serve: CUDA, bf16 / fp16, <= 64 tokens)
      with fuse_experts: mla::moe_experts_decode, streaming only the chosen experts' weights;
      static shapes and no host syncs, so the step compiles fullgraph and captures in a CUDA
      graph. Where the router's kernels and the shared experts' decode GEMMs serve too (the
      16-bit models), the whole block is one op, mla::moe_block_decode
      (lowering/moe/block.py): the same kernels, the shared experts on a second stream
      beside the router and the routed experts, bit for bit the result of the separate ops;
      an FP8 checkpoint's block likewise, mla::moe_block_decode_fp8 (lowering/moe/fp8_block.py);
    - more rows on CUDA with "grouped_mm" (or no setting), experts not split by HF's expert
      parallelism: HF's grouped_mm steps, then one kernel that weights and sums the pairs'
      outputs per token (lowering/moe/prefill.py) where HF makes three fp32 passes;
    - anything else: HF's experts as config._experts_implementation asks ("grouped_mm", the
      default on GPUs, is torch's grouped GEMM over tokens sorted by expert), except that
      "eager" (HF's loop over the experts hit: data dependent, with host syncs) is
      replaced by HF's grouped_mm implementation while torch.compile traces or a CUDA
      graph captures, so the compiled / captured model works with each of them. Any other
      setting ("deepgemm", "sonicmoe", or a name that is not registered) is refused at
      conversion with what to set instead.

The ops have no autograd formulas: with grad enabled for the expert weights, HF's own
experts run (HF's router calls with grad enabled for the router's weight or x); so do they
with lowering.config.linear_impl = "torch" (MLA_LINEAR_IMPL=torch), the setting that keeps
every converted GEMM on the modules' own calls.
"""
from __future__ import annotations

import torch

from lowering import config as mla_config
from lowering.moe import block as moe_block  # registers mla::moe_block_decode
from lowering.moe import experts as moe_ops  # registers mla::moe_experts_decode
from lowering.moe import fp8_block as moe_fp8_block  # registers mla::moe_block_decode_fp8
from lowering.moe import prefill as moe_prefill  # registers mla::moe_combine
from lowering.moe import router as moe_router  # registers mla::moe_route
from mla_ops.hf import fp8_linear as fp8
from mla_ops.hf.linear import converted_class, fusable_mlp, fused_mlp_class, use_ops

__all__ = ["convert_moe", "moe_blocks", "route", "routed_experts"]

V2_TOPK_METHODS = ("greedy", "group_limited_greedy")
# config._experts_implementation values the converted block serves (None: HF's default);
# the others HF registers (e.g. "deepgemm", "sonicmoe": hub kernels) are refused at
# conversion, since neither their CPU path nor their tracing is something we test
SERVED_IMPLS = (None, "eager", "grouped_mm", "batched_mm")


def _hf(mod: str, *names: str) -> tuple:
    try:
        m = __import__(f"transformers.models.{mod}.modeling_{mod}", fromlist=list(names))
        return tuple(getattr(m, n) for n in names)
    except (ImportError, AttributeError):
        return ()


def hf_moe_classes() -> dict:
    """{HF MoE block class: family} of the installed transformers."""
    out = {}
    for fam, mod, cls in (("v3", "deepseek_v3", "DeepseekV3MoE"),
                          ("v2", "deepseek_v2", "DeepseekV2Moe"),
                          ("v3", "deepseek_v32", "DeepseekV32MoE")):   # V3's router
        for c in _hf(mod, cls):
            out[c] = fam
    return out


def grouped_mm_forward():
    """HF's grouped_mm experts forward (transformers.integrations.moe), or None."""
    try:
        from transformers.integrations.moe import grouped_mm_experts_forward
    except ImportError:
        return None
    return grouped_mm_experts_forward


# ------------------------------------------------------------------------- router


def route_args(block) -> tuple:
    """(bias, mode, top_k, n_group, topk_group, norm_topk_prob, scale) of block's router:
    the arguments after (x, weight) of mla::moe_route and lowering's route_torch."""
    gate = block.gate
    if block.mla_family == "v3":                        # DeepseekV3TopkRouter
        return (gate.e_score_correction_bias, 0, gate.top_k, gate.num_group, gate.topk_group,
                bool(gate.norm_topk_prob), float(gate.routed_scaling_factor))
    mode = 2 if gate.topk_method == "group_limited_greedy" else 1     # DeepseekV2TopkRouter
    groups = (gate.num_group, gate.topk_group) if mode == 2 else (1, 1)
    return (None, mode, gate.top_k, *groups, False, float(gate.routed_scaling_factor))


def route(block, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts [T, K] and their weights [T, K] (fp32) HF's router of `block` picks for
    x [T, H]: mla::moe_route's kernels where they serve (no grad wanted, linear_impl not
    "torch"), else HF's torch calls."""
    gate = block.gate
    if (mla_config.linear_impl != "torch"
            and not (torch.is_grad_enabled() and (gate.weight.requires_grad or x.requires_grad))
            and moe_router.kernel_serves(x, gate.weight) is None):
        return torch.ops.mla.moe_route(x, gate.weight, *route_args(block))
    return moe_router.route_torch(x, gate.weight, *route_args(block))


# ------------------------------------------------------------------------- experts


def _needs_grad(experts) -> bool:
    return torch.is_grad_enabled() and (experts.gate_up_proj.requires_grad
                                        or experts.down_proj.requires_grad)


def routed_experts(block, x: torch.Tensor, topk_idx: torch.Tensor,
                   topk_weight: torch.Tensor) -> torch.Tensor:
    """sum_k topk_weight[t, k] * expert_{topk_idx[t, k]}(x[t]): x [T, H] -> [T, H]."""
    experts = block.experts
    if block.mla_fuse_experts and fp8.is_fp8_experts(experts):        # an FP8 checkpoint
        return fp8.fp8_routed_experts(block, x, topk_idx, topk_weight)
    gate_up, down = experts.gate_up_proj, experts.down_proj
    impl = getattr(experts.config, "_experts_implementation", None)
    ours = (block.mla_fuse_experts and mla_config.linear_impl != "torch"
            and not _needs_grad(experts))
    if (ours and gate_up.dtype == down.dtype == x.dtype
            and moe_ops.kernel_serves(x, gate_up, down)):
        return torch.ops.mla.moe_experts_decode(x, topk_idx, topk_weight, gate_up, down)
    if (ours and impl in (None, "grouped_mm")
            and not getattr(experts, "_is_expert_parallel", False)
            and moe_prefill.serves(x, gate_up, down)):
        return moe_prefill.grouped_experts(x, topk_idx, topk_weight, gate_up, down)
    grouped = grouped_mm_forward()
    if impl in (None, "eager") and grouped is not None and (
            torch.compiler.is_compiling()
            or (x.is_cuda and torch.cuda.is_current_stream_capturing())):
        return grouped(experts, x, topk_idx, topk_weight)      # HF's loop syncs, no trace
    return experts(x, topk_idx, topk_weight)


def block_decode_args(block, x: torch.Tensor):
    """mla::moe_block_decode's arguments for x [T, H] where its kernels serve the whole
    block (decode rows on CUDA, 16-bit experts, shared experts converted with plain
    linears, no grad wanted), else None. Shapes, dtypes and settings only."""
    shared = block.shared_experts
    if (mla_config.linear_impl == "torch" or not block.mla_fuse_experts
            or fp8.is_fp8_experts(block.experts) or _needs_grad(block.experts)
            or not getattr(shared, "mla_converted", False)
            or not use_ops(shared.gate_proj, shared.up_proj, shared.down_proj)
            or (torch.is_grad_enabled() and (block.gate.weight.requires_grad
                                             or x.requires_grad))):
        return None
    w = (block.experts.gate_up_proj, block.experts.down_proj, shared.gate_proj.weight,
         shared.up_proj.weight, shared.down_proj.weight)
    if not moe_block.block_serves(x, block.gate.weight, *w):
        return None
    return (x, block.gate.weight, *route_args(block), *w)


def fp8_block_decode_args(block, x: torch.Tensor):
    """mla::moe_block_decode_fp8's arguments for x [T, H] where its kernels serve the whole
    block of an FP8 checkpoint (decode rows on CUDA, FP8Experts and FP8Linear shared
    experts with one scale block, no grad wanted), else None. Shapes, dtypes and settings
    only."""
    shared, ex = block.shared_experts, block.experts
    if (mla_config.linear_impl == "torch" or not block.mla_fuse_experts
            or not fp8.is_fp8_experts(ex) or _needs_grad(ex)
            or not getattr(shared, "mla_converted", False)
            or not fp8.uses_fp8_ops(shared.gate_proj, shared.up_proj, shared.down_proj)
            or fp8.groups(shared.gate_proj) != fp8.groups(ex)
            or (torch.is_grad_enabled() and (block.gate.weight.requires_grad
                                             or x.requires_grad))):
        return None
    w = (ex.gate_up_proj, ex.gate_up_proj_scale_inv, ex.down_proj, ex.down_proj_scale_inv,
         *(t for m in (shared.gate_proj, shared.up_proj, shared.down_proj)
           for t in (m.weight, m.weight_scale_inv)), *fp8.groups(ex))
    if not moe_fp8_block.block_serves(x, block.gate.weight, *w):
        return None
    return (x, block.gate.weight, *route_args(block), *w)


def block_quant_group(block) -> int:
    """group_k of a converted FP8 checkpoint's block whose decode rows run
    mla::moe_block_decode_fp8 (its experts read x quantized per group_k columns), else 0."""
    if not getattr(block, "mla_fuse_experts", False) or not fp8.is_fp8_experts(block.experts):
        return 0
    group = fp8.groups(block.experts)[1]
    return group if fp8.mlp_quant_group(block.shared_experts) == group else 0


def _moe_forward(self, hidden_states: torch.Tensor, residual=None,
                 x_quant=None) -> torch.Tensor:
    """HF's MoE block (+ residual, in HF's order): hidden_states [B, S, H] -> [B, S, H].
    x_quant: (x_q, x_s), hidden_states quantized per group_k columns by the norm that made
    it (mla_ops/hf/layer.py), which an FP8 block's experts then read."""
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, shape[-1])                                   # [T, H]
    args, op = block_decode_args(self, x), torch.ops.mla.moe_block_decode
    if args is None:
        args, op = fp8_block_decode_args(self, x), torch.ops.mla.moe_block_decode_fp8
        if args is not None and x_quant is not None:                 # [T, H], [T, G]
            args = (*args, x_quant[0].reshape(x.shape), x_quant[1].reshape(x.shape[0], -1))
    if args is not None:               # decode rows: one op, the shared experts beside
        pairs, shared = op(*args)      # [T, K, H], [split_k, T, H] (fp8: [1, T, H])
        shared = shared[0] if shared.shape[0] == 1 else shared.sum(0).to(x.dtype)  # [T, H]
        out = (pairs.sum(1).to(x.dtype) + shared).view(shape)
        return out if residual is None else residual + out
    topk_idx, topk_weight = route(self, x)                                     # [T, K] each
    out = routed_experts(self, x, topk_idx, topk_weight).view(shape)
    out = out + self.shared_experts(hidden_states)
    return out if residual is None else residual + out


def fused_moe_class(cls):
    """The subclass of an HF MoE block class whose forward is ours (HF's kept as hf_forward)."""
    return converted_class(cls, "Fused", _moe_forward)


# ------------------------------------------------------------------------- convert


def moe_blocks(model) -> list:
    """(name, module, family) of the HF DeepSeek MoE blocks of model not yet converted."""
    classes = hf_moe_classes()
    return [(name, m, classes[type(m)]) for name, m in model.named_modules()
            if type(m) in classes and not getattr(m, "mla_converted", False)]


def _registered_impls() -> tuple:
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        return ()
    return tuple(ALL_EXPERTS_FUNCTIONS.keys())


def check_block(name: str, m, family: str) -> None:
    """Raise a ValueError naming what to change where the block is not one we convert."""
    gate, experts = m.gate, m.experts
    if getattr(m.config, "hidden_act", None) not in ("silu", "swish"):
        raise ValueError(f"{name}: the routed experts must use SiLU (config.hidden_act "
                         f"{m.config.hidden_act!r}); convert with fuse_experts=False")
    E, H = gate.num_experts, gate.hidden_dim
    gu, dn = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if (not isinstance(gu, torch.Tensor) or not isinstance(dn, torch.Tensor) or gu.dim() != 3
            or gu.shape[0] != E or gu.shape[2] != H or gu.shape[1] % 2
            or tuple(dn.shape) != (E, H, gu.shape[1] // 2)):
        raise ValueError(f"{name}.experts must hold gate_up_proj [E={E}, 2I, H={H}] and "
                         f"down_proj [E, H, I] (HF's layout, not transposed)")
    if getattr(experts, "is_transposed", False) or getattr(experts, "has_bias", False) \
            or not getattr(experts, "is_concatenated", True):
        raise ValueError(f"{name}.experts: transposed, interleaved or biased expert weights "
                         f"are not supported")
    if gu.device.type == "meta":
        raise ValueError(f"{name} has weights on the meta device; load them before converting")
    if family == "v2" and gate.topk_method not in V2_TOPK_METHODS:
        raise ValueError(f"{name}: config.topk_method={gate.topk_method!r} is not one of "
                         f"{V2_TOPK_METHODS}")
    if family == "v3" or gate.topk_method == "group_limited_greedy":       # groups used
        G, KG = gate.num_group, gate.topk_group
        if not (isinstance(G, int) and G >= 1 and E % G == 0 and isinstance(KG, int)
                and 1 <= KG <= G and gate.top_k <= KG * (E // G)):
            raise ValueError(f"{name}: config.n_group={G} must divide the {E} experts and "
                             f"config.topk_group={KG} lie in [1, n_group] with top_k="
                             f"{gate.top_k} experts in topk_group groups")
    impl = getattr(experts.config, "_experts_implementation", None)
    registered = _registered_impls()
    if impl not in (None, "eager") and registered and impl not in registered:
        raise ValueError(f"config._experts_implementation={impl!r} is not a registered experts "
                         f"implementation; set it to one of {('eager',) + registered}")
    if impl not in SERVED_IMPLS:
        raise ValueError(f"{name}: config._experts_implementation={impl!r} is not one the "
                         f"converted MoE block runs (its prefill rows, compiled and captured "
                         f"steps): call model.set_experts_implementation('grouped_mm') (or "
                         f"'batched_mm', 'eager') before converting, or convert with "
                         f"fuse_experts=False to keep HF's MoE blocks")


def convert_moe(model, *, fuse_experts: bool = True, fuse_shared: bool = True) -> int:
    """Swap every HF DeepSeek V2 / V3 MoE block of model for ours (in place; see the module
    docstring); returns how many were converted. With fuse_experts the routed experts of a
    decode step run on mla::moe_experts_decode; with fuse_shared the shared experts run on
    the decode GEMM ops (as convert(fuse_mlp=True) does for every SiLU MLP). Every block is
    checked before any is touched; converting twice converts nothing more."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"convert_moe() takes a torch.nn.Module, got {type(model).__name__}")
    blocks = moe_blocks(model)
    for name, m, fam in blocks:
        check_block(name, m, fam)
    for name, m, fam in blocks:              # nothing below can fail
        m.mla_family = fam
        m.mla_fuse_experts = bool(fuse_experts)
        m.mla_hf_fp8_runs = fp8.is_fp8_experts(m.experts) and fp8.hf_fp8_kernel_loads()
        m.__class__ = fused_moe_class(type(m))
        shared = m.shared_experts
        if fuse_shared and fusable_mlp(shared) and not getattr(shared, "mla_converted", False):
            shared.__class__ = fused_mlp_class(type(shared))
    return len(blocks)
