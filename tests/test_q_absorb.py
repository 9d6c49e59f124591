"""mla::decode_q_absorb (lowering/fused/q_absorb.py, q_absorb_kernel.py): q_b, the query's RoPE
and the absorbed W_UK_T GEMM in one launch. The kernel vs float64 (CPU: the Triton
interpreter in fp32; GPU: bf16), the op's torch path bit for bit against the unfused
ops, bad input."""
import pytest
import torch

pytest.importorskip("triton")

from lowering.fused import q_absorb  # noqa: E402
from test_prologue import _inputs, _rel, _rope64  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _weights(T, Q, N, P, R, L, g):
    """float64 q_a [T, Q], w [N * (P + R), Q], W_UK_T [N, P, L] with O(1) products."""
    q_a = torch.randn(T, Q, generator=g, dtype=torch.float64)
    w = torch.randn(N * (P + R), Q, generator=g, dtype=torch.float64) * Q ** -0.5
    wuk = torch.randn(N, P, L, generator=g, dtype=torch.float64) * P ** -0.5
    return q_a, w, wuk


def _reference(q_a, w, wuk, cos, sin, interleave, round_to=None):
    """float64 [q_nope @ W_UK_T | RoPE(q_pe)] of q = q_a @ w.T; round_to: q's dtype after
    q_b (the kernel rounds there as the unfused q_b output does)."""
    N, P, L = wuk.shape
    R = cos.shape[-1]
    q = (q_a @ w.T).view(-1, N, P + R)
    if round_to is not None:
        q = q.to(round_to).double()
    nope = torch.einsum("tnp,npl->tnl", q[..., :P], wuk)
    return torch.cat([nope, _rope64(q[..., P:], cos[:, None], sin[:, None], interleave)], -1)


# tokens, Q, heads, P, R, L, interleave: one token, rows not a multiple of the 16-row block,
# Q over several K steps, rope half-widths 16 and 32, V3's query (Q 1536, P 128, R 64,
# L 512) at 32 rows
CASES = [
    (1, 64, 3, 16, 32, 32, True),
    (5, 96, 2, 32, 32, 48, False),
    (17, 32, 2, 16, 64, 64, True),
    (32, 1536, 2, 128, 64, 512, True),
]


@pytest.mark.parametrize("T,Q,N,P,R,L,interleave", CASES)
def test_kernel_vs_fp64(T, Q, N, P, R, L, interleave):
    g = torch.Generator().manual_seed(T * 100 + Q)
    dt, tol = (torch.bfloat16, 2e-2) if DEV == "cuda" else (torch.float32, 1e-5)
    q_a, w, wuk = _weights(T, Q, N, P, R, L, g)
    _, _, _, cos, sin = _inputs(1, T, 1, 1, R, g, dt)
    q_a, w, wuk = q_a.to(dt), w.to(dt), wuk.to(dt)
    ref = _reference(q_a.double(), w.double(), wuk.double(), cos, sin, interleave, dt)
    y = torch.full((T, N, L + R), float("nan"), dtype=dt, device=DEV)
    q_absorb.launch(q_a.to(DEV), w.to(DEV), wuk.to(DEV), cos.to(DEV), sin.to(DEV),
                             interleave, y)
    assert not y.isnan().any()
    assert _rel(y[..., :L], ref[..., :L]) < tol
    assert _rel(y[..., L:], ref[..., L:]) < tol


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_path_equals_unfused_ops(interleave, dtype):
    """Off the kernel the op is q_b (F.linear), mla::decode_q_rope and the absorbed GEMM
    (lowering.gemm.head_gemm.absorb_query), bit for bit."""
    from lowering.gemm.head_gemm import absorb_query
    g = torch.Generator().manual_seed(5)
    B, S, Q, N, P, R, L = 2, 3, 24, 4, 16, 8, 32
    q_a, w, wuk = (t.to(dtype) for t in _weights(B * S, Q, N, P, R, L, g))
    _, _, _, cos, sin = _inputs(1, B * S, 1, 1, R, g, dtype)
    q_a, cos, sin = q_a.view(B, S, Q), cos.view(B, S, R), sin.view(B, S, R)
    y = torch.ops.mla.decode_q_absorb(q_a, w, wuk, cos, sin, interleave)
    q = torch.nn.functional.linear(q_a, w).view(B, S, N, P + R)
    q = torch.ops.mla.decode_q_rope(q, cos, sin, interleave)
    assert torch.equal(y, absorb_query(q.view(B * S, N, P + R), wuk))


