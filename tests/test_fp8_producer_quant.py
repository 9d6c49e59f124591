"""Activations quantized by the kernel that produces them, for the fp8 decode GEMMs after it
(lowering/gemm/fp8_act_quant.py, the GEMMs' x_quant, mla::rms_norm_fp8 and
mla::residual_rms_norm_fp8 for q_a + kv_a, the MLP and the MoE block,
mla::decode_qkv_prologue_fp8 for q_b): the same e4m3 values and scales as the GEMMs'
own quantization, so every consumer computes bit for bit what it computes without them.
CPU: the kernels under the Triton interpreter (fp16, fp32) against the GEMMs' own quant
and a float64 reference; GPU: the converted FP8 model's decode step with and without."""
import importlib
import os

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("transformers.integrations.finegrained_fp8")

from lowering.gemm import fp8_act_quant, fp8_linear  # noqa: E402
from lowering.gemm import fp8_linear_configs  # noqa: E402
from test_fp8_checkpoint import quant_act_ref, rand_fp8, rel, w8a8_ref  # noqa: E402
from hf_models import cache_kw  # noqa: E402

FP8 = torch.float8_e4m3fn
CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
DT = torch.bfloat16 if CUDA else torch.float16
INTERPRETED = pytest.mark.skipif(not CUDA and os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="Triton kernels on CPU tensors need TRITON_INTERPRET=1")


def _bits(t):
    return t.view(torch.uint8) if t.dtype == FP8 else t


def same(a, b):
    return torch.equal(_bits(a), _bits(b))


