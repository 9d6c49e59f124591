"""The decode routes: one table for lowering.mla_decode (a bf16/fp16/fp32 query) and
lowering.mla_decode_fp8q (an fp8 query over an fp8 cache).

A route is a kernel family serving one kind of query, with
    priority  the order backend="auto" tries the routes of a query kind (lower first),
    unmet     unmet(call, auto) -> None if the route serves this DecodeCall, else a
              sentence naming the unmet condition (shown in BackendUnavailable); auto:
              asked by backend="auto" (which passes over the interpreter on CPU, and over
              flashmla and gluon in the batch-invariant mode: the Triton kernels give it),
    run       run(call) -> (out [B, s_q, H, head_dim_v], lse [B, H, s_q] fp32),
    bounds_in_kernel  its kernels bound lengths and block ids themselves; the others get
              their block_table / cache_seqlens clamped before the launch (unless the
              caller bounded them: call.bounded).
backend_choices counts eager calls under the route's name ("flashmla", "gluon-fp8q", ...).

Backend modules are imported when a route first runs or is asked, so `import lowering`
needs neither triton nor flash_mla.
"""
from __future__ import annotations

import functools
import importlib.util
import os
from typing import Callable, NamedTuple, Optional

import torch

from lowering import config


class BackendUnavailable(RuntimeError):
    """The requested decode backend cannot serve this call (the message says why)."""


class DecodeCall(NamedTuple):
    """One decode call, arguments checked and resolved (see lowering.checks)."""
    q: torch.Tensor                 # [B, s_q, H, L + R]
    kv_cache: torch.Tensor          # [num_blocks, block_size, L + R]
    block_table: torch.Tensor       # [B, max_blocks] int32
    cache_seqlens: torch.Tensor     # [B] int32
    softmax_scale: float
    causal: bool
    kind: str                       # cache storage: "auto" (q's dtype) | "fp8"
    k_scale: Optional[torch.Tensor]  # [1] fp32 with an fp8 cache
    head_dim_v: int                 # L
    q_scale: Optional[torch.Tensor] = None      # [1] fp32: an fp8 query
    out_dtype: Optional[torch.dtype] = None     # an fp8 query's output dtype
    schedule: Optional[tuple] = None            # decode_schedule() of these lengths
    bounded: bool = False           # block_table / cache_seqlens already bounded


class Route(NamedTuple):
    name: str                       # counted in backend_choices
    backend: str                    # the backend= argument that asks for it
    query: str                      # "bf16" (mla_decode) | "fp8q" (mla_decode_fp8q)
    priority: int
    unmet: Callable                 # (call, auto: bool) -> str | None
    run: Callable                   # (call) -> (out, lse)
    bounds_in_kernel: bool


# Looked up once: torch.compile refuses to trace importlib's find_spec, and the route
# choice runs inside compiled code.
HAVE_TRITON = importlib.util.find_spec("triton") is not None


@functools.lru_cache(maxsize=None)
def device_capability(device: torch.device) -> tuple:
    """torch.cuda.get_device_capability, asked once per device."""
    return torch.cuda.get_device_capability(device)


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device, asked once per device."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def _capability(device) -> tuple:
    # Under torch.compile the answer is traced as before (an lru_cache is not traced).
    if torch.compiler.is_compiling():
        return torch.cuda.get_device_capability(device)
    return device_capability(device)


def hopper_unmet(q, what: str) -> Optional[str]:
    """None if q is on an SM90 GPU, else why `what` cannot run."""
    if q.device.type != "cuda":
        return f"q is on {q.device.type}; {what} needs a CUDA device"
    cap = _capability(q.device)
    if cap != (9, 0):
        return f"{what} needs an SM90 GPU, this one is SM{cap[0]}{cap[1]}"
    return None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _triton_unmet(call, auto, least):
    q = call.q
    if not HAVE_TRITON:
        return "the triton package is not installed"
    if q.device.type != "cuda":
        if not _interpreting():
            return f"q is on {q.device.type}; the triton backend needs CUDA (or TRITON_INTERPRET=1)"
        if auto and call.q_scale is None:
            return "backend='auto' uses triton only on CUDA (the CPU interpreter is for tests)"
    L, R = call.head_dim_v, q.shape[-1] - call.head_dim_v
    for name, v in (("head_dim_v (L)", L), ("rope width D - head_dim_v (R)", R)):
        if v < least or v & (v - 1):
            return f"the triton backend needs {name} to be a power of two >= {least}, got {v}"
    return None


