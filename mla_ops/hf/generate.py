"""generate() on a converted model: with no cache argument it runs on a PagedMLACache.

transformers builds generate()'s default cache in GenerationMixin's
_prepare_cache_for_generation(generation_config, model_kwargs, generation_mode,
batch_size, max_cache_length); it offers no public hook for a model-specific default
(cache_implementation takes only HF's own names). So convert() swaps the model's class for
a subclass (same name, so save_pretrained records the same architecture) whose
_prepare_cache_for_generation puts a PagedMLACache into model_kwargs when generate() would
otherwise build a DynamicCache:

- sized from the call: max(num_beams, num_return_sequences) * batch rows of
  generation_config.max_length - 1 tokens (prompt with its left pads + max_new_tokens;
  at least generation_config.max_cache_len when set), and never smaller than the previous
  call's default cache, so a compiled decode step keeps its shapes across calls;
- kept for the next call when this one did not hand it out (return_dict_in_generate
  off, so the caller never holds it): model.mla_default_cache holds it between calls
  (set it to None to free its memory), and the next call of the same shape and options
  resets it in place and replays the decode-step graph captured before
  (mla_ops/hf/generate_graph.py), as HF reuses its static cache; a call that returns its
  cache gets a new one and leaves it to the caller;
- block size 64 on CUDA (FlashMLA's page), 16 elsewhere; the activations' dtype (the input
  embedding's) and device; the 16-bit cache unless convert(cache_options=...) asks
  otherwise (e.g. dict(kv_cache_dtype="fp8", k_scale=...)).

Everything else is HF's: a cache the user passes (cache= or past_key_values=) is used as
is, use_cache=False builds none, and generation_config.cache_implementation builds HF's
cache of that kind (the converted layers then run HF's attention). Strategies the paged
cache cannot serve (beam search and the other modes that reorder or crop the cache) raise
a ValueError naming what to do instead of running wrong.

Decode steps: generate() builds a 4D attention mask before each forward for a compileable
cache; on a PagedMLACache a decode step's is not built (the converted attention reads no
mask for one token per row), so generate()'s decode forward, compiled through
compile_config or HF's auto-compile, is the step DecodeGraph compiles (same inputs, same
graph), and an eager step launches none of the mask's kernels.

Eager calls: the class's forward launches the converted ops' Triton kernels directly,
without torch's per-launch higher-order-op dispatch (mla_ops/hf/eager.py); compiled calls
trace HF's forward as before. With convert(generate_graph=True) (the default), generate()'s
eager decode steps on a CUDA PagedMLACache replay a CUDA graph of the eager step, captured
at the call's first decode step and kept with the cache where the cache is kept (the
user's, or a default one kept as above) (mla_ops/hf/generate_graph.py); a call without compile_config then runs that graph
rather than HF's automatic compile of the decode step, and a call with one the graph of
the compiled step, DecodeGraph's (auto_compile below).
"""
from __future__ import annotations

import functools
import inspect

from mla_ops.hf.cache import PagedMLACache
from mla_ops.hf.eager import direct_launch_forward
from mla_ops.hf.generate_graph import attach, attached, detach
from mla_ops.layer import MLAAttention

__all__ = ["generation_class", "check_cache_options", "cache_kwargs", "HOOK"]

HOOK = "_prepare_cache_for_generation"
MASK_HOOK = "create_masks_for_generate"
AUTO_COMPILE_HOOK = "_valid_auto_compile_criteria"
HOOK_PARAMS = ("generation_config", "model_kwargs", "generation_mode", "batch_size",
               "max_cache_length")
SERVED_MODES = ("greedy_search", "sample")
BLOCK_SIZE = {"cuda": 64}          # FlashMLA's page; other devices: DEFAULT_BLOCK_SIZE
DEFAULT_BLOCK_SIZE = 16
CACHE_OPTIONS = ("kv_cache_dtype", "k_scale", "block_size", "num_blocks", "schedule_per_step")
POOL_KEY = "mla_default_key"       # a default cache's shape and options, for its reuse
CALL = "_mla_default_call"         # the default cache of the call under way, if it stays ours


def cache_kwargs(model, cache) -> dict:
    """{name: cache} for model(...) / model.generate(...): `cache` where the installed
    transformers takes it (>= 5.24; past_key_values is deprecated there), else
    past_key_values. model: an HF model or its class."""
    cls = model if isinstance(model, type) else type(model)
    params = inspect.signature(cls.forward).parameters
    return {"cache" if "cache" in params else "past_key_values": cache}


