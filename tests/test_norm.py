"""mla::rms_norm (lowering/fused/norm.py) vs float64, and the converted HF decoder layer that
runs its norms on it with the residual adds in the GEMMs' epilogues (mla_ops/hf/layer.py).
CPU: the kernel under the Triton interpreter; the op's torch path bit for bit against HF's
RMSNorm module."""
import pytest
import torch

pytest.importorskip("triton")

from lowering.fused import norm  # noqa: E402
from hf_models import cache_kw  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _ref(x64, w64, eps, dt):
    """HF's RMSNorm in float64, rounded where HF rounds: the normalized row to dt, then
    the weight product to dt."""
    y = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    return (w64 * y.to(dt).double()).to(dt)


def _ulps(a, ref):
    """Largest difference between a and ref in units of ref's dtype's spacing at ref."""
    spacing = torch.finfo(ref.dtype).eps * ref.double().abs().clamp_min(2 ** -14)
    return ((a.double() - ref.double()).abs() / spacing).max().item()


# rows; N: 1, not a power of two, DeepSeek-V3's hidden size; dtypes
@pytest.mark.parametrize("T,N", [(1, 7168), (5, 100), (3, 1), (32, 512)])
@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_kernel_vs_fp64(T, N, dt):
    g = torch.Generator().manual_seed(T * 100 + N)
    x = (torch.randn(T, N, generator=g, dtype=torch.float64) * 3 + 0.5).to(dt)
    w = (torch.rand(N, generator=g, dtype=torch.float64) + 0.5).to(dt)
    xs, ws = x.to(DEV), w.to(DEV)
    y = torch.full((T, N), float("nan"), device=DEV, dtype=dt)
    norm.launch(xs, ws, 1e-6, y)
    ref = _ref(x.double(), w.double(), 1e-6, dt)
    assert not y.isnan().any()
    # the fp32 sum of squares may round the normalized row one way where fp64 rounds the
    # other: one ulp of the row, then the weight product
    assert _ulps(y.cpu(), ref) <= 2.0


def test_kernel_reads_strided_rows():
    """Rows with a stride (a view of a wider buffer): only each row's N columns are read."""
    g = torch.Generator().manual_seed(3)
    buf = torch.randn(4, 300, generator=g).to(DEV)
    w = torch.rand(200, generator=g).add(0.5).to(DEV)
    y = torch.empty(4, 200, device=DEV)
    norm.launch(buf[:, 50:250], w, 1e-5, y)
    assert _ulps(y.cpu(), _ref(buf[:, 50:250].double().cpu(), w.double().cpu(), 1e-5,
                                 torch.float32)) <= 2.0


def test_op_torch_path_is_hf_rms_norm_and_errors():
    pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm
    m = DeepseekV3RMSNorm(64, eps=1e-5)
    with torch.no_grad():
        m.weight.copy_(torch.rand(64) + 0.5)
    for dt in (torch.float32, torch.bfloat16):
        x = torch.randn(2, 3, 64).to(dt)
        mm = m.to(dt)
        with torch.no_grad():
            assert torch.equal(torch.ops.mla.rms_norm(x, mm.weight, 1e-5), mm(x))
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match=r"weight must be \[64\]"):
        torch.ops.mla.rms_norm(x, torch.ones(63), 1e-6)
    with pytest.raises(ValueError, match="eps must be >= 0"):
        torch.ops.mla.rms_norm(x, torch.ones(64), -1.0)
    torch.library.opcheck(torch.ops.mla.rms_norm.default, (x, torch.rand(64), 1e-6),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.skipif(DEV != "cuda", reason="the op's Triton path runs on CUDA")
@pytest.mark.parametrize("T", [1, 32, 300])
def test_op_on_gpu_eager_and_compiled(T):
    """bf16 on CUDA at V3's hidden size: the kernel, eager and under Inductor (where it
    appears in the generated code), within the rounding of HF's formula."""
    from torch._inductor.utils import run_and_get_code
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, 1, 7168, generator=g).mul(2).to(DEV, torch.bfloat16)
    w = torch.rand(7168, generator=g).add(0.5).to(DEV, torch.bfloat16)

    def f(x):
        return torch.ops.mla.rms_norm(x, w, 1e-6)
    ref = _ref(x.double().cpu(), w.double().cpu(), 1e-6, torch.bfloat16)
    compiled, codes = run_and_get_code(torch.compile(f, fullgraph=True), x)
    for y in (f(x), compiled):
        assert y.shape == x.shape and y.dtype == torch.bfloat16
        assert _ulps(y.cpu(), ref) <= 2.0
    assert "rms_norm_kernel" in "".join(codes)


