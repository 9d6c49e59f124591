"""mla::moe_block_decode_residual and mla::moe_layer_tail_decode (lowering/moe/tail.py),
a MoE decoder layer's tail as one persistent launch: on the CPU under the Triton
interpreter against a float64 block written here (fp32) and against the shipped ops
(mla::moe_block_decode and its sum; o_proj's partials and mla::residual_rms_norm); the
three router modes, experts chosen by several rows, E not a multiple of the router's
items, H in one and several gate + up slices, one and several programs, 1 to 16 rows.
On a GPU the same against the shipped ops at bf16, eager and in a CUDA graph."""
import os

import pytest
import torch

pytest.importorskip("triton")

import lowering.fused.norm  # noqa: E402,F401  (mla::residual_rms_norm)
import lowering.moe.block  # noqa: E402,F401  (mla::moe_block_decode)
from lowering.gemm import linear as gemm  # noqa: E402
from lowering.moe import router as moe_router  # noqa: E402
from lowering.moe import fp8_tail, tail  # noqa: E402

INTERPRETED = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="Triton kernels on CPU tensors need TRITON_INTERPRET=1")
GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def make_block(kind, T, H, E, I, S, dt=torch.float32, dev="cpu", seed=0):
    """Random block arguments after x: v3 (sigmoid, bias, groups, norm, scale), v2 (softmax
    greedy) or v2g (group-limited greedy); and x [T, H]."""
    g = torch.Generator(device=dev).manual_seed(seed)

    def rnd(*shape, s=1.0):
        return (torch.randn(*shape, generator=g, device=dev) * s).to(dt)
    route = {"v3": lambda: (rnd(E, s=0.1).float(), 0, 8 if E >= 64 else 3, 8 if E >= 64 else 4,
                            4 if E >= 64 else 2, True, 2.5),
             "v2": lambda: (None, 1, 6 if E >= 64 else 3, 1, 1, False, 1.0),
             "v2g": lambda: (None, 2, 3, 4, 2, False, 1.5)}[kind]()
    rest = (rnd(E, H, s=H ** -0.5), *route, rnd(E, 2 * I, H, s=H ** -0.5),
            rnd(E, H, I, s=I ** -0.5), rnd(S, H, s=H ** -0.5), rnd(S, H, s=H ** -0.5),
            rnd(H, S, s=S ** -0.5))
    return rnd(T, H), rest


def block_fp64(x, rest, idx, wgt):
    """The block in float64 with HF's roundings (gate, up, SiLU, h, each pair's output) for
    the choice idx, wgt [T, K]."""
    *_, gate_up, down, sg, su, sd = rest
    dt, (T, H), I = x.dtype, x.shape, gate_up.shape[1] // 2

    def mlp(xt, g_w, u_w, d_w):
        g, u = (g_w.double() @ xt).to(dt).double(), (u_w.double() @ xt).to(dt).double()
        h = ((g * torch.sigmoid(g)).to(dt).double() * u).to(dt).double()
        return d_w.double() @ h
    out = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        xt = x[t].double()
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            out[t] += mlp(xt, gate_up[e, :I], gate_up[e, I:], down[e]).to(dt).double() * float(
                wgt[t, k])
        out[t] += mlp(xt, sg, su, sd)
    return out


def shipped_block(x, rest, residual):
    """mla::moe_block_decode and the sum mla_ops/hf/moe.py makes of it, + residual."""
    pairs, shared = torch.ops.mla.moe_block_decode(x, *rest)
    shared = shared[0] if shared.shape[0] == 1 else shared.sum(0).to(x.dtype)
    return residual + (pairs.sum(1).to(x.dtype) + shared)


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


# kind, T, H, E, I, S, config (BLOCK_ER, CH_R, BN_G, BN_D, BLOCK_K, CH_S, warps, stages,
# programs an SM, CH_G)
CASES = [
    ("v2", 1, 96, 8, 40, 72, (16, 64, 16, 32, 32, 2048, 4, 1, 2, 2048)),
    ("v3", 5, 96, 16, 40, 72, (16, 32, 16, 32, 32, 32, 4, 1, 2, 32)),    # H in 3 g+u slices
    ("v2g", 3, 80, 16, 24, 56, (16, 2048, 16, 16, 32, 32, 4, 1, 2, 2048)),
    ("v2", 16, 64, 24, 32, 48, (16, 32, 16, 16, 32, 32, 4, 1, 2, 32)),   # 16 rows, E % 16
]