def check_cache_options(options) -> dict:
    """convert(cache_options=...): keyword arguments of the default PagedMLACache."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise TypeError(f"cache_options must be a dict of PagedMLACache arguments, got "
                        f"{type(options).__name__}")
    unknown = sorted(set(options) - set(CACHE_OPTIONS))
    if unknown:
        raise TypeError(f"cache_options: unknown {unknown}; PagedMLACache takes {list(CACHE_OPTIONS)}"
                        f" here (batch, length, dtype and device come from the generate() call)")
    return dict(options)


def unserved(generation_config, generation_mode) -> str | None:
    """Why the paged cache cannot serve this generate() call, or None."""
    mode = getattr(generation_mode, "value", generation_mode)
    if mode not in SERVED_MODES:
        return f"generation mode {mode!r}"
    if getattr(generation_config, "is_assistant", False):
        return "use as an assistant model (its cache must roll back)"
    return None


def refuse(why: str):
    raise ValueError(f"PagedMLACache (a converted model's cache) serves greedy search and "
                     f"sampling only, not {why}: pass use_cache=False, or "
                     f"cache=transformers.DynamicCache(config=model.config) to run HF's "
                     f"attention with HF's cache")


def default_cache(model, generation_config, batch_size: int, max_cache_length: int):
    """A PagedMLACache for this call (see the module docstring)."""
    rows = max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1,
               1) * batch_size
    length = max(max_cache_length, getattr(generation_config, "max_cache_len", None) or 0, 1)
    prev_rows, prev_len = getattr(model, "mla_default_cache_shape", (0, 0))
    rows, length = max(rows, prev_rows), max(length, prev_len)
    weight = model.get_input_embeddings().weight              # the activations' dtype, device
    options = dict(getattr(model, "mla_cache_options", {}))
    fp8_query = any(getattr(m, "q_scale", None) is not None for m in model.modules()
                    if isinstance(m, MLAAttention))
    if fp8_query and options.get("kv_cache_dtype") != "fp8":
        raise ValueError("convert(fp8_decode_query=...) needs an fp8 cache: convert with "
                         "cache_options=dict(kv_cache_dtype='fp8', k_scale=...) or pass "
                         "cache=PagedMLACache(..., kv_cache_dtype='fp8')")
    options.setdefault("block_size", BLOCK_SIZE.get(weight.device.type, DEFAULT_BLOCK_SIZE))
    heads = {m.num_heads for m in model.modules() if isinstance(m, MLAAttention)}
    if len(heads) == 1:                 # the layers' heads (one rank's, tensor parallel)
        options.setdefault("num_heads", heads.pop())
    key = (rows, length, weight.device, weight.dtype, repr(sorted(options.items())))
    kept, model.mla_default_cache = getattr(model, "mla_default_cache", None), None
    if kept is not None and getattr(kept, POOL_KEY, None) == key:
        kept.reset()                         # in place: its step graphs stay valid
        cache = kept
    else:
        cache = PagedMLACache(model.config, max_batch_size=rows, max_cache_len=length,
                              device=weight.device, dtype=weight.dtype, **options)
        setattr(cache, POOL_KEY, key)
    model.mla_default_cache_shape = (rows, length)
    return cache


def cache_key() -> str:
    """The name generate() keeps its cache under in model_kwargs: "cache" from transformers
    5.24, "past_key_values" before."""
    from transformers.generation import utils
    return "cache" if "cache" in getattr(utils, "ALL_CACHE_NAMES", ()) else "past_key_values"


def hook_serves(cls) -> bool:
    """Whether transformers still builds generate()'s cache through HOOK as we expect."""
    fn = getattr(cls, HOOK, None)
    if fn is None:
        return False
    params = tuple(inspect.signature(fn).parameters)[1:]
    return params == HOOK_PARAMS


GENERATION_CLASSES: dict = {}


def generation_class(cls):
    """cls (an HF model class with generate()) with the default cache hook; same name."""
    if getattr(cls, "mla_generation", False):
        return cls
    if cls not in GENERATION_CLASSES:
        GENERATION_CLASSES[cls] = build_class(cls)
    return GENERATION_CLASSES[cls]