def test_bad_input_is_named():
    op = torch.ops.mla.decode_q_absorb
    q_a, w, wuk = torch.randn(3, 8), torch.randn(2 * (4 + 6), 8), torch.randn(2, 4, 16)
    cs = torch.ones(3, 6)
    with pytest.raises(TypeError, match="q_a must be a floating"):
        op(q_a.long(), w, wuk, cs, cs, True)
    with pytest.raises(TypeError, match="W_UK_T"):
        op(q_a, w, wuk.double(), cs, cs, True)
    with pytest.raises(ValueError, match="w must be"):
        op(q_a, torch.randn(2 * (4 + 5), 8), wuk, cs, cs, True)
    with pytest.raises(ValueError, match="even RoPE"):
        op(q_a, torch.randn(2 * (4 + 5), 8), wuk, torch.ones(3, 5), torch.ones(3, 5), True)
    with pytest.raises(ValueError, match="sin must be"):
        op(q_a, w, wuk, cs, torch.ones(2, 6), True)
    with pytest.raises(ValueError, match="q_a"):
        op(torch.randn(3, 7), w, wuk, cs, cs, True)
    with pytest.raises(TypeError, match="cos must be a floating"):
        op(q_a, w, wuk, cs.long(), cs, True)


@pytest.mark.parametrize("T,Q,N,P,R,L,interleave", [CASES[0], CASES[2], CASES[3]])
def test_kernel_fp8_output_is_the_static_quant_of_its_query(T, Q, N, P, R, L, interleave):
    """With q_scale the kernel stores fp8(clamp(y / q_scale, +-448)) of the query y it
    stores without: bit for bit the static quant of that y, and float64's within e4m3's
    rounding (a scale that saturates some values: they hold +-448)."""
    g = torch.Generator().manual_seed(T * 10 + Q)
    dt = torch.bfloat16 if DEV == "cuda" else torch.float32
    q_a, w, wuk = (t.to(dt).to(DEV) for t in _weights(T, Q, N, P, R, L, g))
    _, _, _, cos, sin = _inputs(1, T, 1, 1, R, g, dt)
    cos, sin = cos.to(DEV), sin.to(DEV)
    y = torch.empty((T, N, L + R), dtype=dt, device=DEV)
    q_absorb.launch(q_a, w, wuk, cos, sin, interleave, y)
    scale = (y.float().abs().amax() / 448.0 * 0.8).reshape(1)     # the top values saturate
    y8 = torch.zeros((T, N, L + R), dtype=torch.float8_e4m3fn, device=DEV)
    q_absorb.launch(q_a, w, wuk, cos, sin, interleave, y8, q_scale=scale)
    want = (y.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    assert torch.equal(y8.view(torch.uint8), want.view(torch.uint8))
    assert (y8.float().abs() == 448).any()
    ref = _reference(q_a.double().cpu(), w.double().cpu(), wuk.double().cpu(), cos.cpu(),
                     sin.cpu(), interleave, dt) / scale.double().cpu()
    # e4m3 rounds to within 2^-4 of a value (RMS ~2.5 %); bf16 adds its 2e-2 on the GPU
    assert _rel(y8.double().cpu(), ref.clamp(-448, 448)) < 4e-2 + (2e-2 if DEV == "cuda" else 0)


def test_fp8_op_quantizes_decode_q_absorb_and_names_a_bad_scale():
    """The op (torch path off the kernel) is the static quant of mla::decode_q_absorb."""
    g = torch.Generator().manual_seed(9)
    Q, N, P, R, L = 24, 4, 16, 8, 32
    q_a, w, wuk = (t.float() for t in _weights(5, Q, N, P, R, L, g))
    _, _, _, cos, sin = _inputs(1, 5, 1, 1, R, g, torch.float32)
    scale = torch.tensor([0.01])
    y8 = torch.ops.mla.decode_q_absorb_fp8(q_a, w, wuk, cos, sin, True, scale)
    y = torch.ops.mla.decode_q_absorb(q_a, w, wuk, cos, sin, True)
    want = (y / 0.01).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert y8.dtype == torch.float8_e4m3fn and torch.equal(y8.float(), want.float())
    for bad in (torch.tensor([0.01], dtype=torch.float64), torch.tensor([0.01, 0.02])):
        with pytest.raises(TypeError, match="q_scale must be a one-element float32"):
            torch.ops.mla.decode_q_absorb_fp8(q_a, w, wuk, cos, sin, True, bad)


# rope 2: DeepSeek-V2's complex pairs (cos / sin: its freqs_cis parts, [T, R / 2] fp32)
@pytest.mark.parametrize("T,Q,N,P,R,L", [(1, 64, 3, 16, 32, 32), (17, 32, 2, 16, 64, 64),
                                         (32, 1536, 2, 128, 64, 512)])
def test_kernel_complex_rope_vs_fp64(T, Q, N, P, R, L):
    from test_prologue import _complex_angles, _rope_complex64
    g = torch.Generator().manual_seed(T * 10 + Q + 1)
    dt, tol = (torch.bfloat16, 2e-2) if DEV == "cuda" else (torch.float32, 1e-5)
    q_a, w, wuk = _weights(T, Q, N, P, R, L, g)
    cos, sin = _complex_angles(T, R // 2, g)
    q_a, w, wuk = q_a.to(dt), w.to(dt), wuk.to(dt)
    q = (q_a.double() @ w.double().T).view(T, N, P + R).to(dt).double()
    ref = torch.cat([torch.einsum("tnp,npl->tnl", q[..., :P], wuk.double()),
                     _rope_complex64(q[..., P:], cos[:, None], sin[:, None])], -1)
    y = torch.full((T, N, L + R), float("nan"), dtype=dt, device=DEV)
    q_absorb.launch(q_a.to(DEV), w.to(DEV), wuk.to(DEV), cos.to(DEV), sin.to(DEV), 2, y)
    assert not y.isnan().any()
    assert _rel(y[..., :L], ref[..., :L]) < tol
    assert _rel(y[..., L:], ref[..., L:]) < tol


def test_complex_rope_torch_path_equals_hf():
    """Off the kernel the op with rope 2 is q_b, HF's V2 apply_rotary_emb and the absorbed
    GEMM: the RoPE'd columns bit for bit against HF's function."""
    from test_prologue import _complex_angles
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as m
    g = torch.Generator().manual_seed(21)
    B, Q, N, P, R, L = 3, 32, 2, 16, 8, 24
    q_a, w, wuk = (t.bfloat16() for t in _weights(B, Q, N, P, R, L, g))
    cos, sin = _complex_angles(B, R // 2, g)
    y = torch.ops.mla.decode_q_absorb(q_a, w, wuk, cos, sin, 2)
    q = torch.nn.functional.linear(q_a, w).view(B, 1, N, P + R).transpose(1, 2)
    q_pe, _ = m.apply_rotary_emb(q[..., P:], q[..., P:], torch.complex(cos, sin)[:, None])
    assert torch.equal(y[..., L:], q_pe.transpose(1, 2)[:, 0])
    with pytest.raises(ValueError, match="rope must be"):
        torch.ops.mla.decode_q_absorb(q_a, w, wuk, cos, sin, 3)


# ------------------------------------------------------------ an FP8 checkpoint's q_b (W8A8)

# tokens, Q, heads, P, R, L, the scale block (gn, gk), interleave: scale row blocks that
# split heads (gn 32 over 48-row heads), K steps of 32, V3's query widths at two heads
W8A8_CASES = [
    (1, 256, 2, 16, 32, 32, 32, 128, True),
    (5, 96, 3, 16, 32, 48, 128, 32, False),
    (3, 1536, 2, 128, 64, 512, 128, 128, True),
]


@pytest.mark.parametrize("T,Q,N,P,R,L,gn,gk,interleave", W8A8_CASES)
def test_w8a8_kernel_vs_fp64(T, Q, N, P, R, L, gn, gk, interleave):
    """q_b as HF's FP8Linear computes it (q_a quantized per gk columns, fp8 x fp8 times
    both block scales), rounded to q_a's dtype, then RoPE and the absorption: against the
    same in float64."""
    from lowering.gemm.fp8_act_quant import quantize_rows_torch
    from test_fp8_checkpoint import expand_scales, quant_act_ref, rand_fp8
    g = torch.Generator().manual_seed(T * 10 + Q + gn)
    dt, tol = (torch.bfloat16, 2e-2) if DEV == "cuda" else (torch.float32, 1e-5)
    q_a = (torch.randn(T, Q, generator=g) * 2).to(dt)
    w, s = rand_fp8(N * (P + R), Q, g, gn, gk)
    wuk = (torch.randn(N, P, L, generator=g) * P ** -0.5).to(dt)
    _, _, _, cos, sin = _inputs(1, T, 1, 1, R, g, dt)
    q64 = quant_act_ref(q_a.float(), gk) @ (w.double() * expand_scales(s, *w.shape, gn, gk)).T
    ref = _reference(q64, torch.eye(N * (P + R), dtype=torch.float64), wuk.double(), cos, sin,
                     interleave, dt)
    q_q, q_s = quantize_rows_torch(q_a, gk)
    y = torch.full((T, N, L + R), float("nan"), dtype=dt, device=DEV)
    q_absorb.launch(q_q.to(DEV), w.to(DEV), wuk.to(DEV), cos.to(DEV), sin.to(DEV),
                    interleave, y, config=q_absorb.w8a8_config(T, Q, L, gk),
                    w8a8=(s.to(DEV), q_s.to(DEV), gn))
    assert not y.isnan().any()
    assert _rel(y[..., :L], ref[..., :L]) < tol
    assert _rel(y[..., L:], ref[..., L:]) < tol


def test_w8a8_op_torch_path_and_bad_input():
    """Off the kernel the op is the fp8 decode GEMM op, the query's RoPE and the absorbed
    GEMM, bit for bit (with q_scale, then the static quant); bad weights, scales or a
    quantized q_a that does not match are named."""
    from lowering.gemm.fp8_act_quant import quantize_rows_torch
    from lowering.gemm.head_gemm import absorb_query
    from test_fp8_checkpoint import rand_fp8
    g = torch.Generator().manual_seed(9)
    T, Q, N, P, R, L = 3, 256, 2, 16, 32, 32
    q_a = torch.randn(T, Q, generator=g).to(torch.bfloat16)
    w, s = rand_fp8(N * (P + R), Q, g)
    wuk = (torch.randn(N, P, L, generator=g) * 0.25).to(torch.bfloat16)
    _, _, _, cos, sin = _inputs(1, T, 1, 1, R, g, torch.bfloat16)
    q_q, q_s = quantize_rows_torch(q_a, 128)
    args = (q_a, q_q, q_s, w, s, wuk, cos, sin, 1, 128, 128)
    y = torch.ops.mla.decode_q_absorb_w8a8(*args)
    q = torch.ops.mla.decode_linear_fp8(q_a, w, s, 128, 128).view(T, N, P + R)
    want = absorb_query(torch.ops.mla.decode_q_rope(q, cos, sin, True), wuk)
    assert torch.equal(y, want)
    scale = torch.tensor([0.05])
    y8 = torch.ops.mla.decode_q_absorb_w8a8(*args, scale)
    assert torch.equal(y8.view(torch.uint8), (want.float() / 0.05).clamp(-448, 448).to(
        torch.float8_e4m3fn).view(torch.uint8))
    with pytest.raises(TypeError, match="w must be"):
        torch.ops.mla.decode_q_absorb_w8a8(q_a, q_q, q_s, w.to(torch.bfloat16), *args[4:])
    with pytest.raises(ValueError, match="weight_scale_inv"):
        torch.ops.mla.decode_q_absorb_w8a8(*args[:4], s[:, :1], *args[5:])
    with pytest.raises(ValueError, match="x_s"):
        torch.ops.mla.decode_q_absorb_w8a8(q_a, q_q, q_s[:, :1], *args[3:])
    torch.library.opcheck(torch.ops.mla.decode_q_absorb_w8a8.default, args,
                          test_utils=("test_faketensor",))


# ------------------------------------------ DeepSeek-V2 without q_lora: from the partials

# splits, tokens, heads, P, R, L: one token, one split; rows past one 16-row block; a
# head's absorption in two programs (L 256); V2-Lite's widths (16 heads, P 128, R 64, L
# 512: four programs a head) at 32 rows and 4 splits
Q_KV_CASES = [(1, 1, 2, 16, 32, 32), (3, 17, 3, 32, 32, 48), (2, 5, 2, 16, 32, 256),
              (4, 32, 16, 128, 64, 512)]


@pytest.mark.parametrize("S,T,N,P,R,L", Q_KV_CASES)
def test_q_kv_kernel_vs_fp64(S, T, N, P, R, L):
    """The absorbed query and the cache row from the partials, against float64: the sums
    rounded to the activation dtype, V2's complex RoPE, the absorption, the key's norm."""
    from test_prologue import _complex_angles, _rope_complex64
    g = torch.Generator().manual_seed(S * 100 + T + N)
    dt, tol = (torch.bfloat16, 2e-2) if DEV == "cuda" else (torch.float32, 1e-5)
    NQ = N * (P + R)
    part = torch.randn(S, T, NQ + L + R, generator=g, dtype=torch.float64) * 3
    w_kv = (1 + 0.5 * torch.randn(L, generator=g, dtype=torch.float64)).to(dt)
    wuk = (torch.randn(N, P, L, generator=g, dtype=torch.float64) * P ** -0.5).to(dt)
    cos, sin = _complex_angles(T, R // 2, g)
    x = part.float().sum(0).double()           # (the kernel's fp32 sum is within tol of it)
    q = x[:, :NQ].reshape(T, N, P + R).to(dt).double()
    kv, k = x[:, NQ:NQ + L].to(dt).double(), x[:, NQ + L:].to(dt).double()
    ref_q = torch.cat([torch.einsum("tnp,npl->tnl", q[..., :P], wuk.double()),
                       _rope_complex64(q[..., P:], cos[:, None], sin[:, None])], -1)
    ref_kv = torch.cat([kv / torch.sqrt((kv * kv).mean(-1, keepdim=True) + 1e-6)
                        * w_kv.double(), _rope_complex64(k, cos, sin)], -1)
    y = torch.full((T, N, L + R), float("nan"), dtype=dt, device=DEV)
    kv_out = torch.full((T, L + R), float("nan"), dtype=dt, device=DEV)
    q_absorb.launch_q_kv(part.float().to(DEV), w_kv.to(DEV), wuk.to(DEV), cos.to(DEV),
                         sin.to(DEV), 1e-6, y, kv_out)
    assert not (y.isnan().any() or kv_out.isnan().any())
    assert _rel(y[..., :L], ref_q[..., :L]) < tol and _rel(y[..., L:], ref_q[..., L:]) < tol
    assert _rel(kv_out[:, :L], ref_kv[:, :L]) < tol and _rel(kv_out[:, L:], ref_kv[:, L:]) < tol


def test_q_kv_op_torch_path_and_bad_input():
    """Off the kernel the op is mla::decode_q_kv_rope and the absorbed GEMM, bit for bit; a
    W_UK_T of the wrong shape is named."""
    from lowering.gemm.head_gemm import absorb_query
    from test_prologue import _complex_angles
    g = torch.Generator().manual_seed(4)
    S, B, N, P, R, L = 2, 3, 2, 16, 32, 32
    part = torch.randn(S, B, 1, N * (P + R) + L + R, generator=g)
    w_kv = torch.rand(L, generator=g).add(0.5).to(torch.bfloat16)
    wuk = (torch.randn(N, P, L, generator=g) * 0.25).to(torch.bfloat16)
    cos, sin = (a.view(B, 1, R // 2) for a in _complex_angles(B, R // 2, g))
    y, kv = torch.ops.mla.decode_q_kv_absorb(part, w_kv, wuk, cos, sin, 1e-6, N)
    q0, kv0 = torch.ops.mla.decode_q_kv_rope(part, w_kv, cos, sin, 1e-6, N)
    assert torch.equal(kv, kv0) and kv.shape == (B, 1, L + R)
    assert torch.equal(y, absorb_query(q0.reshape(B, N, P + R), wuk))
    with pytest.raises(ValueError, match="W_UK_T"):
        torch.ops.mla.decode_q_kv_absorb(part, w_kv, wuk[:1], cos, sin, 1e-6, N)
    torch.library.opcheck(torch.ops.mla.decode_q_kv_absorb.default,
                          (part, w_kv, wuk, cos, sin, 1e-6, N), test_utils=("test_faketensor",))
