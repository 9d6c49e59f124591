"""DeepSeek's FP8 block-quantized checkpoints (HF's FineGrainedFP8 FP8Linear modules) through
convert(): the fp8 decode GEMM kernel (lowering/gemm/fp8_linear.py) against a float64
reference of HF's W8A8 numerics, written here; the converted model against the same model
run by HF on dequantized weights (what HF runs on the CPU); on CUDA the same with the
kernel in the decode steps."""
import copy

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
fg = pytest.importorskip("transformers.integrations.finegrained_fp8")

import mla_ops.hf as H  # noqa: E402
from hf_models import cache_kw, build_pair, left_padded, logit_err, tiny_config  # noqa: E402
from lowering import config as mla_config  # noqa: E402
from lowering.gemm import fp8_linear  # noqa: E402
from mla_ops.hf import fp8_linear as hf_fp8  # noqa: E402

FP8 = torch.float8_e4m3fn
CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


# ------------------------------------------------------------------ references (float64)


def expand_scales(s, N, K, gn=128, gk=128):
    return s.double().repeat_interleave(gn, 0)[:N].repeat_interleave(gk, 1)[:, :K]


def quant_act_ref(x, gk=128):
    """x [M, K] as HF's FP8Linear sees it after its activation quant, in float64: per row
    and per gk columns s = amax / 448, e4m3(x / max(s, 1e-12)), times s; the quotient as
    the kernels form it, x times the fp32 reciprocal (HF's GPU kernel: an approximate
    division; both within an ulp of x / s)."""
    x = x.float()
    out = torch.empty(x.shape, dtype=torch.float64)
    for k0 in range(0, x.shape[1], gk):
        blk = x[:, k0:k0 + gk]
        s = blk.abs().amax(1, keepdim=True) / torch.tensor(448.0)
        q = (blk * (1.0 / s.clamp(min=1e-12))).clamp(-448, 448).to(FP8)
        out[:, k0:k0 + gk] = q.double() * s.double()
    return out


def w8a8_ref(x, w, s, gn=128, gk=128):
    return quant_act_ref(x, gk) @ (w.double() * expand_scales(s, *w.shape, gn, gk)).T


