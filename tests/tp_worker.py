"""One rank of tests/test_tensor_parallel.py: builds tiny DeepSeek models, splits them over a
gloo group of two processes, generates greedily and saves what the test compares."""
from __future__ import annotations

import os

import torch
import torch._dynamo
import torch.distributed as dist

NEW_TOKENS = 4
LENGTHS = [5, 9]
CASES = {   # name: (family, q_lora_rank, how the model is split, fuse_experts, compiled)
    "v3": ("v3", 192, "convert, then shard", True, False),
    "v2": ("v2", None, "shard, then convert", False, False),
    "v3-compiled": ("v3", 192, "convert(tp_group)", True, True),
}

graphs: list = []   # graphs handed to the compiler backend (module level: CompileConfig copies)


def counting_backend(gm, example_inputs, **kwargs):
    from torch._dynamo.backends.registry import lookup_backend
    graphs.append(len(gm.graph.nodes))
    return lookup_backend("aot_eager")(gm, example_inputs)


def gen_kwargs():
    return dict(max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                return_dict_in_generate=True)


def build(name):
    from hf_models import build_pair, tiny_config
    fam, q_lora, *_ = CASES[name]
    return build_pair(tiny_config(fam, q_lora_rank=q_lora), seed=len(name))[0]


def run_case(name, group):
    import mla_ops.hf as H
    from hf_models import left_padded
    _, _, how, fuse_experts, compiled = CASES[name]
    model = build(name)
    if how == "convert(tp_group)":
        H.convert(model, tp_group=group, fuse_experts=fuse_experts)
    elif how == "convert, then shard":
        H.shard(H.convert(model, fuse_experts=fuse_experts), group)
    else:
        H.convert(H.shard(model, group), fuse_experts=fuse_experts)
    ids, mask = left_padded(LENGTHS)
    kw = dict(attention_mask=mask, **gen_kwargs())
    out = {}
    if compiled:
        from transformers.generation.configuration_utils import CompileConfig
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        graphs.clear()
        cc = CompileConfig(fullgraph=True, dynamic=False, backend=counting_backend, mode=None)
        cc._compile_all_devices = True        # CPU too
        kw["compile_config"] = cc
    with torch.no_grad():
        res = model.generate(ids, **kw)
    if compiled:
        out["graphs"] = len(graphs)
        out["graph_breaks"] = sum(torch._dynamo.utils.counters["graph_break"].values())
    heads = {m.num_heads for m in model.modules() if type(m).__name__ == "MLAAttention"}
    cache = next(v for k in ("past_key_values", "cache") if (v := getattr(res, k, None)))
    out.update(sequences=res.sequences, logits=torch.stack(res.logits), heads=sorted(heads),
               cache_heads=cache.num_heads,     # generate()'s default cache: one rank's
               head_rows=model.get_output_embeddings().weight.shape[0])
    return out


def run_tp_plan(model_dir):
    """transformers' own tp_plan model (DTensor weights), converted (split again by us)."""
    import mla_ops.hf as H
    from transformers import AutoModelForCausalLM
    from hf_models import left_padded
    model = AutoModelForCausalLM.from_pretrained(model_dir, tp_plan="auto", dtype=torch.float32)
    hf_tp = {}
    ids, mask = left_padded(LENGTHS)
    with torch.no_grad():
        hf_tp["hf_logits"] = model(input_ids=ids, attention_mask=mask).logits
    H.convert(model.eval(), fuse_experts=True)
    with torch.no_grad():
        res = model.generate(ids, attention_mask=mask, **gen_kwargs())
    return dict(hf_tp, sequences=res.sequences, logits=torch.stack(res.logits))


def main(rank, world, store, out_dir, names, model_dir):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        results = {n: run_case(n, dist.group.WORLD) for n in names}
        if model_dir is not None:
            results["tp_plan"] = run_tp_plan(model_dir)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------- two GPUs

GPU_STEPS = 8


def decode_logits(model, cache, ids, mask, fed):
    """Prefill ids into cache, then DecodeGraph steps fed the tokens fed [B, steps]:
    logits [steps, B, vocab] in fp32."""
    import mla_ops.hf as H
    from hf_models import cache_kw
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, position_ids=pos, **cache_kw(cache))
    runner = H.DecodeGraph(model, cache, backend="inductor")
    out = [runner(fed[:, i:i + 1]).float().reshape(fed.shape[0], -1).clone()
           for i in range(fed.shape[1])]
    return torch.stack(out)


def gpu_model(dev, tp_group=None):
    import mla_ops.hf as H
    from hf_models import build_pair, tiny_config
    model = build_pair(tiny_config("v3"), seed=4, dtype=torch.bfloat16)[0].to(dev)
    return H.convert(model, tp_group=tp_group, fuse_experts=True)


def gpu_cache(model, dev, heads):
    import mla_ops.hf as H
    return H.PagedMLACache(model.config, max_batch_size=len(LENGTHS), max_cache_len=64,
                           block_size=64, device=dev, dtype=torch.bfloat16, num_heads=heads)


def gpu_main(rank, world, store, out_dir, fed):
    """Rank `rank` on cuda:rank over NCCL: the tiny V3 model split in two, each step of
    the captured decode graph fed the tokens `fed` [B, steps]."""
    from hf_models import left_padded
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank,
                            world_size=world, device_id=dev)
    try:
        model = gpu_model(dev, dist.group.WORLD)
        heads = model.config.num_attention_heads // world
        ids, mask = (t.to(dev) for t in left_padded(LENGTHS))
        logits = decode_logits(model, gpu_cache(model, dev, heads), ids, mask, fed.to(dev))
        torch.save(logits.cpu(), os.path.join(out_dir, f"gpu_rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