def build_class(cls):
    eager = {"forward": direct_launch_forward(cls)} if hasattr(cls, "forward") else {}
    if not hook_serves(cls):
        return type(cls.__name__, (cls,), {"generate": _guarded_generate(cls),
                                          "mla_generation": True, "__module__": __name__,
                                          "__qualname__": cls.__qualname__, **eager})
    hf_prepare, key = getattr(cls, HOOK), cache_key()

    def prepare_cache(self, generation_config, model_kwargs, generation_mode, batch_size,
                      max_cache_length):
        user = model_kwargs.get(key)
        if isinstance(user, PagedMLACache):
            why = unserved(generation_config, generation_mode)
            if why:
                refuse(why)
        if (user is not None or generation_config.use_cache is False
                or generation_config.cache_implementation is not None):
            out = hf_prepare(self, generation_config, model_kwargs, generation_mode,
                             batch_size, max_cache_length)
        else:
            why = unserved(generation_config, generation_mode)
            if why:
                refuse(why)
            model_kwargs[key] = default_cache(self, generation_config, batch_size,
                                              max_cache_length)
            if not generation_config.return_dict_in_generate:     # never handed out
                self.__dict__[CALL] = model_kwargs[key]
            out = None
        attach(self, model_kwargs.get(key), kept=user is not None or CALL in self.__dict__)
        return out

    prepare_cache.__doc__ = "A PagedMLACache as generate()'s default cache (mla_ops/hf/generate.py)."
    hf_generate = cls.generate

    @functools.wraps(hf_generate)
    def generate(self, *args, **kwargs):
        self.__dict__.pop(CALL, None)
        try:
            return hf_generate(self, *args, **kwargs)
        finally:
            detach(self)              # this call's decode-step graphs go with it
            kept = self.__dict__.pop(CALL, None)
            if kept is not None:      # a default cache the caller never saw: the next call's
                self.mla_default_cache = kept

    return type(cls.__name__, (cls,), {HOOK: prepare_cache, "mla_generation": True,
                                      "generate": generate,
                                      MASK_HOOK: decode_masks(cls), **eager,
                                      **auto_compile(cls),
                                      "__module__": __name__, "__qualname__": cls.__qualname__})


def auto_compile(cls) -> dict:
    """{AUTO_COMPILE_HOOK: ...}: HF compiles generate()'s decode step by itself for a
    compileable cache on CUDA (mode "reduce-overhead"; seconds of compiling at the first
    call and at every new shape). Where generate() attached its step graphs to the cache
    (convert(generate_graph=True), mla_ops/hf/generate_graph.py), HF compiles nothing:
    a call that names no compile_config replays the eager step's CUDA graph (the same speed
    or better without the compile; BENCHMARKS.md, "generate() end to end"), and one whose
    compile_config HF would honour gets the graph of the compiled step (DecodeGraph's)."""
    if getattr(cls, AUTO_COMPILE_HOOK, None) is None:
        return {}

    def _valid_auto_compile_criteria(self, model_kwargs, generation_config):
        cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
        graphs = attached({"cache": cache})
        if graphs is None:
            return getattr(cls, AUTO_COMPILE_HOOK)(self, model_kwargs, generation_config)
        config = generation_config.compile_config
        if config is not None and getattr(cls, AUTO_COMPILE_HOOK)(self, model_kwargs,
                                                                  generation_config):
            graphs.compile_with(config)
        return False

    return {AUTO_COMPILE_HOOK: _valid_auto_compile_criteria}


def decode_masks(cls):
    """The model's create_masks_for_generate, which generate() calls before each forward
    when the cache is compileable: for a decode step (one token per row) on a
    PagedMLACache it builds nothing. The converted attention reads no mask there (every
    row's one token is real), so the step is the forward DecodeGraph compiles, inputs
    included, and an eager step skips HF's mask kernels."""
    own = getattr(cls, MASK_HOOK, None)

    def create_masks_for_generate(self, *args, **kwargs):
        embeds = kwargs.get("inputs_embeds")
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if isinstance(cache, PagedMLACache) and embeds is not None and embeds.shape[1] == 1:
            return None
        if own is not None:
            return own(self, *args, **kwargs)
        from transformers.masking_utils import create_masks_for_generate as hf_masks
        return hf_masks(*args, **kwargs)

    return create_masks_for_generate


def _guarded_generate(cls):
    """generate() for a transformers whose cache hook we do not recognise: a call that
    would get HF's default cache raises instead of silently running HF's attention."""
    hf_generate = cls.generate

    def generate(self, *args, **kwargs):
        given = kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None
        if not given and kwargs.get("use_cache", True) is not False:
            raise RuntimeError(
                f"this transformers version no longer builds generate()'s cache through "
                f"{HOOK}{HOOK_PARAMS}, so a converted model cannot supply its PagedMLACache "
                f"by default: pass cache=mla_ops.hf.PagedMLACache(model.config, "
                f"max_batch_size=..., max_cache_len=...) (or use_cache=False)")
        return hf_generate(self, *args, **kwargs)

    generate.__doc__ = hf_generate.__doc__
    return generate
