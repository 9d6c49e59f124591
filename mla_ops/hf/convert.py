"""convert(): swap an MLA model's attention for MLAAttention (see mla_ops/hf/__init__.py;
the families and what each differs in: mla_ops/hf/families.py; V3.2's forward and its sparse
attention: mla_ops/hf/v32.py)."""
from __future__ import annotations

import torch

from mla_ops.cache import CacheFullError  # noqa: F401  (raised by PagedMLACache and DecodeGraph)
from mla_ops.hf.fallback import paged_or_hf
from mla_ops.hf.families import (FAMILY_NAMES, beside_of, class_attributes, convert_v2_rotary,
                                 family_of, layout_unmet, refusal_of)
from mla_ops.hf.fp8_linear import check_model, dequantized_weight, is_block_fp8
from mla_ops.hf.generate import check_cache_options, generation_class
from mla_ops.hf.layer import convert_layers
from mla_ops.hf.linear import (absorbed_decode_query, convertible_head, decode_head_class,
                               fusable_mlp, fused_mlp_class, linear, linear_pair,
                               linear_residual_norm,
                               q_kv_rope_prologue, qkv_a_prologue, rope_angles,
                               rope_query, rope_rows)
from mla_ops.hf.moe import convert_moe
from mla_ops.hf.v32 import v32_forward
from mla_ops.hf.tensor_parallel import prepare_shard, shard, tp_plan_group
from mla_ops.layer import MLAAttention

__all__ = ["convert", "is_converted"]


# ------------------------------------------------------------------------- attention


def _attention_slot(name: str) -> bool:
    """A decoder layer's attention module: ...self_attn, or ...self_attn.<i> where the layer
    holds a list of them (LongCat-Flash: two MLA blocks per layer)."""
    head, _, last = name.rpartition(".")
    return name.endswith("self_attn") or (last.isdigit() and head.endswith("self_attn"))


def is_converted(model) -> bool:
    return any(getattr(m, "mla_converted", False) for m in model.modules())