def _bf16_triton_unmet(call, auto):
    if call.q.dtype not in (torch.bfloat16, torch.float16):
        return f"the triton backend needs q in bfloat16 or float16, got {call.q.dtype}"
    return _triton_unmet(call, auto, 16)


def _fp8q_triton_unmet(call, auto):
    return _triton_unmet(call, auto, 32)      # fp8 dots need a reduction width >= 32


def _batch_invariant_unmet(auto):
    if auto and config.batch_invariant:
        return "the batch-invariant mode is on (the Triton kernels provide it)"
    return None


# Backend modules are imported inside these functions (import statements, which
# torch.compile traces; importlib calls it refuses).

def _hopper_route_unmet(call, auto, what, backend_check):
    """A Hopper route's answer: the GPU, then the backend's own check (backend_check()
    imports it), then the batch-invariant rule."""
    reason = hopper_unmet(call.q, what)
    if reason is None:
        reason = backend_check()(call) or _batch_invariant_unmet(auto)
    return reason


def _flashmla_check():
    from lowering.decode.flashmla import flashmla_unmet
    return flashmla_unmet


def _flashmla_fp8q_check():
    from lowering.decode.flashmla import flashmla_fp8q_unmet
    return flashmla_fp8q_unmet


def _gluon_check():
    from lowering.decode.gluon_serves import gluon_unmet
    return gluon_unmet


def _gluon_fp8q_check():
    from lowering.decode.gluon_serves import gluon_fp8q_unmet
    return gluon_fp8q_unmet


# Below 64 heads FlashMLA's tile still holds 64 query rows, and its scheduler and combine
# kernels cost 10-25 µs a step. Where the Gluon few-rows kernel cannot serve (_few_rows_gluon),
# at 16 heads on an H200 (BENCHMARKS.md, "16-head decode")
# the Triton kernel was as fast or faster up to this many cached positions a call
# (batch x block-table width: 15.6 vs 23.2 µs at 1 x 4096, 18.4 vs 18.3 at 8 x 2048,
# FlashMLA's schedule not counted), and slower past it (25.6 vs 22.3 at 32 x 1024).
SMALL_DECODE_POSITIONS = 16384


# From 64 heads the Gluon pair kernel (its own split count) beat FlashMLA's kernels, its
# schedule computed outside the call, at up to this many requests on an H200 (µs, 128
# heads: 1 x 4096 19.2 vs 20.8, 4 x 4096 26.3 vs 27.5, 1 x 32768 39.7 vs 46.8, 2 x 16384
# 38.6 vs 49.5, 4 x 8192 35.5 vs 37.9), and lost from 8 (8 x 4096 35.4 vs 34.0, 16 x 4096
# 52.0 vs 43.5); BENCHMARKS.md, "128 heads at a few requests".
FEW_REQUESTS = 4


