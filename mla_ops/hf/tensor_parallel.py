"""Tensor parallelism for HF DeepSeek V2 / V3 on a torch.distributed process group.

    mla_ops.hf.convert(model, tp_group=group)     # convert, then shard (in place)
    mla_ops.hf.shard(model, group)                # the same split, before or after convert()

Every rank holds the whole model first (loaded or built on each rank, or loaded by
transformers with from_pretrained(..., tp_plan="auto"), whose DTensor parameters are
gathered and re-split here); shard() then keeps rank r's share of size ranks:

    attention   q_proj / q_b_proj rows, kv_b_proj rows (so W_UK_T / W_UV) and o_proj
                columns of heads [r*N/size, (r+1)*N/size); q_a, kv_a and their norms
                whole: MLA has one latent KV head, so every rank writes the same 576-wide
                rows to its own paged cache for its requests and attends with its heads
    MLPs        gate_proj / up_proj rows and down_proj columns of intermediate slice r
                (dense layers and shared experts)
    experts     each routed expert's gate and up rows and down columns of slice r;
                the router whole, so every rank picks the same experts
    output head vocabulary rows of slice r (a bias-free nn.Linear not tied to the input
                embedding, the vocabulary a multiple of size; else whole); each rank's
                logits gathered whole after it
    the rest    embedding, norms whole

Each decoder layer then sums the ranks' partial outputs once after o_proj and once after
its MLP / MoE block (shared and routed experts summed first), before the residual add:

    h = x + all_reduce(attn(norm1(x)));    out = h + all_reduce(mlp(norm2(h)))

The sum is torch's functional all-reduce (torch.ops._c10d_functional.all_reduce +
wait_tensor), which torch.compile traces: a converted, sharded decode step compiles
fullgraph. The MLA ops and kernels run per rank unchanged, with num_heads = N / size;
generate()'s default cache takes the layers' heads (PagedMLACache(num_heads=...) for a
cache built by hand, which matters where the layers run FlashMLA). The residual adds
stay outside the GEMMs here (an all-reduce sits between them), and convert() after
shard() leaves the decoder layers' norms as HF's modules.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from mla_ops.layer import MLAAttention

__all__ = ["shard", "prepare_shard", "all_reduce", "all_gather_last", "is_sharded",
           "check_shardable", "tp_plan_group"]

_FAMILIES = (("deepseek_v3", "DeepseekV3"), ("deepseek_v2", "DeepseekV2"))
_KINDS = {"attention": "Attention", "mlp": "MLP", "layer": "DecoderLayer",
          "moe": ("MoE", "Moe")}


def hf_classes(kind: str) -> tuple:
    """The installed transformers' DeepSeek V2 / V3 classes of one kind: "attention",
    "mlp", "layer" or "moe"."""
    suffixes = _KINDS[kind] if isinstance(_KINDS[kind], tuple) else (_KINDS[kind],)
    out = []
    for mod, prefix in _FAMILIES:
        try:
            m = __import__(f"transformers.models.{mod}.modeling_{mod}", fromlist=["x"])
        except ImportError:
            continue
        out += [getattr(m, prefix + s) for s in suffixes if hasattr(m, prefix + s)]
    return tuple(out)


def all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """The sum of x over the ranks of the process group named group_name (a new tensor),
    as torch's functional collective: traced by torch.compile, no graph break."""
    y = torch.ops._c10d_functional.all_reduce(x, "sum", group_name)
    return torch.ops._c10d_functional.wait_tensor(y)


def all_gather_last(x: torch.Tensor, group_name: str, size: int) -> torch.Tensor:
    """The ranks' x [..., n] side by side along the last dim: [..., size * n] (rank order),
    as torch's functional all-gather (traced, no graph break)."""
    y = torch.ops._c10d_functional.all_gather_into_tensor(x.contiguous(), size, group_name)
    y = torch.ops._c10d_functional.wait_tensor(y)                   # [size * rows, n]
    y = y.view(size, *x.shape)                                      # [size, ..., n]
    return torch.cat(y.unbind(0), dim=-1)                           # [..., size * n]


def is_sharded(model) -> bool:
    return any(getattr(m, "mla_tp_group_name", None) is not None for m in model.modules())


# ------------------------------------------------------------------------- the layer