def _paged_forward(self, hidden_states, position_embeddings=None, attention_mask=None,
                   past_key_values=None, **kwargs):
    """Converted forward: hidden_states [B, S, H] -> ([B, S, H], None); with mla_residual
    (a converted decoder layer's residual [B, S, H]) the output is mla_residual + o_proj(...),
    the add in o_proj's epilogue.

    mla_x_quant: hidden_states quantized per group by the layer's input norm (an FP8
    checkpoint's q_a + kv_a GEMM reads it).

    With mla_post_norm too (the layer's post-attention RMSNorm) the first output is the
    pair (that sum, the norm of it), the GEMM's split-K partials, the add and the norm in
    one launch where they serve (linear_residual_norm).

    mla_context_bound: a bound of the rows' cached lengths, passed by a captured prefill
    chunk (mla_ops/hf/prefill_graph.py) so that the step reads nothing on the host.

    transformers < 5.24 passes the cache as past_key_values, later versions as cache.
    """
    post_norm = kwargs.pop("mla_post_norm", None)
    x_quant = kwargs.pop("mla_x_quant", None)     # hidden_states quantized by the input norm
    context_bound = kwargs.pop("mla_context_bound", None)   # a captured prefill chunk's
    residual, cache, hf_result = paged_or_hf(self, hidden_states, position_embeddings,
                                             attention_mask, past_key_values, kwargs)
    if hf_result is not None:
        return hf_result
    mla: MLAAttention = self.mla_attn
    B, S, _ = hidden_states.shape
    N, P, R, V, L = (mla.num_heads, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim,
                     mla.kv_lora_rank)
    T = B * S
    step = cache.prepare(self.layer_idx, B, S, attention_mask, hidden_states.dtype,
                         hidden_states.device, backend=mla.backend,
                         fp8_query=mla.q_scale is not None, context_bound=context_bound)
    # CUDA, V3 or V2 with q_lora: both norms and the key's RoPE in one op after the GEMM
    # (decode rows: the split-K kernel's partials; a prefill's: cuBLAS's two outputs); for
    # decode rows then q_b, the query's RoPE and its absorption in another, else q_b and
    # the query's RoPE (one kernel). V2 without q_lora: the key norm and both RoPEs in one
    # op. (A family with a query scale never takes them: it scales q below.)
    fused = v2_fused = None
    rows = rope_rows(position_embeddings, B, S)          # one rotary row per token
    if self.mla_query_scale is None:
        fused = qkv_a_prologue(self, hidden_states, rows, x_quant)
        if fused is None:     # V2 without q_lora: the key norm and both RoPEs in one op
            v2_fused = q_kv_rope_prologue(self, hidden_states, rows,         # (decode rows:
                                          decode=step.meta.num_decode_tokens == T)  # absorbed)
    q = decode_q = None
    if v2_fused is not None:
        q, kv_row, decode_q = v2_fused   # [B, S, N, P+R] or None, [B, S, L+R], [T, N, L+R]
        kv_row = kv_row.reshape(T, L + R)
    elif fused is not None:
        q_a, kv_row, q_a_quant = fused                        # [B, S, q_lora], [B, S, L+R]
        kv_row = kv_row.reshape(T, L + R)
        if step.meta.num_decode_tokens == T:                  # (then step.perm is None)
            decode_q = absorbed_decode_query(self, q_a, rows, q_a_quant)    # [T, N, L+R]
        if decode_q is None:                                  # (q_a_quant: an fp8 q_b's input)
            q = linear(self.q_b_proj, q_a, x_quant=q_a_quant).view(B, S, N, P + R)
            q = rope_query(q, *rope_angles(self, rows))                      # [B, S, N, P+R]
    else:
        if self.q_lora_rank is None:
            q, kv = linear_pair(self.q_proj, self.kv_a_proj_with_mqa, hidden_states)
        else:                                  # q_a and kv_a in one launch
            q_a, kv = linear_pair(self.q_a_proj, self.kv_a_proj_with_mqa, hidden_states)
            q = linear(self.q_b_proj, self.q_a_layernorm(q_a))
        q = q.view(B, S, N, P + R)                                           # [B, S, N, P+R]
        kv_c, k_rot = torch.split(kv, [L, R], dim=-1)                        # kv [B, S, L+R]
        kv_c = self.kv_a_layernorm(kv_c)                                     # [B, S, L]
        k_rot = k_rot.reshape(B, 1, S, R)
        q_rot, k_rot = self.mla_rope(q[..., P:].transpose(1, 2), k_rot, position_embeddings)
        # RoPE written back in place: q_pass stays where the GEMM put it (a cat would copy
        # all P + R columns into a new buffer).
        q[..., P:] = q_rot.transpose(1, 2)
        # This step's cache rows as one buffer that both ops read through views (compiled,
        # Inductor otherwise writes the normed latent into a separate buffer for each op).
        kv_row = torch.cat((kv_c.reshape(T, L), k_rot.reshape(T, R)), dim=-1)   # [T, L+R]
    if q is not None:
        q = q.view(T, N, P + R)                                              # [T, N, P+R]
        if self.mla_query_scale is not None:      # e.g. Mistral 4's position scale
            scale = self.mla_query_scale(kwargs).reshape(T, 1, 1)           # [T, 1, 1]
            q = q * scale.to(q.dtype)
    if step.perm is not None:            # (a step with pads: never one with decode_q)
        q, kv_row = q[step.perm], kv_row[step.perm]
    kv_c, k_pe = kv_row[:, :L], kv_row[:, None, L:]                          # [T, L], [T, 1, R]
    out = mla(q, kv_c, k_pe, cache.kv(self.layer_idx), cache.k_scale, step.meta,
              kv_cache_dtype=cache.kv_cache_dtype, decode_q=decode_q)       # [T, N*V]
    cache.layer_done(self.layer_idx, B, S)
    if step.inv is not None:
        out = out[step.inv]
    out = out.view(B, S, N * V)
    if self.mla_output_gate is not None:          # e.g. Ling 3's per-head gate
        out = self.mla_output_gate(hidden_states, out, None)
    if post_norm is not None:
        return linear_residual_norm(self.o_proj, out, residual, post_norm), None
    return linear(self.o_proj, out, residual), None


_PAGED_CLASSES: dict = {}


def _paged_class(cls, fam):
    """The converted class of HF attention class `cls` (family row `fam`)."""
    if cls not in _PAGED_CLASSES:
        _PAGED_CLASSES[cls] = type(f"Paged{cls.__name__}", (cls,), {
            "forward": v32_forward if fam.sparse else _paged_forward,
            "hf_forward": cls.forward, "mla_converted": True, "__module__": __name__,
            **class_attributes(cls, fam)})
    return _PAGED_CLASSES[cls]


