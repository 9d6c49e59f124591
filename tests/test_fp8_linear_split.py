"""Split-K in the fp8 decode GEMM (lowering/gemm/fp8_linear.py): the kernel's fp32 partials
over contiguous ranges of whole scale groups, the reduce's roundings and epilogues, the
config helpers, and the ops picking a split from CONFIGS; against test_fp8_checkpoint.py's
float64 reference of HF's W8A8 numerics. On the CPU the kernels run in Triton's
interpreter in fp16 (its bf16 cast truncates; its fp16 cast rounds as the GPU's)."""
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
pytest.importorskip("transformers.integrations.finegrained_fp8")

from lowering.gemm import fp8_launch, fp8_linear  # noqa: E402

from lowering.gemm import fp8_linear_configs  # noqa: E402
from test_fp8_checkpoint import quant_act_ref, rand_fp8, rel, w8a8_ref, expand_scales  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
DT = torch.bfloat16 if CUDA else torch.float16


def group_ranges(K, split, gk=128):
    """The columns [k0, k1) of each split: the G = cdiv(K, gk) scale groups dealt in
    contiguous ranges, groups [s G // split, (s + 1) G // split) to split s (the kernel's
    documented split), sizes differing by at most one group."""
    G = -(-K // gk)
    bounds = [s * G // split for s in range(split + 1)]
    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == G
    return [(a * gk, min(K, b * gk)) for a, b in zip(bounds, bounds[1:])]


def partial_ref(x, w, s, k0, k1):
    """fp64 W8A8 product over columns [k0, k1) only (x quantized over all of K first)."""
    xq = quant_act_ref(x)
    wd = w.double() * expand_scales(s, *w.shape)
    return xq[:, k0:k1] @ wd[:, k0:k1].T


# (M, N1, N2, K, split): 7 groups in 4 splits (ranges of 1, 2, 2, 2 groups); a partial last
# group (K % 128 != 0) in 3 splits; one group per split; N not a multiple of BLOCK_N
SPLIT_CASES = [(1, 100, 37, 7 * 128, 4), (5, 72, 130, 7 * 128 - 50, 3),
               (33, 40, 20, 3 * 128, 3), (5, 16, 64, 2 * 128 + 5, 2)]


@pytest.mark.parametrize("M,N1,N2,K,split", SPLIT_CASES)
def test_split_partials_cover_contiguous_group_ranges(M, N1, N2, K, split):
    """Partial s of modes 0 and 1 is the product over the s-th range of whole scale groups
    (each range's activation groups quantized as without splits)."""
    g = torch.Generator().manual_seed(M * 31 + K)
    x = torch.randn(M, K, generator=g) * 3
    (w1, s1), (w2, s2) = rand_fp8(N1, K, g), rand_fp8(N2, K, g)
    xs = x.to(DEV, DT)
    x = xs.cpu().float()
    dev = [t.to(DEV) for t in (w1, s1, w2, s2)]
    cfg = (32, 4, 2, split)
    parts = torch.full((split, M, N1), float("nan"), device=DEV)
    fp8_linear.launch(xs, dev[0], dev[1], None, None, 0, parts, None, 128, 128, cfg)
    pair = torch.full((split, M, N1 + N2), float("nan"), device=DEV)
    fp8_linear.launch(xs, *dev, 1, pair, None, 128, 128, cfg, y2_col0=N1)
    tol = 1e-3 if CUDA else 1e-5          # (the GPU's fp8 cast: see test_fp8_checkpoint.py)
    for s, (k0, k1) in enumerate(group_ranges(K, split)):
        assert k1 > k0
        want = partial_ref(x, w1, s1, k0, k1)
        assert rel(parts[s], want) < tol, s
        want2 = torch.cat([want, partial_ref(x, w2, s2, k0, k1)], 1)
        assert rel(pair[s], want2) < tol, s
    full = torch.cat([w8a8_ref(x, w1, s1), w8a8_ref(x, w2, s2)], 1)
    assert rel(pair.sum(0), full) < tol


@pytest.mark.parametrize("dt", [torch.float16, torch.bfloat16] if CUDA else [torch.float16])
def test_reduce_rounds_once_then_applies_the_epilogue(dt):
    """reduce_partials: the fp32 sum rounded once to y's dtype; the residual added to the
    rounded sum (HF's `residual + linear(x)`, rounded again); gated: gate, silu(gate), up and
    the product each rounded, as the unfused modules. Bit for bit vs torch on the partials."""
    g = torch.Generator().manual_seed(3)
    parts = (torch.randn(3, 5, 600, generator=g) * 7).to(DEV)             # [S, M, NP]
    total = parts[0] + parts[1] + parts[2]                                 # split order
    y1, y2 = torch.empty(5, 250, device=DEV, dtype=dt), torch.empty(5, 350, device=DEV, dtype=dt)
    fp8_launch.reduce_partials(parts, y1, y2)
    assert torch.equal(y1, total[:, :250].to(dt)) and torch.equal(y2, total[:, 250:].to(dt))
    r = torch.randn(5, 600, generator=g).to(DEV, dt)
    y = torch.empty(5, 600, device=DEV, dtype=dt)
    fp8_launch.reduce_partials(parts, y, residual=r)
    assert torch.equal(y, total.to(dt) + r)
    # the product rounded first matters: the unrounded sum plus r differs somewhere
    assert not torch.equal(y, (total + r.float()).to(dt))
    y = torch.empty(5, 300, device=DEV, dtype=dt)
    fp8_launch.reduce_partials(parts, y, gated=True)
    gate, up = total[:, :300].to(dt), total[:, 300:].to(dt)
    # silu(gate) rounded to dt, times up, rounded: the GPU's sigmoid (a fast exp) may put
    # silu one unit in the last place of dt away from torch's
    want = F.silu(gate.float()).to(dt) * up
    ulp = torch.finfo(dt).eps
    torch.testing.assert_close(y, want, rtol=2 * ulp if CUDA else 0, atol=0)
    with pytest.raises(ValueError, match="partials"):
        fp8_launch.reduce_partials(parts, torch.empty(5, 200, device=DEV, dtype=dt))


@pytest.mark.parametrize("pre_quant", [True, False])
@pytest.mark.parametrize("M,N1,N2,K,split", SPLIT_CASES[:3])
def test_run_with_split_k_vs_fp64(M, N1, N2, K, split, pre_quant):
    """run() (the ops' kernel path) with a split config for every mode, residual included,
    against the float64 W8A8 reference rounded as HF rounds; and equal to the unsplit run
    up to the order of the fp32 sum. Both ways of quantizing the activations: once before
    the GEMM (act_quant_kernel) and in every program."""
    g = torch.Generator().manual_seed(M * 13 + K)
    x = torch.randn(M, K, generator=g) * 2
    (w1, s1), (w2, s2), (w3, s3) = rand_fp8(N1, K, g), rand_fp8(N2, K, g), rand_fp8(N1, K, g)
    xs = x.to(DEV, DT)
    x = xs.cpu().float()
    d = {k: t.to(DEV) for k, t in dict(w1=w1, s1=s1, w2=w2, s2=s2, w3=w3, s3=s3).items()}
    cast = (lambda t: t.to(DT).double())
    tol = 2e-2 if CUDA else 2e-3          # a few ulps of the 16-bit output
    ref1, ref2 = w8a8_ref(x, w1, s1), w8a8_ref(x, w2, s2)
    out = {}
    for sk in (1, split):
        cfg = (32, 4, 2, sk, pre_quant)
        y = torch.empty(M, N1, device=DEV, dtype=DT)
        fp8_linear.run(xs, d["w1"], d["s1"], None, None, 0, y, None, 128, 128, cfg)
        assert rel(y, cast(ref1)) < tol
        r = torch.randn(M, N1, generator=g).to(DEV, DT) * 20
        yr = torch.empty(M, N1, device=DEV, dtype=DT)
        fp8_linear.run(xs, d["w1"], d["s1"], None, None, 0, yr, None, 128, 128, cfg,
                       residual=r)
        assert rel(yr, cast(cast(ref1) + r.cpu().double())) < tol
        y1 = torch.empty(M, N1, device=DEV, dtype=DT)
        y2 = torch.empty(M, N2, device=DEV, dtype=DT)
        fp8_linear.run(xs, d["w1"], d["s1"], d["w2"], d["s2"], 1, y1, y2, 128, 128, cfg)
        assert rel(y1, cast(ref1)) < tol and rel(y2, cast(ref2)) < tol
        yg = torch.empty(M, N1, device=DEV, dtype=DT)
        fp8_linear.run(xs, d["w1"], d["s1"], d["w3"], d["s3"], 2, yg, None, 128, 128, cfg)
        want = cast(cast(F.silu(cast(ref1))) * cast(w8a8_ref(x, w3, s3)))
        assert rel(yg, want) < 3 * tol
        out[sk] = (y, y1, y2, yg)
    for a, b in zip(out[1], out[split]):          # the same W8A8 numerics, another sum order
        assert rel(b, a.double().cpu()) < 2e-3


def test_default_split_fills_the_sms_within_bounds():
    """default_split_k: a power of two, the grid within PROGRAMS_PER_SM per SM, each split
    at least MIN_GROUPS_PER_SPLIT groups, and the largest such; wide weights unsplit."""
    cap = fp8_linear_configs.PROGRAMS_PER_SM * fp8_linear_configs.SMS
    for mode, N, K, bn in [(1, 2112, 7168, 16), (0, 7168, 16384, 32), (0, 7168, 18432, 64),
                           (2, 2048, 7168, 64), (0, 300, 1024, 64), (0, 2048, 256, 16)]:
        sk = fp8_linear_configs.default_split_k(mode, N, K, bn)
        blocks = -(-N // bn) * (2 if mode == 2 and sk > 1 else 1)
        groups = -(-K // 128)
        assert sk & (sk - 1) == 0 and blocks * sk <= max(cap, blocks)
        assert sk == 1 or groups // sk >= fp8_linear_configs.MIN_GROUPS_PER_SPLIT
        bigger = 2 * sk
        b2 = -(-N // bn) * (2 if mode == 2 else 1)
        assert b2 * bigger > cap or groups // bigger < fp8_linear_configs.MIN_GROUPS_PER_SPLIT, (mode, N)
    assert fp8_linear_configs.default_split_k(1, 2112, 7168, 16) == 4              # 132 x 4 = 528
    assert fp8_linear_configs.default_split_k(0, 24576, 1536, 64) == 1             # 384 programs
    assert fp8_linear_configs.default_split_k(2, 18432, 7168, 64) == 1             # 288 programs
    assert fp8_linear_configs.default_split_k(2, 2048, 7168, 64) > 1               # 32 programs


def test_split_k_for_bounds_the_workspace_and_the_groups():
    assert fp8_linear_configs.split_k_for((64, 4, 4, 8), 0, 1, 7168, 3 * 128, 128) == 3   # 3 groups
    assert fp8_linear_configs.split_k_for((64, 4, 4), 0, 1, 7168, 7168, 128) == 1
    big = fp8_linear_configs.split_k_for((64, 4, 4, 64), 2, 64, 18432, 7168, 128)
    assert big >= 1 and big * 64 * 2 * 18432 * 4 <= fp8_linear_configs.MAX_PARTIAL_BYTES
    for key, cfg in fp8_linear_configs.CONFIGS.items():
        assert len(cfg) in (4, 5) and cfg[3] >= 1, key
        assert fp8_linear_configs.pre_quant_of(cfg) == (len(cfg) == 4 or cfg[4]), key
    cfg = fp8_linear_configs.pick_config(0, 123, 4096, 1)                     # no entry: the default
    assert cfg[:3] == fp8_linear_configs.DEFAULT_TILE
    assert cfg[3] == fp8_linear_configs.default_split_k(0, 123, 4096, cfg[0])


def test_launch_rejects_a_split_it_cannot_run():
    g = torch.Generator().manual_seed(4)
    w, s = rand_fp8(32, 256, g)
    x = torch.randn(2, 256).to(DEV, DT)
    w, s = w.to(DEV), s.to(DEV)
    y = torch.empty(2, 2, 32, device=DEV)
    with pytest.raises(ValueError, match="SPLIT_K=2"):       # mode 2 splits through run()
        fp8_linear.launch(x, w, s, w, s, 2, y, None, 128, 128, (32, 4, 2, 2))
    with pytest.raises(ValueError, match="SPLIT_K=2"):       # not [SPLIT_K, M, N] fp32
        fp8_linear.launch(x, w, s, None, None, 0, y[0], None, 128, 128, (32, 4, 2, 2))
    with pytest.raises(ValueError, match="SPLIT_K=2"):       # mode 1 splits into one output
        fp8_linear.launch(x, w, s, w, s, 1, y, y, 128, 128, (32, 4, 2, 2))
    with pytest.raises(ValueError, match="SPLIT_K"):
        fp8_linear.launch(x, w, s, None, None, 0, y[0], None, 128, 128, (32, 4, 2, 0))


# ------------------------------------------------------------------ the ops


@pytest.mark.parametrize("rows", [1, 5, 33])
def test_ops_split_through_configs_eager_and_compiled(rows, monkeypatch):
    """With CONFIGS entries that split K, every op (and the prologue's partials op: S
    partials) matches the fp64 reference, eager and (on CUDA) compiled fullgraph. On the
    CPU the kernel path is forced (fp8_linear_unmet patched) and runs in the interpreter
    (which cannot run under fake tensors: eager only there)."""
    g = torch.Generator().manual_seed(rows)
    K, N1, N2 = 1000, 192, 72                                   # 8 groups, the last partial
    (w1, s1), (w2, s2), (w3, s3) = rand_fp8(N1, K, g), rand_fp8(N2, K, g), rand_fp8(N1, K, g)
    x = (torch.randn(rows, K, generator=g) * 2).to(DT)
    for key in [(0, N1, K), (1, N1 + N2, K), (2, N1, K)]:
        monkeypatch.setitem(fp8_linear_configs.CONFIGS, (*key, rows <= 16), (32, 4, 3, 3))
    if not CUDA:
        monkeypatch.setattr(fp8_linear, "fp8_linear_unmet", lambda *a: None)
    w1, s1, w2, s2, w3, s3, xd = (t.to(DEV) for t in (w1, s1, w2, s2, w3, s3, x))
    r = (torch.randn(rows, N1, generator=g) * 20).to(DEV, DT)
    ops = torch.ops.mla

    def f(x):
        return (ops.decode_linear_fp8(x, w1, s1, 128, 128),
                ops.decode_linear_fp8_residual(x, w1, s1, r, 128, 128),
                *ops.decode_linear_pair_fp8(x, w1, s1, w2, s2, 128, 128),
                ops.decode_gate_up_fp8(x, w1, s1, w3, s3, 128, 128),
                ops.decode_linear_pair_fp8_partials(x, w1, s1, w2, s2, 128, 128),
                ops.decode_linear_fp8_partials(x, w1, s1, 128, 128))
    xf = x.float()
    ref1 = w8a8_ref(xf, w1.cpu(), s1.cpu())
    ref2 = w8a8_ref(xf, w2.cpu(), s2.cpu())
    cast = (lambda t: t.to(DT).double())
    gate_up = cast(cast(F.silu(cast(ref1))) * cast(w8a8_ref(xf, w3.cpu(), s3.cpu())))
    tol, tight = (1e-2, 1e-3) if CUDA else (2e-3, 1e-5)
    for fn in (f, torch.compile(f, fullgraph=True)) if CUDA else (f,):
        y, yr, y1, y2, yg, parts, parts1 = fn(xd)
        assert parts.shape == (3, rows, N1 + N2) and parts.dtype == torch.float32
        assert parts1.shape == (3, rows, N1) and parts1.dtype == torch.float32
        assert rel(parts1.sum(0), ref1) < tight
        # o_proj's partials through the residual norm: its h is the residual op's output
        norm_w = (torch.rand(N1, generator=g) + 0.5).to(DEV, DT)
        h, _ = ops.residual_rms_norm(parts1, r, norm_w, 1e-6)
        assert torch.equal(h, yr) if CUDA else rel(h, yr.double().cpu()) < 1e-6
        assert rel(y, cast(ref1)) < tol and rel(y1, cast(ref1)) < tol
        assert rel(y2, cast(ref2)) < tol
        assert rel(yr, cast(cast(ref1) + r.double().cpu())) < tol
        assert rel(yg, gate_up) < 3 * tol
        assert rel(parts.sum(0), torch.cat([ref1, ref2], 1)) < tight


# ------------------------------------------------------------------ GPU: a model's decode


@pytest.fixture
def tiny_splits(monkeypatch):
    """default_split_k splits even the tiny test model's K (2 to 4 scale groups): q_a +
    kv_a, o_proj, the fused MLPs' gate + up and down_proj then run split-K."""
    monkeypatch.setattr(fp8_linear_configs, "MIN_GROUPS_PER_SPLIT", 1)
    assert fp8_linear_configs.pick_config(0, 256, 512, 1)[3] == 4                   # o_proj, down
    assert fp8_linear_configs.pick_config(2, 512, 256, 1)[3] == 2                   # gate + up
    assert fp8_linear_configs.pick_config(1, 832, 256, 1)[3] == 2                   # q_a + kv_a


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_split_decode_step_gemms_vs_fp64(tiny_splits, monkeypatch):
    from test_fp8_checkpoint import test_every_fp8_gemm_of_a_gpu_decode_step_vs_fp64 as check
    assert "fp8_partials" in check(monkeypatch)       # o_proj split: its partials checked


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_split_model_compiles_fullgraph_once(tiny_splits):
    from test_fp8_checkpoint import test_fp8_model_compiles_fullgraph_once_for_every_decode_step as check
    check()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_split_model_decode_graph_matches_generate(tiny_splits):
    from test_fp8_checkpoint import test_fp8_model_decode_graph_on_gpu_matches_generate as check
    check()


@pytest.mark.parametrize("M,K", [(1, 7 * 128), (3, 2 * 128 + 5), (33, 128)])
def test_act_quant_kernel_vs_fp64_and_both_ways_equal(M, K):
    """act_quant_kernel's e4m3 values times their scales are HF's quantized activations
    (float64 reference); a GEMM over them equals the one that quantizes in every program
    (on the CPU bit for bit: the same products summed in the same order)."""
    from lowering.gemm.fp8_linear_kernel import act_quant_kernel
    g = torch.Generator().manual_seed(M * 7 + K)
    x = (torch.randn(M, K, generator=g) * 3).to(DEV, DT)
    G = -(-K // 128)
    xq = torch.empty(M, K, device=DEV, dtype=torch.float8_e4m3fn)
    xs = torch.full((M, G), float("nan"), device=DEV)
    act_quant_kernel[(M, G)](x, xq, xs, K, x.stride(0), G, BLOCK_K=128, NATIVE_CAST=CUDA,
                             num_warps=1)
    deq = xq.cpu().double() * xs.cpu().double().repeat_interleave(128, 1)[:, :K]
    assert torch.equal(deq, quant_act_ref(x.cpu().float()))
    w, s = rand_fp8(40, K, g)
    w, s = w.to(DEV), s.to(DEV)
    ys = []
    for pq in (True, False):
        y = torch.empty(M, 40, device=DEV, dtype=DT)
        fp8_linear.run(x, w, s, None, None, 0, y, None, 128, 128, (32, 4, 2, 1), pre_quant=pq)
        ys.append(y)
    if CUDA:
        assert rel(ys[0], ys[1].double().cpu()) < 2e-3
    else:
        assert torch.equal(ys[0], ys[1])


# ------------------------------------------------ a prefill's rows: the grouped W8A8 GEMM

@pytest.mark.parametrize("M,N,K,tile", [(70, 96, 256, (16, 32)), (5, 40, 200, (16, 64)),
                                        (33, 130, 384, (32, 64))])
def test_prefill_linear_vs_fp64(M, N, K, tile):
    """grouped.prefill_linear (every row one group): HF's W8A8 product, rows and columns
    not multiples of the tile, K not a multiple of the scale group."""
    from lowering.gemm.grouped import prefill_linear
    g = torch.Generator().manual_seed(M + N + K)
    x = (torch.randn(M, K, generator=g) * 3).to(DEV, DT)
    w, s = rand_fp8(N, K, g)
    y = prefill_linear(x, w.to(DEV), s.to(DEV), 128, 128, config=(*tile, 4, 2))
    assert y.dtype == DT and y.shape == (M, N)
    tol = 2e-2 if CUDA else 2e-3
    assert rel(y.float(), w8a8_ref(x.cpu().float(), w, s)) < tol


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_ops_take_the_grouped_gemm_past_the_decode_rows():
    """At 200 rows in bf16 on CUDA the fp8 ops run the grouped W8A8 GEMM: within bf16
    rounding of the float64 W8A8 product (the dequantized path differs by the activations'
    fp8 rounding), the residual and gated forms too."""
    g = torch.Generator().manual_seed(11)
    M, N, K = 200, 256, 512
    x = torch.randn(M, K, generator=g).to("cuda", torch.bfloat16)
    (w, s), (w2, s2) = rand_fp8(N, K, g), rand_fp8(N, K, g)
    wd, sd, w2d, s2d = (t.cuda() for t in (w, s, w2, s2))
    ref = w8a8_ref(x.cpu().float(), w, s)
    assert rel(torch.ops.mla.decode_linear_fp8(x, wd, sd, 128, 128).float(), ref) < 2e-2
    r = torch.randn(M, N, generator=g).to("cuda", torch.bfloat16)
    got = torch.ops.mla.decode_linear_fp8_residual(x, wd, sd, r, 128, 128)
    assert rel(got.float(), ref + r.double().cpu()) < 2e-2
    h = torch.ops.mla.decode_gate_up_fp8(x, wd, sd, w2d, s2d, 128, 128)
    assert rel(h.float(), F.silu(ref) * w8a8_ref(x.cpu().float(), w2, s2)) < 3e-2


@pytest.mark.parametrize("mode,split,pre", [(2, 3, True), (0, 2, True), (0, 1, True),
                                            (2, 1, False)])
def test_scratch_made_beforehand_gives_the_same_bits(mode, split, pre):
    """run() with scratch() made first (as the fp8 MoE block makes its side branch's
    before forking) writes the same bits as run() making its own, and uses the buffers it
    was given (the partials and the quantized activations hold this call's values)."""
    g = torch.Generator().manual_seed(11 * mode + split)
    M, N, K = 3, 48, 5 * 128 - 40
    x = (torch.randn(M, K, generator=g) * 2).to(DEV, DT)
    (w1, s1), (w2, s2) = rand_fp8(N, K, g), rand_fp8(N, K, g)
    w1, s1, w2, s2 = (t.to(DEV) for t in (w1, s1, w2, s2))
    pair = (w2, s2) if mode == 2 else (None, None)
    cfg = (32, 4, 2, split, pre)
    outs = []
    for made in (None, fp8_launch.scratch(x, w1, pair[0], mode, 128, cfg)):
        y = torch.full((M, N), float("nan"), dtype=DT, device=DEV)
        fp8_linear.run(x, w1, s1, *pair, mode, y, None, 128, 128, cfg, made=made)
        outs.append(y)
    assert torch.isfinite(outs[0].float()).all()
    assert torch.equal(outs[0], outs[1])
    assert (made["parts"] is not None) == (split > 1)
    assert (made["quant_out"] is not None) == pre
    if pre:
        xq, xs = made["quant_out"]
        ref_q, ref_s = fp8_linear.quantized(x, 128, True)[:2]
        assert torch.equal(xq.view(torch.uint8), ref_q.view(torch.uint8))
        assert torch.equal(xs, ref_s)
    if split > 1:
        assert torch.isfinite(made["parts"]).all()