@INTERPRETED
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-T{c[1]}")
@pytest.mark.parametrize("programs", [1, 3])
def test_block_vs_fp64_and_the_shipped_op(case, programs, monkeypatch):
    kind, T, H, E, I, S, cfg = case
    monkeypatch.setitem(tail.CONFIGS, (E, H, I, S), cfg)
    x, rest = make_block(kind, T, H, E, I, S, seed=T)
    residual = torch.randn(T, H)
    out, idx, wgt = tail.launch(x, residual, *rest, programs=programs)[:3]
    assert not tail._SYNC[x.device].any()          # the launch leaves its counters zeroed
    ref_idx, ref_w = moe_router.launch(x, *rest[:8])
    K = rest[3]
    assert torch.equal(idx.view(T, K).long(), ref_idx)
    assert torch.allclose(wgt.view(T, K), ref_w, rtol=1e-6, atol=0)
    ref = block_fp64(x, rest, ref_idx, ref_w) + residual.double()
    assert rel(out, ref) < 1e-5
    assert rel(out, shipped_block(x, rest, residual)) < 1e-5
    if T > 1 and len(set(ref_idx.flatten().tolist())) == T * K:
        pytest.fail("no expert chosen by two rows: the case tests no run")   # (the seeds do)


@INTERPRETED
def test_op_and_its_checks():
    x, rest = make_block("v3", 2, 96, 16, 40, 72, seed=3)
    residual = torch.randn(2, 96)
    out = torch.ops.mla.moe_block_decode_residual(x, residual, *rest)
    assert rel(out, shipped_block(x, rest, residual)) < 1e-5
    with pytest.raises(ValueError, match="residual must be"):
        torch.ops.mla.moe_block_decode_residual(x, residual[:1], *rest)
    with pytest.raises(ValueError, match="17 rows"):
        torch.ops.mla.moe_block_decode_residual(torch.randn(17, 96), torch.randn(17, 96), *rest)
    with pytest.raises(TypeError, match="shared_down"):
        torch.ops.mla.moe_block_decode_residual(x, residual, *rest[:-1], rest[-1].double())
    with pytest.raises(ValueError, match="o_proj must be"):
        torch.ops.mla.moe_layer_tail_decode(torch.randn(2, 64), torch.randn(96, 32), residual,
                                            torch.ones(96), 1e-6, *rest)


def shipped_front(o_rows, o_proj, residual, nw, eps, rest):
    """The shipped layer after W_UV: o_proj's split-K partials, mla::residual_rms_norm, the
    block on the normed rows with h1 as the residual."""
    parts = torch.ops.mla.decode_linear_partials(o_rows, o_proj,
                                                 max(1, gemm.linear_split_k(o_rows, o_proj)))
    h1, x = torch.ops.mla.residual_rms_norm(parts, residual, nw, eps)
    return shipped_block(x, rest, h1), x, h1


FRONT_CASES = [  # kind, T, H, E, I, S, NV, dtype, config, front config
    ("v2", 1, 96, 8, 40, 72, 80, torch.float32, (16, 64, 16, 32, 32, 2048, 4, 1, 2, 2048),
     (32, 32)),
    ("v3", 4, 96, 16, 40, 72, 64, torch.float32, (16, 32, 16, 32, 32, 32, 4, 1, 2, 32),
     (16, 2048)),
    # 16-bit: fp16, whose conversions the interpreter rounds to nearest (it truncates
    # fp32 -> bf16, so bf16 is held to HF's roundings on the GPU only)
    ("v2g", 3, 80, 16, 24, 56, 96, torch.float16, (16, 2048, 16, 16, 32, 32, 4, 1, 2, 2048),
     (16, 64)),
]


