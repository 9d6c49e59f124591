"""The attention prologue ops (lowering/fused/prologue.py, q_rope.py): split-K partial
sums -> q_a norm, kv_c norm and the key's RoPE; the query's RoPE. The kernels vs float64 (CPU: the Triton
interpreter in fp32; GPU: bf16), the ops' torch paths bit for bit against HF's own modules
and RoPE functions, bad input (the converted attention's use of them on a GPU:
test_prologue_models.py)."""
import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("transformers")

from lowering.fused import prologue, q_rope  # noqa: E402
from lowering.fused.decode_rows import angle_rows  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _inputs(S, T, NQ, L, R, g, dtype):
    part = torch.randn(S, T, NQ + L + R, generator=g, dtype=torch.float64) * 3
    w_q = 1 + 0.5 * torch.randn(NQ, generator=g, dtype=torch.float64)
    w_kv = 1 + 0.5 * torch.randn(L, generator=g, dtype=torch.float64)
    pos = torch.randint(0, 5000, (T, 1), generator=g).double()
    freqs = pos / 10000 ** (torch.arange(0, R, 2, dtype=torch.float64) / R)   # [T, R/2]
    emb = torch.cat([freqs, freqs], dim=-1) * 1.2                              # attention scaling
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    return part, w_q.to(dtype), w_kv.to(dtype), cos, sin


def _rope64(x, cos, sin, interleave):
    """float64 RoPE of x [..., R] with cos / sin broadcastable to it (cat(freqs, freqs))."""
    H = x.shape[-1] // 2
    c, s = cos.double(), sin.double()
    if interleave:          # pair j = (x[2j], x[2j+1]), angle j
        x1, x2, c2, s2 = x[..., 0::2], x[..., 1::2], c[..., :H], s[..., :H]
    else:                   # rotate_half: (x[j], x[H+j]), angles j and H + j
        x1, x2, c2, s2 = x[..., :H], x[..., H:], c[..., H:], s[..., H:]
    return torch.cat([x1 * c[..., :H] - x2 * s[..., :H], x2 * c2 + x1 * s2], dim=-1)


def _reference(part, w_q, w_kv, cos, sin, eps, interleave):
    """float64: the same steps on the rounded inputs, no intermediate rounding."""
    NQ, L = w_q.shape[0], w_kv.shape[0]
    x = part.sum(0)
    q, kv, k = x[..., :NQ], x[..., NQ:NQ + L], x[..., NQ + L:]

    def norm(v, w):
        return v / torch.sqrt((v * v).mean(-1, keepdim=True) + eps) * w.double()
    return norm(q, w_q), torch.cat([norm(kv, w_kv), _rope64(k, cos, sin, interleave)], dim=-1)


def _rel(a, ref):
    return ((a.double().cpu() - ref).abs().max() / ref.abs().max()).item()


# split, tokens, NQ, L, R, interleave: one token, one split, widths and half-widths not
# powers of two, V3's widths (NQ 1536, L 512, R 64) at 32 tokens and 4 splits
CASES = [
    (1, 1, 64, 32, 8, False),
    (3, 5, 100, 40, 12, True),
    (2, 3, 30, 20, 6, False),
    (4, 32, 1536, 512, 64, True),
]


