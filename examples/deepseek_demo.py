"""DeepSeek-V3 with multi-head latent attention on the mla ops, under torch.compile.

Builds a small random DeepseekV3ForCausalLM from a config (nothing is downloaded; the
attention keeps the real MLA dims: kv_lora_rank 512, qk_rope_head_dim 64,
qk_nope_head_dim 128, v_head_dim 128), converts it with mla_ops.hf.convert, generates
a left-padded batch with a PagedMLACache and a compiled decode step, checks the tokens
against the unconverted HF model, and prints tokens/s and KV-cache bytes beside HF's
StaticCache.

    python examples/deepseek_demo.py                      # CPU, tiny model, ~seconds
    python examples/deepseek_demo.py --device cuda --config v3-shaped --dtype bfloat16
"""
from __future__ import annotations

import argparse
import copy
import sys
import time

import torch

import mla_ops.hf

from mla_ops.hf.models import build_model, make_config


def left_padded_batch(lengths, vocab, device, seed=1):
    g = torch.Generator().manual_seed(seed)
    B, S = len(lengths), max(lengths)
    ids = torch.randint(3, vocab, (B, S), generator=g)
    mask = torch.zeros(B, S, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, S - n:] = 1
        ids[b, :S - n] = 0
    return ids.to(device), mask.to(device)


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed_generate(model, ids, mask, new, device, **kw):
    sync(device)
    t = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                             min_new_tokens=new, **kw)
    sync(device)
    return out, time.perf_counter() - t


def decode_graph_run(model, cache, ids, mask, expected, new, dev, backend):
    """Prefill eagerly, then new - 1 greedy steps through DecodeGraph; same tokens as generate."""
    cache.reset()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        first = model(input_ids=ids, attention_mask=mask, position_ids=pos,
                      **mla_ops.hf.cache_kwargs(model, cache)).logits[:, -1].argmax(-1)   # [B]
    t = time.perf_counter()
    try:
        runner = mla_ops.hf.DecodeGraph(model, cache, backend=backend)
    except RuntimeError as exc:       # a layer that reads on the host (e.g. HF's MoE block
                                      # left by convert(fuse_experts=False))
        print(f"DecodeGraph: no CUDA graph for this model ({str(exc).splitlines()[-1]}); "
              f"running its compiled step without one")
        runner = mla_ops.hf.DecodeGraph(model, cache, backend=backend, graph=False)
    second = runner.greedy(first, 1)  # first call (compiles when graph=False)
    t_setup = time.perf_counter() - t
    sync(dev)
    t = time.perf_counter()
    rest = runner.greedy(second[:, 0], new - 2)                             # [B, new - 2]
    sync(dev)
    dt = time.perf_counter() - t
    B = ids.shape[0]
    tokens = torch.cat([first[:, None], second, rest], 1)                   # [B, new]
    same = (tokens == expected[:, -new:]).float().mean().item()
    how = "the whole step in one CUDA graph" if runner.graph_enabled else "no CUDA graph"
    print(f"ours with DecodeGraph ({how}): {B * (new - 2) / dt:.1f} tokens/s ({B}x{new - 2} "
          f"steps in {dt:.3f} s; set-up {t_setup:.1f} s); tokens equal to generate: {same:.1%}")


