"""mla::moe_block_decode (lowering/moe/block.py), a MoE block's decode rows in one op: on the
CPU its kernels under the Triton interpreter (fp32) against a float64 block written here
and against the block's separate kernels; on a GPU the converted block with and without
it, bit for bit, eager and captured in a CUDA graph."""
import os

import pytest
import torch

pytest.importorskip("triton")

from lowering.gemm import linear as gemm  # noqa: E402
from lowering.moe import block as moe_block  # noqa: E402
from lowering.moe import experts, router  # noqa: E402
from test_moe_kernels import moe_fp64  # noqa: E402

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# the op's kernels on CPU tensors: only under the interpreter (conftest sets it without a GPU)
INTERPRETED = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="Triton kernels on CPU tensors need TRITON_INTERPRET=1")


def inputs(family, T, H=96, E=8, I=40, S=56, seed=0):
    """(op arguments in fp32, top_k): random router, experts and shared experts."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, s=1.0):
        return torch.randn(*shape, generator=g) * s
    x = rnd(T, H)
    weight = rnd(E, H, s=H ** -0.5)
    if family == "v3":                       # sigmoid, bias, 4 groups keep 2, norm, scale
        route = (rnd(E, s=0.1), 0, 3, 4, 2, True, 2.5)
    else:                                    # softmax greedy
        route = (None, 1, 3, 1, 1, False, 1.0)
    gate_up, down = rnd(E, 2 * I, H, s=H ** -0.5), rnd(E, H, I, s=I ** -0.5)
    sg, su, sd = rnd(S, H, s=H ** -0.5), rnd(S, H, s=H ** -0.5), rnd(H, S, s=S ** -0.5)
    return (x, weight, *route, gate_up, down, sg, su, sd), route[2]


def block_fp64(args, idx, w):
    """The block in float64 for the router's choice (idx, w): routed sum + shared MLP."""
    x, *_, gate_up, down, sg, su, sd = args
    routed = moe_fp64(x, idx, w, gate_up, down)
    x, sg, su, sd = x.double(), sg.double(), su.double(), sd.double()
    g, u = x @ sg.T, x @ su.T
    return routed + (g * torch.sigmoid(g) * u) @ sd.T


