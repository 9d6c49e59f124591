"""QuantKey and the FP8 quant ops: torch reference vs float64, Triton vs torch (bitwise)."""
import pytest
import torch

import passes.quant as Q
import lowering.config as mla_config
import mla_ops.quant_ops as QO
from lowering.fused.concat_quant import concat_quant
from lowering.fused.group_quant import group_quant
from lowering.fused.static_quant import static_quant
from lowering.fused.wuv_quant import wuv_quant, wuv_quant_unmet
from passes.quant import QUANT_KEYS, QuantKey

FP8 = torch.float8_e4m3fn

# The Triton tests below run the kernels on CPU tensors under the interpreter; on a CUDA
# host (no TRITON_INTERPRET) the same kernels are tested on the GPU in test_passes_gpu.py.
interpreter_only = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU-interpreter kernel test; CUDA: test_passes_gpu.py")


def e4m3_grid():
    """Every finite non-negative e4m3 value, float64 (independent of torch's fp8 cast)."""
    vals = {0.0}
    for e in range(-6, 9):
        for m in range(8):
            vals.add((1 + m / 8) * 2.0 ** e)
    vals |= {m / 8 * 2.0 ** -6 for m in range(1, 8)}          # subnormals
    return torch.tensor(sorted(v for v in vals if v <= 448.0), dtype=torch.float64)


def nearest_e4m3(y):
    """Round float64 y to the nearest e4m3 value (saturating), ties to even mantissa."""
    grid = e4m3_grid()
    a = y.abs().clamp(max=448.0)
    idx = torch.searchsorted(grid, a).clamp(1, len(grid) - 1)
    lo, hi = grid[idx - 1], grid[idx]
    pick_hi = (hi - a) < (a - lo)
    tie = (hi - a) == (a - lo)
    # even mantissa: the grid index parity alternates with the mantissa's last bit
    pick_hi |= tie & (idx % 2 == 0)
    return torch.where(pick_hi, hi, lo) * y.sign()


