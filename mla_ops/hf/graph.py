"""A converted HF model's decode step, compiled and captured once in a CUDA graph.

    runner = mla_ops.hf.DecodeGraph(model, cache, batch_size=B)   # after the prefill
    logits = runner(next_ids)                 # [B, 1, vocab]: one decode step
    tokens = runner.greedy(next_ids, 32)      # [B, 32]: 32 greedy steps, no host syncs

torch.compile(mode="reduce-overhead") replays CUDA graphs through cudagraph trees, which
still evaluate dynamo's guards and the tree's bookkeeping on every call: a few hundred
microseconds of host time per step, during which a small model's GPU idles. Here the
compiled step (Inductor, no cudagraph trees) is captured once in one torch.cuda.CUDAGraph
and each call is one replay. The step is replayable because PagedMLACache keeps all its
bookkeeping on the device: every replay writes the new tokens after each row's stored
tokens, takes blocks from the bump allocator and advances the lengths.

Positions. Row b's new token gets position = the real (non-pad) tokens row b holds,
which is what generate() computes from the attention mask; the graph reads it from the
cache, so callers pass token ids only.

Room. Capturing runs `warmup` real steps (then undone), so it needs room for them.
The graph cannot raise, so the runner counts: when it reads the cache (at the first
call, and again after any eager call, reset() or occupy() on the cache) it works out how
many more steps fit (max_cache_len and free blocks) and raises CacheFullError before a
step that would not fit. A compiled call on the same cache made outside the runner is
not seen: call runner.sync() after one. Were the count ever stale, the device side still
drops tokens that have no room (never writing outside a row's own blocks).

Without CUDA (or with graph=False) the runner calls the compiled step directly.

A step that cannot be captured raises a RuntimeError. Where the cause is a host read of a
device value (HF code that reads expert counts, `.item()`, `.tolist()`), the error names
the line: after the failed capture the step runs once more eagerly under torch's sync
debug mode, which raises at the first such read (host_read_site; the cache is restored).
"""
from __future__ import annotations

import contextlib
import gc
import os
import traceback

import torch

from mla_ops.cache import CacheFullError
from mla_ops.hf.convert import is_converted
from mla_ops.hf.cache import PagedMLACache
from mla_ops.hf.generate import cache_kwargs
from mla_ops.hf.step import decode_room


@contextlib.contextmanager
def capturing(graph: torch.cuda.CUDAGraph, pool=None):
    """torch.cuda.graph(graph, pool=pool) with Python's cyclic garbage collector paused. A
    collection inside the capture runs destructors at an arbitrary point of the step, and
    one that makes a CUDA call not allowed while a stream captures invalidates the capture
    (noticed only at a later launch). Objects it would have freed are freed after it."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool):
            yield
    finally:
        if enabled:
            gc.enable()


TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def host_read_site(step) -> str | None:
    """Where step() first reads a device value on the host ("file:line in function", the
    innermost frame outside torch), found by running it once under torch's sync debug
    mode; None if it runs through without such a read. CUDA only; step's effects stay."""
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    except RuntimeError as exc:
        if "synchronizing" not in str(exc):
            return None
        frames = [f for f in traceback.extract_tb(exc.__traceback__)
                  if not f.filename.startswith(TORCH_DIR)]
        if not frames:
            return None
        f = frames[-1]
        where = os.sep.join(f.filename.split(os.sep)[-3:])   # enough to find the file
        return f"{where}:{f.lineno} in {f.name}: {f.line}"
    finally:
        torch.cuda.set_sync_debug_mode(mode)
    return None


