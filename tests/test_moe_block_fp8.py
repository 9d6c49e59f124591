"""mla::moe_block_decode_fp8 (lowering/moe/fp8_block.py), an FP8 checkpoint's MoE block
decode rows in one op: on the CPU its kernels under the Triton interpreter (fp32) against
a float64 W8A8 block written here; on a GPU the converted FP8 block with and without it,
bit for bit, eager and captured in a CUDA graph."""
import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
pytest.importorskip("transformers.integrations.finegrained_fp8")

from lowering.gemm import fp8_linear_configs  # noqa: E402
from lowering.moe import fp8_block, fp8_experts, router  # noqa: E402
from test_fp8_checkpoint import rand_fp8, rel, w8a8_ref  # noqa: E402
from test_fp8_experts import moe_w8a8_ref  # noqa: E402

FP8 = torch.float8_e4m3fn
GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
INTERPRETED = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="Triton kernels on CPU tensors need TRITON_INTERPRET=1")
H, E, I, S = 256, 8, 128, 192          # S: a shared width with a partial scale block


def inputs(family, T, seed=0):
    """(op arguments, x fp32 [T, H] on the CPU): random router, fp8 experts and shared
    experts with random block scales."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    weight = torch.randn(E, H, generator=g) * H ** -0.5
    if family == "v3":                       # sigmoid, bias, 4 groups keep 2, norm, scale
        route = (torch.randn(E, generator=g) * 0.1, 0, 3, 4, 2, True, 2.5)
    else:                                    # softmax greedy
        route = (None, 1, 3, 1, 1, False, 1.0)
    gu = (torch.randn(E, 2 * I, H, generator=g) * 100).clamp(-448, 448).to(FP8)
    gus = torch.rand(E, 2 * (I // 128), H // 128, generator=g) * 0.02 + 1e-3
    dn = (torch.randn(E, H, I, generator=g) * 100).clamp(-448, 448).to(FP8)
    dns = torch.rand(E, H // 128, I // 128, generator=g) * 0.02 + 1e-3
    (sg, sgs), (su, sus) = rand_fp8(S, H, g), rand_fp8(S, H, g)
    sd, sds = rand_fp8(H, S, g)
    return (x, weight, *route, gu, gus, dn, dns, sg, sgs, su, sus, sd, sds, 128, 128)


def block_fp64(args, idx, w):
    """The block in float64, W8A8 as HF's FP8Linear, each linear's output rounded to fp32
    (the CPU kernels' dtype): the routed pairs' sum for the router's choice plus the shared
    MLP."""
    x, *_, gu, gus, dn, dns, sg, sgs, su, sus, sd, sds, _, _ = args
    cast = (lambda t: t.float().double())
    routed = moe_w8a8_ref(x, idx, w, gu, gus, dn, dns, cast)
    g, u = cast(w8a8_ref(x, sg, sgs)), cast(w8a8_ref(x, su, sus))
    h = cast(cast(F.silu(g)) * u)
    return routed + cast(w8a8_ref(h.float(), sd, sds))


@INTERPRETED
@pytest.mark.parametrize("family", ["v3", "v2"])
@pytest.mark.parametrize("T,split", [(1, False), (3, False), (2, True)])
def test_op_vs_fp64_and_the_routed_kernels(family, T, split, monkeypatch):
    """pairs + shared against the float64 block; pairs summed over k equal the routed
    experts' own kernel path (fp8_experts.run_kernels) bit for bit. split: the shared
    experts' GEMMs split K (fp32 partials and their reduce on the shared branch)."""
    if split:
        monkeypatch.setattr(fp8_linear_configs, "MIN_GROUPS_PER_SPLIT", 1)
    args = inputs(family, T, seed=T + (family == "v3"))
    down_split = fp8_linear_configs.split_k_for(fp8_linear_configs.pick_config(0, H, S, T),
                                                0, T, H, S, 128)
    assert (down_split > 1) == split
    pairs, shared = torch.ops.mla.moe_block_decode_fp8(*args)
    assert pairs.shape == (T, 3, H) and pairs.dtype == torch.float32
    assert shared.shape == (1, T, H) and shared.dtype == torch.float32
    x, weight, bias, mode, top_k, G, KG, norm, scale, gu, gus, dn, dns = args[:13]
    idx, w = router.launch(x, weight, bias, mode, top_k, G, KG, norm, scale)
    out = pairs.sum(1) + shared.sum(0)
    assert rel(out, block_fp64(args, idx, w)) < 1e-4
    routed = fp8_experts.run_kernels(x, idx, w, gu, gus, dn, dns, 128, 128)
    assert torch.equal(pairs.sum(1), routed)


def test_op_rejects_bad_shapes_scales_and_dtypes():
    args = inputs("v2", 2)
    bad = list(args)
    bad[-4] = bad[-4][:, :100]                                       # shared_down [H, 100]
    with pytest.raises(ValueError, match="shared_down"):
        torch.ops.mla.moe_block_decode_fp8(*bad)
    bad = list(args)
    bad[-7] = bad[-7][:1]                                            # shared_gate_scale
    with pytest.raises(ValueError, match="shared_gate.weight_scale_inv"):
        torch.ops.mla.moe_block_decode_fp8(*bad)
    bad = list(args)
    bad[-6] = bad[-6].float()                                        # shared_up not fp8
    with pytest.raises(TypeError, match="shared_up"):
        torch.ops.mla.moe_block_decode_fp8(*bad)
    bad = list(args)
    bad[10] = bad[10][:, :1]                                         # gate_up_scale
    with pytest.raises(ValueError, match="gate_up_scale"):
        torch.ops.mla.moe_block_decode_fp8(*bad)


def test_op_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        torch.ops.mla.moe_block_decode_fp8(*inputs("v2", 2))


@INTERPRETED
def test_op_fake_and_schema():
    """opcheck: the fake's shapes and dtypes match the kernels' outputs; no input is
    written (compared as bytes: torch's schema checker cannot compare float8 tensors on
    the CPU); the op traces fullgraph."""
    args = inputs("v3", 2, seed=5)
    torch.library.opcheck(torch.ops.mla.moe_block_decode_fp8.default, args,
                          test_utils=("test_faketensor",))
    before = [a.clone() for a in args if isinstance(a, torch.Tensor)]
    torch.ops.mla.moe_block_decode_fp8(*args)
    after = [a for a in args if isinstance(a, torch.Tensor)]
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.dtype == FP8
               else torch.equal(a, b) for a, b in zip(before, after))

    def f(*a):
        pairs, shared = torch.ops.mla.moe_block_decode_fp8(*a)
        return pairs.sum(1) + shared.sum(0)
    torch._dynamo.reset()
    out = torch.compile(f, fullgraph=True, backend="aot_eager")(*args)
    assert torch.equal(out, f(*args))


