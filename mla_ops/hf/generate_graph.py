"""generate()'s decode steps replayed from a CUDA graph of the step (compiled for a
compile_config, else the eager step).

An eager decode step of a converted model launches a few dozen kernels per layer, and
their host time (Python, the op dispatch, Triton's launcher: 0.1-0.4 ms per op call on an
H200) exceeds their GPU time several times over at decode sizes. The eager step is
capturable, though: after its first step a PagedMLACache counts its room on the host and
the step reads nothing else there (mla_ops/hf/cache.py), and the MoE blocks keep decode
rows on the device. So when generate() runs its forward eagerly (disable_compile=True, or
no compile criteria met), its first decode step of each call captures that step
(DecodeGraph(compile=False): one warm-up step, then the capture, both undone) and every
decode step replays it. The kernels are the eager step's, so the logits are the eager
step's; what goes is the host time.

compile_config. A generate() call that asks for HF's compile of the decode step
(compile_config, and HF's own criteria met: a CUDA device, no disable_compile) gets the
same graphs over the compiled step instead: DecodeGraph(compile=True) with the config's
backend, its options less "triton.cudagraphs", and (without options) its mode without
CUDA graphs ("reduce-overhead" -> None, "max-autotune" -> "max-autotune-no-cudagraphs"),
the step compiled fullgraph with static shapes whatever the config's fullgraph / dynamic
say, and captured once in one CUDA graph. That is the step DecodeGraph runs, where HF's
compile replays cudagraph trees behind dynamo's guards (BENCHMARKS.md, "generate() end
to end"). The compiled code is dynamo's, kept across calls: a later call with the same
shapes compiles nothing.

convert(model, generate_graph=...) picks it (default: on); it applies to generate()'s
PagedMLACache on CUDA, the default one or one the user passes, and only for the call:
generate() detaches it when it returns, so a forward of the user's own afterwards runs
eagerly again. A cache the user passes keeps its graphs for the next generate() call on
it (a chat's turns): capturing costs a warm-up step and the capture (30-55 ms at the
shapes of BENCHMARKS.md's generate() rows), so a later call on that cache replays the
graphs captured before, while the model's parameters and buffers are the tensors they
were captured with (a model moved or re-cast gets new graphs). So does generate()'s
default cache where generate() keeps it for the next call (one the caller was not handed:
mla_ops/hf/generate.py); one the call returns starts with new graphs.

A forward that asks for more than the logits (hidden states, attentions) or that is not
one token per row runs eagerly. Where the step cannot be captured, or the cache has no
room for the warm-up step, the call's decode steps run eagerly (same numbers), with a
warning saying why.
"""
from __future__ import annotations

import warnings

import torch

from mla_ops.hf.cache import PagedMLACache
from mla_ops.hf.step import decode_room

__all__ = ["GenerateGraphs", "attached", "output_class"]

ATTR = "mla_generate_graphs"          # the PagedMLACache attribute that holds them
KEPT = "mla_kept_generate_graphs"     # ... and the one a cache keeps them under between calls
DEVICES = ("cuda",)                   # where a cache gets them
WARMUP = 1
EXTRA_OUTPUTS = ("output_attentions", "output_hidden_states", "output_router_logits",
                 "inputs_embeds")


