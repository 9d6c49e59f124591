"""Why the eager decode step of a V3-shaped FP8 MoE model does not capture in a CUDA graph
(GPU probe, not maintained; NOTES-fp8-checkpoints.md).

The tiny FP8 model of tests/test_fp8_checkpoint.py captures; probe_l2_prefetch_1row.py's
`v3-moe-fp8` shape (1 dense + 1 MoE layer, `quantize_fp8`, `convert`) does not: the
capture is invalidated before the routed experts' down kernel launches. This builds that
model and captures DecodeGraph(compile=False) four ways, printing every Triton compile
(and its stack) that happens while a stream is capturing:
  - global: as DecodeGraph captures (torch.cuda.graph's default error mode);
  - relaxed: capture_error_mode="relaxed" (if this one captures, the culprit is a call
    that is only unsafe under "global", e.g. a module load from a compile);
  - serial: the MoE block's shared experts run before the routed ones on the caller's
    stream (if this one captures, the side-stream fork is the culprit);
  - again: as the first, once everything has run (a first-use compile or load would be
    gone by then).

    python docs/notes/probe_fp8_capture.py [v3-moe-fp8]
"""
import functools
import sys
import traceback
from types import SimpleNamespace

import torch
from triton.runtime.jit import JITFunction

sys.path.insert(0, "benchmarks")                    # run from the repository root
sys.path.insert(0, "docs/notes")
import mla_ops.hf  # noqa: E402
import lowering.moe.fp8_block as fp8_block  # noqa: E402
from bench_hf_decode import fill_paged_cache  # noqa: E402
from probe_l2_prefetch_1row import build  # noqa: E402

_compile = JITFunction._do_compile


def _loud_compile(self, *args, **kwargs):
    capturing = torch.cuda.is_current_stream_capturing()
    print(f"  compile {self.__name__}{' WHILE CAPTURING' if capturing else ''}", flush=True)
    if capturing:
        traceback.print_stack(limit=8)
    return _compile(self, *args, **kwargs)


def main():
    JITFunction._do_compile = _loud_compile
    dev = torch.device("cuda")
    cfg, model = build(sys.argv[1] if len(sys.argv) > 1 else "v3-moe-fp8", dev)
    graph, fork = torch.cuda.graph, fp8_block.fork_shared

    def serial(x, shared, routed):
        shared()
        routed()

    for name, mode, fork_fn in (("global", "global", fork), ("relaxed", "relaxed", fork),
                                ("serial", "global", serial), ("again", "global", fork)):
        torch.cuda.graph = functools.partial(graph, capture_error_mode=mode)
        fp8_block.fork_shared = fork_fn
        opts = SimpleNamespace(kv_cache_dtype="auto", k_scale=1.0, per_layer_schedule=False)
        cache = fill_paged_cache(cfg, 1, 4096, 64, dev, torch.bfloat16, opts)
        print(name, "capturing", flush=True)
        try:
            runner = mla_ops.hf.DecodeGraph(model, cache, batch_size=1, graph=True,
                                            compile=False)
            runner(torch.randint(3, cfg.vocab_size, (1, 1), device=dev))
            torch.cuda.synchronize()
            print(name, "CAPTURED", flush=True)
        except Exception as exc:
            print(name, "FAILED", str(exc).splitlines()[0][:200], flush=True)
            torch.cuda.synchronize()
    torch.cuda.graph, fp8_block.fork_shared = graph, fork


if __name__ == "__main__":
    main()