class DecodeGraph:
    """One-token-per-row decode steps of a converted model on a PagedMLACache."""

    def __init__(self, model, cache: PagedMLACache, batch_size: int | None = None, *,
                 compile: bool = True, backend: str = "inductor", mode: str | None = None,
                 options: dict | None = None, graph: bool | None = None, warmup: int = 2):
        if not isinstance(model, torch.nn.Module) or not is_converted(model):
            raise TypeError("DecodeGraph needs a model converted with mla_ops.hf.convert(model)")
        if not isinstance(cache, PagedMLACache):
            raise TypeError(f"cache must be a mla_ops.hf.PagedMLACache, got {type(cache).__name__}")
        B = cache.max_batch_size if batch_size is None else batch_size
        if not isinstance(B, int) or isinstance(B, bool) or not 1 <= B <= cache.max_batch_size:
            raise ValueError(f"batch_size must be an int in [1, max_batch_size="
                             f"{cache.max_batch_size}], got {batch_size!r}")
        if mode in ("reduce-overhead", "max-autotune"):
            raise ValueError(f"mode={mode!r} makes torch.compile capture CUDA graphs itself; "
                             f"DecodeGraph captures the step: use None, 'default' or "
                             f"'max-autotune-no-cudagraphs'")
        if options is not None and (not isinstance(options, dict) or mode is not None
                                    or options.get("triton.cudagraphs")):
            raise ValueError(f"options must be a dict of backend options without "
                             f"'triton.cudagraphs' (DecodeGraph captures the step), given "
                             f"with mode=None (torch.compile takes one of the two); got "
                             f"options={options!r}, mode={mode!r}")
        if warmup < 1:
            raise ValueError(f"warmup must be >= 1, got {warmup}")
        self.model, self.cache, self.batch_size = model, cache, B
        self.device = cache.device
        self.graph_enabled = (self.device.type == "cuda") if graph is None else bool(graph)
        if self.graph_enabled and self.device.type != "cuda":
            raise ValueError(f"graph=True needs a CUDA cache, this one is on {self.device}")
        dev = self.device
        self.input_ids = torch.zeros(B, 1, dtype=torch.long, device=dev)      # [B, 1] graph input
        # one compiled function for the whole step: positions, forward and argmax
        self._fwd = (torch.compile(self._forward, fullgraph=True, dynamic=False,
                                   backend=backend, mode=mode, options=options)
                     if compile else self._forward)
        self.logits = self.next_tokens = None
        self._graph = None
        self._steps_left = None          # steps that fit, counted from the last sync()
        self._seen_version = None
        if self.graph_enabled:
            self._capture(warmup)

    # -- the step ----------------------------------------------------------------------
    def _forward(self, input_ids):
        c = self.cache
        pos = c.lens[:self.batch_size, None].long()           # [B, 1] each row's next position
        logits = self.model.forward(input_ids=input_ids, position_ids=pos, use_cache=True,
                                    logits_to_keep=1, **cache_kwargs(self.model, c)).logits
        tokens = logits[:, -1].argmax(-1)                      # [B]
        # the greedy next input, written by the step itself (every call sets its input
        # first, so only greedy() relies on it: one copy kernel per step fewer)
        input_ids.copy_(tokens[:, None])
        return logits, tokens                                  # [B, 1, V], [B]

    def _step(self):
        with torch.no_grad():
            return self._fwd(self.input_ids)

    def _capture(self, warmup: int) -> None:
        """Warm up (compile) on a side stream, capture one step, undo the warm-up steps."""
        c = self.cache
        if self.sync() < warmup:
            raise CacheFullError(f"capturing runs warmup={warmup} real steps first (undone "
                                 f"afterwards), but the cache has room for {self._steps_left}; "
                                 f"build PagedMLACache larger, or warmup=1 / graph=False")
        saved = c.snapshot()
        s = torch.cuda.Stream(self.device)
        s.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(s):
            for _ in range(warmup):
                self._step()
        torch.cuda.current_stream(self.device).wait_stream(s)
        g = torch.cuda.CUDAGraph()
        try:
            with capturing(g):
                self.logits, self.next_tokens = self._step()
        except RuntimeError as exc:
            c.restore(saved)
            site = self._host_read(warmup)
            c.restore(saved)
            why = (f"the step reads a device value on the host at {site}" if site else
                   "some layer of the model copies between host and device inside its "
                   "forward, e.g. a MoE router reading token counts on the host")
            raise RuntimeError(
                f"the decode step cannot be captured in a CUDA graph: {why} ({exc})\n(use "
                f"DecodeGraph(..., graph=False) or compile with mode='reduce-overhead', "
                f"which skips such graphs)") from exc
        c.restore(saved)        # warm-up tokens were written past the lengths: unseen
        self._graph = g

    def _host_read(self, warmup: int) -> str | None:
        """host_read_site of the step after `warmup` plain steps (as the capture saw it);
        the caller restores the cache."""
        try:
            for _ in range(warmup):
                self._step()
            return host_read_site(self._step)
        except Exception:            # the diagnosis must not hide the capture's own error
            return None

    # -- room --------------------------------------------------------------------------
    def sync(self) -> int:
        """Re-read the cache state (one host sync); return how many steps still fit."""
        lo = decode_room(self.cache, self.batch_size)
        self._steps_left = lo
        self._seen_version = self.cache.version
        return lo

    @property
    def steps_left(self) -> int:
        if self._steps_left is None or self._seen_version != self.cache.version:
            self.sync()
        return self._steps_left

    # -- calls -------------------------------------------------------------------------
    def _set_ids(self, input_ids) -> None:
        B = self.batch_size
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"input_ids must be a torch.Tensor, got {type(input_ids).__name__}")
        if input_ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"input_ids must be int64 or int32 token ids, got {input_ids.dtype}")
        if tuple(input_ids.shape) not in ((B,), (B, 1)):
            raise ValueError(f"input_ids must be [B={B}] or [B, 1] (one token per row), got "
                             f"{tuple(input_ids.shape)}")
        self.input_ids.copy_(input_ids.reshape(B, 1))

    def _take(self, n: int) -> None:
        left = self.steps_left
        if n > left:
            raise CacheFullError(f"{n} more decode step(s) do not fit: the cache has room for "
                                 f"{left} (max_cache_len={self.cache.max_cache_len}, "
                                 f"{self.cache.num_blocks} blocks); build PagedMLACache larger "
                                 f"or call cache.reset()")
        self._steps_left -= n

    def _run(self) -> None:
        self.cache.forget_room()             # the step changes the state unseen by the host
        if self._graph is not None:
            self._graph.replay()
        else:
            self.logits, self.next_tokens = self._step()

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        """One decode step: input_ids [B] or [B, 1] -> logits [B, 1, vocab].

        With a CUDA graph the logits live in the graph's output buffer, overwritten by
        the next call: clone them to keep them.
        """
        self._set_ids(input_ids)
        self._take(1)
        self._run()
        return self.logits

    def greedy(self, input_ids: torch.Tensor, steps: int) -> torch.Tensor:
        """steps greedy decode steps from input_ids [B] / [B, 1] -> new tokens [B, steps].

        Each step's argmax feeds the next on the device: no host syncs in the loop.
        """
        if not isinstance(steps, int) or steps < 0:
            raise ValueError(f"steps must be a non-negative int, got {steps!r}")
        self._set_ids(input_ids)
        self._take(steps)
        out = torch.empty(self.batch_size, steps, dtype=torch.long, device=self.device)
        for i in range(steps):
            self._run()
            out[:, i] = self.next_tokens      # the step already fed them to input_ids
        return out