def teacher_forced_check(model, ref, seq, mask, new, cache, dev):
    """Decode HF's own output sequence token by token through both models (teacher
    forcing): per-step argmax agreement and logit error of the decode path, free of the
    divergence one near-tie causes in free-running greedy decoding."""
    from transformers import DynamicCache
    S = mask.shape[1]
    cache.reset()
    ref_cache = DynamicCache(config=ref.config)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    agree, err = [], 0.0
    ours = mla_ops.hf.cache_kwargs(model, cache)          # cache= (or past_key_values=
    theirs = mla_ops.hf.cache_kwargs(ref, ref_cache)      # before transformers 5.24)
    with torch.no_grad():
        model(input_ids=seq[:, :S], attention_mask=mask, position_ids=pos, **ours)
        ref(input_ids=seq[:, :S], attention_mask=mask, position_ids=pos, **theirs)
        p = pos[:, -1:]
        for i in range(new - 1):
            p = p + 1
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            tok = seq[:, S + i:S + i + 1]
            a = model(input_ids=tok, position_ids=p, **ours).logits.float()
            b = ref(input_ids=tok, attention_mask=mask, position_ids=p, **theirs).logits.float()
            agree.append((a.argmax(-1) == b.argmax(-1)).float().mean().item())
            err = max(err, ((a - b).abs().max() / b.abs().max().clamp(min=1)).item())
    print(f"teacher-forced decode of the same {new - 1} steps: argmax equal "
          f"{sum(agree) / len(agree):.1%}, max |logit diff| / max(1, |logits|) = {err:.2e}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--config", choices=["tiny", "v3-shaped"], default="tiny")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                    help="default: float32 on CPU, bfloat16 on CUDA")
    ap.add_argument("--prompt-lens", default="7,21,40,13", help="comma-separated, left-padded")
    ap.add_argument("--new-tokens", type=int, default=40)
    ap.add_argument("--block-size", type=int, default=None, help="default: 64 on CUDA, 16 on CPU")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    ap.add_argument("--backend", default=None,
                    help="torch.compile backend (default: inductor on CUDA, aot_eager on CPU)")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--no-check", action="store_true", help="skip the unconverted-model run")
    ap.add_argument("--decode-graph", choices=["on", "off"], default=None,
                    help="also decode with mla_ops.hf.DecodeGraph (the whole step in one CUDA "
                         "graph) after a prefill; default: on with CUDA")
    args = ap.parse_args()

    from transformers import StaticCache
    from transformers.generation.configuration_utils import CompileConfig

    dev = torch.device(args.device)
    on_cuda = dev.type == "cuda"
    dtype = getattr(torch, args.dtype or ("bfloat16" if on_cuda else "float32"))
    backend = args.backend or ("inductor" if on_cuda else "aot_eager")
    lens = [int(x) for x in args.prompt_lens.split(",")]
    B, new = len(lens), args.new_tokens
    max_len = max(lens) + new
    block_size = args.block_size or (64 if on_cuda else 16)

    cfg = make_config(args.config, args.layers)
    t0 = time.perf_counter()
    ref = build_model(cfg, dev, dtype)
    model = mla_ops.hf.convert(copy.deepcopy(ref))
    print(f"model: DeepseekV3 {args.config}, {cfg.num_hidden_layers} layers, hidden "
          f"{cfg.hidden_size}, {cfg.num_attention_heads} heads, MLA L={cfg.kv_lora_rank} "
          f"R={cfg.qk_rope_head_dim} P={cfg.qk_nope_head_dim} V={cfg.v_head_dim}, {dtype}, "
          f"{dev}; built and converted in {time.perf_counter() - t0:.1f} s")
    ids, mask = left_padded_batch(lens, cfg.vocab_size, dev)

    cache = mla_ops.hf.PagedMLACache(model.config, max_batch_size=B, max_cache_len=max_len,
                                     block_size=block_size,
                                     kv_cache_dtype=args.kv_cache_dtype, device=dev, dtype=dtype)
    # generate() with no cache argument runs on a PagedMLACache sized from the call; this
    # demo passes its own to report the blocks it used
    kw = mla_ops.hf.cache_kwargs(model, cache)
    if not args.no_compile:
        # fullgraph: the decode step must trace to one graph; CUDA graphs on GPU
        cc = CompileConfig(fullgraph=True, dynamic=False, backend=backend,
                           mode="reduce-overhead" if (on_cuda and backend == "inductor") else None)
        cc._compile_all_devices = True       # compile on CPU as well
        kw["compile_config"] = cc
    if on_cuda:
        # A decode kernel may set up persistent buffers on its first call (FlashMLA's
        # scheduler table): make that call eagerly, outside the CUDA-graph pool.
        timed_generate(model, ids, mask, 2, dev, disable_compile=True,
                       **mla_ops.hf.cache_kwargs(model, cache))
        cache.reset()
    out, t_first = timed_generate(model, ids, mask, new, dev, **kw)
    used_blocks, used_bytes = cache.blocks_in_use(), cache.bytes_in_use()
    cache.reset()
    out2, t_ours = timed_generate(model, ids, mask, new, dev, **kw)
    assert torch.equal(out, out2), "second run differs from the first"
    compiled = "compiled decode" if not args.no_compile else "eager"
    print(f"ours ({compiled}, PagedMLACache block {block_size}, kv {args.kv_cache_dtype}): "
          f"{B * new / t_ours:.1f} tokens/s ({B}x{new} new tokens in {t_ours:.2f} s; "
          f"first call with compilation {t_first:.1f} s)")

    if (args.decode_graph or ("on" if on_cuda else "off")) == "on":
        decode_graph_run(model, cache, ids, mask, out, new, dev, backend)

    if not args.no_check:
        hf_cache = StaticCache(config=ref.config, max_cache_len=max_len)
        exp, t_hf = timed_generate(ref, ids, mask, new, dev, disable_compile=True,
                                   **mla_ops.hf.cache_kwargs(ref, hf_cache))
        print(f"HF eager + StaticCache: {B * new / t_hf:.1f} tokens/s")
        same = (out[:, -new:] == exp[:, -new:]).float().mean().item()
        print(f"greedy tokens equal to the unconverted model: {same:.1%}"
              + ("" if same == 1 else "  (expected with an fp8 cache or bf16: one near-tie "
                 "changes every later token; the teacher-forced check compares step by step)"))
        teacher_forced_check(model, ref, exp, mask, new, cache, dev)
        hf_layer = hf_cache.layers[0]
        hf_row = (hf_layer.keys.shape[-1] + hf_layer.values.shape[-1]) * hf_layer.keys.element_size()
        hf_bytes = sum(l.keys.numel() * l.keys.element_size() + l.values.numel()
                       * l.values.element_size() for l in hf_cache.layers)
    else:
        same = None
        hf_row = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * torch.finfo(dtype).bits // 8
        hf_bytes = hf_row * B * max_len * cfg.num_hidden_layers

    scale = " + one fp32 scale per layer" if args.kv_cache_dtype == "fp8" else ""
    print(f"KV bytes per token per layer: ours {cache.bytes_per_token_per_layer()}{scale}, "
          f"HF StaticCache {hf_row} (plain MHA would need "
          f"{cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) * torch.finfo(dtype).bits // 8})")
    print(f"KV memory after generation: ours {used_blocks} blocks in use = {used_bytes / 2**20:.2f} "
          f"MiB (pool {cache.num_blocks} blocks); HF StaticCache allocates "
          f"{hf_bytes / 2**20:.2f} MiB (B x max_cache_len, padding included)")
    if not on_cuda:
        print("(CPU tokens/s measure per-step overhead of a tiny model, not kernels)")
    if same is not None and args.kv_cache_dtype == "auto" and dtype == torch.float32 and same < 1:
        sys.exit("tokens differ from the unconverted model")


if __name__ == "__main__":
    main()