def convert(model, *, backend: str = "auto", workspace_rows: int = 8192,
            fp8_decode_query: float | None = None, fuse_mlp: bool = True,
            decode_head: bool = True, fuse_norms: bool = True, fuse_experts: bool = True,
            cache_options: dict | None = None, generate_graph: bool = True, tp_group=None):
    """Route every MLA attention layer of `model` through the MLA ops (in place): DeepSeek
    V2 / V3 / V3.2, GLM-4.7-Flash (glm4_moe_lite), Youtu, MiniCPM3, Mistral 4, LongCat-Flash,
    Kimi Linear and Ling 3 (bailing_hybrid; their MLA layers, the KDA layers stay HF's),
    GLM-5 (glm_moe_dsa), A.X K1 and A.X K2 (axk1, axk2) (the table in
    mla_ops/hf/families.py, which also names the MLA families refused and why; past V3.2
    only the attention is swapped, the rest of those models runs HF's code).

    The attention's own projections run as decode GEMM ops (q_a + kv_a in one launch; see
    mla_ops/hf/linear.py), and with fuse_mlp every dense MLP / shared expert with SiLU runs
    gate + up + SiLU x up as one op and down_proj as another. Both use the modules' own
    weights and compute what the modules do; they differ from cuBLAS only on CUDA at
    decode sizes (<= 64 rows, bf16 / fp16: the weight-streaming Triton kernel, fp32
    accumulation like cuBLAS, in another order).

    With decode_head, the output head (lm_head, when a plain bias-free nn.Linear) runs on
    the decode GEMM op too, with the same numerics rule.

    With fuse_experts (the default), every MoE block runs our router (HF's computation,
    the same experts and weights) and, for a decode step's few rows on CUDA, its routed
    experts as mla::moe_experts_decode, which streams only the chosen experts' weights
    (mla_ops/hf/moe.py); other batches run HF's experts as config._experts_implementation
    asks ("grouped_mm", "batched_mm" or "eager"; HF's eager loop is replaced by grouped_mm
    while compiling or capturing, so every one of them compiles fullgraph). Any other
    setting, or a block we cannot convert, raises a ValueError here saying what to change.
    fuse_experts=False keeps HF's MoE blocks as they are.

    With fuse_norms, each HF decoder layer adds its residuals in o_proj's and down_proj's
    epilogues and runs its two RMSNorms (and the model's final one) as mla::rms_norm
    (mla_ops/hf/layer.py); same roundings as HF's modules.

    fp8_decode_query=q_scale quantizes each decode step's 576-wide query to fp8 with that
    static scale (fp8 x fp8 decode; the cache must then be fp8). On CUDA, where the decode
    query kernel serves the step, it builds and quantizes the query in one launch
    (mla::decode_q_absorb_fp8); elsewhere the query's cat + quant are in the graph, where
    the Inductor passes fuse them (passes.compile_with_passes).

    model.generate(...) with no cache argument then runs on a PagedMLACache sized from the
    call (mla_ops/hf/generate.py); cache_options are that cache's other arguments
    (kv_cache_dtype, k_scale, block_size, num_blocks, schedule_per_step), e.g.
    dict(kv_cache_dtype="fp8", k_scale=...), which generate()'s default cache needs with
    fp8_decode_query (else that generate() call raises a ValueError saying so). A cache
    passed as cache= / past_key_values= is used as is.

    With generate_graph (the default), generate() on a CUDA PagedMLACache replays its
    decode steps from a CUDA graph of the eager step, captured at each call's first decode
    step: the eager step's kernels and logits without its host time
    (mla_ops/hf/generate_graph.py). A call without compile_config takes it in place of
    HF's automatic compile of the decode step; a call with compile_config replays the
    compiled step (DecodeGraph's, with the config's backend) from such a graph instead of
    HF's cudagraph trees.

    A model loaded from an FP8 checkpoint (HF's FineGrainedFP8: FP8Linear modules with
    weight_scale_inv in block_size blocks, DeepSeek-V3 / R1) keeps its fp8 weights: W_UK_T /
    W_UV are absorbed from kv_b_proj dequantized once (as HF dequantizes), and the layer's
    linears (q_a + kv_a, q_b, o_proj, the dense MLPs and shared experts) run the fp8 decode
    GEMM ops (mla_ops/hf/fp8_linear.py): on CUDA at decode sizes HF's FP8Linear numerics
    (W8A8) reading the fp8 weights; elsewhere the dequantized weights, as HF computes on the
    CPU. With fuse_experts, FP8 routed experts run the fp8 MoE decode op likewise.

    tp_group (a torch.distributed ProcessGroup) then splits the converted model over its
    ranks for tensor parallelism (mla_ops.hf.shard: each rank keeps its heads and MLP /
    expert slices, the decoder layers sum the ranks' outputs); a model loaded with
    transformers' tp_plan is split so without it, over its tp_plan group (its DTensor
    weights gathered first).

    All checks and weight absorption happen before the first module is touched, so a
    failure leaves the model as it was (a tp_plan model's weights gathered). Converting
    twice is a no-op.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"convert() takes a torch.nn.Module, got {type(model).__name__}")
    if tp_group is not None or tp_plan_group(model) is not None:   # checked; DTensors gathered
        tp_group = prepare_shard(model, tp_group)
    attns, others, beside = [], [], []
    for name, m in model.named_modules():
        fam = family_of(m)
        if fam is not None:
            attns.append((name, m, fam))
        elif refusal_of(m) is not None:
            raise TypeError(f"convert() does not take {type(m).__name__} ({name}): "
                            f"{refusal_of(m)}")
        elif beside_of(m) is not None:
            beside.append((name, m, beside_of(m)))
        elif _attention_slot(name) and not isinstance(m, torch.nn.ModuleList):
            others.append(f"{name} ({type(m).__name__})")
    tags = {fam.tag for _, _, fam in attns}
    others += [f"{name} ({type(m).__name__})" for name, m, fam in beside if fam.tag not in tags]
    if not attns:
        raise TypeError(f"convert() needs a model of a supported family "
                        f"({', '.join(FAMILY_NAMES)}) with multi-head latent attention; "
                        f"{type(model).__name__} has none"
                        + (f" (its attention: {others[0]})" if others else ""))
    if others:
        raise TypeError(f"convert() supports models whose attention is all MLA; found {others[:3]}")
    options = check_cache_options(cache_options)
    if not isinstance(generate_graph, bool):
        raise TypeError(f"generate_graph must be a bool, got {type(generate_graph).__name__}")
    check_model(model)                  # HF's FP8 linears and experts: their scales agree
    plans, seen = [], set()
    for name, m, fam in attns:
        if getattr(m, "mla_converted", False):
            continue
        why = layout_unmet(m, fam)
        if why is not None:
            import transformers
            raise TypeError(f"{name} ({type(m).__name__}) {why}: this transformers "
                            f"({transformers.__version__}) lays the {fam.module} attention out "
                            f"otherwise than the one convert() follows (transformers 5.24); "
                            f"upgrade transformers")
        if m.layer_idx in seen:
            raise ValueError(f"two attention modules share layer_idx {m.layer_idx}")
        seen.add(m.layer_idx)
        if fam.sparse and fp8_decode_query is not None:
            raise ValueError("fp8_decode_query is not supported for DeepSeek-V3.2 (its sparse "
                             "attention takes a 16-bit query)")
        w = m.kv_b_proj.weight
        N, P, V, R, L = m.num_heads, m.qk_nope_head_dim, m.v_head_dim, m.qk_rope_head_dim, m.kv_lora_rank
        if tuple(w.shape) != (N * (P + V), L):
            raise ValueError(f"{name}.kv_b_proj.weight is {tuple(w.shape)}, expected "
                             f"[N*(P+V)={N * (P + V)}, L={L}]")
        if w.device.type == "meta":
            raise ValueError(f"{name} has weights on the meta device; load them before convert()")
        scale_inv = getattr(m.kv_b_proj, "weight_scale_inv", None)
        dt = m.kv_a_layernorm.weight.dtype if scale_inv is not None else w.dtype   # activations
        if is_block_fp8(m.kv_b_proj):       # dequantized once, as HF dequantizes
            w, scale_inv = dequantized_weight(m.kv_b_proj, dt), None
        # constant query / latent factors of the family (LongCat-Flash), folded here
        q_f, kv_f = fam.latent_scales(m) if fam.latent_scales is not None else (1.0, 1.0)
        mla = MLAAttention(N, P, R, V, L, float(m.scaling) * q_f,
                           workspace_rows=workspace_rows, backend=backend)
        with torch.no_grad():
            mla.absorb(w, weight_scale_inv=scale_inv, dtype=dt)
            if kv_f != 1.0:          # keys' nope part and values both read the latent
                mla.W_UK_T.mul_(kv_f)
                mla.W_UV.mul_(kv_f)
            if fp8_decode_query is not None:
                mla.enable_fp8_decode_query(fp8_decode_query)
        plans.append((m, mla, fam))
    mlps = [m for m in model.modules() if fuse_mlp and fusable_mlp(m)
            and not getattr(m, "mla_converted", False)]
    head = convertible_head(model) if decode_head else None
    if fuse_experts:
        convert_moe(model, fuse_experts=True, fuse_shared=False)   # checks, then swaps
    for m, mla, fam in plans:          # nothing below can fail
        m.add_module("mla_attn", mla)
        m.__class__ = _paged_class(type(m), fam)
    if any(fam.tag == "v2" for _, _, fam in plans):
        convert_v2_rotary(model)       # freqs_cis's parts once a forward (families.V2Rotary)
    for m in mlps:
        m.__class__ = fused_mlp_class(type(m))
    if head is not None:
        head.__class__ = decode_head_class(type(head))
    if fuse_norms:
        convert_layers(model)
    if hasattr(model, "generate"):
        if cache_options is not None or not hasattr(model, "mla_cache_options"):
            model.mla_cache_options = options           # (converting again keeps them)
        model.mla_generate_graph = bool(generate_graph)
        model.__class__ = generation_class(type(model))
    if tp_group is not None:
        shard(model, tp_group)
    return model