def _tp_layer_forward(self, hidden_states, attention_mask=None, position_ids=None,
                      use_cache=False, position_embeddings=None, **kwargs):
    """HF's decoder layer with the ranks' partial attention and MLP outputs summed before
    each residual add: hidden_states [B, S, H] -> [B, S, H]. The cache travels in kwargs
    under the name the caller used (cache, or past_key_values before transformers 5.24)."""
    group = self.mla_tp_group_name
    residual = hidden_states
    h, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states),
                          attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=use_cache, position_embeddings=position_embeddings,
                          **kwargs)                                   # [B, S, H] partial
    h = residual + all_reduce(h, group)
    y = self.mlp(self.post_attention_layernorm(h))                    # [B, S, H] partial
    return h + all_reduce(y, group)


_LAYER_CLASSES: dict = {}


def tp_layer_class(cls):
    """The subclass of a decoder layer class (HF's, or a converted one) whose forward sums
    the ranks' outputs; named after HF's class, made once."""
    if cls not in _LAYER_CLASSES:
        base = next(c for c in cls.__mro__ if c.__module__.startswith("transformers."))
        _LAYER_CLASSES[cls] = type(f"TensorParallel{base.__name__}", (cls,), {
            "forward": _tp_layer_forward, "__module__": __name__})
    return _LAYER_CLASSES[cls]


def _tp_head_forward(self, x):
    """This rank's vocabulary slice of the logits, gathered: x [..., H] -> [..., vocab]."""
    local = type(self).mla_head_forward(self, x)                       # [..., vocab / size]
    return all_gather_last(local, self.mla_tp_group_name, self.mla_tp_size)


_HEAD_CLASSES: dict = {}


def tp_head_class(cls):
    """The subclass of an output head class (nn.Linear, or the converted one) whose
    forward gathers the ranks' vocabulary slices; made once."""
    if cls not in _HEAD_CLASSES:
        _HEAD_CLASSES[cls] = type(f"TensorParallel{cls.__name__}", (cls,), {
            "forward": _tp_head_forward, "mla_head_forward": cls.forward,
            "__module__": __name__})
    return _HEAD_CLASSES[cls]


def splittable_head(model, size: int):
    """The model's output head when shard() splits it by vocabulary, else None."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if (not isinstance(head, nn.Linear) or head.bias is not None or head.out_features % size
            or (emb is not None and emb.weight is head.weight)
            or getattr(head, "weight_scale_inv", None) is not None):
        return None
    return head


# ------------------------------------------------------------------------- checks


def _gu_width(experts) -> int:
    return experts.gate_up_proj.shape[1] // 2                         # I of [E, 2I, H]


def _mlp_modules(model) -> list:
    mlps = hf_classes("mlp")
    return [(n, m) for n, m in model.named_modules() if mlps and isinstance(m, mlps)]


def _expert_modules(model) -> list:
    moes = hf_classes("moe")
    return [(f"{n}.experts", m.experts) for n, m in model.named_modules()
            if moes and isinstance(m, moes)]


def check_shardable(model, size: int) -> None:
    """Raise a TypeError / ValueError naming what stops `model` from being split over
    `size` ranks (nothing is changed)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"shard() takes a torch.nn.Module, got {type(model).__name__}")
    attns = [(n, m) for n, m in model.named_modules() if isinstance(m, hf_classes("attention"))]
    if not attns:
        raise TypeError(f"shard() needs a DeepSeek V2/V3 model with multi-head latent "
                        f"attention; {type(model).__name__} has none")
    layers = hf_classes("layer")
    for n, m in model.named_modules():
        if n.endswith("self_attn") and not isinstance(m, hf_classes("attention")):
            raise TypeError(f"shard() supports models whose attention is all MLA; found {n} "
                            f"({type(m).__name__})")
    for n, m in attns:
        if m.num_heads % size:
            raise ValueError(f"{n}: {m.num_heads} heads do not split over {size} ranks")
        for lin in ("q_proj", "q_b_proj", "kv_b_proj", "o_proj"):
            _check_linear(f"{n}.{lin}", getattr(m, lin, None))
    for n, m in _mlp_modules(model):
        for lin in ("gate_proj", "up_proj", "down_proj"):
            _check_linear(f"{n}.{lin}", getattr(m, lin))
        if m.gate_proj.out_features % size:
            raise ValueError(f"{n}: intermediate size {m.gate_proj.out_features} does not "
                             f"split over {size} ranks")
    for n, e in _expert_modules(model):
        if getattr(e, "is_transposed", False) or not getattr(e, "is_concatenated", True) \
                or getattr(e, "has_bias", False):
            raise ValueError(f"{n}: transposed, interleaved or biased expert weights are "
                             f"not supported")
        if _gu_width(e) % size:
            raise ValueError(f"{n}: moe intermediate size {_gu_width(e)} does not split over "
                             f"{size} ranks")
    found = [n for n, m in model.named_modules() if isinstance(m, layers)]
    if len(found) != len(attns):
        raise ValueError(f"shard() needs every MLA attention inside an HF DeepSeek decoder "
                         f"layer; {len(attns)} attentions, {len(found)} layers")


