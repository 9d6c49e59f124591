"""Programmatic dependent launch (lowering/pdl.py, mla_ops/hf/pdl_edges.py): the kernels
named as waiting really wait, the edges set on a captured graph keep every result, and
DecodeGraph(programmatic=True) decodes the tokens generate() does."""
import inspect

import pytest
import torch

import mla_ops.hf as H
from hf_models import build_pair, cache_kw, graph_and_generate_tokens, left_padded, tiny_config
from lowering.pdl import PDL_KERNELS, gdc_enabled, is_pdl_kernel

CUDA = torch.cuda.is_available()
HOPPER = CUDA and torch.cuda.get_device_capability()[0] >= 9


def _kernel(name):
    """The Triton kernel of that name, from the module its PDL_KERNELS comment names."""
    import importlib
    src = open(importlib.import_module("lowering.pdl").__file__).read()
    line = next(l for l in src.splitlines() if f'"{name}"' in l)
    path = line.split("# ")[1].split(":")[0]                     # lowering/.../x_kernel.py
    module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
    return getattr(module, name)


@pytest.mark.parametrize("name", sorted(PDL_KERNELS))
def test_named_kernels_wait_and_take_their_switch(name):
    kernel = _kernel(name)
    switch = "GDC" if "GDC" in kernel.arg_names else "PRE_K"
    assert switch in kernel.arg_names
    src = inspect.getsource(kernel.fn)
    assert "gdc_wait()" in src or "PRE_K" in src or "GDC)" in src   # or a helper it passes them to