@INTERPRETED
@pytest.mark.parametrize("case", FRONT_CASES, ids=lambda c: f"{c[0]}-T{c[1]}-{str(c[7])[6:]}")
def test_layer_tail_vs_the_shipped_ops(case):
    kind, T, H, E, I, S, NV, dt, cfg, fcfg = case
    _, rest = make_block(kind, T, H, E, I, S, dt, seed=10 + T)
    g = torch.Generator().manual_seed(T)
    o_rows = torch.randn(T, NV, generator=g).to(dt)
    o_proj = (torch.randn(H, NV, generator=g) * NV ** -0.5).to(dt)
    residual = torch.randn(T, H, generator=g).to(dt)
    nw = (1 + 0.1 * torch.randn(H, generator=g)).to(dt)
    shipped, x_ref, h1_ref = shipped_front(o_rows, o_proj, residual, nw, 1e-6, rest)
    for programs in (1, 3):
        out, idx, _, x, h1 = tail.launch(None, residual, *rest, front=(o_rows, o_proj, nw, 1e-6),
                                         config=cfg, front_config=fcfg, programs=programs)
        # h1 and x as float64 with HF's roundings, up to the rounding of o_proj's fp32 sum
        # (fp16: where it flips, an ulp of o, then of h1 and x)
        o = (o_rows.double() @ o_proj.double().T).to(dt).double()
        h1_64 = (residual.double() + o).to(dt)
        hf = h1_64.float()
        x_64 = nw.float() * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dt)
        tol = 2.0 ** -10 if dt == torch.float16 else 1e-5
        assert rel(h1, h1_64) <= tol and rel(x, x_64.to(dt)) <= tol
        if dt == torch.float32:
            assert rel(h1, h1_ref) <= tol and rel(x, x_ref) <= tol
        ref_idx, ref_w = moe_router.launch(x, *rest[:8])
        assert torch.equal(idx.view(T, -1).long(), ref_idx)
        ref = block_fp64(x, rest, ref_idx, ref_w) + h1.double()
        base = rel(shipped_block(x, rest, h1), ref)          # the shipped block on the same x
        assert rel(out, ref) < (1e-5 if dt == torch.float32 else 2 * base + 1e-2)
        if dt == torch.float32:
            assert rel(out, shipped) < 1e-5
    if dt == torch.float32:
        op = torch.ops.mla.moe_layer_tail_decode(o_rows, o_proj, residual, nw, 1e-6, *rest)
        assert rel(op, shipped) < 1e-5


