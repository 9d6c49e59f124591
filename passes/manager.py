"""The pass manager: one CustomGraphPass that runs the MLA fusion passes after grad.

Where it runs, and why
----------------------
Post-grad (`post_grad_custom_post_pass`), not pre-grad:
  * the graph is functional ATen IR: mutating custom ops appear as
    auto_functionalized nodes whose mutated buffers are explicit inputs/outputs, so
    swapping the attention output buffer for an fp8 one is a pure data-flow rewrite;
    pre-grad graphs still hold the in-place call and the `torch.cat` / `Tensor.new_empty`
    spellings the user wrote, which vary from model to model;
  * it runs before Inductor's reinplacing and auto_functionalized decomposition, so the
    buffers our replacements allocate are still written in place by the op;
  * the FX graph cache keys post-grad custom passes by `uuid()`, so compiled artefacts
    stay correct and reusable (pre-grad custom passes bypass part of that machinery).

auto_functionalized v2, not v1: v2 is Inductor's default (and on torch 2.11 too), it
avoids v1's defensive clones of every mutated argument, and it keeps views of a base
explicit. A pattern written for one form matches 0 times under the other, so the
manager pins the form per compile (`enable_auto_functionalized_v2` in the compile's
options) and builds its patterns for the form in use (both forms are supported and
tested).

uuid: sha256 of the sources of the pass modules plus the pattern parameters (the
QuantKeys, which passes are on, the HOP form). A second identical compile hits the FX
graph cache; a change to any of those misses it.

Pattern variants are registered lazily, once per (HOP form, kv_cache_dtype, backend,
decode-query kind) found in a graph: those strings are literal arguments of the op, and
the graph itself is already part of the cache key.
"""
from __future__ import annotations

import hashlib
import inspect
from collections import Counter

import torch
from torch._higher_order_ops.auto_functionalize import auto_functionalized, auto_functionalized_v2
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.pattern_matcher import PatternMatcherPass
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

from mla_ops import quant_ops

from passes import pass_a, pass_b, quant
from passes.quant import QUANT_KEYS

ATTN = torch.ops.mla.attention_with_output.default
CACHE = torch.ops.mla.kv_cache_update.default
HOPS = (auto_functionalized, auto_functionalized_v2)


def hop_target(node):
    """The OpOverload a (possibly auto-functionalized) call node runs, else node.target."""
    if node.op == "call_function" and node.target in HOPS:
        return node.args[0]
    return node.target


def attention_nodes(graph):
    return [n for n in graph.nodes if n.op == "call_function" and hop_target(n) == ATTN]


def count_ops(graph) -> Counter:
    """Op name -> count; auto-functionalized calls count as the op they run."""
    c = Counter()
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        t = hop_target(n)
        if isinstance(t, torch._ops.OpOverload):
            c[f"{t.namespace}::{t._opname}"] += 1
        elif isinstance(t, torch._ops.OpOverloadPacket):
            c[f"{t._qualified_op_name}"] += 1
    return c


class KVCacheDependencyError(RuntimeError):
    """An attention call no longer depends on its layer's cache write."""


def _dep_sources(graph) -> list:
    """For each attention call: the node its kv_cache_dep comes from (through a getitem)."""
    out = []
    for n in attention_nodes(graph):
        dep = n.kwargs.get("kv_cache_dep", n.args[14] if len(n.args) > 14 else None)
        src = dep.args[0] if dep is not None and dep.op == "call_function" and \
            dep.target.__name__ == "getitem" else dep
        out.append((n, dep, src))
    return out


def input_dependencies(graph) -> int:
    """Attention calls whose kv_cache_dep is a graph input: the cache write ran before this
    graph (outside the compiled region, or before a graph break), so order is kept."""
    return sum(1 for _, _, src in _dep_sources(graph) if src is not None and src.op == "placeholder")


def verify_kv_cache_dependency(graph, max_input_deps: int = 0) -> None:
    """Each attention's kv_cache_dep must come from an mla::kv_cache_update call in the
    graph, or be one of at most max_input_deps graph inputs (as many as before a rewrite)."""
    inputs = 0
    for n, dep, src in _dep_sources(graph):
        if src is not None and src.op == "placeholder":
            inputs += 1
            if inputs <= max_input_deps:
                continue
        if src is None or hop_target(src) != CACHE:
            raise KVCacheDependencyError(
                f"{n.name}: kv_cache_dep is {dep}, not the result of mla::kv_cache_update; "
                f"the cache write could be dropped or moved after the read")


def _sources_hash(params: str) -> str:
    h = hashlib.sha256()
    for mod in (pass_a, pass_b, quant, quant_ops, inspect.getmodule(_sources_hash)):
        h.update(inspect.getsource(mod).encode())
    h.update(params.encode())
    return h.hexdigest()