@pytest.mark.parametrize("S,T,NQ,L,R,interleave", CASES)
def test_kernel_vs_fp64(S, T, NQ, L, R, interleave):
    g = torch.Generator().manual_seed(S * 100 + T)
    dt, tol = (torch.bfloat16, 2e-2) if DEV == "cuda" else (torch.float32, 1e-5)
    part, w_q, w_kv, cos, sin = _inputs(S, T, NQ, L, R, g, dt)
    ref_q, ref_kv = _reference(part, w_q, w_kv, cos, sin, 1e-6, interleave)
    q_out = torch.empty(T, NQ, dtype=dt, device=DEV)
    kv_out = torch.empty(T, L + R, dtype=dt, device=DEV)
    prologue.launch(part.float().to(DEV), w_q.to(DEV), w_kv.to(DEV), cos.to(DEV), sin.to(DEV),
                    1e-6, 1e-6, interleave, q_out, kv_out)
    assert _rel(q_out, ref_q) < tol
    assert _rel(kv_out[:, :L], ref_kv[:, :L]) < tol
    assert _rel(kv_out[:, L:], ref_kv[:, L:]) < tol


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_path_equals_hf_modules(interleave, dtype):
    """Off the kernel (CPU) the op computes what HF's RMSNorm modules and RoPE functions do,
    bit for bit, in the activation dtype."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m
    g = torch.Generator().manual_seed(7)
    S, B, NQ, L, R = 3, 4, 96, 64, 16
    part, w_q, w_kv, cos, sin = _inputs(S, B, NQ, L, R, g, dtype)
    part = part.float()[:, :, None]                                        # [S, B, 1, W]
    cos, sin = cos[:, None], sin[:, None]                                  # [B, 1, R]
    nq, nkv = m.DeepseekV3RMSNorm(NQ, eps=1e-6), m.DeepseekV3RMSNorm(L, eps=1e-5)
    with torch.no_grad():
        nq.weight.copy_(w_q)
        nkv.weight.copy_(w_kv)
    nq, nkv = nq.to(dtype), nkv.to(dtype)
    q_out, kv_row = torch.ops.mla.decode_qkv_prologue(part, nq.weight, nkv.weight, cos, sin,
                                                       1e-6, 1e-5, interleave)
    x = part.sum(0).to(dtype)
    k = x[..., NQ + L:].reshape(B, 1, 1, R)
    rope = m.apply_rotary_pos_emb_interleave if interleave else m.apply_rotary_pos_emb
    _, k_hf = rope(k, k, cos, sin)
    with torch.no_grad():
        assert torch.equal(q_out, nq(x[..., :NQ]))
        assert torch.equal(kv_row[..., :L], nkv(x[..., NQ:NQ + L]))
    assert torch.equal(kv_row[..., L:], k_hf.reshape(B, 1, R))


def _q_reference(q, cos, sin, interleave):
    """float64 RoPE of q [T, N, P + R]'s last R columns, token t's angles for all heads."""
    R = cos.shape[-1]
    rope = _rope64(q[..., -R:], cos[:, None], sin[:, None], interleave)
    return torch.cat([q[..., :-R], rope], dim=-1)


# tokens, heads, P, R, interleave: one token, rows not a multiple of the 16-row block,
# non-power-of-two widths, V3's head (P 128, R 64)
Q_CASES = [
    (1, 3, 20, 12, True),
    (5, 4, 24, 10, False),
    (32, 8, 128, 64, True),
    (3, 7, 128, 64, False),
]


@pytest.mark.parametrize("T,N,P,R,interleave", Q_CASES)
def test_q_rope_kernel_vs_fp64(T, N, P, R, interleave):
    g = torch.Generator().manual_seed(T * 10 + N)
    dt, tol = (torch.bfloat16, 1e-2) if DEV == "cuda" else (torch.float32, 1e-6)
    _, _, _, cos, sin = _inputs(1, T, 1, 1, R, g, dt)
    q = (torch.randn(T, N, P + R, generator=g, dtype=torch.float64) * 2).to(dt)
    ref = _q_reference(q.double(), cos, sin, interleave)
    y = torch.empty(T, N, P + R, dtype=dt, device=DEV)
    q_rope.launch(q.to(DEV), cos.to(DEV), sin.to(DEV), interleave, y)
    assert torch.equal(y[..., :P].cpu(), q[..., :P])              # q_nope copied as is
    assert _rel(y[..., P:], ref[..., P:]) < tol


@pytest.mark.parametrize("interleave", [True, False])
def test_q_rope_torch_path_equals_hf(interleave):
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m
    g = torch.Generator().manual_seed(11)
    B, S, N, P, R = 2, 3, 4, 16, 8
    _, _, _, cos, sin = _inputs(1, B * S, 1, 1, R, g, torch.bfloat16)
    cos, sin = cos.view(B, S, R), sin.view(B, S, R)
    q = torch.randn(B, S, N, P + R, generator=g).bfloat16()
    y = torch.ops.mla.decode_q_rope(q, cos, sin, interleave)
    rope = m.apply_rotary_pos_emb_interleave if interleave else m.apply_rotary_pos_emb
    q_hf, _ = rope(q[..., P:].transpose(1, 2), q[..., P:].transpose(1, 2), cos, sin)
    assert torch.equal(y[..., :P], q[..., :P])
    assert torch.equal(y[..., P:], q_hf.transpose(1, 2))


def _complex_angles(T, H, g):
    """V2's freqs_cis rows as (cos, sin) [T, H] fp32: angles pos * theta^(-2j / R), scaled."""
    pos = torch.randint(0, 5000, (T, 1), generator=g).double()
    freqs = pos / 10000 ** (torch.arange(H, dtype=torch.float64) / H)
    return (freqs.cos() * 1.1).float(), (freqs.sin() * 1.1).float()