def rand_fp8(N, K, g, gn=128, gk=128):
    w = (torch.randn(N, K, generator=g) * 100).clamp(-448, 448).to(FP8)
    s = torch.rand(-(-N // gn), -(-K // gk), generator=g) * 0.02 + 1e-3
    return w, s


def rel(a, ref):
    return ((a.double().cpu() - ref).abs().max() / ref.abs().max()).item()


# ------------------------------------------------------------------ the kernel


# rows 1 / 5 / 33 / 64; N and K not multiples of 128 (partial scale blocks); a second weight
# shorter than one block
KERNEL_CASES = [(1, 100, 37, 300, (32, 4, 2)), (5, 200, 130, 256, (64, 4, 2)),
                (33, 64, 20, 200, (64, 4, 3)), (64, 130, 129, 384, (16, 4, 2))]


@pytest.mark.parametrize("M,N1,N2,K,cfg", KERNEL_CASES)
def test_kernel_modes_vs_fp64(M, N1, N2, K, cfg):
    g = torch.Generator().manual_seed(M * 7 + K)
    x = torch.randn(M, K, generator=g) * 3
    x[0, :7] = 0.0 if M > 1 else x[0, :7]          # a partly zero group
    (w1, s1), (w2, s2), (w3, s3) = rand_fp8(N1, K, g), rand_fp8(N2, K, g), rand_fp8(N1, K, g)
    dt, tol = (torch.bfloat16, 2e-2) if CUDA else (torch.float32, 1e-5)
    xs = x.to(DEV, dt)
    x = xs.cpu().float()                                                   # the rounded input
    w1d, s1d, w2d, s2d, w3d, s3d = (t.to(DEV) for t in (w1, s1, w2, s2, w3, s3))

    y = torch.empty(M, N1, device=DEV, dtype=dt)
    fp8_linear.launch(xs, w1d, s1d, None, None, 0, y, None, 128, 128, cfg)
    ref1 = w8a8_ref(x, w1, s1)
    assert rel(y, ref1) < tol

    r = torch.randn(M, N1, generator=g).to(DEV, dt)
    y = torch.empty(M, N1, device=DEV, dtype=dt)
    fp8_linear.launch(xs, w1d, s1d, None, None, 0, y, None, 128, 128, cfg, residual=r)
    assert rel(y, ref1 + r.cpu().double()) < tol

    y1, y2 = torch.empty(M, N1, device=DEV, dtype=dt), torch.empty(M, N2, device=DEV, dtype=dt)
    fp8_linear.launch(xs, w1d, s1d, w2d, s2d, 1, y1, y2, 128, 128, cfg)
    ref2 = w8a8_ref(x, w2, s2)
    assert rel(y1, ref1) < tol and rel(y2, ref2) < tol
    # the pair into one fp32 output, W2's columns from N1 on (the prologue's partial)
    y = torch.full((M, N1 + N2), float("nan"), device=DEV)
    fp8_linear.launch(xs, w1d, s1d, w2d, s2d, 1, y, None, 128, 128, cfg, y2_col0=N1)
    # fp32 out; on the GPU the hardware's fp8 cast of x / s may round a few values of x to
    # the other neighbour than the reference's cast
    assert rel(y, torch.cat([ref1, ref2], 1)) < (1e-3 if CUDA else 1e-5)

    y = torch.empty(M, N1, device=DEV, dtype=dt)
    fp8_linear.launch(xs, w1d, s1d, w3d, s3d, 2, y, None, 128, 128, cfg)
    assert rel(y, F.silu(ref1) * w8a8_ref(x, w3, s3)) < 3 * tol


def test_kernel_quantizes_the_activation_as_hf():
    """The activation's fp8 rounding is part of the result: a plain fp64 product of x and
    the dequantized weight differs from the kernel by far more than its error against the
    W8A8 reference (so the reference above can tell the two numerics apart)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 256, generator=g)
    w, s = rand_fp8(96, 256, g)
    y = torch.empty(3, 96, device=DEV)
    fp8_linear.launch(x.to(DEV), w.to(DEV), s.to(DEV), None, None, 0, y, None, 128, 128,
                      (32, 4, 2))
    plain = x.double() @ (w.double() * expand_scales(s, 96, 256)).T
    tight = 3e-4 if CUDA else 1e-5           # (the GPU's fp8 cast: see test_kernel_modes_vs_fp64)
    assert rel(y, w8a8_ref(x, w, s)) < tight < 1e-3 < rel(y, plain)


def test_ops_torch_path_dequantizes_as_hf():
    """Off the kernel path (here: CPU) the ops compute F.linear on the weight dequantized
    as HF dequantizes (HF's own Fp8Dequantize on 128-divisible shapes), bit for bit."""
    g = torch.Generator().manual_seed(1)
    w, s = rand_fp8(256, 384, g)
    x = torch.randn(2, 3, 384, generator=g).to(torch.bfloat16)
    hf_w = fg.Fp8Dequantize(None)._dequantize_one(w, s, output_dtype=torch.bfloat16)
    assert torch.equal(fp8_linear.dequantize(w, s, 128, 128, torch.bfloat16), hf_w)
    assert torch.equal(torch.ops.mla.decode_linear_fp8(x, w, s, 128, 128), F.linear(x, hf_w))
    r = torch.randn(2, 3, 256, generator=g).to(torch.bfloat16)
    assert torch.equal(torch.ops.mla.decode_linear_fp8_residual(x, w, s, r, 128, 128),
                       r + F.linear(x, hf_w))
    y1, y2 = torch.ops.mla.decode_linear_pair_fp8(x, w, s, w, s, 128, 128)
    assert torch.equal(y1, F.linear(x, hf_w)) and torch.equal(y2, y1)
    assert torch.equal(torch.ops.mla.decode_gate_up_fp8(x, w, s, w, s, 128, 128),
                       F.silu(F.linear(x, hf_w)) * F.linear(x, hf_w))


def test_unmet_names_the_condition():
    g = torch.Generator().manual_seed(2)
    w, s = rand_fp8(64, 128, g)
    x = torch.randn(1, 128)
    assert "CUDA" in fp8_linear.fp8_linear_unmet(x, [(w, s)], 128, 128)
    with mla_config.patch(linear_impl="torch"):
        assert "torch" in fp8_linear.fp8_linear_unmet(x, [(w, s)], 128, 128)
    with pytest.raises(ValueError, match="lin.weight_scale_inv"):
        fp8_linear.check_fp8_weight("lin", w, s[:, :0], 128, 128)
    with pytest.raises(TypeError, match="lin.weight"):
        fp8_linear.check_fp8_weight("lin", w.float(), s, 128, 128)


# ------------------------------------------------------------------ the model


def hf_quantize(weight, quantizer):
    """(fp8 weight, weight_scale_inv) by HF's own Fp8Quantize; a weight whose shape is not a
    multiple of the block is zero-padded to one first (zeros leave every block's amax as
    it is) and cut back, as FP8 checkpoints store such weights (ceil-sized scale grids)."""
    N, K = weight.shape
    pn, pk = -(-N // 128) * 128, -(-K // 128) * 128
    padded = torch.zeros(pn, pk, dtype=weight.dtype)
    padded[:N, :K] = weight
    out = fg.Fp8Quantize(quantizer)._quantize_one("w.weight", padded)
    return out["w.weight"][:N, :K].contiguous(), out["w.weight_scale_inv"]


def fp8_pair(cfg, dtype=torch.float32, skip=("lm_head", "mlp.experts")):
    """(HF model on dequantized weights, the same model with HF's FP8Linear modules holding
    the fp8 weights and scales), both on the CPU."""
    from transformers import FineGrainedFP8Config
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer
    base, _ = build_pair(cfg, dtype=dtype)
    qc = FineGrainedFP8Config(weight_block_size=[128, 128], modules_to_not_convert=list(skip))
    quantizer = FineGrainedFP8HfQuantizer(qc)
    model = copy.deepcopy(base)
    fg.replace_with_fp8_linear(model, modules_to_not_convert=list(skip),
                               quantization_config=qc, pre_quantized=True)
    ref = copy.deepcopy(base)
    for name, m in model.named_modules():
        if isinstance(m, fg.FP8Experts):       # each expert's gate, up, down quantized alone
            src, dst = base.get_submodule(name), ref.get_submodule(name)
            I = src.gate_up_proj.shape[1] // 2
            for attr, parts in (("gate_up_proj", (slice(0, I), slice(I, 2 * I))),
                                ("down_proj", (slice(None),))):
                ws, ss, deq = [], [], []
                for e in range(src.gate_up_proj.shape[0]):
                    qs = [hf_quantize(getattr(src, attr)[e, p].detach(), quantizer)
                          for p in parts]
                    ws.append(torch.cat([q for q, _ in qs]))
                    ss.append(torch.cat([sc for _, sc in qs]))
                    deq.append(torch.cat([q.double() * expand_scales(sc, *q.shape)
                                          for q, sc in qs]).to(dtype))
                setattr(m, attr, torch.nn.Parameter(torch.stack(ws), requires_grad=False))
                setattr(m, attr + "_scale_inv",
                        torch.nn.Parameter(torch.stack(ss), requires_grad=False))
                with torch.no_grad():
                    getattr(dst, attr).copy_(torch.stack(deq))
        if isinstance(m, fg.FP8Linear):
            src = base.get_submodule(name)
            w, s = hf_quantize(src.weight.detach(), quantizer)
            m.weight = torch.nn.Parameter(w, requires_grad=False)
            m.weight_scale_inv = torch.nn.Parameter(s, requires_grad=False)
            with torch.no_grad():
                ref.get_submodule(name).weight.copy_(
                    (w.double() * expand_scales(s, *w.shape)).to(dtype))
    return ref, model


def generate(model, ids, mask, new, **kw):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                              output_logits=True, return_dict_in_generate=True, **kw)


def test_tiny_fp8_model_converts_and_matches_hf_on_cpu():
    cfg = tiny_config("v3", q_lora_rank=256)
    ref, model = fp8_pair(cfg)
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.q_a_proj, fg.FP8Linear) and attn.kv_a_proj_with_mqa.weight.dtype == FP8
    assert tuple(attn.kv_a_proj_with_mqa.weight_scale_inv.shape) == (5, 2)    # 576 rows: ceil
    H.convert(model)
    assert hf_fp8.is_block_fp8(attn.o_proj) and attn.o_proj.weight.dtype == FP8   # kept fp8
    # W_UK_T / W_UV from kv_b_proj dequantized once, exactly as HF's dequantized model's
    kvb = ref.model.layers[0].self_attn.kv_b_proj.weight                    # [N*(P+V), L]
    w = kvb.t().reshape(512, 4, 256)
    assert torch.equal(attn.mla_attn.W_UK_T, w[..., :128].permute(1, 2, 0))
    assert torch.equal(attn.mla_attn.W_UV, w[..., 128:].transpose(0, 1))
    assert getattr(model.model.layers[0].mlp, "mla_converted", False)       # fp8 MLP fused
    ids, mask = left_padded([5, 17, 30])
    cache = H.PagedMLACache(model.config, max_batch_size=3, max_cache_len=64, block_size=16,
                            dtype=torch.float32)
    out = generate(model, ids, mask, 12, **cache_kw(cache))
    exp = generate(ref, ids, mask, 12)
    errs = [logit_err(a, b) for a, b in zip(out.logits, exp.logits)]
    assert max(errs) <= 1e-4, f"max logit error {max(errs):.2e}"
    assert torch.equal(out.sequences, exp.sequences)
    assert len(set(out.sequences[:, -12:].flatten().tolist())) > 4


def test_fully_quantized_moe_model_with_fused_experts_matches_hf_on_cpu():
    """Every linear and the routed experts fp8 (HF's FP8Experts): with fuse_experts the
    experts run the fp8 MoE op (on the CPU its dequantizing reference)."""
    ref, model = fp8_pair(tiny_config("v3", q_lora_rank=256), skip=("lm_head",))
    block = model.model.layers[1].mlp
    assert isinstance(block.experts, fg.FP8Experts)
    assert tuple(block.experts.gate_up_proj_scale_inv.shape) == (8, 2, 2)
    H.convert(model, fuse_experts=True)
    assert hf_fp8.is_fp8_experts(block.experts) and not block.mla_hf_fp8_runs
    ids, mask = left_padded([5, 17, 30])
    cache = H.PagedMLACache(model.config, max_batch_size=3, max_cache_len=64, block_size=16,
                            dtype=torch.float32)
    out = generate(model, ids, mask, 12, **cache_kw(cache))
    exp = generate(ref, ids, mask, 12)
    errs = [logit_err(a, b) for a, b in zip(out.logits, exp.logits)]
    assert max(errs) <= 1e-4, f"max logit error {max(errs):.2e}"
    assert torch.equal(out.sequences, exp.sequences)


def test_fp8_model_compiles_fullgraph_once_for_every_decode_step():
    """generate() with a fullgraph CompileConfig: the fp8 ops (linears, fused MLP, MoE
    experts) trace without graph breaks and the decode steps share one graph."""
    import torch._dynamo
    from torch._dynamo.backends.registry import lookup_backend
    from transformers.generation.configuration_utils import CompileConfig
    graphs = []

    def counting(gm, example_inputs, **kw):
        graphs.append(gm)
        return lookup_backend("inductor" if CUDA else "aot_eager")(gm, example_inputs)
    ref, model = fp8_pair(tiny_config("v3", q_lora_rank=256), skip=("lm_head",))
    ref, model = ref.to(DEV), H.convert(model, fuse_experts=True).to(DEV)
    ids, mask = (t.to(DEV) for t in left_padded([6, 19, 13]))
    cc = CompileConfig(fullgraph=True, dynamic=False, backend=counting, mode=None)
    cc._compile_all_devices = True          # CPU too
    cache = H.PagedMLACache(model.config, max_batch_size=3, max_cache_len=64, block_size=16,
                            device=DEV)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    try:
        out = generate(model, ids, mask, 10, **cache_kw(cache), compile_config=cc)
        breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    finally:
        torch._dynamo.reset()
    exp = generate(ref, ids, mask, 10)
    assert len(graphs) == 1 and breaks == 0, (len(graphs), breaks)
    targets = {str(n.target) for n in graphs[0].graph.nodes}
    for op in ("decode_linear_pair_fp8", "decode_gate_up_fp8", "moe_experts_decode_fp8"):
        assert any(op in t for t in targets), op
    assert torch.equal(out.sequences, exp.sequences)


def test_quantize_fp8_helper_is_hfs_quantization():
    """mla_ops.hf.fp8_models.quantize_fp8 (the benchmarks' FP8 models) holds the tensors this
    file's HF quantization gives, and leaves the source model as it was."""
    from mla_ops.hf.fp8_models import quantize_fp8
    cfg = tiny_config("v3", q_lora_rank=256)
    base, _ = build_pair(cfg)
    _, model = fp8_pair(cfg, skip=("lm_head",))
    before = {k: v.clone() for k, v in base.state_dict().items()}
    q = quantize_fp8(base)
    got, want = q.state_dict(), model.state_dict()
    assert got.keys() == want.keys()
    assert sum(v.dtype == FP8 for v in got.values()) > 10
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
    assert all(torch.equal(v, before[k]) for k, v in base.state_dict().items())


def test_convert_checks_fp8_scales_before_touching_the_model():
    ref, model = fp8_pair(tiny_config("v3", q_lora_rank=256, layers=1))
    o = model.model.layers[0].self_attn.o_proj
    o.weight_scale_inv = torch.nn.Parameter(o.weight_scale_inv[:, :1].clone(),
                                            requires_grad=False)
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.o_proj\.weight_scale_inv"):
        H.convert(model)
    assert not H.is_converted(model)


# ------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_ops_on_gpu_vs_fp64_eager_and_compiled(rows):
    g = torch.Generator().manual_seed(rows)
    w, s = rand_fp8(2112, 1024, g)
    x = (torch.randn(rows, 1024, generator=g) * 2).to(torch.bfloat16)
    ref = w8a8_ref(x.float(), w, s)
    wd, sd, xd = w.cuda(), s.cuda(), x.cuda()
    f = lambda x: torch.ops.mla.decode_linear_fp8(x, wd, sd, 128, 128)   # noqa: E731
    assert rel(f(xd), ref) < 1e-2
    assert rel(torch.compile(f, fullgraph=True)(xd), ref) < 1e-2


def cuda_fp8_model(dtype=torch.bfloat16, device="cuda"):
    """A tiny V3 with every linear but the head and the routed experts fp8, bf16 on CUDA,
    converted with fuse_experts."""
    _, model = fp8_pair(tiny_config("v3", q_lora_rank=256), dtype=dtype, skip=("lm_head",))
    return H.convert(model.to(device), fuse_experts=True)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_every_fp8_gemm_of_a_gpu_decode_step_vs_fp64(monkeypatch, dtype=torch.bfloat16,
                                                     device="cuda"):
    """Each fp8 GEMM of the converted model's decode steps on CUDA (the W8A8 kernels:
    q_a + kv_a, q_b, o_proj + residual, the fused MLPs, the routed experts) against the
    float64 W8A8 reference on the very inputs it got. (Whole-model tokens are no test of
    the numerics here: the activations' fp8 rounding makes this tiny random model's greedy
    run diverge under any bf16-level change.)"""
    import mla_ops.hf.moe as hf_moe
    from test_fp8_experts import moe_w8a8_ref
    model = cuda_fp8_model(dtype, device)
    model.mla_generate_graph = False      # every decode step an eager call, its values seen
    # the MoE block's separate ops, each seen (the block op is their composition, bit for
    # bit: test_moe_block_fp8.py)
    monkeypatch.setattr(hf_moe, "fp8_block_decode_args", lambda *a: None)
    calls = []

    def record(name, fn):
        def wrapped(*args):
            args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
            out = fn(*args)       # kept as returned (the layer writes RoPE into q in place)
            if out is not None:   # (fp8_pair_partials: None where the kernel does not serve)
                calls.append((name, args, tuple(o.clone() for o in out)
                              if isinstance(out, tuple) else out.clone()))
            return out
        monkeypatch.setattr(hf_fp8, name, wrapped)
    for name in ("fp8_linear", "fp8_linear_pair", "fp8_pair_partials", "fp8_partials",
                 "fp8_mlp", "fp8_routed_experts"):
        record(name, getattr(hf_fp8, name))
    ids, mask = (t.to(device) for t in left_padded([5, 17, 30]))
    cache = H.PagedMLACache(model.config, max_batch_size=3, max_cache_len=64, block_size=64,
                            device=device, dtype=dtype)
    generate(model, ids, mask, 3, **cache_kw(cache), disable_compile=True)   # each call seen
    cast = (lambda t: t.to(dtype).double())
    checked = set()
    for name, args, out in calls:
        x = args[2] if name in ("fp8_linear_pair", "fp8_pair_partials") else args[1]
        if x.numel() // x.shape[-1] > 64:
            continue                                    # prefill: the dequantized path
        x2 = x.reshape(-1, x.shape[-1]).float().cpu()
        if name == "fp8_linear":
            mod, residual = args[0], args[2] if len(args) > 2 else None
            ref = cast(w8a8_ref(x2, mod.weight.cpu(), mod.weight_scale_inv.cpu()))
            if residual is not None:
                ref = cast(ref + residual.reshape(ref.shape).double().cpu())
            got = out
        elif name == "fp8_partials":           # o_proj's fp32 split-K partials, unrounded
            mod = args[0]
            ref = w8a8_ref(x2, mod.weight.cpu(), mod.weight_scale_inv.cpu())
            assert out.dtype == torch.float32 and out.shape[0] >= 2
            got = out.sum(0)
        elif name in ("fp8_linear_pair", "fp8_pair_partials"):
            ref = torch.cat([w8a8_ref(x2, m.weight.cpu(), m.weight_scale_inv.cpu())
                             for m in args[:2]], -1)
            if name == "fp8_linear_pair":
                ref = cast(ref)
                got = torch.cat([o.reshape(ref.shape[0], -1) for o in out], -1)
            else:                              # fp32 split-K partials, unrounded
                assert out.dtype == torch.float32 and out.shape[0] >= 1
                got = out.sum(0)
        elif name == "fp8_mlp":
            mlp = args[0]
            g, u = (w8a8_ref(x2, m.weight.cpu(), m.weight_scale_inv.cpu())
                    for m in (mlp.gate_proj, mlp.up_proj))
            h = cast(cast(F.silu(cast(g))) * cast(u))
            ref = cast(w8a8_ref(h.float(), mlp.down_proj.weight.cpu(),
                                mlp.down_proj.weight_scale_inv.cpu()))
            if len(args) > 2 and args[2] is not None:
                ref = cast(ref + args[2].reshape(ref.shape).double().cpu())
            got = out
        else:
            block, idx, wts = args[0], args[2], args[3]
            ex = block.experts
            ref = moe_w8a8_ref(x2, idx.cpu(), wts.float().cpu(),
                               *(t.cpu() for t in (ex.gate_up_proj, ex.gate_up_proj_scale_inv,
                                                   ex.down_proj, ex.down_proj_scale_inv)), cast)
            got = out
        err = rel(got.reshape(ref.shape).float(), ref)
        assert err < 2e-2, (name, err, tuple(x.shape))
        checked.add(name)
    # q_a + kv_a: the fp32 partial for the fused prologue (V3 on CUDA), else the pair op;
    # o_proj's partials where its GEMM splits K (test_fp8_linear_split.py's configs)
    assert checked - {"fp8_linear_pair", "fp8_partials"} == {
        "fp8_linear", "fp8_pair_partials", "fp8_mlp", "fp8_routed_experts"}
    return checked


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_fp8_model_decode_graph_on_gpu_matches_generate():
    """The FP8 model's decode step (fp8 GEMM and MoE kernels) compiles fullgraph and
    captures in DecodeGraph; its replays give the tokens of compiled generate()."""
    from hf_models import graph_and_generate_tokens
    model = cuda_fp8_model()
    ids, mask = (t.cuda() for t in left_padded([5, 17, 30]))
    cache = H.PagedMLACache(model.config, max_batch_size=3, max_cache_len=64, block_size=64,
                            device="cuda", dtype=torch.bfloat16)
    runner, got, exp = graph_and_generate_tokens(model, ids, mask, cache, 8)
    assert runner.graph_enabled
    assert torch.equal(got, exp)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_fp8_model_generate_replays_the_eager_step_graph():
    """generate() without compile on the FP8 model: its eager decode step (the fp8 GEMMs,
    the MoE block with its shared experts on a side stream) is captured, no fallback
    warning, and the replays give the eager steps' tokens and logits bit for bit."""
    import warnings
    from mla_ops.hf import generate_graph as GG
    model = cuda_fp8_model()
    ids, mask = (t.cuda() for t in left_padded([5, 17, 30], seed=3))
    cache = H.PagedMLACache(model.config, max_batch_size=3, max_cache_len=64, block_size=64,
                            device="cuda", dtype=torch.bfloat16)
    model.mla_generate_graph = False
    exp = generate(model, ids, mask, 8, **cache_kw(cache), disable_compile=True)
    model.mla_generate_graph = True
    cache.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)               # captured, not eager
        got = generate(model, ids, mask, 8, **cache_kw(cache), disable_compile=True)
    kept = getattr(cache, GG.KEPT)
    assert kept is not None and all(r._graph is not None for r in kept.runners.values())
    assert torch.equal(got.sequences, exp.sequences)
    for a, b in zip(got.logits, exp.logits):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