def test_block_serves_only_the_kernels_shapes():
    args = inputs("v3", 2)
    w = args[9:]
    assert not fp8_block.block_serves(args[0], args[1], *w)          # CPU: the kernels need CUDA
    if torch.cuda.is_available():
        cu = [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]
        x = cu[0].bfloat16()
        assert fp8_block.block_serves(x, cu[1], *cu[9:])
        assert not fp8_block.block_serves(x.float(), cu[1], *cu[9:])            # fp32 x
        assert not fp8_block.block_serves(x.repeat(40, 1), cu[1], *cu[9:])     # 80 rows


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("T", [1, 7, 32])
def test_converted_fp8_block_with_and_without_the_op(T, monkeypatch):
    """The converted FP8 block's decode rows through mla::moe_block_decode_fp8 give the
    separate ops' output bit for bit, eager and replayed from a CUDA graph."""
    import mla_ops.hf.moe as hf_moe
    from test_fp8_checkpoint import cuda_fp8_model
    model = cuda_fp8_model()
    block = model.model.layers[1].mlp
    x = torch.randn(1, T, model.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    r = torch.randn_like(x)
    with torch.no_grad():
        assert hf_moe.fp8_block_decode_args(block, x.view(T, -1)) is not None
        one = block(x, r)
        with monkeypatch.context() as m:
            m.setattr(hf_moe, "fp8_block_decode_args", lambda *a: None)
            sep = block(x, r)
        assert torch.equal(one, sep)
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            block(x, r)
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            cap = block(x, r)
        x.copy_(torch.randn_like(x))
        g.replay()
        with monkeypatch.context() as m:
            m.setattr(hf_moe, "fp8_block_decode_args", lambda *a: None)
            want = block(x, r)
        assert torch.equal(cap, want)