def _compiled_matches_hf(model, ref_model, ids) -> set:
    """Compile model's forward fullgraph on a paged cache, check its logits against
    ref_model's (HF's, no cache) and return the ops its graph calls."""
    import mla_ops.hf as H
    targets = set()

    def backend(gm, example_inputs):
        targets.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward
    torch._dynamo.reset()
    cache = H.PagedMLACache(model.config, max_batch_size=2, max_cache_len=16, block_size=4)
    with torch.no_grad():
        out = torch.compile(model.forward, backend=backend, fullgraph=True)(
            ids, **cache_kw(cache)).logits
        ref = ref_model(ids).logits
    assert (out - ref).abs().max() <= 1e-4 * max(1.0, ref.abs().max().item())
    return targets


def test_converted_layer_graph_holds_the_ops_and_matches_hf(monkeypatch):
    """A converted decoder layer traces to mla::rms_norm and the residual GEMMs (no HF
    norm left), computes what HF's layer computes, and convert(fuse_norms=False) traces
    HF's own layer instead."""
    pytest.importorskip("transformers")
    import mla_ops.hf as H
    from hf_models import build_pair, tiny_config
    ref_model, model = build_pair(tiny_config("v3"))
    H.convert(model)
    _, unfused = build_pair(tiny_config("v3"))
    H.convert(unfused, fuse_norms=False)
    ids = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(0))
    targets = [_compiled_matches_hf(m, ref_model, ids) for m in (model, unfused)]
    assert {"mla.rms_norm", "mla.decode_linear_residual"} <= targets[0]
    assert not any(t.startswith("mla.rms_norm") or "residual" in t for t in targets[1])


def _residual_ref(p32, r64, dt):
    """The partials summed in split order in fp32 (the GEMM's documented accumulation),
    rounded to dt; the residual add in float64 rounded to dt."""
    acc = p32[0].clone()
    for s in range(1, p32.shape[0]):
        acc = acc + p32[s]
    return (r64 + acc.to(dt).double()).to(dt)


# splits, rows, N (not a power of two; V2-Lite's hidden size), dtypes
@pytest.mark.parametrize("S,T,N", [(2, 1, 2048), (4, 5, 100), (3, 32, 512), (1, 2, 7)])
@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_residual_kernel_vs_fp64(S, T, N, dt):
    g = torch.Generator().manual_seed(S * 1000 + T * 10 + N)
    p = torch.randn(S, T, N, generator=g, dtype=torch.float64).float()
    r = (torch.randn(T, N, generator=g, dtype=torch.float64) * 2).to(dt)
    w = (torch.rand(N, generator=g, dtype=torch.float64) + 0.5).to(dt)
    h = torch.full((T, N), float("nan"), device=DEV, dtype=dt)
    y = torch.full((T, N), float("nan"), device=DEV, dtype=dt)
    norm.launch_residual(p.to(DEV), r.to(DEV), w.to(DEV), 1e-6, h, y)
    h_ref = _residual_ref(p, r.double(), dt)
    assert not (h.isnan().any() or y.isnan().any())
    if DEV == "cuda" or dt == torch.float32:
        assert torch.equal(h.cpu(), h_ref)              # the same roundings, in order
    else:                   # the interpreter's bf16 cast truncates: two casts, each within
        big = torch.maximum(r.double().abs(), p.double().sum(0).abs())   # an ulp of an addend
        assert ((h.cpu().double() - h_ref.double()).abs() <= 2 * 2 ** -7 * big + 1e-30).all()
    # the norm of the h it stored; its fp32 sum of squares may round the row one way where
    # fp64 rounds the other
    assert _ulps(y.cpu(), _ref(h.cpu().double(), w.double(), 1e-6, dt)) <= 2.0


def test_residual_op_torch_path_and_errors():
    """Off CUDA the op is `residual + parts.sum(0).to(dtype)` and HF's norm, bit for bit;
    bad partials are refused naming them."""
    g = torch.Generator().manual_seed(5)
    p = torch.randn(3, 2, 4, 64, generator=g)
    r = torch.randn(2, 4, 64, generator=g).to(torch.bfloat16)
    w = torch.rand(64, generator=g).add(0.5).to(torch.bfloat16)
    h, y = torch.ops.mla.residual_rms_norm(p, r, w, 1e-6)
    want = r + p.sum(0).to(torch.bfloat16)
    assert torch.equal(h, want) and torch.equal(y, norm.rms_norm_torch(want, w, 1e-6))
    with pytest.raises(ValueError, match="parts must be fp32"):
        torch.ops.mla.residual_rms_norm(p[:, :1], r, w, 1e-6)
    with pytest.raises(ValueError, match="parts must be fp32"):
        torch.ops.mla.residual_rms_norm(p.double(), r, w, 1e-6)
    torch.library.opcheck(torch.ops.mla.residual_rms_norm.default, (p, r, w, 1e-6),
                          test_utils=("test_schema", "test_faketensor"))


