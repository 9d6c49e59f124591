"""An FP8 checkpoint's absorbed weights kept in e4m3 (MLAAttention.absorb(keep_fp8=True),
split_kv_b_proj_fp8, mla::attention_with_output's W_UK_T_scale / W_UV_scale): the same
values as kv_b_proj dequantized, the op's outputs those of the dequantized weights (decode
and prefill rows; CPU: the torch paths dequantize, so bit for bit in fp32; CUDA: the head
GEMMs widen the blocks in registers), against the float64 reference, and bad scales
named before anything is written."""
import pytest
import torch

import mla_ops  # noqa: F401
from mla_ops.layer import MLAAttention, split_kv_b_proj, split_kv_b_proj_fp8
from mla_ops.quant import FP8, dequantize_block_fp8
from scenario import Dims, Step

# two heads of 32 key + 32 value rows (one 128-row block holds both heads), 160 latent
# columns: a full and a 32-column scale group
D = Dims(N=2, P=32, R=16, V=32, L=160)


def fp8_kv_b(d: Dims, seed=0):
    """A random kv_b_proj as an FP8 checkpoint holds it: e4m3 [N*(P+V), L] and scale_inv
    [ceil(rows / 128), ceil(L / 128)] (varied per block)."""
    g = torch.Generator().manual_seed(seed)
    rows = d.N * (d.P + d.V)
    w8 = (torch.randn(rows, d.L, generator=g) * 64).clamp(-448, 448).to(FP8)
    s = torch.rand(-(-rows // 128), -(-d.L // 128), generator=g) * 0.002 + 0.0005
    return w8, s


def layers(d: Dims, dtype=torch.float32, kind="auto"):
    """(the layer keeping e4m3 weights, the layer with kv_b_proj dequantized to dtype)."""
    w8, s = fp8_kv_b(d)
    kept = MLAAttention(d.N, d.P, d.R, d.V, d.L, (d.P + d.R) ** -0.5, kv_cache_dtype=kind)
    kept.absorb(w8, weight_scale_inv=s, dtype=dtype, keep_fp8=True)
    deq = MLAAttention(d.N, d.P, d.R, d.V, d.L, (d.P + d.R) ** -0.5, kv_cache_dtype=kind)
    deq.absorb(w8, weight_scale_inv=s, dtype=dtype)
    return kept, deq, dequantize_block_fp8(w8, s, dtype=torch.float64)


def test_split_keeps_the_checkpoint_values():
    w8, s = fp8_kv_b(D)
    W_UK_T, W_UV, s_uk, s_uv = split_kv_b_proj_fp8(w8, s, D.N, D.P, D.V)
    assert W_UK_T.dtype == W_UV.dtype == FP8
    assert tuple(s_uk.shape) == tuple(s_uv.shape) == (D.N, 2)
    w = w8.view(torch.uint8).reshape(D.N, D.P + D.V, D.L)
    assert torch.equal(W_UK_T.view(torch.uint8), w[:, :D.P])
    assert torch.equal(W_UV.view(torch.uint8), w[:, D.P:].transpose(1, 2))
    uk, uv = split_kv_b_proj(w8, D.N, D.P, D.V, weight_scale_inv=s, dtype=torch.float32)
    from lowering.gemm.head_gemm import dequantize_heads
    assert torch.equal(dequantize_heads(W_UK_T, s_uk, 2, torch.float32), uk)
    assert torch.equal(dequantize_heads(W_UV, s_uv, 1, torch.float32), uv)


def test_split_refuses_blocks_that_do_not_fit():
    """A head's key or value rows across two row blocks, or blocks other than 128 x 128:
    None (the layer then dequantizes)."""
    d = Dims(N=3, P=24, V=20, L=64)           # head 2's value rows cross row 128
    w8, s = fp8_kv_b(d)
    assert split_kv_b_proj_fp8(w8, s, d.N, d.P, d.V) is None
    w8, s = fp8_kv_b(D)
    assert split_kv_b_proj_fp8(w8, s, D.N, D.P, D.V, block=(64, 128)) is None
    layer = MLAAttention(d.N, d.P, d.R, d.V, d.L, 0.1)
    w8, s = fp8_kv_b(d)
    layer.absorb(w8, weight_scale_inv=s, dtype=torch.float32, keep_fp8=True)
    assert layer.W_UK_T.dtype == torch.float32 and layer.W_UK_T_scale is None


@pytest.mark.parametrize("kind", ["auto", "fp8"])
def test_layer_with_e4m3_weights_as_dequantized(kind):
    """Decode rows and prefill rows with context: the layer keeping e4m3 weights gives the
    dequantized layer's output bit for bit on the CPU, and (bf16 cache) the float64
    reference's."""
    kept, deq, kv_b64 = layers(D, kind=kind)
    assert kept.W_UK_T.dtype == FP8 and kept.W_UK_T_scale is not None
    step = Step(D, [6, 0, 3, 9], [1, 1, 5, 2], kv_cache_dtype=kind)
    ins = step.inputs()
    out = kept(*ins, step.cache.kv[0], step.cache.k_scale, step.meta)
    want = deq(*ins, step.cache.kv[0], step.cache.k_scale, step.meta)
    assert torch.equal(out, want)
    if kind == "auto":        # (an fp8 cache's own error against float64: its tests)
        ref = step.reference(kv_b64.float(), kept.softmax_scale)
        assert ((out.double() - ref).abs().max() / ref.abs().max()) < 1e-5


def test_attention_op_refuses_bad_scales_before_writing():
    kept, _, _ = layers(D)
    step = Step(D, [6, 0], [1, 4])
    q, kv_c, k_pe = step.inputs()
    m = step.meta
    out = torch.full((q.shape[0], D.N * D.V), 7.0)
    dep = torch.ops.mla.kv_cache_update(kv_c, k_pe, step.cache.kv[0], m.slot_mapping,
                                        "auto", step.cache.k_scale)
    args = [q, kv_c, k_pe, step.cache.kv[0], kept.W_UK_T, kept.W_UV, m.block_table,
            m.seq_lens, m.query_start_loc, m.num_decode_tokens, kept.softmax_scale, "auto",
            step.cache.k_scale, dep, out]
    op = torch.ops.mla.attention_with_output
    with pytest.raises(TypeError, match="W_UK_T"):              # e4m3 without its scales
        op(*args)
    with pytest.raises(ValueError, match=r"W_UV_scale must be contiguous \[2, 2\]"):
        op(*args, W_UK_T_scale=kept.W_UK_T_scale, W_UV_scale=kept.W_UV_scale[:, :1])
    with pytest.raises(TypeError, match="W_UK_T_scale must be a float32"):
        op(*args, W_UK_T_scale=kept.W_UK_T_scale.double(), W_UV_scale=kept.W_UV_scale)
    a16 = list(args)
    a16[4], a16[5] = kept.W_UK_T.float(), kept.W_UV.float()
    with pytest.raises(TypeError, match="W_UK_T"):              # scales with a 16-bit weight
        op(*a16, W_UK_T_scale=kept.W_UK_T_scale, W_UV_scale=kept.W_UV_scale)
    assert (out == 7.0).all()
    op(*args, W_UK_T_scale=kept.W_UK_T_scale, W_UV_scale=kept.W_UV_scale)
    assert not (out == 7.0).any()
    torch.library.opcheck(op.default, args, dict(W_UK_T_scale=kept.W_UK_T_scale,
                                                 W_UV_scale=kept.W_UV_scale),
                          test_utils=("test_faketensor",))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_layer_with_e4m3_weights_on_cuda():
    """bf16 on a GPU, decode rows through the head GEMM kernel widening the blocks and
    prefill rows through the dequantized weights, against float64."""
    kept, _, kv_b64 = layers(D, torch.bfloat16)
    step = Step(D, [6, 0, 3, 9], [1, 1, 5, 2], dtype=torch.bfloat16)
    out = step.run_on_cuda(kept).double().cpu()
    ref = step.reference(kv_b64.float(), kept.softmax_scale)
    assert ((out - ref).abs().max() / ref.abs().max()) < 2e-2