def output_class():
    """HF's causal-LM output and the name of its cache field ("cache" from transformers
    5.24, "past_key_values" before)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast
    names = CausalLMOutputWithPast.__dataclass_fields__
    return CausalLMOutputWithPast, ("cache" if "cache" in names else "past_key_values")


class GenerateGraphs:
    """One generate() call's decode-step graphs on one PagedMLACache, one per batch size."""

    def __init__(self, model, cache: PagedMLACache, graph: bool | None = None):
        self.model, self.cache = model, cache
        self.graph = cache.device.type == "cuda" if graph is None else graph
        self.runners: dict = {}                 # (B, compile arguments) -> DecodeGraph
        self.weights: tuple | None = None       # a kept cache's: what its graphs read
        self.off: str | None = None             # why the steps run eagerly, once decided
        self.output, self.cache_field = output_class()
        self.busy = False                       # inside the runner's own forward calls
        self.compile: dict | None = None        # DecodeGraph's compile arguments, if any

    def begin_call(self) -> None:
        """A generate() call starts: it decides its own compile and fallbacks."""
        self.off, self.compile, self.busy = None, None, False

    def compile_with(self, config) -> None:
        """Compile the step as generate()'s compile_config asks (see above); before the
        call's first decode step."""
        modes = {"reduce-overhead": None, "max-autotune": "max-autotune-no-cudagraphs"}
        options = dict(config.options or {})
        options.pop("triton.cudagraphs", None)          # the runner captures the step
        self.compile = dict(compile=True, backend=config.backend,
                            mode=None if options else modes.get(config.mode, config.mode),
                            options=options or None)

    def serves(self, args: tuple, kwargs: dict) -> bool:
        """Whether this forward call is a decode step the graph computes (see above)."""
        if self.busy or self.off is not None or args:
            return False
        ids = kwargs.get("input_ids")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[1] != 1:
            return False
        if any(kwargs.get(k) is not None and kwargs.get(k) is not False for k in EXTRA_OUTPUTS):
            return False
        return kwargs.get("use_cache", True) is not False and ids.shape[0] <= self.cache.max_batch_size

    def step(self, kwargs: dict):
        """The decode step of kwargs["input_ids"] [B, 1]: HF's output with logits [B, 1, V]
        (the graph's buffer: generate() copies what it keeps) and the cache; None where the
        steps run eagerly from now on."""
        ids = kwargs["input_ids"]
        B = ids.shape[0]
        key = (B, None if self.compile is None else
               (self.compile["backend"], self.compile["mode"], repr(self.compile["options"])))
        runner = self.runners.get(key)
        if runner is None:
            runner = self._capture(B)
            if runner is None:
                return None
            self.runners[key] = runner
        self.busy = True                 # (without a graph the runner calls the forward)
        try:
            logits = runner(ids)                                           # [B, 1, V]
        finally:
            self.busy = False
        return self.output(logits=logits, **{self.cache_field: self.cache})

    def prefill(self, args: tuple, kwargs: dict):
        """generate()'s prefill forward through the PrefillGraph registered on this call's
        cache (mla_ops/hf/prefill_graph.py) where there is one for this model and the call
        wants the last position's logits only; HF's output, else None (run it eagerly)."""
        from mla_ops.hf.prefill_graph import ATTR as PREFILL
        runner = getattr(self.cache, PREFILL, None)
        ids = kwargs.get("input_ids")
        if (runner is None or runner.model is not self.model or self.busy or args
                or not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[1] < 2
                or kwargs.get("logits_to_keep") != 1 or kwargs.get("use_cache") is False
                or any(kwargs.get(k) is not None and kwargs.get(k) is not False
                       for k in EXTRA_OUTPUTS)):
            return None
        self.busy = True                 # the runner calls the forward itself
        try:
            logits = runner(ids, kwargs.get("attention_mask"))             # [B, 1, V]
        finally:
            self.busy = False
        return self.output(logits=logits, **{self.cache_field: self.cache})

    def _capture(self, B: int):
        from mla_ops.hf.graph import DecodeGraph          # (graph.py imports convert.py)
        room = decode_room(self.cache, B)                   # one host read per capture
        if room < WARMUP + 1:
            self._eager(f"{room} decode step(s) fit in the cache; capturing needs "
                        f"{WARMUP + 1}", warn=False)
            return None
        self.busy = True
        try:
            runner = DecodeGraph(self.model, self.cache, batch_size=B, graph=self.graph,
                                 warmup=WARMUP, **(self.compile or dict(compile=False)))
        except RuntimeError as exc:                         # not capturable: says why
            self._eager(str(exc).splitlines()[0], warn=True)
            return None
        finally:
            self.busy = False
        return runner

    def _eager(self, why: str, warn: bool) -> None:
        self.off = why
        if warn:
            warnings.warn(f"generate(): this call's decode steps run eagerly, not from a CUDA "
                          f"graph of the step ({why}); convert(model, generate_graph=False) "
                          f"skips the attempt", RuntimeWarning, stacklevel=4)


def attached(kwargs: dict) -> GenerateGraphs | None:
    """The graphs generate() attached to this forward call's cache, if any."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    return getattr(cache, ATTR, None) if isinstance(cache, PagedMLACache) else None


def weights_key(model) -> tuple:
    """The addresses of the model's parameters and buffers: a captured step reads them."""
    return tuple(t.data_ptr() for t in (*model.parameters(), *model.buffers()))


def attach(model, cache, kept: bool = False) -> None:
    """generate()'s prepare hook: graphs for this call's cache when the model asks for them
    (convert(generate_graph=True)) and the cache is a PagedMLACache on CUDA: the ones the
    cache keeps, if it keeps valid ones, else new ones. kept: the cache keeps them for
    later calls (the user's cache, or a default cache generate() keeps; see above)."""
    if (isinstance(cache, PagedMLACache) and getattr(model, "mla_generate_graph", False)
            and cache.device.type in DEVICES and getattr(cache, ATTR, None) is None):
        graphs = getattr(cache, KEPT, None)
        weights = weights_key(model) if kept or graphs is not None else None
        if graphs is None or graphs.model is not model or graphs.weights != weights:
            graphs = GenerateGraphs(model, cache)
            graphs.weights = weights
            setattr(cache, KEPT, graphs if kept else None)
        graphs.begin_call()
        setattr(cache, ATTR, graphs)
        model.__dict__["_mla_graph_cache"] = cache


def detach(model) -> None:
    """When generate() returns: the call's graphs go (and their memory with them)."""
    cache = model.__dict__.pop("_mla_graph_cache", None)
    if cache is not None:
        setattr(cache, ATTR, None)