def test_converted_layer_takes_the_residual_norm_where_o_proj_splits(monkeypatch):
    """Where o_proj's decode GEMM splits K (forced here for every GEMM: on the CPU the ops'
    torch paths), the converted layer's graph holds mla::residual_rms_norm after the
    partials, and the model still computes HF's logits."""
    pytest.importorskip("transformers")
    import mla_ops.hf as H
    from lowering.gemm import linear as gemm
    from hf_models import build_pair, tiny_config
    monkeypatch.setattr(gemm, "linear_split_k", lambda x, w: 2)
    for family in ("v3", "v2"):
        ref_model, model = build_pair(tiny_config(family))
        H.convert(model)
        ids = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(1))
        targets = _compiled_matches_hf(model, ref_model, ids)
        assert {"mla.residual_rms_norm", "mla.decode_linear_partials"} <= targets


@pytest.mark.skipif(DEV != "cuda", reason="the op's Triton path runs on CUDA")
def test_residual_op_on_gpu_is_the_separate_ops():
    """bf16 on CUDA, two splits: the op gives the separate sum, add and mla::rms_norm bit
    for bit, eager and compiled."""
    g = torch.Generator().manual_seed(2)
    p = torch.randn(2, 32, 1, 2048, generator=g).to(DEV)
    r = torch.randn(32, 1, 2048, generator=g).to(DEV, torch.bfloat16)
    w = torch.rand(2048, generator=g).add(0.5).to(DEV, torch.bfloat16)

    def f(p, r):
        return torch.ops.mla.residual_rms_norm(p, r, w, 1e-6)
    h_want = r + (p[0] + p[1]).to(torch.bfloat16)
    y_want = torch.ops.mla.rms_norm(h_want, w, 1e-6)
    for h, y in (f(p, r), torch.compile(f, fullgraph=True)(p, r)):
        assert torch.equal(h, h_want) and torch.equal(y, y_want)


# rows, N, quant group: DeepSeek-V3's hidden size in 128-groups; a partial last group;
# one row of V2-Lite's hidden size
@pytest.mark.parametrize("T,N,gk", [(2, 7168, 128), (3, 100, 32), (1, 2048, 128)])
def test_residual_kernel_quantizes_y_as_the_fp8_gemms_do(T, N, gk):
    """With a quant group the kernel also writes y quantized per gk columns: bit for bit
    act_quant_kernel's quantization of the y it stored (what the fp8 GEMMs would compute
    in their own launch) and quantize_rows_torch's; h and y as without it."""
    from lowering.gemm import fp8_act_quant
    dt = torch.bfloat16 if DEV == "cuda" else torch.float16
    g = torch.Generator().manual_seed(T * 7 + N)
    p = (torch.randn(2, T, N, generator=g) * 3).to(DEV)
    r = (torch.randn(T, N, generator=g) * 2).to(DEV, dt)
    w = (torch.rand(N, generator=g) + 0.5).to(DEV, dt)
    outs = [torch.full((T, N), float("nan"), device=DEV, dtype=dt) for _ in range(4)]
    norm.launch_residual(p, r, w, 1e-6, outs[0], outs[1])
    G = -(-N // gk)
    yq = torch.empty((T, N), dtype=torch.float8_e4m3fn, device=DEV)
    ys = torch.full((T, G), float("nan"), device=DEV)
    norm.launch_residual(p, r, w, 1e-6, outs[2], outs[3], (yq, ys), gk)
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[3])
    want_q, want_s, _ = fp8_act_quant.quantized(outs[1], gk, True)
    assert torch.equal(ys, want_s) and torch.equal(yq.view(torch.uint8), want_q.view(torch.uint8))
    tq, ts = fp8_act_quant.quantize_rows_torch(outs[1].cpu(), gk)
    assert torch.equal(ts, ys.cpu()) and torch.equal(tq.view(torch.uint8), yq.cpu().view(torch.uint8))
    assert ys.min() > 0 and yq.float().abs().amax() == 448          # each group's max at 448