def _check_linear(name: str, m) -> None:
    if m is None:
        return
    if not isinstance(m, nn.Linear) or m.bias is not None:
        raise ValueError(f"{name} ({type(m).__name__}) must be a bias-free nn.Linear to be "
                         f"split by shard()")
    if getattr(m, "weight_scale_inv", None) is not None or m.weight.dtype == torch.float8_e4m3fn:
        raise ValueError(f"{name}: block-quantized fp8 weights are not split by shard(); "
                         f"dequantize them first")


# ------------------------------------------------------------------------- the split


def _set(module, name: str, value: torch.Tensor) -> None:
    """Replace a parameter by `value` (an owned copy: a slice would keep the whole tensor)."""
    old = getattr(module, name)
    new = value.clone(memory_format=torch.contiguous_format)
    if isinstance(old, nn.Parameter):
        new = nn.Parameter(new, requires_grad=old.requires_grad)
    setattr(module, name, new)


def _rows(lin: nn.Linear, start: int, stop: int) -> None:
    _set(lin, "weight", lin.weight[start:stop])
    lin.out_features = stop - start


def _cols(lin: nn.Linear, start: int, stop: int) -> None:
    _set(lin, "weight", lin.weight[:, start:stop])
    lin.in_features = stop - start


def split_attention(m, rank: int, size: int) -> None:
    """Keep heads [rank*n, (rank+1)*n) of an HF MLA attention (converted or not), n = N/size."""
    n = m.num_heads // size
    h0, h1 = rank * n, (rank + 1) * n
    P, R, V = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
    q = m.q_proj if getattr(m, "q_lora_rank", None) is None else m.q_b_proj
    _rows(q, h0 * (P + R), h1 * (P + R))                        # [n*(P+R), q_lora | H]
    _rows(m.kv_b_proj, h0 * (P + V), h1 * (P + V))              # [n*(P+V), L]
    _cols(m.o_proj, h0 * V, h1 * V)                             # [H, n*V]
    m.num_heads = n
    mla = getattr(m, "mla_attn", None)
    if isinstance(mla, MLAAttention) and mla.W_UK_T is not None:
        mla.W_UK_T = mla.W_UK_T[h0:h1].clone()                  # [n, P, L]
        mla.W_UV = mla.W_UV[h0:h1].clone()                      # [n, L, V]
        mla.num_heads = n


def split_mlp(m, rank: int, size: int) -> None:
    """Keep intermediate slice `rank` of a SiLU MLP (dense layer or shared experts)."""
    i = m.gate_proj.out_features // size
    for lin in (m.gate_proj, m.up_proj):
        _rows(lin, rank * i, (rank + 1) * i)                    # [i, H]
    _cols(m.down_proj, rank * i, (rank + 1) * i)                # [H, i]
    if hasattr(m, "intermediate_size"):
        m.intermediate_size = i


def split_experts(e, rank: int, size: int) -> None:
    """Keep intermediate slice `rank` of every routed expert: gate_up_proj [E, 2I, H] ->
    [E, 2i, H] (its gate rows, then its up rows), down_proj [E, H, I] -> [E, H, i]."""
    I = _gu_width(e)
    i = I // size
    gu = e.gate_up_proj
    lo, hi = rank * i, (rank + 1) * i
    _set(e, "gate_up_proj", torch.cat((gu[:, lo:hi], gu[:, I + lo:I + hi]), dim=1))
    _set(e, "down_proj", e.down_proj[:, :, lo:hi])
    if hasattr(e, "intermediate_dim"):
        e.intermediate_dim = i