def make_fp8(rest, seed=0):
    """rest with the experts' and shared experts' weights e4m3 and random 128 x 128 block
    scales (gate_up's gate and up rows in blocks of their own): (rest, (gate_up, down,
    shared gate, up, down scales))."""
    g = torch.Generator(device=rest[0].device).manual_seed(seed + 200)

    def q(w, split):
        e4m3 = (torch.randn(w.shape, generator=g, device=w.device) * 100).clamp(-448, 448)
        lead, (N, K) = w.shape[:-2], w.shape[-2:]
        rows = 2 * -(-N // 256) if split else -(-N // 128)
        sc = torch.rand(*lead, rows, -(-K // 128), generator=g, device=w.device)
        return e4m3.to(torch.float8_e4m3fn), sc * 2e-4 + 1e-5
    pairs = [q(w, n == 0) for n, w in enumerate(rest[8:])]
    return (*rest[:8], *[w for w, _ in pairs]), tuple(sc for _, sc in pairs)


def fp8_args(rest, scales):
    """mla::moe_block_decode_fp8's arguments after x."""
    gu, dn, sg, su, sd = rest[8:]
    gus, dns, sgs, sus, sds = scales
    return (*rest[:8], gu, gus, dn, dns, sg, sgs, su, sus, sd, sds, 128, 128)


def shipped_fp8(x, rest, scales, residual):
    pairs, shared = torch.ops.mla.moe_block_decode_fp8(x, *fp8_args(rest, scales))
    return residual + (pairs.sum(1).to(x.dtype) + shared[0])


@INTERPRETED
@pytest.mark.parametrize("kind,T,programs", [("v2", 1, 1), ("v3", 3, 3)])
def test_fp8_block_vs_the_shipped_op(kind, T, programs, monkeypatch):
    """e4m3 experts (W8A8): the op against mla::moe_block_decode_fp8 and its sum, fp32 rows,
    H in one and in two gate + up slices."""
    H, E, I, S = 256, 8 if kind == "v2" else 16, 192, 256
    x, rest = make_block(kind, T, H, E, I, S, seed=20 + T)
    rest, scales = make_fp8(rest, seed=T)
    residual = torch.randn(T, H)
    monkeypatch.setitem(fp8_tail.CONFIGS, (E, H, I, S),
                        (16, 128, 16, 32, 128, 128, 4, 1, 2, 2048 if T == 1 else 128))
    want = shipped_fp8(x, rest, scales, residual)
    got = torch.ops.mla.moe_block_decode_fp8_residual(x, residual, *fp8_args(rest, scales))
    assert rel(got, want) < 1e-5
    out = tail.launch(x, residual, *rest[:8], *rest[8:], scales=scales, programs=programs,
                      config=fp8_tail.CONFIGS[(E, H, I, S)])[0]
    assert rel(out, want) < 1e-5
    with pytest.raises(ValueError, match="gate_up_scale"):
        torch.ops.mla.moe_block_decode_fp8_residual(
            x, residual, *fp8_args(rest, (scales[0][:, :1], *scales[1:])))


@INTERPRETED
@pytest.mark.parametrize("dt", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_fp8_layer_tail(dt, monkeypatch):
    """An FP8 checkpoint's layer tail (e4m3 o_proj and experts): h1 against float64 W8A8,
    the output against the shipped fp8 block on the launch's own x and h1."""
    from lowering.gemm.fp8_act_quant import quantize_rows_torch
    T, H, E, I, S, NV = 2, 256, 16, 128, 192, 384
    _, rest = make_block("v3", T, H, E, I, S, dt, seed=30)
    rest, scales = make_fp8(rest, seed=3)
    g = torch.Generator().manual_seed(300)
    o_rows = torch.randn(T, NV, generator=g).to(dt)
    wq = (torch.randn(H, NV, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    wos = torch.rand(2, 3, generator=g) * 2e-4 + 1e-5                       # [H/128, NV/128]
    residual = torch.randn(T, H, generator=g).to(dt)
    nw = (1 + 0.1 * torch.randn(H, generator=g)).to(dt)
    cfg = (16, 128, 16, 32, 128, 128, 4, 1, 2, 128)
    monkeypatch.setitem(fp8_tail.CONFIGS, (E, H, I, S), cfg)
    out, _, _, x, h1 = tail.launch(None, residual, *rest, front=(o_rows, wq, nw, 1e-6, wos),
                                   config=cfg, front_config=(16, 128), programs=3,
                                   scales=scales)
    aq, a_s = quantize_rows_torch(o_rows, 128)                          # W8A8 in float64
    a64 = aq.double() * a_s.double().repeat_interleave(128, -1)[..., :NV]
    w64 = wq.double() * wos.double().repeat_interleave(128, 0).repeat_interleave(128, 1)
    h1_64 = (residual.double() + (a64 @ w64.T).to(dt).double()).to(dt)
    assert rel(h1, h1_64) <= (2.0 ** -10 if dt == torch.float16 else 1e-5)
    assert rel(out, shipped_fp8(x, rest, scales, h1)) < (1e-5 if dt == torch.float32 else 2e-3)
    op = torch.ops.mla.moe_layer_tail_decode_fp8(o_rows, wq, wos, residual, nw, 1e-6,
                                                 *fp8_args(rest, scales))
    assert rel(op, out) < (1e-6 if dt == torch.float32 else 1e-3)


@GPU
@pytest.mark.parametrize("kind,T", [("v2", 1), ("v2", 4), ("v3", 1), ("v3", 16)])
def test_on_gpu_against_the_shipped_ops(kind, T):
    shapes = {"v2": (2048, 64, 1408, 2816, 2048), "v3": (7168, 256, 2048, 2048, 16384)}
    H, E, I, S, NV = shapes[kind]
    x, rest = make_block(kind, T, H, E, I, S, torch.bfloat16, dev="cuda", seed=T)
    residual = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    assert tail.serves(x, rest[0], *rest[8:])
    ref = shipped_block(x, rest, residual)
    out = torch.ops.mla.moe_block_decode_residual(x, residual, *rest)
    assert rel(out, ref) < 2e-2
    g = torch.cuda.CUDAGraph()                  # captured: the counters left zeroed each time
    with torch.cuda.graph(g):
        captured = torch.ops.mla.moe_block_decode_residual(x, residual, *rest)
    for _ in range(3):
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, out)
    o_rows = torch.randn(T, NV, device="cuda").to(torch.bfloat16)
    o_proj = (torch.randn(H, NV, device="cuda") * NV ** -0.5).to(torch.bfloat16)
    nw = (1 + 0.1 * torch.randn(H, device="cuda")).to(torch.bfloat16)
    shipped = shipped_front(o_rows, o_proj, residual, nw, 1e-6, rest)[0]
    got = torch.ops.mla.moe_layer_tail_decode(o_rows, o_proj, residual, nw, 1e-6, *rest)
    assert rel(got, shipped) < 3e-2


@GPU
@pytest.mark.parametrize("T", [1, 4])
def test_fp8_on_gpu_against_the_shipped_op(T):
    """DeepSeek-V3's FP8 block at its real shape: the op against mla::moe_block_decode_fp8
    and its sum (bf16 rows)."""
    H, E, I, S = 7168, 256, 2048, 2048
    x, rest = make_block("v3", T, H, E, I, S, torch.bfloat16, dev="cuda", seed=T)
    rest, scales = make_fp8(rest, seed=T)
    residual = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    want = shipped_fp8(x, rest, scales, residual)
    got = torch.ops.mla.moe_block_decode_fp8_residual(x, residual, *fp8_args(rest, scales))
    assert rel(got, want) < 2e-2
