"""A converted model's eager forward with its Triton kernels launched directly.

The converted modules' ops are torch.library.triton_op's whose launchers call
wrap_triton(kernel)[grid](...), so that torch.compile sees the kernels. Called eagerly,
wrap_triton dispatches a higher-order op per launch, which costs 0.3-1 ms of host time
(torch's own note on set_wrap_triton_enabled; the Triton decode route measured 0.3-0.7 ms
on an H200): at a dozen launches per layer, an eager decode step was host bound several
times over. torch offers a switch, set_wrap_triton_enabled(False), under which wrap_triton
returns the kernel itself; it is right for eager code on plain tensors, never while
torch.compile traces (the kernels would not be seen).

direct_launch_forward(cls) is cls.forward run under that switch when not compiling: the
converted model's top-level class gets it (mla_ops/hf/generate.py's generation_class), so
every eager call of the model (generate()'s steps included) launches its kernels
directly, and a compiled call (generate()'s compile_config, DecodeGraph) traces cls.forward
as before. Where this torch has no such switch, the forward is cls.forward unchanged.

Inside generate(), an eager decode step on a PagedMLACache is a replay of a CUDA graph of
this eager step where generate() attached one to the cache (mla_ops/hf/generate_graph.py),
and its prefill runs through the cache's PrefillGraph where one is registered on it
(mla_ops/hf/prefill_graph.py).
"""
from __future__ import annotations

import functools

import torch

from mla_ops.hf.generate_graph import attached

try:
    from torch._library.triton import set_wrap_triton_enabled
except ImportError:                                    # torch without the switch
    set_wrap_triton_enabled = None

__all__ = ["direct_launch_forward", "set_wrap_triton_enabled"]


def direct_launch_forward(cls):
    """cls.forward, run with direct Triton launches when not compiling (see above)."""
    hf_forward = cls.forward

    @functools.wraps(hf_forward)                       # (HF reads forward's signature)
    def forward(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            return hf_forward(self, *args, **kwargs)
        graphs = attached(kwargs)
        if graphs is not None and graphs.serves(args, kwargs):
            out = graphs.step(kwargs)
            if out is not None:
                return out
        elif graphs is not None:         # a prefill chunk, where the cache has a PrefillGraph
            out = graphs.prefill(args, kwargs)
            if out is not None:
                return out
        if set_wrap_triton_enabled is None:
            return hf_forward(self, *args, **kwargs)
        with set_wrap_triton_enabled(False):
            return hf_forward(self, *args, **kwargs)

    return forward