# ------------------------------------------------------------------------- HF's tp_plan


def tp_plan_group(model):
    """The tensor-parallel group of a model whose parameters are DTensors (transformers'
    tp_plan), else None."""
    from torch.distributed.tensor import DTensor
    for p in model.parameters():
        if isinstance(p, DTensor):
            mesh = p.device_mesh
            return mesh.get_group() if mesh.ndim == 1 else mesh.get_group("tp")
    return None


def gather_dtensors(model) -> None:
    """Replace every DTensor parameter / buffer by the whole tensor (a collective: every
    rank calls it, in the same order) and drop the forwards transformers installed per
    module for its tp_plan, so the model is a plain replicated one."""
    from torch.distributed.tensor import DTensor
    for m in model.modules():
        for name, p in list(m.named_parameters(recurse=False)):
            if isinstance(p, DTensor):
                m._parameters[name] = nn.Parameter(p.full_tensor().detach(),
                                                   requires_grad=p.requires_grad)
        for name, b in list(m.named_buffers(recurse=False)):
            if isinstance(b, DTensor):
                m._buffers[name] = b.full_tensor()
        if getattr(m, "_is_hooked", False) and "forward" in vars(m):
            del m.forward                          # the class's forward again
            m._is_hooked = False


# ------------------------------------------------------------------------- shard


def _resolve(model, group):
    """(group, its name) for shard(): checked, defaulted; raises before any change."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"shard() takes a torch.nn.Module, got {type(model).__name__}")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed ProcessGroup, got "
                        f"{type(group).__name__}")
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("shard() needs torch.distributed initialized (init_process_group)")
    planned = tp_plan_group(model)
    if group is None:
        group = planned if planned is not None else dist.group.WORLD
    if planned is not None and planned.group_name != group.group_name:
        raise ValueError("group is not the process group of the model's tp_plan")
    return group, group.group_name


def _sharded_over(model):
    return {getattr(m, "mla_tp_group_name", None) for m in model.modules()} - {None}


def prepare_shard(model, group=None):
    """shard()'s checks, and a tp_plan model's DTensors gathered (so convert() can absorb
    plain weights); returns the group to pass to shard() after converting."""
    group, name = _resolve(model, group)
    done = _sharded_over(model)
    if done and done != {name}:
        raise ValueError(f"the model is already sharded over process group {done}")
    if not done:
        check_shardable(model, dist.get_world_size(group))
        if tp_plan_group(model) is not None:
            gather_dtensors(model)
    return group


def shard(model, group=None):
    """Split `model` (HF DeepSeek V2 / V3, converted or not) over the ranks of `group`
    for tensor parallelism, in place, and return it (see the module docstring).

    group: a torch.distributed ProcessGroup; default the tp_plan group of a model loaded
    with transformers' tp_plan, else the default group. Call it on every rank of the
    group, each holding the same weights. Every check runs before anything changes;
    sharding a sharded model again is a no-op (the same group) or a ValueError. For
    inference: the all-reduce has no backward.
    """
    group, name = _resolve(model, group)
    done = _sharded_over(model)
    if done:
        if done == {name}:
            return model
        raise ValueError(f"the model is already sharded over process group {done}")
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    check_shardable(model, size)
    if tp_plan_group(model) is not None:
        gather_dtensors(model)
    attns = [m for m in model.modules() if isinstance(m, hf_classes("attention"))]
    head = splittable_head(model, size) if size > 1 else None
    if size > 1:
        with torch.no_grad():
            for m in attns:
                split_attention(m, rank, size)
            for _, m in _mlp_modules(model):
                split_mlp(m, rank, size)
            for _, e in _expert_modules(model):
                split_experts(e, rank, size)
            if head is not None:
                v = head.out_features // size
                _rows(head, rank * v, (rank + 1) * v)                   # [vocab / size, H]
    if head is not None:
        head.mla_tp_group_name, head.mla_tp_size = name, size
        head.__class__ = tp_head_class(type(head))
    for layer in [m for m in model.modules() if isinstance(m, hf_classes("layer"))]:
        layer.mla_tp_group_name = name
        layer.__class__ = tp_layer_class(type(layer))
    return model