def _rope_complex64(x, cos, sin):
    """float64 V2 RoPE of x [..., R]: pair j = (x[2j], x[2j+1]) times cos_j + i sin_j, in place."""
    c, s = cos.double(), sin.double()
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)


# split, tokens, heads, P, R, L: one token and one split, a head count not a power of two
# and more heads than one program takes, R / 2 not a power of two, V2-Lite's widths
V2_CASES = [
    (1, 1, 2, 20, 12, 40),
    (3, 5, 19, 24, 10, 48),
    (2, 3, 3, 16, 6, 20),
    (4, 32, 16, 128, 64, 512),
]


@pytest.mark.parametrize("views", [False, True], ids=["rows", "freqs_cis"])
@pytest.mark.parametrize("S,T,N,P,R,L", V2_CASES)
def test_v2_kernel_vs_fp64(S, T, N, P, R, L, views):
    """views: the angles as freqs_cis.real / .imag (a column stride of 2), as a V2 model
    hands them, read in place (angle_rows(strided=True) copies nothing)."""
    g = torch.Generator().manual_seed(S * 100 + T + N)
    dt, tol = (torch.bfloat16, 2e-2) if DEV == "cuda" else (torch.float32, 1e-5)
    NQ = N * (P + R)
    part = torch.randn(S, T, NQ + L + R, generator=g, dtype=torch.float64) * 3
    w_kv = (1 + 0.5 * torch.randn(L, generator=g, dtype=torch.float64)).to(dt)
    cos, sin = _complex_angles(T, R // 2, g)
    x = part.sum(0)
    q = x[:, :NQ].reshape(T, N, P + R)
    kv, k = x[:, NQ:NQ + L], x[:, NQ + L:]
    ref_q = torch.cat([q[..., :P], _rope_complex64(q[..., P:], cos[:, None], sin[:, None])], -1)
    ref_kv = kv / torch.sqrt((kv * kv).mean(-1, keepdim=True) + 1e-6) * w_kv.double()
    ref_k = _rope_complex64(k, cos, sin)
    q_out = torch.empty(T, NQ, dtype=dt, device=DEV)
    kv_out = torch.empty(T, L + R, dtype=dt, device=DEV)
    c, s = cos.to(DEV), sin.to(DEV)
    if views:
        z = torch.complex(c, s)                                           # [T, R/2]
        c, s = angle_rows(z.real, z.imag, T, torch.float32, strided=True)
        assert c.stride(-1) == 2 and c.data_ptr() == z.real.data_ptr()
    prologue.launch_v2(part.float().to(DEV), w_kv.to(DEV), c, s, 1e-6, N, q_out, kv_out)
    q_out = q_out.view(T, N, P + R)
    assert _rel(q_out[..., :P], ref_q[..., :P]) < tol
    assert _rel(q_out[..., P:], ref_q[..., P:]) < tol
    assert _rel(kv_out[:, :L], ref_kv) < tol
    assert _rel(kv_out[:, L:], ref_k) < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_v2_torch_path_equals_hf(dtype):
    """Off the kernel (CPU) mla::decode_q_kv_rope computes what HF's DeepSeek-V2 attention
    does to q_proj's and kv_a's outputs (its RMSNorm module, apply_rotary_emb on freqs_cis),
    bit for bit."""
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as m
    g = torch.Generator().manual_seed(3)
    S, B, N, P, R, L = 3, 4, 5, 16, 8, 24
    NQ = N * (P + R)
    part = (torch.randn(S, B, 1, NQ + L + R, generator=g) * 3).float()       # [S, B, 1, W]
    cos, sin = _complex_angles(B, R // 2, g)
    freqs = torch.complex(cos, sin)[:, None]                                  # [B, 1, R/2]
    nkv = m.DeepseekV2RMSNorm(L, eps=1e-6)
    with torch.no_grad():
        nkv.weight.copy_(1 + 0.5 * torch.randn(L, generator=g))
    nkv = nkv.to(dtype)
    q, kv_row = torch.ops.mla.decode_q_kv_rope(part, nkv.weight, freqs.real, freqs.imag,
                                               1e-6, N)
    x = part.sum(0).to(dtype)                                                 # [B, 1, W]
    q_hf = x[..., :NQ].view(B, 1, N, P + R).transpose(1, 2)                   # [B, N, 1, P+R]
    k_hf = x[..., NQ + L:].view(B, 1, 1, R)
    q_pe, k_pe = m.apply_rotary_emb(q_hf[..., P:], k_hf, freqs)
    assert q.shape == (B, 1, N, P + R) and kv_row.shape == (B, 1, L + R)
    assert torch.equal(q[..., :P], q_hf.transpose(1, 2)[..., :P])
    assert torch.equal(q[..., P:], q_pe.transpose(1, 2))
    with torch.no_grad():
        assert torch.equal(kv_row[..., :L], nkv(x[..., NQ:NQ + L]))
    assert torch.equal(kv_row[..., L:], k_pe.reshape(B, 1, R))


@pytest.mark.parametrize("S,T,NQ,L,R", [(1, 1, 64, 32, 8), (3, 5, 100, 40, 12),
                                         (4, 32, 1536, 512, 64)])
def test_q_a_prologue_complex_rope_vs_fp64(S, T, NQ, L, R):
    """The q_a-norm prologue (DeepSeek-V2 with q_lora) with V2's complex key RoPE (rope 2)."""
    g = torch.Generator().manual_seed(S * 10 + T)
    dt, tol = (torch.bfloat16, 2e-2) if DEV == "cuda" else (torch.float32, 1e-5)
    part, w_q, w_kv, _, _ = _inputs(S, T, NQ, L, R, g, dt)
    cos, sin = _complex_angles(T, R // 2, g)
    x = part.sum(0)

    def norm(v, w):
        return v / torch.sqrt((v * v).mean(-1, keepdim=True) + 1e-6) * w.double()
    q_out = torch.empty(T, NQ, dtype=dt, device=DEV)
    kv_out = torch.empty(T, L + R, dtype=dt, device=DEV)
    prologue.launch(part.float().to(DEV), w_q.to(DEV), w_kv.to(DEV), cos.to(DEV), sin.to(DEV),
                    1e-6, 1e-6, 2, q_out, kv_out)
    assert _rel(q_out, norm(x[:, :NQ], w_q)) < tol
    assert _rel(kv_out[:, :L], norm(x[:, NQ:NQ + L], w_kv)) < tol
    assert _rel(kv_out[:, L:], _rope_complex64(x[:, NQ + L:], cos, sin)) < tol


def test_q_a_prologue_complex_torch_path_equals_hf():
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as m
    g = torch.Generator().manual_seed(8)
    S, B, NQ, L, R = 2, 3, 48, 32, 8
    part, w_q, w_kv, _, _ = _inputs(S, B, NQ, L, R, g, torch.bfloat16)
    cos, sin = _complex_angles(B, R // 2, g)
    q, kv_row = torch.ops.mla.decode_qkv_prologue(part.float(), w_q, w_kv, cos, sin,
                                                   1e-6, 1e-6, 2)
    x = part.float().sum(0).bfloat16()
    k = x[:, NQ + L:].view(B, 1, 1, R)
    _, k_hf = m.apply_rotary_emb(k, k, torch.complex(cos, sin)[:, None])
    assert torch.equal(kv_row[:, L:], k_hf.reshape(B, R))
    with pytest.raises(ValueError, match="cos must be"):
        torch.ops.mla.decode_qkv_prologue(part.float(), w_q, w_kv, torch.ones(B, R), sin,
                                          1e-6, 1e-6, 2)


def test_v2_bad_input_is_named():
    op = torch.ops.mla.decode_q_kv_rope
    part, w_kv, cs = torch.randn(2, 3, 2 * 12 + 8 + 4), torch.ones(8), torch.ones(3, 2)
    op(part, w_kv, cs, cs, 1e-6, 2)                                           # fits
    with pytest.raises(TypeError, match="part"):
        op(part.bfloat16(), w_kv, cs, cs, 1e-6, 2)
    with pytest.raises(ValueError, match="num_heads"):
        op(part, w_kv, cs, cs, 1e-6, 5)
    with pytest.raises(ValueError, match="sin"):
        op(part, w_kv, cs, torch.ones(2, 2), 1e-6, 2)
    with pytest.raises(ValueError, match="w_kv"):
        op(part, torch.ones(8, 1), cs, cs, 1e-6, 2)
    with pytest.raises(TypeError, match="cos must be a floating"):
        op(part, w_kv, cs.long(), cs, 1e-6, 2)


def test_rope_rows_expand_batch_one_rows():
    from mla_ops.hf.linear import rope_rows
    cos, sin = torch.randn(1, 5, 8), torch.randn(1, 5, 8)
    c, s = rope_rows((cos, sin), 3, 5)
    assert c.shape == s.shape == (3, 5, 8) and torch.equal(c[2], cos[0])
    freqs = torch.polar(torch.ones(1, 5, 4), torch.randn(1, 5, 4))
    assert rope_rows(freqs, 3, 5).shape == (3, 5, 4)
    full = torch.randn(3, 5, 8)
    assert rope_rows((full, full), 3, 5)[0] is full


def test_rope_angles_per_family():
    """The fused ops' rope layout: V3's rows by rope_interleave, V2's complex freqs_cis as
    its real and imaginary parts (rope 2), none for another family or a mismatched form."""
    from types import SimpleNamespace as NS
    from mla_ops.hf.linear import rope_angles, rope_query
    cos, sin = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    v3 = NS(mla_family="v3", config=NS(rope_interleave=True))
    assert rope_angles(v3, (cos, sin))[2] == 1
    assert rope_angles(NS(mla_family="v3", config=NS(rope_interleave=False)), (cos, sin))[2] == 0
    freqs = torch.polar(torch.ones(2, 3, 4), torch.randn(2, 3, 4))
    c, s, rope = rope_angles(NS(mla_family="v2", config=NS()), freqs)
    assert rope == 2 and torch.equal(c, freqs.real) and torch.equal(s, freqs.imag)
    assert rope_angles(NS(mla_family="v2", config=NS()), (cos, sin)) is None
    assert rope_angles(NS(mla_family="glm4_moe_lite", config=NS()), (cos, sin)) is None
    q = torch.randn(2, 3, 5, 16 + 8)
    y = rope_query(q, c, s, 2)
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as m
    q_pe, _ = m.apply_rotary_emb(q[..., 16:].transpose(1, 2), q[..., 16:].transpose(1, 2), freqs)
    assert torch.equal(y[..., :16], q[..., :16])
    assert torch.equal(y[..., 16:], q_pe.transpose(1, 2))


@pytest.mark.parametrize("interleave", [True, False])
def test_kernels_take_one_16bit_output_at_prefill_rows(interleave):
    """A prefill's rows: the prologue kernels read one GEMM output in the activations' dtype
    (a [1, T, ...] "partial") at more rows than a decode step has, and give what they give
    for the same values as an fp32 partial (16-bit values are exact in fp32)."""
    g = torch.Generator().manual_seed(11)
    T, NQ, L, R, N, P = 100, 48, 40, 8, 3, 16
    dt = torch.bfloat16
    part, w_q, w_kv, cos, sin = _inputs(1, T, NQ, L, R, g, dt)
    part16 = part.to(dt).to(DEV)                                       # [1, T, NQ + L + R]
    outs = []
    for p in (part16, part16.float()):
        q_out = torch.empty(T, NQ, dtype=dt, device=DEV)
        kv_out = torch.empty(T, L + R, dtype=dt, device=DEV)
        prologue.launch(p, w_q.to(DEV), w_kv.to(DEV), cos.to(DEV), sin.to(DEV), 1e-6, 1e-6,
                        interleave, q_out, kv_out)
        outs.append((q_out, kv_out))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    ref_q, ref_kv = _reference(part16.double().cpu(), w_q, w_kv, cos, sin, 1e-6, interleave)
    assert _rel(outs[0][0], ref_q) < 2e-2 and _rel(outs[0][1], ref_kv) < 2e-2
    # V2 without q_lora: the query heads' RoPE and the key's, from one 16-bit output
    NQ2 = N * (P + R)
    part2 = (torch.randn(1, T, NQ2 + L + R, generator=g) * 3).to(dt).to(DEV)
    c2, s2 = (a.to(DEV) for a in _complex_angles(T, R // 2, g))
    outs = []
    for p in (part2, part2.float()):
        q_out = torch.empty(T, NQ2, dtype=dt, device=DEV)
        kv_out = torch.empty(T, L + R, dtype=dt, device=DEV)
        prologue.launch_v2(p, w_kv.to(DEV), c2, s2, 1e-6, N, q_out, kv_out)
        outs.append((q_out, kv_out))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    ref_k = _rope_complex64(part2[0, :, NQ2 + L:].double().cpu(), c2.cpu(), s2.cpu())
    assert _rel(outs[0][1][:, L:], ref_k) < 2e-2


def test_ops_take_one_16bit_output():
    """The ops accept one GEMM output in the weights' dtype ([1, ...]) as well as fp32
    partials, with the same result; several 16-bit partials are refused by name."""
    g = torch.Generator().manual_seed(12)
    T, NQ, L, R = 7, 24, 16, 8
    dt = torch.bfloat16
    part, w_q, w_kv, cos, sin = _inputs(1, T, NQ, L, R, g, dt)
    part16 = part.to(dt)
    a = torch.ops.mla.decode_qkv_prologue(part16, w_q, w_kv, cos, sin, 1e-6, 1e-6, 1)
    b = torch.ops.mla.decode_qkv_prologue(part16.float(), w_q, w_kv, cos, sin, 1e-6, 1e-6, 1)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    with pytest.raises(TypeError, match="one .* GEMM output in the weights' dtype"):
        torch.ops.mla.decode_qkv_prologue(part16.expand(2, -1, -1), w_q, w_kv, cos, sin,
                                          1e-6, 1e-6, 1)
    c2, s2 = _complex_angles(T, R // 2, g)
    a = torch.ops.mla.decode_q_kv_rope(part16, w_kv, c2, s2, 1e-6, 1)
    b = torch.ops.mla.decode_q_kv_rope(part16.float(), w_kv, c2, s2, 1e-6, 1)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    with pytest.raises(TypeError, match="GEMM output in the weights' dtype"):
        torch.ops.mla.decode_q_kv_rope(part16.half(), w_kv, c2, s2, 1e-6, 1)


def test_bad_input_is_named():
    part = torch.randn(2, 3, 10 + 8 + 4)
    w_q, w_kv, cs = torch.ones(10), torch.ones(8), torch.ones(3, 4)
    op = torch.ops.mla.decode_qkv_prologue
    with pytest.raises(TypeError, match="part"):
        op(part.bfloat16(), w_q, w_kv, cs, cs, 1e-6, 1e-6, True)
    with pytest.raises(ValueError, match="even R"):
        op(torch.randn(2, 3, 10 + 8 + 5), w_q, w_kv, torch.ones(3, 5), torch.ones(3, 5),
           1e-6, 1e-6, True)
    with pytest.raises(ValueError, match="cos"):
        op(part, w_q, w_kv, torch.ones(3, 5), cs, 1e-6, 1e-6, True)
    with pytest.raises(ValueError, match="w_kv"):
        op(part, w_q, torch.ones(8).double(), cs, cs, 1e-6, 1e-6, True)
    q = torch.randn(3, 2, 20)
    with pytest.raises(ValueError, match="cos and sin"):
        torch.ops.mla.decode_q_rope(q, torch.ones(3, 4), torch.ones(2, 4), True)
    with pytest.raises(ValueError, match="even"):
        torch.ops.mla.decode_q_rope(q, torch.ones(3, 5), torch.ones(3, 5), True)
    with pytest.raises(TypeError, match="q must be a floating"):
        torch.ops.mla.decode_q_rope(q.long(), torch.ones(3, 4), torch.ones(3, 4), True)
    with pytest.raises(TypeError, match="sin must be a floating"):
        torch.ops.mla.decode_q_rope(q, torch.ones(3, 4), torch.ones(3, 4).long(), True)
    with pytest.raises(TypeError, match="cos must be a floating"):
        op(part, w_q, w_kv, cs.long(), cs, 1e-6, 1e-6, True)