class MLAFusionPass(CustomGraphPass):
    """Runs Pass A (decode query cat + fp8 quant) and Pass B (attention output quant)."""

    def __init__(self, *, pass_a_on: bool = True, pass_b_on: bool = True,
                 quant_keys=QUANT_KEYS, v2: bool = True):
        self.pass_a_on, self.pass_b_on, self.v2 = pass_a_on, pass_b_on, v2
        self.quant_keys = tuple(quant_keys)
        self._passes: dict = {}          # variant -> PatternMatcherPass
        self.records: list = []          # one dict per candidate the pass examined
        self.ops_before: Counter = Counter()
        self.ops_after: Counter = Counter()
        self.graph_before = self.graph_after = ""

    # ---- cache key
    def params(self) -> str:
        return repr((self.pass_a_on, self.pass_b_on, self.v2,
                     [(str(k), k.group_size, k.pow2, k.static, str(k.dtype)) for k in self.quant_keys]))

    def uuid(self) -> str:
        return _sources_hash(self.params())

    # ---- bookkeeping used by the extra checks
    def _record(self, pass_name, pattern, attn_node, reason, quant=None):
        self._pending.append(dict(pass_=pass_name, pattern=pattern, node=attn_node, reason=reason,
                                  quant=quant))

    def _variant_pass(self, kind: str, key: tuple) -> PatternMatcherPass:
        if (kind, key) not in self._passes:
            p = PatternMatcherPass(pass_name=f"mla_fusion_{kind}")
            # Trace patterns on fake tensors: the ops' fake kernels run, not their checks.
            with unset_fake_temporarily(), FakeTensorMode():
                self._register(kind, key, p)
            self._passes[(kind, key)] = p
        return self._passes[(kind, key)]

    def _register(self, kind, key, p):
            if kind == "B":
                v2, kvd, backend, dq, sched = key
                strings = dict(kv_cache_dtype=kvd, backend=backend,
                               extra=pass_b.optional_extra(dq, sched))
                for qk in self.quant_keys:
                    pass_b.register(p, qk, v2, strings, self._record, decode_q=dq)
            else:
                pass_a.register(p, self._record)

    def __call__(self, graph: torch.fx.Graph) -> None:
        self._pending = []
        self.graph_before = str(graph)
        self.ops_before = count_ops(graph)
        input_deps = input_dependencies(graph)
        layers = {n: i for i, n in enumerate(attention_nodes(graph))}
        v2_in_graph = any(n.target is auto_functionalized_v2 for n in graph.nodes)
        v1_in_graph = any(n.target is auto_functionalized for n in graph.nodes)
        if self.v2 and v1_in_graph or not self.v2 and v2_in_graph:
            raise RuntimeError("graph uses the other auto_functionalized form than this pass "
                               "was built for; compile through passes.compile_with_passes")
        if self.pass_a_on:
            quants_before = [n for n in graph.nodes if n.target is pass_a.QSTATIC]
            self._variant_pass("A", ()).apply(graph)
            touched = {r["quant"] for r in self._pending if r.get("quant") is not None}
            for qn, reason in pass_a.explain_candidates(graph, touched):
                if qn in quants_before:
                    self._record("A", "cat_quant_fp8_static",
                                 pass_a.consumer_attention(qn) or qn, reason)
        if self.pass_b_on:
            keys = {pass_b.variant_key(n, self.v2) for n in attention_nodes(graph)}
            for key in sorted(keys, key=repr):
                self._variant_pass("B", key).apply(graph)
        if self.pass_b_on:
            seen = {r["node"] for r in self._pending if r["pass_"] == "B"}
            for n in attention_nodes(graph):
                if n not in seen and n in layers:
                    pattern, reason = pass_b.explain(n)
                    self._record("B", pattern, n, reason)
        graph.eliminate_dead_code()
        verify_kv_cache_dependency(graph, max_input_deps=input_deps)
        self.ops_after = count_ops(graph)
        self.graph_after = str(graph)
        self._finish_records(graph, layers)

    def _finish_records(self, graph, layers):
        """Turn pending candidate records into per-layer results."""
        for r in self._pending:
            node = r.pop("node")
            r.pop("quant", None)
            layer = layers.get(node)              # None: not feeding an attention call
            self.records.append(dict(r, layer=layer, matched=not r["reason"]))

    def match_counts(self, pass_name: str) -> Counter:
        """pattern -> number of fused candidates for one pass."""
        return Counter(r["pattern"] for r in self.records if r["pass_"] == pass_name and r["matched"])