def test_residual_fp8_op_torch_path_and_errors():
    """Off CUDA the fp8 op is the residual op plus quantize_rows_torch of its y; a bad group
    or bad partials are refused naming them; its fake matches."""
    from lowering.gemm import fp8_act_quant
    g = torch.Generator().manual_seed(6)
    p = torch.randn(2, 3, 256, generator=g)
    r = torch.randn(3, 256, generator=g).to(torch.bfloat16)
    w = torch.rand(256, generator=g).add(0.5).to(torch.bfloat16)
    h, y, yq, ys = torch.ops.mla.residual_rms_norm_fp8(p, r, w, 1e-6, 128)
    h0, y0 = torch.ops.mla.residual_rms_norm(p, r, w, 1e-6)
    q0, s0 = fp8_act_quant.quantize_rows_torch(y0, 128)
    assert torch.equal(h, h0) and torch.equal(y, y0) and torch.equal(ys, s0)
    assert torch.equal(yq.view(torch.uint8), q0.view(torch.uint8)) and ys.shape == (3, 2)
    for bad in (0, 100, 2048):
        with pytest.raises(ValueError, match="group_k"):
            torch.ops.mla.residual_rms_norm_fp8(p, r, w, 1e-6, bad)
    with pytest.raises(ValueError, match="parts must be fp32"):
        torch.ops.mla.residual_rms_norm_fp8(p[:, :1], r, w, 1e-6, 128)
    torch.library.opcheck(torch.ops.mla.residual_rms_norm_fp8.default, (p, r, w, 1e-6, 128),
                          test_utils=("test_faketensor",))


@pytest.mark.skipif(DEV != "cuda", reason="the op's Triton path runs on CUDA")
def test_residual_fp8_op_on_gpu_is_the_separate_ops():
    """bf16 on CUDA: h and y of mla::residual_rms_norm bit for bit, and y quantized as the
    fp8 GEMMs' own quant launch quantizes it, eager and compiled."""
    from lowering.gemm import fp8_act_quant
    g = torch.Generator().manual_seed(4)
    p = torch.randn(4, 3, 1, 7168, generator=g).to(DEV)
    r = torch.randn(3, 1, 7168, generator=g).to(DEV, torch.bfloat16)
    w = torch.rand(7168, generator=g).add(0.5).to(DEV, torch.bfloat16)

    def f(p, r):
        return torch.ops.mla.residual_rms_norm_fp8(p, r, w, 1e-6, 128)
    h0, y0 = torch.ops.mla.residual_rms_norm(p, r, w, 1e-6)
    q0, s0, _ = fp8_act_quant.quantized(y0.view(3, 7168), 128, True)
    for h, y, yq, ys in (f(p, r), torch.compile(f, fullgraph=True)(p, r)):
        assert torch.equal(h, h0) and torch.equal(y, y0)
        assert torch.equal(ys.view(3, 56), s0)
        assert torch.equal(yq.view(3, 7168).view(torch.uint8), q0.view(torch.uint8))


@pytest.mark.parametrize("T,N,gk", [(2, 7168, 128), (3, 100, 32)])
def test_kernel_quantizes_y_as_the_fp8_gemms_do(T, N, gk):
    """mla::rms_norm's kernel with a quant group (a layer's input norm before an fp8 q_a +
    kv_a): y as without it, and y quantized bit for bit as the GEMMs' own quant launch and
    quantize_rows_torch quantize it; the op's torch path likewise, its bad group named."""
    from lowering.gemm import fp8_act_quant
    dt = torch.bfloat16 if DEV == "cuda" else torch.float16
    g = torch.Generator().manual_seed(T + N)
    x = (torch.randn(T, N, generator=g) * 3).to(DEV, dt)
    w = (torch.rand(N, generator=g) + 0.5).to(DEV, dt)
    y0 = torch.full((T, N), float("nan"), device=DEV, dtype=dt)
    y1 = y0.clone()
    norm.launch(x, w, 1e-6, y0)
    yq = torch.empty((T, N), dtype=torch.float8_e4m3fn, device=DEV)
    ys = torch.full((T, -(-N // gk)), float("nan"), device=DEV)
    norm.launch(x, w, 1e-6, y1, (yq, ys), gk)
    assert torch.equal(y0, y1)
    want_q, want_s, _ = fp8_act_quant.quantized(y1, gk, True)
    assert torch.equal(ys, want_s) and torch.equal(yq.view(torch.uint8), want_q.view(torch.uint8))
    xc, wc = x.cpu().to(torch.bfloat16), w.cpu().to(torch.bfloat16)
    y, q, s = torch.ops.mla.rms_norm_fp8(xc, wc, 1e-6, gk)           # CPU: the torch path
    tq, ts = fp8_act_quant.quantize_rows_torch(torch.ops.mla.rms_norm(xc, wc, 1e-6), gk)
    assert torch.equal(y, torch.ops.mla.rms_norm(xc, wc, 1e-6)) and torch.equal(s, ts)
    assert torch.equal(q.view(torch.uint8), tq.view(torch.uint8))
    with pytest.raises(ValueError, match="group_k"):
        torch.ops.mla.rms_norm_fp8(xc, wc, 1e-6, 48)
    torch.library.opcheck(torch.ops.mla.rms_norm_fp8.default, (xc, wc, 1e-6, gk),
                          test_utils=("test_faketensor",))