def rand(shape, seed, scale=3.0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * scale
    x.view(-1)[:6] = torch.tensor([0.0, 1e-6, -3e-4, 2000.0, -2000.0, 0.01171875])
    return x.to(dtype)


def u8(t):
    return t.view(torch.uint8)


def test_quant_keys_are_data():
    assert [str(k) for k in QUANT_KEYS] == [
        "fp8_static_tensor", "fp8_dynamic_group128", "fp8_dynamic_group64",
        "fp8_dynamic_group128_pow2", "fp8_dynamic_group64_pow2"]
    assert len(set(QUANT_KEYS)) == len(QUANT_KEYS)
    assert Q.FP8_STATIC_TENSOR.per_tensor and not Q.FP8_GROUP_64.per_tensor
    assert all(k.scale_dtype == torch.float32 and k.dtype == FP8 for k in QUANT_KEYS)
    with pytest.raises(ValueError):
        QuantKey(static=True, group_size=128)
    with pytest.raises(ValueError):
        QuantKey(static=False)
    with pytest.raises(ValueError):
        QuantKey(pow2=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_static_reference_vs_float64(dtype):
    x = rand((7, 96), 0, dtype=dtype)
    s = torch.tensor([0.0123])
    y = Q.ref_static(x, s)
    # the spec: an fp32 divide, then one rounding to e4m3
    want = nearest_e4m3((x.float() / s).double())
    assert torch.equal(y.double(), want)


@pytest.mark.parametrize("g", [64, 128])
@pytest.mark.parametrize("pow2", [False, True])
def test_group_reference_vs_float64(g, pow2):
    x = rand((5, 256), 1)
    y, s = Q.ref_group(x, g, pow2)
    amax = x.double().view(5, -1, g).abs().amax(-1)
    if pow2:
        assert torch.equal(torch.exp2(torch.log2(s.double()).round()), s.double())
        assert (s.double() >= amax / 448 * (1 - 1e-7)).all() and (s.double() < amax / 448 * 2).all()
    else:
        assert torch.allclose(s.double(), amax / 448, rtol=1e-6)
    want = nearest_e4m3((x.float().view(5, -1, g) / s[..., None]).double()).view(5, -1)
    assert torch.equal(y.double(), want)


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_triton_static_bitwise(dtype):
    x = rand((9, 333), 2, dtype=dtype)                    # not a multiple of the block
    s = torch.tensor([0.02])
    assert torch.equal(u8(static_quant(x, s)), u8(Q.ref_static(x, s)))


@interpreter_only
@pytest.mark.parametrize("g", [64, 128])
@pytest.mark.parametrize("pow2", [False, True])
def test_triton_group_bitwise(g, pow2):
    x = rand((6, 512), 3)[:, :384]                       # strided rows
    y, s = group_quant(x, g, pow2)
    y2, s2 = Q.ref_group(x, g, pow2)
    assert torch.equal(s, s2)
    assert torch.equal(u8(y), u8(y2))


@interpreter_only
def test_triton_concat_bitwise_non_contiguous():
    g = torch.Generator().manual_seed(4)
    a = torch.randn(3, 5, 32, generator=g).bfloat16().transpose(0, 1)     # [5, 3, 32] strided
    b = torch.randn(5, 3, 40, generator=g).bfloat16()[..., 8:24]          # [5, 3, 16] sliced
    s = torch.tensor([0.01])
    assert torch.equal(u8(concat_quant(a, b, s)), u8(Q.ref_concat_static(a, b, s)))


@interpreter_only
def test_every_e4m3_rounding_boundary():
    # midpoints between neighbouring e4m3 values: ties must go to the even mantissa
    grid = e4m3_grid()
    mids = torch.cat([grid, (grid[1:] + grid[:-1]) / 2, grid * 1.0001, grid * 0.9999])
    x = torch.cat([mids, -mids]).float()[None]
    one = torch.tensor([1.0])
    assert torch.equal(Q.ref_static(x, one).double(), nearest_e4m3(x.double()))
    assert torch.equal(u8(static_quant(x, one)), u8(Q.ref_static(x, one)))


@interpreter_only
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_custom_ops_dispatch(monkeypatch, impl):
    monkeypatch.setattr(mla_config, "quant_impl", impl)
    x = rand((4, 256), 5)
    s = torch.tensor([0.03])
    assert torch.equal(u8(torch.ops.mla.quant_fp8_static(x, s)), u8(Q.ref_static(x, s)))
    y, sc = torch.ops.mla.quant_fp8_group(x, 128, False)
    y2, sc2 = Q.ref_group(x, 128, False)
    assert torch.equal(u8(y), u8(y2)) and torch.equal(sc, sc2)
    a, b = x.view(4, 2, 128)[..., :96], x.view(4, 2, 128)[..., 96:]
    assert torch.equal(u8(torch.ops.mla.concat_quant_fp8_static(a, b, s)),
                       u8(Q.ref_concat_static(a, b, s)))


@interpreter_only
def test_quant_impl_is_read_at_each_call_of_a_compiled_function(monkeypatch):
    """The quant ops are opaque to the compiler and read lowering.config.quant_impl when
    they run: flipping it between calls of one compiled function switches the path (no
    graph keeps the old choice)."""
    import lowering.fused.static_quant as SQ
    calls = []
    kernel_path = SQ.static_quant
    monkeypatch.setattr(SQ, "static_quant", lambda x, s: calls.append(1) or kernel_path(x, s))
    x, s = rand((4, 256), 9), torch.tensor([0.02])
    torch._dynamo.reset()
    fn = torch.compile(lambda x, s: torch.ops.mla.quant_fp8_static(x, s), backend="aot_eager",
                       fullgraph=True)
    for impl, kernel_calls in (("torch", 0), ("triton", 1), ("torch", 1), ("auto", 1)):
        with mla_config.patch(quant_impl=impl):
            assert torch.equal(u8(fn(x, s)), u8(Q.ref_static(x, s)))
        assert len(calls) == kernel_calls
    with mla_config.patch(quant_impl="torch"):
        assert "quant_impl" in QO.quant_kernel_unmet(x)
    assert "CUDA" in QO.quant_kernel_unmet(x)                  # "auto" on CPU


def test_opcheck_custom_ops():
    x = rand((4, 128), 6)
    s = torch.tensor([0.05])
    torch.library.opcheck(torch.ops.mla.quant_fp8_static.default, (x, s),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.mla.quant_fp8_group.default, (x, 64, True),
                          test_utils=("test_schema", "test_faketensor"))
    a, b = x.view(4, 2, 64)[..., :48], x.view(4, 2, 64)[..., 48:]
    torch.library.opcheck(torch.ops.mla.concat_quant_fp8_static.default, (a, b, s),
                          test_utils=("test_schema", "test_faketensor"))


def test_op_argument_errors():
    x = rand((4, 100), 7)
    with pytest.raises(ValueError, match="divisible"):
        torch.ops.mla.quant_fp8_group(x, 64, False)
    with pytest.raises(ValueError, match="fp32"):
        torch.ops.mla.quant_fp8_static(x, torch.tensor([1.0, 2.0]))


def fp8_step_close(y, ref, max_frac=0.01):
    """Equal except a few elements one e4m3 step apart (fp32 GEMM sums round either way)."""
    a, b = y.double(), ref.double()
    diff = a != b
    assert diff.double().mean().item() <= max_frac
    assert ((a - b).abs()[diff] <= b.abs()[diff] / 8 + 2 ** -9).all()


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [None, 64, 128])
def test_wuv_gemm_quant_epilogue(dtype, group):
    g = torch.Generator().manual_seed(8)
    t, N, L, V = 37, 3, 64, 128
    a = torch.randn(N, t, L, generator=g).to(dtype).transpose(0, 1)         # bmm-output layout
    W = (torch.randn(N, L, V, generator=g) / 8).to(dtype)
    o = torch.einsum("tnl,nlv->tnv", a.double(), W.double()).to(dtype).reshape(t, -1)
    assert wuv_quant_unmet(a, W, group) is None
    if group is None:
        s = torch.tensor([0.01])
        y, _ = wuv_quant(a, W, scale=s)
        fp8_step_close(y, Q.ref_static(o, s))
    else:
        y, sc = wuv_quant(a, W, group_size=group)
        y2, sc2 = Q.ref_group(o, group, False)
        assert torch.allclose(sc, sc2, rtol=1e-2)
        fp8_step_close(y.double() * sc.repeat_interleave(group, 1).double(),
                       y2.double() * sc2.repeat_interleave(group, 1).double())


def test_wuv_epilogue_conditions():
    a = torch.empty(2, 2, 64, dtype=torch.bfloat16)
    assert "power of two" in wuv_quant_unmet(a, torch.empty(2, 64, 96, dtype=a.dtype), None)
    assert "dividing" in wuv_quant_unmet(a, torch.empty(2, 64, 32, dtype=a.dtype), 64)
    assert "bf16/fp16" in wuv_quant_unmet(a.float(), torch.empty(2, 64, 64), None)


@interpreter_only
@pytest.mark.parametrize("quant", ["static", "group"])
def test_attention_op_epilogue_path_matches_reference_path(monkeypatch, quant):
    """The op's fused decode epilogue (Triton) vs its bmm + quant path (torch)."""
    from scenario import Dims, Step, make_layer
    d = Dims(N=2, P=16, R=16, V=64, L=32)
    layer, _ = make_layer(d, torch.bfloat16)
    outs = []
    for impl in ("torch", "triton"):
        monkeypatch.setattr(mla_config, "quant_impl", impl)
        step = Step(d, [6, 2, 0], [1, 1, 3], dtype=torch.bfloat16)
        q, kv_c, k_pe = step.inputs()
        T = q.shape[0]
        dep = torch.ops.mla.kv_cache_update(kv_c, k_pe, step.cache.kv[0], step.meta.slot_mapping,
                                            "auto", step.cache.k_scale)
        out = torch.empty(T, d.N * d.V, dtype=torch.float8_e4m3fn)
        scale = torch.tensor([0.02]) if quant == "static" else None
        bs = torch.empty(T, d.N * d.V // 64) if quant == "group" else None
        m = step.meta
        torch.ops.mla.attention_with_output(
            q, kv_c, k_pe, step.cache.kv[0], layer.W_UK_T, layer.W_UV, m.block_table,
            m.seq_lens, m.query_start_loc, m.num_decode_tokens, layer.softmax_scale, "auto",
            step.cache.k_scale, dep, out, scale, bs)
        outs.append((out, bs))
    (y0, s0), (y1, s1) = outs
    if quant == "group":
        assert torch.allclose(s0, s1, rtol=1e-2)
        fp8_step_close(y1.double() * s1.repeat_interleave(64, 1).double(),
                       y0.double() * s0.repeat_interleave(64, 1).double())
    else:
        fp8_step_close(y1, y0)