def flashmla_pays(num_heads: int, batch: int, max_len: int,
                  dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether backend="auto" gives a decode call of these shapes and query dtype to
    FlashMLA (where FlashMLA serves it): from 64 heads past FEW_REQUESTS requests (always
    for fp16, which the Gluon pair kernel does not take), below only past
    SMALL_DECODE_POSITIONS positions (batch x max_len, max_len = block-table width x
    block size)."""
    if num_heads >= 64:
        return dtype != torch.bfloat16 or batch > FEW_REQUESTS
    return batch * max_len > SMALL_DECODE_POSITIONS


def _pays(call) -> Optional[bool]:
    """flashmla_pays of a call's heads, batch, table width and query dtype (None: no
    block table)."""
    if call.block_table is None:
        return None
    return flashmla_pays(call.q.shape[2], call.q.shape[0],
                         call.block_table.shape[1] * call.kv_cache.shape[1], call.q.dtype)


def _few_rows_gluon(call, auto) -> bool:
    """Whether "auto" gives this bf16 call to the Gluon few-rows kernel before FlashMLA:
    up to gluon_decode.ROWS_MAX query rows (s_q x heads), where it read the cache faster
    than FlashMLA's 64-row tiles at 16 heads on an H200 at every batch measured
    (BENCHMARKS.md, "16-head decode in Gluon")."""
    if not auto or call.kind != "auto" or _gluon_unmet(call, auto) is not None:
        return False
    from lowering.decode.gluon_decode import ROWS_MAX
    return call.q.shape[1] * call.q.shape[2] <= ROWS_MAX


def _flashmla_unmet(call, auto):
    reason = _hopper_route_unmet(call, auto, "FlashMLA's dense decode", _flashmla_check)
    if reason is None and _few_rows_gluon(call, auto):
        return ("at up to 32 query rows (s_q x heads) the gluon few-rows kernel is faster "
                "(lowering.decode.registry._few_rows_gluon)")
    pays = _pays(call) if reason is None and auto else None
    if pays is not None and not pays:          # (a traced SymBool is not `False`)
        B, H = call.q.shape[0], call.q.shape[2]
        if H >= 64:
            if _gluon_unmet(call, auto) is None:
                return (f"at {H} heads and {B} requests the gluon pair kernel is faster "
                        f"(lowering.decode.registry.flashmla_pays)")
            return None                        # FlashMLA, with its schedule in the call
        n = call.block_table.shape[1] * call.kv_cache.shape[1]
        return (f"at {H} heads and {B} x {n} cached positions the triton kernel is "
                f"faster (lowering.decode.registry.flashmla_pays)")
    return reason


def _gluon_unmet(call, auto):
    return _hopper_route_unmet(call, auto, "the gluon backend", _gluon_check)


def _gluon_fp8q_unmet(call, auto):
    return _hopper_route_unmet(call, auto, "the gluon fp8 kernel", _gluon_fp8q_check)


def _flashmla_fp8q_unmet(call, auto):
    reason = _hopper_route_unmet(call, auto, "FlashMLA's dense fp8 decode",
                                 _flashmla_fp8q_check)
    if reason is None and auto and call.schedule is None and _gluon_fp8q_unmet(call, auto) is None:
        # FlashMLA's scheduler inside the call costs 9-32 µs on an H200, which at one
        # request makes it slower than the Gluon kernel: with no schedule, gluon first.
        return "no decode_schedule given and the gluon route serves the call"
    return reason


def _reference_unmet(call, auto):
    return None


def _run_flashmla(call):
    from lowering.decode.flashmla import run_flashmla
    return run_flashmla(call)


def _run_gluon(call):
    from lowering.decode.gluon_decode import run_gluon
    return run_gluon(call)


def _run_triton(call):
    from lowering.decode.triton_decode import run_triton
    return run_triton(call)


def _run_reference(call):
    from lowering.decode.reference import run_reference
    return run_reference(call)


def _run_flashmla_fp8q(call):
    from lowering.decode.flashmla import run_flashmla_fp8q
    return run_flashmla_fp8q(call)


def _run_gluon_fp8q(call):
    from lowering.decode.gluon_decode import run_gluon_fp8q
    return run_gluon_fp8q(call)


def _run_triton_fp8q(call):
    from lowering.decode.triton_decode import run_triton_fp8q
    return run_triton_fp8q(call)


ROUTES = tuple(sorted((
    Route("flashmla", "flashmla", "bf16", 0, _flashmla_unmet,
          _run_flashmla, bounds_in_kernel=False),
    Route("gluon", "gluon", "bf16", 1, _gluon_unmet,
          _run_gluon, bounds_in_kernel=True),
    Route("triton", "triton", "bf16", 2, _bf16_triton_unmet,
          _run_triton, bounds_in_kernel=True),
    Route("reference", "reference", "bf16", 3, _reference_unmet,
          _run_reference, bounds_in_kernel=False),
    Route("flashmla-fp8q", "flashmla", "fp8q", 0, _flashmla_fp8q_unmet,
          _run_flashmla_fp8q, bounds_in_kernel=False),
    Route("gluon-fp8q", "gluon", "fp8q", 1, _gluon_fp8q_unmet,
          _run_gluon_fp8q, bounds_in_kernel=True),
    Route("triton-fp8q", "triton", "fp8q", 2, _fp8q_triton_unmet,
          _run_triton_fp8q, bounds_in_kernel=True),
), key=lambda r: (r.query, r.priority)))

# query kind -> backend name -> route, in priority order
TABLE = {query: {r.backend: r for r in ROUTES if r.query == query} for query in ("bf16", "fp8q")}
# The backend names of mla_decode, in the order backend="auto" tries them.
BACKENDS = tuple(TABLE["bf16"])
FP8Q_BACKENDS = tuple(TABLE["fp8q"])


def choose_route(call: DecodeCall, query: str, backend: str) -> Route:
    """The route serving `call` (query "bf16" | "fp8q"); an explicit backend that cannot
    serve it raises BackendUnavailable with the reason, as does "auto" when none can."""
    routes = TABLE[query]
    if backend != "auto":
        route = routes.get(backend)
        if route is None:
            names = [repr(n) for n in ("auto",) + tuple(routes)]
            raise ValueError(f"backend must be {', '.join(names[:-1])} or {names[-1]}, got "
                             f"{backend!r}")
        reason = route.unmet(call, False)
        if reason is not None:
            raise BackendUnavailable(f"backend {backend!r} cannot serve this call: {reason}")
        return route
    reasons = []
    for route in routes.values():
        reason = route.unmet(call, True)
        if reason is None:
            return route
        reasons.append(f"{route.backend}: {reason}")
    raise BackendUnavailable("no decode backend can serve this call; " + "; ".join(reasons))


# (query, backend, call class) -> route: the choice is a pure function of these in eager
# mode (devices, dtypes, widths, settings), so it is made once per class of call.
_chosen: dict = {}


def call_class(call: DecodeCall, query: str, backend: str) -> tuple:
    """What a route's unmet() reads of a call: devices, dtypes, query tokens, heads,
    widths, settings, and the answer of flashmla_pays for its batch and table width."""
    q, kv = call.q, call.kv_cache
    device = q.device
    return (query, backend, device, q.dtype, kv.dtype, call.kind, q.shape[1], q.shape[2],
            q.shape[3], kv.shape[1], call.head_dim_v, call.out_dtype, call.schedule is None,
            call.q_scale is None, config.batch_invariant,
            device.type == "cuda" or _interpreting(), _pays(call))


def route_for(call: DecodeCall, query: str, backend: str) -> Route:
    """choose_route, remembered per call class in eager mode (torch.compile traces the
    choice itself and keeps its answer in the graph)."""
    if torch.compiler.is_compiling():
        return choose_route(call, query, backend)
    key = call_class(call, query, backend)
    route = _chosen.get(key)
    if route is None:
        route = _chosen[key] = choose_route(call, query, backend)
    return route


def route_unmet(name: str, q, kv_cache, *, kind: str = "auto", head_dim_v=None,
                out_dtype=torch.bfloat16):
    """Why route `name` ("flashmla", "gluon-fp8q", ...) cannot serve an explicit call with
    this q and cache (only their devices, dtypes and shapes are read), or None: for tests
    and benchmarks that skip a route a machine lacks."""
    route = next((r for r in ROUTES if r.name == name), None)
    if route is None:
        raise ValueError(f"no decode route {name!r}; routes: {[r.name for r in ROUTES]}")
    head_dim_v = q.shape[-1] - 64 if head_dim_v is None else head_dim_v
    fp8q = route.query == "fp8q"
    call = DecodeCall(q, kv_cache, None, None, 1.0, True, "fp8" if fp8q else kind, None,
                      head_dim_v, out_dtype=out_dtype if fp8q else None)
    return route.unmet(call, False)