def test_preload_spans_whole_tiles_within_the_range():
    from lowering.pdl import PRELOAD_ELEMS, preload_k
    for bn, bk, k_range, weights in [(64, 128, 512, 1), (64, 128, 1024, 1), (32, 256, 2048, 2),
                                     (64, 128, 100, 1), (16, 128, 4096, 1), (64, 64, 7168, 1)]:
        pre = preload_k(bn, bk, k_range, weights)
        tiles = pre // bk
        assert pre % bk == 0 and tiles & (tiles - 1) == 0                  # power-of-2 tiles
        assert tiles == 1 or (pre <= -(-k_range // bk) * bk and bn * pre * weights <= PRELOAD_ELEMS)


DEV = "cuda" if CUDA else "cpu"
DT, TOL = (torch.bfloat16, 1e-2) if CUDA else (torch.float32, 1e-5)   # the interpreter: fp32


def _rand(*shape, g):
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    return x.to(DEV, DT), x.to(DT).double()                     # (kernel input, its fp64 value)


def _rel(a, ref):
    return ((a.double().cpu() - ref).abs().max() / ref.abs().max()).item()


# M, N1, N2, K, config (BLOCK_N, BLOCK_K, warps, stages[, SPLIT_K]), pre_k: the first
# pre_k columns as one tile (1, 2 and 4 tiles; past a split's own range; K not a multiple)
PEELED = [
    (1, 100, 37, 300, (32, 64, 4, 2), 64),
    (5, 64, 20, 512, (16, 64, 4, 2), 128),
    (3, 70, 9, 300, (32, 64, 4, 2, 3), 128),     # splits of 2 tiles, the last partly empty
    (2, 70, 9, 100, (16, 64, 4, 2, 5), 128),     # more splits than tiles: 2 tiles past them
    (33, 50, 7, 1000, (64, 64, 4, 2), 256),
]


@pytest.mark.parametrize("M,N1,N2,K,cfg,pre_k", PEELED)
def test_linear_with_preloaded_tiles_vs_fp64(M, N1, N2, K, cfg, pre_k):
    from lowering.gemm import linear
    g = torch.Generator().manual_seed(M + N1 + K + pre_k)
    (x, x64), (w1, w164), (w2, w264), (w3, w364) = (
        _rand(*s, g=g) for s in ((M, K), (N1, K), (N2, K), (N1, K)))
    split = cfg[4] if len(cfg) > 4 else 1
    shape = (split, M) if split > 1 else (M,)
    out = lambda n: torch.full((*shape, n), float("nan"), device=DEV,
                               dtype=torch.float32 if split > 1 else DT)
    total = (lambda y: y.sum(0)) if split > 1 else (lambda y: y)
    y = out(N1)
    linear.launch(x, w1, None, 0, y, None, cfg, pre_k=pre_k)
    assert _rel(total(y), x64 @ w164.T) < TOL
    y = out(N1 + N2)
    linear.launch(x, w1, w2, 1, y, None, cfg, y2_col0=N1, pre_k=pre_k)
    assert _rel(total(y), torch.cat([x64 @ w164.T, x64 @ w264.T], -1)) < TOL
    if split == 1:
        y = out(N1)
        linear.launch(x, w1, w3, 2, y, None, cfg, pre_k=pre_k)
        assert _rel(y, torch.nn.functional.silu(x64 @ w164.T) * (x64 @ w364.T)) < 3 * TOL
        r, r64 = _rand(M, N1, g=g)
        y = out(N1)
        linear.launch(x, w1, None, 0, y, None, cfg, residual=r, pre_k=pre_k)
        assert _rel(y, r64 + x64 @ w164.T) < TOL


@pytest.mark.parametrize("t,N,K,J,copy,cfg,pre_k", [
    (1, 3, 64, 64, 16, (32, 16, 4, 2), 32),
    (17, 2, 64, 32, 0, (32, 16, 4, 2), 64),      # the whole of K preloaded
    (33, 2, 128, 128, 32, (64, 32, 4, 1), 64),
])
def test_head_gemm_with_preloaded_tiles_vs_fp64(t, N, K, J, copy, cfg, pre_k):
    from lowering.gemm import head_gemm
    g = torch.Generator().manual_seed(t + K + pre_k)
    a, a64 = _rand(t, N, K + copy, g=g)
    w, w64 = _rand(N, K, J, g=g)
    y = torch.full((t, N, J + copy), float("nan"), device=DEV, dtype=DT)
    head_gemm.launch(a, w, y, copy, cfg, pre_k=pre_k)
    assert _rel(y[..., :J], torch.einsum("tnk,nkj->tnj", a64[..., :K], w64)) < TOL
    assert torch.equal(y[..., J:].cpu(), a[..., K:].cpu())


def test_kernel_names():
    assert is_pdl_kernel("decode_linear_kernel")
    assert is_pdl_kernel("head_gemm_kernel_0")            # a compiler's variant suffix
    assert not is_pdl_kernel("head_gemm_kernel_x")
    assert not is_pdl_kernel("triton_poi_fused_add_0")
    assert not is_pdl_kernel("")
    assert not gdc_enabled(torch.zeros(1))                 # CPU: the interpreter, no PDL
    if CUDA:
        assert gdc_enabled(torch.zeros(1, device="cuda")) == HOPPER


def test_programmatic_needs_a_graph():
    cfg = tiny_config("v3")
    _, model = build_pair(cfg, seed=3)
    model = H.convert(model)
    cache = H.PagedMLACache(model.config, max_batch_size=1, max_cache_len=16, block_size=4)
    with pytest.raises(ValueError, match="graph=True"):
        H.DecodeGraph(model, cache, programmatic=True, graph=False, backend="aot_eager")
    with pytest.raises(TypeError, match="programmatic"):
        H.DecodeGraph(model, cache, programmatic=1, graph=False, backend="aot_eager")
    runner = H.DecodeGraph(model, cache, graph=False, backend="aot_eager")   # None: where it can
    assert runner.programmatic is False and runner.programmatic_edges == 0


def test_programmatic_unmet_says_why():
    from mla_ops.hf.pdl_edges import programmatic_unmet
    assert "not a CUDA GPU" in programmatic_unmet(torch.device("cpu"))
    if CUDA:
        assert (programmatic_unmet(torch.device("cuda")) is None) == HOPPER


@pytest.mark.skipif(not HOPPER, reason="programmatic dependent launch needs a Hopper GPU")
@pytest.mark.parametrize("producer", ["torch", "pdl"])
def test_edges_wait_for_a_slow_producer(producer):
    """x comes from a long reduction (torch) or from a PDL GEMM over a 64 MB weight, which
    lets its successor launch as it starts; decode_linear then reads x through a
    programmatic edge. Were any x read before the kernel's wait, the replays with new
    inputs would see stale x."""
    from lowering.gemm.linear import decode_linear
    from mla_ops.hf.pdl_edges import programmatic_edges
    g = torch.Generator(device="cuda").manual_seed(0)
    if producer == "torch":
        src = torch.randn(4096, 2048, device="cuda", generator=g)                 # ~32 MB
        make_x = lambda: src.sum(0, keepdim=True).to(torch.bfloat16)              # [1, 2048]
    else:
        src = torch.randn(1, 4096, device="cuda", generator=g).to(torch.bfloat16)
        w0 = (torch.randn(2048, 4096 * 4, device="cuda", generator=g) / 128).to(torch.bfloat16)
        make_x = lambda: decode_linear(src.repeat(1, 4), w0)                       # [1, 2048]
    w = torch.randn(2048, 2048, device="cuda", generator=g).to(torch.bfloat16)
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):                                                    # compile
            y = decode_linear(make_x(), w)
        with torch.cuda.graph(graph, stream=s):
            x = make_x()
            y = decode_linear(x, w)                                           # [1, 2048]
    torch.cuda.current_stream().wait_stream(s)
    log = []
    assert programmatic_edges(graph, log=log) >= 1
    assert ("decode_linear_kernel" in dict(log).values()) or any(
        n == "decode_linear_kernel" for _, n in log)
    graph.instantiate()
    last = None
    for seed in range(1, 6):
        src.copy_(torch.randn(src.shape, device="cuda",
                              generator=torch.Generator(device="cuda").manual_seed(seed)))
        graph.replay()
        torch.cuda.synchronize()
        assert last is None or not torch.equal(x, last)                   # new x each replay
        last = x.clone()
        ref = x.double() @ w.double().T                                   # from this replay's x
        err = ((y.double() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, (seed, err)


@pytest.mark.skipif(not HOPPER, reason="programmatic dependent launch needs a Hopper GPU")
@pytest.mark.parametrize("moe", [False, True])
def test_decode_graph_programmatic_is_bit_equal_to_plain(moe):
    """The same compiled step captured twice on the same cache state, its edges plain and
    programmatic: the same logits bit for bit at every step, and the greedy tokens of
    compiled generate() (whose runner takes the default, programmatic here)."""
    cfg = tiny_config("v3")
    if not moe:
        cfg.first_k_dense_replace = cfg.num_hidden_layers
    _, model = build_pair(cfg, seed=8, dtype=torch.bfloat16)
    model = H.convert(model).to("cuda")
    ids, mask = (t.to("cuda") for t in left_padded([30, 70, 5], seed=8))
    cache = H.PagedMLACache(model.config, max_batch_size=3, max_cache_len=128, device="cuda",
                            dtype=torch.bfloat16)
    runner, got, exp = graph_and_generate_tokens(model, ids, mask, cache, 24)
    assert runner.programmatic and runner.programmatic_edges > 0
    assert torch.equal(got, exp)
    cache.reset()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        first = model(input_ids=ids, attention_mask=mask, position_ids=pos,
                      **cache_kw(cache)).logits[:, -1].argmax(-1, keepdim=True)
    saved = cache.snapshot()
    logits = {}
    for programmatic in (False, True):
        cache.restore(saved)
        r = H.DecodeGraph(model, cache, programmatic=programmatic)
        assert (r.programmatic_edges > 0) == programmatic
        x, out = first, []
        for _ in range(12):
            out.append(r(x).clone())                                  # [B, 1, vocab]
            x = out[-1][:, -1].argmax(-1, keepdim=True)
        logits[programmatic] = torch.stack(out)
    assert torch.equal(logits[False], logits[True])


# M, N1, N2, K, config (BLOCK_N, warps, stages[, SPLIT_K]): one group; a partial last
# group; more splits than groups (empty splits, whose peeled group must add nothing)
FP8_PEELED = [(1, 100, 37, 128, (32, 4, 2)), (5, 72, 130, 3 * 128 - 50, (32, 4, 2, 2)),
              (3, 40, 20, 2 * 128, (32, 4, 2, 4)), (33, 64, 20, 300, (64, 4, 3))]


@pytest.mark.parametrize("pre_quant", [False, True])
@pytest.mark.parametrize("M,N1,N2,K,cfg", FP8_PEELED)
def test_fp8_linear_peeled_first_group_is_bit_equal(M, N1, N2, K, cfg, pre_quant):
    """fp8_linear_kernel with its first scale group's weight tile loaded before x (PEEL,
    what it does around its PDL wait on a Hopper GPU) gives the loop's result bit for bit
    in every mode, and that result is HF's W8A8 product (float64)."""
    pytest.importorskip("transformers.integrations.finegrained_fp8")
    from lowering.gemm import fp8_launch
    from test_fp8_checkpoint import rand_fp8, w8a8_ref
    dt = torch.bfloat16 if CUDA else torch.float16      # the interpreter's fp16 cast rounds
    g = torch.Generator().manual_seed(M + N1 + K)
    x = (torch.randn(M, K, generator=g) * 3).to(DEV, dt)
    (w1, s1), (w2, s2), (w3, s3) = rand_fp8(N1, K, g), rand_fp8(N2, K, g), rand_fp8(N1, K, g)
    w1, s1, w2, s2, w3, s3 = (t.to(DEV) for t in (w1, s1, w2, s2, w3, s3))
    split = cfg[3] if len(cfg) > 3 else 1
    shape = (split, M) if split > 1 else (M,)
    runs = [(0, N1, None, None, {}), (1, N1 + N2, w2, s2, dict(y2_col0=N1))]
    runs += [(2, N1, w3, s3, {})] if split == 1 else []                # gate w1, up w3
    for mode, n, wb, sb, kw in runs:
        ys = []
        for peel in (False, True):
            y = torch.full((*shape, n), float("nan"), device=DEV,
                           dtype=torch.float32 if split > 1 else dt)
            fp8_launch.launch(x, w1, s1, wb, sb, mode, y, None, 128, 128, cfg,
                              pre_quant=pre_quant, peel=peel, **kw)
            ys.append(y)
        torch.testing.assert_close(ys[1], ys[0], rtol=0, atol=0, equal_nan=True,
                                   msg=f"mode {mode}")
        if mode == 0:
            ref = w8a8_ref(x.cpu().float(), w1.cpu(), s1.cpu())
            got = ys[1].sum(0) if split > 1 else ys[1]
            assert ((got.double().cpu() - ref).abs().max() / ref.abs().max()).item() < 1e-2