@INTERPRETED
@pytest.mark.parametrize("family", ["v3", "v2"])
@pytest.mark.parametrize("T,split", [(1, 1), (5, 1), (3, 2)])
def test_op_vs_fp64_and_the_separate_kernels(family, T, split, monkeypatch):
    if T == 3:                               # the shared down_proj as split-K partials
        monkeypatch.setitem(gemm.CONFIGS, (0, 96, 56, True), (32, 16, 4, 2, split))
    args, K = inputs(family, T, seed=T + 7 * split)
    pairs, shared = torch.ops.mla.moe_block_decode(*args)
    assert pairs.shape == (T, K, 96) and pairs.dtype == torch.float32
    assert shared.shape == (split, T, 96)
    out = pairs.sum(1) + shared.sum(0)
    # the router's choice, from its own kernels (tested against float64 in test_moe_router)
    x, weight, bias, mode, top_k, G, KG, norm, scale, gate_up, down, sg, su, sd = args
    idx, w = router.launch(x, weight, bias, mode, top_k, G, KG, norm, scale)
    ref = block_fp64(args, idx, w)
    assert ((out.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5
    # the block's separate kernels, one after another: the same numbers
    routed = experts.run_kernels(x, idx, w, gate_up, down)
    h = torch.empty(T, 56)
    gemm.launch(x, sg, su, 2, h, None, gemm.pick_config(2, 56, 96, T))
    cfg = gemm.pick_config(0, 96, 56, T)
    parts = torch.empty(gemm.split_k_of(cfg), T, 96)
    gemm.launch(h, sd, None, 0, parts if split > 1 else parts[0], None, cfg)
    assert torch.equal(pairs.sum(1), routed) and torch.equal(shared, parts)


def test_op_rejects_bad_shapes_and_devices():
    args, _ = inputs("v2", 2)
    bad = list(args)
    bad[-1] = bad[-1][:, :50]                                    # shared_down [H, 50]
    with pytest.raises(ValueError, match="shared_down"):
        torch.ops.mla.moe_block_decode(*bad)
    bad = list(args)
    bad[-3] = bad[-3].double()
    with pytest.raises(TypeError, match="shared_gate"):
        torch.ops.mla.moe_block_decode(*bad)


def test_op_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    args, _ = inputs("v2", 2)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        torch.ops.mla.moe_block_decode(*args)


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("family", ["v3", "v2"])
@pytest.mark.parametrize("T", [1, 7, 32])
def test_converted_block_with_and_without_the_op(family, T, monkeypatch):
    """The converted block's decode rows through mla::moe_block_decode give the separate
    ops' output bit for bit, eager and replayed from a CUDA graph."""
    from test_moe import moe_pair
    import mla_ops.hf.moe as hf_moe
    _, model = moe_pair(family)
    model = model.to("cuda", torch.bfloat16)
    hf_moe.convert_moe(model)
    block = model.model.layers[1].mlp
    x = torch.randn(1, T, model.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        assert hf_moe.block_decode_args(block, x.view(T, -1)) is not None
        one = block(x)
        with monkeypatch.context() as m:
            m.setattr(hf_moe, "block_decode_args", lambda *a: None)
            sep = block(x)
        assert torch.equal(one, sep)
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            block(x)
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            cap = block(x)
        x.copy_(torch.randn_like(x))
        g.replay()
        with monkeypatch.context() as m:
            m.setattr(hf_moe, "block_decode_args", lambda *a: None)
            want = block(x)
        assert torch.equal(cap, want)


@INTERPRETED
@pytest.mark.parametrize("split", [1, 2])
def test_op_fake_and_schema(split, monkeypatch):
    """opcheck: the fake's shapes and dtypes match the kernels' outputs (both shared
    layouts) and the schema mutates nothing; the op traces fullgraph with static shapes
    (its kernel configs are chosen by shape, as a compiled decode step's are)."""
    if split > 1:
        monkeypatch.setitem(gemm.CONFIGS, (0, 96, 56, True), (32, 16, 4, 2, split))
    args, _ = inputs("v3", 2, seed=split)
    torch.library.opcheck(torch.ops.mla.moe_block_decode.default, args,
                          test_utils=("test_schema", "test_faketensor"))

    def f(*a):
        pairs, shared = torch.ops.mla.moe_block_decode(*a)
        return pairs.sum(1) + shared.sum(0)
    torch._dynamo.reset()
    out = torch.compile(f, fullgraph=True, backend="aot_eager")(*args)
    assert torch.equal(out, f(*args))


@INTERPRETED
def test_converted_block_sums_the_op_as_its_ops_on_cpu(monkeypatch):
    """The converted block's decode composition with the op (its kernels forced onto the CPU
    under the interpreter, fp32) against the block's separate ops (their torch paths):
    the same output up to fp32 rounding, the residual added in HF's order."""
    import mla_ops.hf.moe as hf_moe
    from test_moe import moe_pair
    for family in ("v3", "v2"):
        _, model = moe_pair(family)
        hf_moe.convert_moe(model)
        block = model.model.layers[1].mlp
        x = torch.randn(1, 3, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
        r = torch.randn_like(x)
        calls = []
        real = torch.ops.mla.moe_block_decode

        def counted(*a):
            calls.append(1)
            return real(*a)
        with torch.no_grad():
            want = block(x, r)
            with monkeypatch.context() as m:
                m.setattr(moe_block, "block_serves", lambda *a: True)
                m.setattr(hf_moe.torch.ops.mla, "moe_block_decode", counted, raising=False)
                got = block(x, r)
        assert calls, family
        assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5, family