@INTERPRETED
@pytest.mark.parametrize("M,K,gk", [(3, 7168, 128), (2, 300, 128), (1, 96, 32)])
def test_quantize_rows_torch_is_the_kernels_quant(M, K, gk):
    """quantize_rows_torch: bit for bit act_quant_kernel (the GEMMs' quant launch) and, as
    values times scales, the float64 reference of HF's activation quant; a partial last
    group is quantized over its own columns."""
    g = torch.Generator().manual_seed(M + K)
    x = (torch.randn(M, K, generator=g) * 5).to(DT)
    x[0, :gk] *= 1e-3                                # a group far smaller than the others
    q, s = fp8_act_quant.quantize_rows_torch(x, gk)
    assert q.dtype == FP8 and s.shape == (M, -(-K // gk))
    want = quant_act_ref(x.float(), gk)
    scales = s.double().repeat_interleave(gk, 1)[:, :K]
    assert torch.equal(q.double() * scales, want)
    kq, ks, _ = fp8_act_quant.quantized(x.to(DEV), gk, True)
    assert same(kq.cpu(), q) and torch.equal(ks.cpu(), s)


def _gemm_inputs(M, K, N, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, K, generator=g) * 3).to(DEV, DT)
    (w1, s1), (w2, s2) = rand_fp8(N, K, g), rand_fp8(N, K, g)
    return x, [t.to(DEV) for t in (w1, s1, w2, s2)]


@INTERPRETED
@pytest.mark.parametrize("mode,split", [(0, 1), (0, 3), (2, 1), (2, 2)])
def test_gemm_reads_the_given_quant_bit_for_bit(mode, split):
    """fp8_linear.run with x_quant (x quantized by its producer) writes what it writes when
    it quantizes x itself, in a launch of its own or in every program, split or not; and
    that is the float64 W8A8 product."""
    M, K, N = 2, 5 * 128, 96
    x, (w1, s1, w2, s2) = _gemm_inputs(M, K, N, mode * 10 + split)
    cfg = (32, 4, 2, split)
    outs = []
    for pre, given in ((True, None), (False, None),
                       (False, fp8_act_quant.quantize_rows_torch(x.cpu(), 128))):
        if given is not None:
            given = tuple(t.to(DEV) for t in given)
        y = torch.full((M, N), float("nan"), device=DEV, dtype=DT)
        fp8_linear.run(x, w1, s1, w2 if mode else None, s2 if mode else None, mode, y, None,
                       128, 128, cfg, pre_quant=pre, x_quant=given)
        outs.append(y)
    assert same(outs[0], outs[2]) and same(outs[1], outs[2])
    if mode == 0:
        assert rel(outs[2].float(), w8a8_ref(x.cpu().float(), w1.cpu(), s1.cpu())) < 2e-3


def test_ops_check_the_given_quant():
    """A given (x_q, x_s) must match x: e4m3 of x's shape, fp32 scales one per group, both
    or neither; the error names the argument."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 256, generator=g).to(torch.bfloat16)
    w, s = rand_fp8(64, 256, g)
    q, sc = fp8_act_quant.quantize_rows_torch(x, 128)
    y = torch.ops.mla.decode_linear_fp8(x, w, s, 128, 128, q, sc)       # CPU: the torch path
    assert torch.equal(y, torch.ops.mla.decode_linear_fp8(x, w, s, 128, 128))
    with pytest.raises(TypeError, match="x_q"):
        torch.ops.mla.decode_linear_fp8(x, w, s, 128, 128, q.float(), sc)
    with pytest.raises(ValueError, match="x_s"):
        torch.ops.mla.decode_linear_fp8(x, w, s, 128, 128, q, sc[:, :1])
    with pytest.raises(ValueError, match="x_s"):
        torch.ops.mla.decode_linear_fp8(x, w, s, 128, 128, q, sc.t().contiguous().t())
    with pytest.raises(ValueError, match="together"):
        torch.ops.mla.decode_linear_fp8(x, w, s, 128, 128, q, None)
    with pytest.raises(TypeError, match="x_q"):
        torch.ops.mla.decode_gate_up_fp8(x, w, s, w, s, 128, 128, q[:1], sc)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the block's CPU inputs need TRITON_INTERPRET=1 (on a GPU: the "
                           "model test below)")
@pytest.mark.parametrize("family,T", [("v3", 1), ("v2", 3)])
def test_moe_block_op_reads_the_given_quant_bit_for_bit(family, T):
    """mla::moe_block_decode_fp8 with x_q, x_s: the routed experts and the shared experts
    read them, and both outputs are the op's without them, bit for bit."""
    from test_moe_block_fp8 import inputs
    args = inputs(family, T, seed=11 + T)
    pairs, shared = torch.ops.mla.moe_block_decode_fp8(*args)
    q, s = fp8_act_quant.quantize_rows_torch(args[0], 128)
    pairs_q, shared_q = torch.ops.mla.moe_block_decode_fp8(*args, q, s)
    assert torch.equal(pairs, pairs_q) and torch.equal(shared, shared_q)
    torch.library.opcheck(torch.ops.mla.moe_block_decode_fp8.default, (*args, q, s),
                          test_utils=("test_faketensor",))


@pytest.mark.parametrize("absorbed", [False, True])
def test_converted_fp8_model_quantizes_in_the_producers(monkeypatch, absorbed):
    """convert() marks the post-attention norms of layers whose MLP or MoE block runs fp8
    GEMMs. Where o_proj's fp8 partials reach that norm and the q_a + kv_a pair's reach the
    prologue (forced here: on the CPU the fp8 ops' torch paths), the compiled decode step
    holds mla::rms_norm_fp8, whose quantized output the pair reads, mla::residual_rms_norm_fp8, whose quantized output the fp8 MLP's gate + up reads,
    and mla::decode_qkv_prologue_fp8, whose quantized q_a q_b's GEMM reads, or with
    `absorbed` (the query kernel taken as it is on a GPU) mla::decode_q_absorb_w8a8; the
    tokens stay HF's."""
    import mla_ops.hf as H
    import mla_ops.hf.layer as hf_layer
    import mla_ops.hf.linear as hf_linear
    if absorbed:
        monkeypatch.setattr(hf_linear, "w8a8_unmet", lambda *a: None)
    monkeypatch.setattr(hf_layer, "fp8_decode_rows", lambda x: True)
    from hf_models import left_padded, tiny_config
    from mla_ops.hf import fp8_linear as hf_fp8
    from test_fp8_checkpoint import fp8_pair, generate
    from torch._dynamo.backends.registry import lookup_backend
    from transformers.generation.configuration_utils import CompileConfig
    monkeypatch.setattr(hf_fp8, "fp8_partials", lambda mod, x: torch.ops.mla.decode_linear_fp8_partials(
        x, mod.weight, mod.weight_scale_inv, *hf_fp8.groups(mod)))
    monkeypatch.setattr(hf_fp8, "fp8_pair_partials", lambda m1, m2, x, x_quant=None: (
        torch.ops.mla.decode_linear_pair_fp8_partials(x, m1.weight, m1.weight_scale_inv,
                                                      m2.weight, m2.weight_scale_inv,
                                                      *hf_fp8.groups(m1),
                                                      *(x_quant or (None, None)))))
    ref, model = fp8_pair(tiny_config("v3", q_lora_rank=256), skip=("lm_head",))
    H.convert(model, fuse_experts=True)
    layers = model.model.layers
    assert [l.post_attention_layernorm.mla_quant_group for l in layers] == [128, 128]
    assert [l.input_layernorm.mla_quant_group for l in layers] == [128, 128]
    graphs = []

    def counting(gm, example_inputs, **kw):
        graphs.append(gm)
        return lookup_backend("aot_eager")(gm, example_inputs)
    ids, mask = left_padded([6, 19, 13])
    cc = CompileConfig(fullgraph=True, dynamic=False, backend=counting, mode=None)
    cc._compile_all_devices = True
    cache = H.PagedMLACache(model.config, max_batch_size=3, max_cache_len=64, block_size=16)
    torch._dynamo.reset()
    try:
        out = generate(model, ids, mask, 6, **cache_kw(cache), compile_config=cc)
    finally:
        torch._dynamo.reset()
    exp = generate(ref, ids, mask, 6)
    assert torch.equal(out.sequences, exp.sequences)
    nodes = list(graphs[0].graph.nodes)
    norms = [n for n in nodes if "residual_rms_norm_fp8" in str(n.target)]
    assert len(norms) == 2
    gate_up = [n for n in nodes if "decode_gate_up_fp8" in str(n.target)]
    # the dense MLP's gate + up reads the first norm's quantized output (args 7 and 8)
    dense = [n for n in gate_up if len(n.args) > 8 and n.args[7] is not None]
    assert len(dense) == 1 and dense[0].args[7].args[0] is norms[0]
    prologues = [n for n in nodes if "decode_qkv_prologue_fp8" in str(n.target)]
    q_b = [n for n in nodes if str(n.target) == "mla.decode_linear_fp8"
           and len(n.args) > 6 and n.args[5] is not None]
    query = [n for n in nodes if "decode_q_absorb_w8a8" in str(n.target)]
    assert len(prologues) == 2
    readers, arg = (query, 1) if absorbed else (q_b, 5)
    assert not (query if not absorbed else q_b)
    assert [n.args[arg].args[0] for n in readers] == prologues
    # the q_a + kv_a pair reads the input norm's quantized output (args 7 and 8)
    inputs = [n for n in nodes if "rms_norm_fp8" in str(n.target)
              and "residual" not in str(n.target)]
    pairs = [n for n in nodes if "decode_linear_pair_fp8_partials" in str(n.target)]
    assert len(inputs) == 2 and [n.args[7].args[0] for n in pairs] == inputs


# splits, tokens, NQ (V3's q_lora 1536: 12 groups in a 16-group block; 200: a partial
# group), quant group
@INTERPRETED
@pytest.mark.parametrize("S,T,NQ,gk", [(4, 2, 1536, 128), (1, 3, 200, 128), (2, 1, 96, 32)])
def test_prologue_kernel_quantizes_q_a_as_the_fp8_gemms_do(S, T, NQ, gk):
    """The prologue with a quant group writes what it writes without one, and q_a quantized
    per gk columns bit for bit as q_b's GEMM would quantize it (act_quant_kernel) and as
    quantize_rows_torch does."""
    from lowering.fused import prologue
    from lowering.fused.decode_rows import angle_rows
    L, R = 64, 16
    g = torch.Generator().manual_seed(S * 100 + NQ)
    part = (torch.randn(S, T, NQ + L + R, generator=g) * 3).to(DEV)
    w_q = (1 + 0.5 * torch.randn(NQ, generator=g)).to(DEV, DT)
    w_kv = (1 + 0.5 * torch.randn(L, generator=g)).to(DEV, DT)
    ang = torch.rand(T, R, generator=g) * 6
    c, s = angle_rows(ang.cos().to(DEV, DT), ang.sin().to(DEV, DT), T, DT, strided=True)
    outs = []
    for quant in (None, (torch.empty(T, NQ, dtype=FP8, device=DEV),
                         torch.full((T, -(-NQ // gk)), float("nan"), device=DEV))):
        q_out = torch.full((T, NQ), float("nan"), device=DEV, dtype=DT)
        kv_out = torch.full((T, L + R), float("nan"), device=DEV, dtype=DT)
        prologue.launch(part, w_q, w_kv, c, s, 1e-6, 1e-6, 1, q_out, kv_out, quant, gk)
        outs.append((q_out, kv_out, quant))
    (q0, kv0, _), (q1, kv1, (qq, qs)) = outs
    assert same(q0, q1) and same(kv0, kv1) and not q1.isnan().any()
    want_q, want_s, _ = fp8_act_quant.quantized(q1, gk, True)
    assert same(qq, want_q) and torch.equal(qs, want_s)
    tq, ts = fp8_act_quant.quantize_rows_torch(q1.cpu(), gk)
    assert same(qq.cpu(), tq) and torch.equal(qs.cpu(), ts)


def test_prologue_fp8_op_torch_path_and_errors():
    """Off CUDA the op is decode_qkv_prologue plus quantize_rows_torch of q_a; a bad group
    is refused naming it; its fake matches."""
    g = torch.Generator().manual_seed(2)
    T, NQ, L, R = 3, 256, 64, 16
    part = torch.randn(2, T, NQ + L + R, generator=g)
    w_q, w_kv = (torch.rand(n, generator=g).add(0.5).to(torch.bfloat16) for n in (NQ, L))
    ang = torch.rand(T, R, generator=g)
    args = (part, w_q, w_kv, ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16),
            1e-6, 1e-6, 1)
    q, kv, qq, qs = torch.ops.mla.decode_qkv_prologue_fp8(*args, 128)
    q0, kv0 = torch.ops.mla.decode_qkv_prologue(*args)
    tq, ts = fp8_act_quant.quantize_rows_torch(q0, 128)
    assert same(q, q0) and same(kv, kv0) and same(qq, tq) and torch.equal(qs, ts)
    with pytest.raises(ValueError, match="group_k"):
        torch.ops.mla.decode_qkv_prologue_fp8(*args, 96)
    torch.library.opcheck(torch.ops.mla.decode_qkv_prologue_fp8.default, (*args, 128),
                          test_utils=("test_faketensor",))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("graph", [False, True])
def test_gpu_decode_steps_with_and_without_producer_quant_are_bit_for_bit(monkeypatch, graph):
    """The tiny FP8 V3 on CUDA with its GEMMs split (so o_proj's partials reach the norm):
    generate() with the producers quantizing (the input norms for q_a + kv_a, the
    post-attention norms for the dense MLP and the MoE block op, the prologue for q_b's
    GEMM) gives the logits of the same model whose GEMMs
    quantize their inputs themselves, bit for bit; eager steps, and replayed from a CUDA
    graph. (q_b's GEMM, not the absorbed W8A8 query kernel, whose sums are ordered
    otherwise: its own test is below.)"""
    import mla_ops.hf as H
    hf_convert = importlib.import_module("mla_ops.hf.convert")
    import mla_ops.hf.linear as hf_linear
    from hf_models import left_padded
    from test_fp8_checkpoint import cuda_fp8_model, generate
    monkeypatch.setattr(fp8_linear_configs, "MIN_GROUPS_PER_SPLIT", 1)
    monkeypatch.setattr(hf_linear, "w8a8_unmet", lambda *a: "the test runs q_b's GEMM")
    model = cuda_fp8_model()
    model.mla_generate_graph = graph
    ids, mask = (t.cuda() for t in left_padded([5, 17, 30]))
    seen = []
    prologue = hf_convert.qkv_a_prologue

    def runs():
        cache = H.PagedMLACache(model.config, max_batch_size=3, max_cache_len=64,
                                block_size=64, device="cuda", dtype=torch.bfloat16)
        return generate(model, ids, mask, 6, **cache_kw(cache), disable_compile=True)

    def watched(attn, x, pe, *rest):
        out = prologue(attn, x, pe, *rest)
        seen.append(out is not None and out[2] is not None)
        return out
    monkeypatch.setattr(hf_convert, "qkv_a_prologue", watched)
    norms = [n for l in model.model.layers
             for n in (l.input_layernorm, l.post_attention_layernorm)]
    assert [n.mla_quant_group for n in norms] == [128] * 4
    with_quant = runs()
    assert any(seen)                      # the decode steps' prologues quantized q_a
    for n in norms:
        del n.mla_quant_group
    monkeypatch.setattr(hf_convert, "qkv_a_prologue",
                        lambda attn, x, pe, *rest: (lambda o: o and (o[0], o[1], None))(
                            prologue(attn, x, pe, *rest)))
    without = runs()
    assert torch.equal(with_quant.sequences, without.sequences)
    for a, b in zip(with_quant.logits, without.logits):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_absorbed_w8a8_query_of_a_decode_step_vs_fp64(monkeypatch):
    """The tiny FP8 V3's decode steps on CUDA build their absorbed query in one launch from
    the prologue's quantized q_a (mla::decode_q_absorb_w8a8); each against float64 q_b
    (W8A8, rounded to bf16), RoPE and the absorption on the inputs it got."""
    import mla_ops.hf as H
    hf_convert = importlib.import_module("mla_ops.hf.convert")
    from hf_models import left_padded
    from mla_ops.hf.linear import rope_angles
    from test_fp8_checkpoint import cuda_fp8_model, expand_scales, generate
    from test_q_absorb import _reference, _rel
    model = cuda_fp8_model()
    model.mla_generate_graph = False
    calls = []
    absorbed = hf_convert.absorbed_decode_query

    def watched(attn, q_a, rows, q_a_quant=None):
        out = absorbed(attn, q_a, rows, q_a_quant)
        if out is not None:
            calls.append((attn, q_a.clone(), rope_angles(attn, rows), out.clone()))
        return out
    monkeypatch.setattr(hf_convert, "absorbed_decode_query", watched)
    ids, mask = (t.cuda() for t in left_padded([5, 17, 30]))
    cache = H.PagedMLACache(model.config, max_batch_size=3, max_cache_len=64, block_size=64,
                            device="cuda", dtype=torch.bfloat16)
    generate(model, ids, mask, 3, **cache_kw(cache), disable_compile=True)
    assert len(calls) >= 2 * model.config.num_hidden_layers
    for attn, q_a, (cos, sin, rope), out in calls:
        lin = attn.q_b_proj
        w, s = lin.weight.cpu(), lin.weight_scale_inv.cpu()
        T = out.shape[0]
        x = q_a.reshape(T, -1).float().cpu()
        q64 = quant_act_ref(x) @ (w.double() * expand_scales(s, *w.shape)).T
        ref = _reference(q64, torch.eye(w.shape[0], dtype=torch.float64),
                         attn.mla_attn.W_UK_T.double().cpu(), cos.reshape(T, -1).cpu(),
                         sin.reshape(T, -1).cpu(), bool(rope), torch.bfloat16)
        assert _rel(out, ref) < 2e-2
