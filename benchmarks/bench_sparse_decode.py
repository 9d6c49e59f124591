"""Sparse decode (DeepSeek Sparse Attention: each query reads its top-k cache tokens) against
the dense decode over the whole context, as the context S grows.

    python benchmarks/bench_sparse_decode.py [--json sparse_decode.json]
        [--seqlens 8192,32768,131072] [--batch 32] [--heads 128,16] [--topk 2048] [--no-indexer]

BF16 latent cache [num_blocks, 64, 576], every request at length S, random page order.
Rows per shape (µs: median of CUDA-graph replays, benchmarks/timing.py):
  dense triton        our Triton decode over all S tokens (page 64)
  dense flashmla      FlashMLA's dense kernel (where the flash_mla package serves)
  sparse              mla::sparse_decode, route "triton": each request's top-k slots
                      (random distinct tokens of its own pages), sorted in the op, then the
                      Triton kernel over pages of one token
  sparse[kernel only] the same kernel on pre-sorted slot lists (the op minus its sort)
  indexer (torch)     mla_ops.hf.dsa.select_slots for one token per request with 64
                      indexer heads of 128 (DeepSeek-V3.2's): the O(S) part of DSA, in
                      torch ops (gather, scores, top-k)
  indexer (ours)      the same with the scores from mla::indexer_scores (a Triton kernel
                      reading each index key once through the block table), then top-k;
                      "same" is the fraction of its slots the torch row also selects
  indexer[kernel only] mla::indexer_scores alone (no top-k)
Each row gives the bytes it reads (cache rows; slot lists for sparse; the index keys for
the indexer) and the achieved GB/s. The point of DSA: past top-k the sparse rows stay flat
in S while dense grows linearly.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

L, R, PAGE = 512, 64, 64


def make_inputs(B, H, S, topk, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    blocks = B * S // PAGE
    kv = torch.randn(blocks, PAGE, L + R, device=device, generator=g).to(torch.bfloat16)
    q = torch.randn(B, 1, H, L + R, device=device, generator=g).to(torch.bfloat16)
    bt = torch.randperm(blocks, device=device, generator=g).int().reshape(B, S // PAGE)
    lens = torch.full((B,), S, dtype=torch.int32, device=device)
    # top-k distinct positions of each request, as cache slots through its block table
    pos = torch.rand(B, S, device=device, generator=g).topk(min(topk, S), dim=-1).indices
    slots = (bt.long().gather(1, pos // PAGE) * PAGE + pos % PAGE).to(torch.int32)
    return q, kv, bt, lens, slots


def bench_shape(B, H, S, topk, indexer, log, device="cuda", timer=None):
    """The rows of one shape; timer(fn) -> µs (default: CUDA-graph replays)."""
    if timer is None:
        from timing import graph_time_us      # benchmarks/timing.py, beside this script
        timer = graph_time_us
    import lowering.decode.triton_decode as td
    from lowering.decode.registry import route_unmet
    from lowering.decode.sparse import sparse_decode_reference

    scale = 192 ** -0.5
    q, kv, bt, lens, slots = make_inputs(B, H, S, topk, device)
    q3 = q[:, 0]                                                         # [B, H, 576]
    one = torch.ones(1, dtype=torch.float32, device=device)
    ref, _ = sparse_decode_reference(q3, kv, slots, scale, "auto", one, L)
    row_bytes = (L + R) * 2
    rows = []

    def record(name, fn, nbytes, ref_out=None, same=None):
        try:
            out = fn()
            us = timer(fn)
        except Exception as exc:       # report and go on with the other rows
            log(f"  {name:22s} FAILED {type(exc).__name__}: {str(exc)[:160]}")
            return
        err = None
        if same is not None:
            same = same(out[0])
        if ref_out is not None:
            o = out[0].reshape(ref_out.shape).float()
            err = ((o - ref_out.float()).norm() / ref_out.float().norm()).item()
        row = dict(B=B, H=H, S=S, topk=topk, impl=name, us=us, bytes=nbytes,
                   gbps=nbytes / us * 1e-3, rel_err=err, same=same)
        log(f"  {name:22s} {us:9.1f} us {nbytes / 1e6:9.1f} MB {row['gbps']:7.0f} GB/s"
            + (f"  err {err:.1e}" if err is not None else "")
            + (f"  same {same:.4f}" if same is not None else ""))
        rows.append(row)

    dense_bytes = B * S * row_bytes
    record("dense triton", lambda: td.triton_decode_op(
        q, kv, bt, lens, None, None, scale, True, L, 0, False, torch.bfloat16), dense_bytes)
    if route_unmet("flashmla", q, kv) is None:
        import lowering.decode.flashmla as fm
        record("dense flashmla", lambda: fm.flashmla_decode_op(q, kv, bt, lens, scale, True, L),
               dense_bytes)
    else:
        log(f"  dense flashmla: {route_unmet('flashmla', q, kv)}")
    k = slots.shape[1]
    sparse_bytes = B * k * (row_bytes + 4)
    record("sparse", lambda: torch.ops.mla.sparse_decode(q3, kv, slots, scale, "auto", one, L,
                                                         "triton"), sparse_bytes, ref)
    ordered = torch.sort(slots, dim=-1, descending=True).values
    klens = torch.full((B,), k, dtype=torch.int32, device=device)
    pages = kv.view(-1, 1, L + R)
    record("sparse[kernel only]", lambda: td.triton_decode_op(
        q, pages, ordered, klens, None, None, scale, False, L, 0, False, torch.bfloat16),
        sparse_bytes, ref)
    if indexer:
        from mla_ops.hf.dsa import select_slots
        g = torch.Generator(device=device).manual_seed(1)
        iq = torch.randn(B, 1, 64, 128, device=device, generator=g).to(torch.bfloat16)
        iw = torch.randn(B, 1, 64, device=device, generator=g)
        pool = torch.randn(kv.shape[0], PAGE, 128, device=device, generator=g).to(torch.bfloat16)
        args = (iq, iw, pool, bt, lens, lens, topk, 128 ** -0.5)
        key_bytes = B * S * 128 * 2
        record("indexer (torch)", lambda: (select_slots(*args, backend="torch"),), key_bytes)
        ref_slots = select_slots(*args, backend="torch").long()               # [B, k]
        row_off = torch.arange(B, device=device)[:, None] * pool.shape[0] * PAGE

        def same(slots):             # the fraction of the torch path's slots selected
            return torch.isin(slots.long() + row_off, ref_slots + row_off).float().mean().item()
        record("indexer (ours)", lambda: (select_slots(*args, backend="triton"),), key_bytes,
               same=same)
        from lowering.decode.indexer import indexer_scores_op
        limit = (lens.long() - 1)[:, None]                                   # [B, 1]
        record("indexer[kernel only]", lambda: (indexer_scores_op(
            iq, iw, pool, bt, limit, 128 ** -0.5),), key_bytes)
    return rows


def flashmla_sparse_note() -> str:
    """What the installed flash_mla offers for sparse decode (feature-detected)."""
    try:
        import inspect

        import flash_mla
    except Exception as exc:
        return f"flash_mla not importable ({type(exc).__name__})"
    fn = getattr(flash_mla, "flash_mla_with_kvcache", None)
    params = inspect.signature(fn).parameters if fn is not None else {}
    if "indices" not in params:
        return "the installed flash_mla has no sparse decode (no indices argument)"
    return ("the installed flash_mla has a sparse decode (flash_mla_with_kvcache(indices=...)); "
            "it reads its own fp8 cache layout, not this bf16 cache: not timed here")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default="sparse_decode_results.json")
    ap.add_argument("--seqlens", default="8192,32768,131072")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--heads", default="128,16")
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--no-indexer", dest="indexer", action="store_false",
                    help="skip the indexer row")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_sparse_decode.py needs a CUDA GPU")
    import triton
    lines = []

    def log(msg):
        print(msg, flush=True)
        lines.append(msg)

    log(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    log(f"flashmla sparse: {flashmla_sparse_note()}")
    results = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                   triton=triton.__version__, command=" ".join(sys.argv), rows=[])
    for H in (int(h) for h in args.heads.split(",")):
        for S in (int(s) for s in args.seqlens.split(",")):
            log(f"B={args.batch} H={H} S={S} topk={args.topk}")
            results["rows"] += bench_shape(args.batch, H, S, args.topk, args.indexer, log)
            torch.cuda.empty_cache()          # the shape's tensors are gone: give back memory
            Path(args.json).write_text(json.dumps(results, indent=1))
    results["log"] = lines
    Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
