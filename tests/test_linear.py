"""The decode GEMM kernel and ops (lowering/gemm/linear.py) vs float64, and the converted HF
layer's use of them. CPU: the kernel under the Triton interpreter in fp32 (it mis-multiplies
16-bit dots); the ops' torch path bit for bit against what the HF modules compute."""
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from lowering.gemm import linear  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _randn(*shape, g):
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def _rel(a, ref):
    return ((a.double() - ref).abs().max() / ref.abs().max()).item()


# M rows, N1 (, N2), K, config: rows 1 / 5 / 33 (BLOCK_M 16 / 16 / 64), N and K not multiples
# of the blocks, a second weight shorter than one block
CASES = [
    (1, 100, 37, 300, (32, 128, 4, 2)),
    (5, 64, 64, 512, (16, 256, 4, 2)),
    (33, 50, 7, 200, (64, 64, 4, 2)),
    (32, 130, 20, 384, (64, 64, 8, 3)),   # 8 warps, as the 32-row gate + up config
]


@pytest.mark.parametrize("M,N1,N2,K,cfg", CASES)
def test_kernel_modes_vs_fp64(M, N1, N2, K, cfg):
    g = torch.Generator().manual_seed(M * 1000 + K)
    x, w1, w2, w3 = _randn(M, K, g=g), _randn(N1, K, g=g), _randn(N2, K, g=g), _randn(N1, K, g=g)
    dt, tol = (torch.bfloat16, 1e-2) if DEV == "cuda" else (torch.float32, 1e-5)
    xs, w1s, w2s, w3s = (t.to(DEV, dt) for t in (x, w1, w2, w3))
    x, w1, w2, w3 = (t.to(dt).double() for t in (x, w1, w2, w3))          # the rounded inputs

    y = torch.empty(M, N1, device=DEV, dtype=dt)
    linear.launch(xs, w1s, None, 0, y, None, cfg)
    assert _rel(y.cpu(), x @ w1.T) < tol

    y1, y2 = torch.empty(M, N1, device=DEV, dtype=dt), torch.empty(M, N2, device=DEV, dtype=dt)
    linear.launch(xs, w1s, w2s, 1, y1, y2, cfg)
    assert _rel(y1.cpu(), x @ w1.T) < tol and _rel(y2.cpu(), x @ w2.T) < tol

    y = torch.empty(M, N1, device=DEV, dtype=dt)
    linear.launch(xs, w1s, w3s, 2, y, None, cfg)
    ref = F.silu(x @ w1.T) * (x @ w3.T)
    assert _rel(y.cpu(), ref) < 3 * tol


@pytest.mark.parametrize("M,K,cfg", [
    (1, 300, (32, 64, 4, 2, 3)),      # K tiles split unevenly, the last split partly empty
    (5, 512, (16, 128, 4, 2, 4)),     # even: each split exactly one tile
    (3, 100, (16, 64, 4, 2, 5)),      # more splits than K tiles: empty splits add zeros
])
def test_kernel_split_k_partials_vs_fp64(M, K, cfg):
    g = torch.Generator().manual_seed(M * 7 + K)
    x, w1, w2 = _randn(M, K, g=g), _randn(70, K, g=g), _randn(9, K, g=g)
    dt, tol = (torch.bfloat16, 1e-2) if DEV == "cuda" else (torch.float32, 1e-5)
    xs, w1s, w2s = (t.to(DEV, dt) for t in (x, w1, w2))
    x, w1, w2 = (t.to(dt).double() for t in (x, w1, w2))
    S = cfg[4]
    parts = torch.full((S, M, 70), float("nan"), device=DEV)          # every entry written
    linear.launch(xs, w1s, None, 0, parts, None, cfg)
    assert _rel(parts.sum(0).cpu(), x @ w1.T) < tol
    parts = torch.full((S, M, 79), float("nan"), device=DEV)
    linear.launch(xs, w1s, w2s, 1, parts, None, cfg, y2_col0=70)    # one buffer
    assert _rel(parts.sum(0).cpu(), torch.cat([x @ w1.T, x @ w2.T], -1)) < tol
    assert (parts[1:].abs().sum() > 0) and (parts[0].abs().sum() > 0)   # K really split
    with pytest.raises(ValueError, match="SPLIT_K=.* needs mode 0 or 1"):
        linear.launch(xs, w1s, w1s, 2, parts[..., :70], None, cfg)


@pytest.mark.parametrize("M,N,K,cfg", [(1, 100, 300, (32, 128, 4, 2)), (33, 50, 200, (64, 64, 4, 2)),
                                       (32, 130, 384, (64, 128, 4, 3))])
def test_kernel_residual_epilogue_vs_fp64(M, N, K, cfg):
    """Mode 0 with a residual: y = r + x @ w.T, the product rounded to y's dtype before the
    add as HF's `residual + o_proj(h)` rounds; rows and N not multiples of the blocks."""
    g = torch.Generator().manual_seed(M + N + K)
    x, w, r = _randn(M, K, g=g), _randn(N, K, g=g), _randn(M, N, g=g).mul(10)
    dt = torch.bfloat16 if DEV == "cuda" else torch.float32
    xs, ws, rs = (t.to(DEV, dt) for t in (x, w, r))
    x, w, r = (t.to(dt).double() for t in (x, w, r))
    y = torch.full((M, N), float("nan"), device=DEV, dtype=dt)
    linear.launch(xs, ws, None, 0, y, None, cfg, residual=rs)
    ref = r + (x @ w.T)
    tol = 1e-2 if dt == torch.bfloat16 else 1e-5
    assert _rel(y.cpu(), ref) < tol
    assert _rel(y.cpu() - rs.cpu(), x @ w.T) < (5e-2 if dt == torch.bfloat16 else 1e-4)
    parts = torch.empty(2, M, N, device=DEV)
    with pytest.raises(ValueError, match="a residual needs mode 0 without split-K"):
        linear.launch(xs, ws, None, 0, parts, None, (*cfg, 2), residual=rs)
    with pytest.raises(ValueError, match="a residual needs mode 0"):
        linear.launch(xs, ws, ws, 2, y, None, cfg, residual=rs)


def test_residual_op_torch_path_and_errors():
    """Off the kernel path decode_linear_residual is HF's `residual + o_proj(h)` bit for
    bit; a residual of the wrong shape or dtype is refused."""
    g = torch.Generator().manual_seed(4)
    x, w, r = (_randn(*s, g=g).float() for s in ((2, 3, 40), (24, 40), (2, 3, 24)))
    assert torch.equal(torch.ops.mla.decode_linear_residual(x, w, r), r + F.linear(x, w))
    with pytest.raises(ValueError, match=r"residual must be \(2, 3, 24\)"):
        torch.ops.mla.decode_linear_residual(x, w, r[:, :1])
    with pytest.raises(TypeError, match="residual must be torch.float32"):
        torch.ops.mla.decode_linear_residual(x, w, r.double())


def test_pair_partials_op_torch_path_sums_to_the_modules():
    """Off the kernel path the partials op puts the whole F.linear result in partial 0."""
    g = torch.Generator().manual_seed(9)
    x = _randn(2, 3, 48, g=g).float()
    w1, w2 = _randn(32, 48, g=g).float(), _randn(16, 48, g=g).float()
    parts = torch.ops.mla.decode_linear_pair_partials(x, w1, w2, 3)
    assert parts.shape == (3, 2, 3, 48) and parts.dtype == torch.float32
    assert torch.equal(parts.sum(0), torch.cat([F.linear(x, w1), F.linear(x, w2)], -1))
    with pytest.raises(ValueError, match="split_k must be a positive int"):
        torch.ops.mla.decode_linear_pair_partials(x, w1, w2, 0)
    assert linear.pair_split_k(x, w1, w2) == 1                          # CPU: no kernel


def test_linear_partials_op_torch_path_sums_to_the_module():
    g = torch.Generator().manual_seed(10)
    x, w = _randn(2, 3, 48, g=g).float(), _randn(40, 48, g=g).float()
    parts = torch.ops.mla.decode_linear_partials(x, w, 4)
    assert parts.shape == (4, 2, 3, 40) and parts.dtype == torch.float32
    assert torch.equal(parts.sum(0), F.linear(x, w))
    with pytest.raises(ValueError, match="split_k must be a positive int"):
        torch.ops.mla.decode_linear_partials(x, w, -1)
    with pytest.raises(ValueError, match=r"weight 0 must be \[N, 48\]"):
        torch.ops.mla.decode_linear_partials(x, w[:, :47], 2)
    assert linear.linear_split_k(x, w) == 1                             # CPU: no kernel


def test_gate_up_kernel_reads_both_weights():
    """Mode 2 must read both weights: swapping gate and up changes the result."""
    g = torch.Generator().manual_seed(3)
    x, wg, wu = (t.float().to(DEV) for t in (_randn(2, 64, g=g), _randn(40, 64, g=g), _randn(40, 64, g=g)))
    a = torch.empty(2, 40, device=DEV)
    b = torch.empty(2, 40, device=DEV)
    linear.launch(x, wg, wu, 2, a, None, (16, 32, 4, 2))
    linear.launch(x, wu, wg, 2, b, None, (16, 32, 4, 2))
    assert (a - b).abs().max() > 1e-2


def test_ops_torch_path_is_what_the_modules_compute():
    """Off the GPU decode path the ops are F.linear / F.silu exactly (the converted model
    then equals HF bit for bit)."""
    g = torch.Generator().manual_seed(5)
    x = _randn(3, 7, 48, g=g).float()
    w1, w2, w3 = (_randn(n, 48, g=g).float() for n in (32, 16, 32))
    assert torch.equal(torch.ops.mla.decode_linear(x, w1), F.linear(x, w1))
    a, b = torch.ops.mla.decode_linear_pair(x, w1, w2)
    assert torch.equal(a, F.linear(x, w1)) and torch.equal(b, F.linear(x, w2))
    assert torch.equal(torch.ops.mla.decode_gate_up(x, w1, w3),
                       F.silu(F.linear(x, w1)) * F.linear(x, w3))


def test_ops_reject_mismatched_weights():
    x = torch.randn(2, 48)
    with pytest.raises(ValueError, match=r"weight 0 must be \[N, 48\]"):
        torch.ops.mla.decode_linear(x, torch.randn(8, 32))
    with pytest.raises(ValueError, match=r"weight 1 must be \[N, 48\]"):
        torch.ops.mla.decode_linear_pair(x, torch.randn(8, 48), torch.randn(8, 47))
    with pytest.raises(ValueError, match="w_gate .* and w_up .* must match"):
        torch.ops.mla.decode_gate_up(x, torch.randn(8, 48), torch.randn(9, 48))
    with pytest.raises(TypeError, match="weight 0 is torch.float64, x is torch.float32"):
        torch.ops.mla.decode_linear(x, torch.randn(8, 48, dtype=torch.float64))
    with pytest.raises(ValueError, match="at least one dimension"):
        torch.ops.mla.decode_linear(torch.tensor(1.0), torch.randn(8, 48))


def test_fit_stages_trims_only_what_does_not_fit():
    """Stages are cut to the shared memory a program may take (mode 1 counts its buffers
    twice, mode 2 two weight tiles per stage), and configs that fit keep theirs."""
    limit = 232448                                          # an H200's, as triton reads it
    assert linear.fit_stages(4, 1, 64, 32, 256, 2, limit) == 2        # 294912 B at 4 stages
    assert linear.fit_stages(4, 1, 16, 32, 256, 2, limit) == 4
    assert linear.fit_stages(6, 2, 32, 64, 128, 2, limit) == 5        # 245760 B at 6
    assert linear.fit_stages(6, 0, 64, 64, 128, 2, limit) == 6
    assert linear.fit_stages(3, 2, 64, 256, 256, 2, 1000) == 1        # never below one
    for (mode, _, _, small), cfg in linear.CONFIGS.items():   # measured at 1 / 32 rows: kept
        if cfg is not None:
            m = 16 if small else 32
            assert linear.fit_stages(cfg[3], mode, m, cfg[0], cfg[1], 2, limit) == cfg[3]


def test_pick_config_falls_back_to_default_and_torch():
    assert linear.pick_config(0, 123, 456, 1) == linear.DEFAULT_CONFIG
    assert linear.pick_config(0, 24576, 1536, 32) is None           # cuBLAS measured faster
    assert linear.pick_config(2, 18432, 7168, 32) is not None
    # DeepSeek-V2's q_a + kv_a (hidden 5120) splits K: its fused decode prologue applies
    assert linear.pick_config(1, 2112, 5120, 1)[4] > 1


@pytest.mark.skipif(DEV != "cuda", reason="the Triton path of the ops runs on CUDA")
@pytest.mark.parametrize("rows", [1, 7, 64, 65])
def test_ops_on_gpu_vs_fp64_eager_and_compiled(rows):
    """bf16 on CUDA: the kernel for <= 64 rows, cuBLAS above; eager and inductor agree with
    float64 and the kernel appears in the compiled code."""
    from torch._inductor.utils import run_and_get_code
    g = torch.Generator().manual_seed(rows)
    x = _randn(rows, 1, 256, g=g).to(DEV, torch.bfloat16)                  # [B, S, K]
    wq, wk, wg, wu, wd = (_randn(n, k, g=g).div(k ** 0.5).to(DEV, torch.bfloat16)
                          for n, k in ((192, 256), (72, 256), (320, 256), (320, 256), (256, 320)))

    def layer(x):
        a, b = torch.ops.mla.decode_linear_pair(x, wq, wk)
        h = torch.ops.mla.decode_gate_up(x, wg, wu)
        return a, b, torch.ops.mla.decode_linear(h, wd)

    xd = x.double()
    h_ref = F.silu(xd @ wg.double().T) * (xd @ wu.double().T)
    refs = (xd @ wq.double().T, xd @ wk.double().T, h_ref.to(torch.bfloat16).double() @ wd.double().T)
    eager = layer(x)
    compiled, codes = run_and_get_code(torch.compile(layer, fullgraph=True), x)
    for out in (eager, compiled):
        for o, r in zip(out, refs):
            assert o.shape == r.shape and o.dtype == torch.bfloat16
            assert _rel(o, r) < 2e-2
    assert ("decode_linear_kernel" in "".join(codes)) == (rows <= 64)


@pytest.mark.skipif(DEV != "cuda", reason="the Triton path of the ops runs on CUDA")
@pytest.mark.parametrize("rows,N1,N2,K", [(1, 150, 50, 512), (9, 150, 50, 512),
                                           (1, 1536, 576, 7168), (32, 1536, 576, 7168)])
def test_split_k_pair_on_gpu_eager_and_compiled(monkeypatch, rows, N1, N2, K):
    """Where CONFIGS splits K, linear_pair sums the partials in the traced graph: same
    results as float64 eager and compiled, the kernel in the compiled code. Small shapes
    with a config set here; DeepSeek-V3's q_a + kv_a with the measured one."""
    from torch._inductor.utils import run_and_get_code
    from mla_ops.hf.linear import linear_pair
    if K == 512:
        monkeypatch.setitem(linear.CONFIGS, (1, 200, 512, rows <= 16), (16, 64, 4, 2, 3))
    g = torch.Generator().manual_seed(rows)
    m1, m2 = torch.nn.Linear(K, N1, bias=False), torch.nn.Linear(K, N2, bias=False)
    for m in (m1, m2):
        m.weight.data = _randn(*m.weight.shape, g=g).div(K ** 0.5).float()
        m.to(DEV, torch.bfloat16)
    x = _randn(rows, 1, K, g=g).to(DEV, torch.bfloat16)
    assert linear.pair_split_k(x, m1.weight, m2.weight) > 1

    def f(x):
        a, b = linear_pair(m1, m2, x)
        return a * 2, b + 1                     # consumers the sum can fuse into
    xd = x.double()
    refs = (2 * (xd @ m1.weight.double().T), xd @ m2.weight.double().T + 1)
    with torch.no_grad():                       # inference ops (no autograd formula)
        compiled, codes = run_and_get_code(torch.compile(f, fullgraph=True), x)
        eager = f(x)
    for out in (eager, compiled):
        for o, r in zip(out, refs):
            assert o.shape == r.shape and o.dtype == torch.bfloat16
            assert _rel(o, r) < 2e-2
    assert "decode_linear_kernel" in "".join(codes)


@pytest.mark.skipif(DEV != "cuda", reason="the Triton path of the ops runs on CUDA")
@pytest.mark.parametrize("rows,N,K", [(1, 150, 512), (9, 150, 512), (1, 2048, 7168),
                                      (32, 2048, 7168)])
def test_split_k_linear_on_gpu_eager_and_compiled(monkeypatch, rows, N, K):
    """A single weight whose config splits K (the 2048-row output head has a measured
    one): hf_linear.linear sums the partials in the traced graph, eager and compiled
    match float64, and the kernel is in the compiled code."""
    from torch._inductor.utils import run_and_get_code
    from mla_ops.hf.linear import linear as hf_linear
    if K == 512:
        monkeypatch.setitem(linear.CONFIGS, (0, N, K, rows <= 16), (16, 64, 4, 2, 3))
    g = torch.Generator().manual_seed(rows + N)
    m = torch.nn.Linear(K, N, bias=False)
    m.weight.data = _randn(N, K, g=g).div(K ** 0.5).float()
    m.to(DEV, torch.bfloat16)
    x = _randn(rows, 1, K, g=g).to(DEV, torch.bfloat16)
    assert linear.linear_split_k(x, m.weight) > 1

    def f(x):
        return hf_linear(m, x) * 2              # a consumer the sum can fuse into
    ref = 2 * (x.double() @ m.weight.double().T)
    with torch.no_grad():
        compiled, codes = run_and_get_code(torch.compile(f, fullgraph=True), x)
        eager = f(x)
    for out in (eager, compiled):
        assert out.shape == ref.shape and out.dtype == torch.bfloat16
        assert _rel(out, ref) < 2e-2
    assert "decode_linear_kernel" in "".join(codes)


@pytest.mark.skipif(DEV != "cuda", reason="the Triton path of the ops runs on CUDA")
@pytest.mark.parametrize("key", [k for k, v in linear.CONFIGS.items() if v is not None], ids=str)
@pytest.mark.parametrize("big", [False, True], ids=["rows", "64-rows"])
def test_measured_configs_at_their_shapes_vs_fp64(key, big):
    """Each measured CONFIGS entry at its own DeepSeek-V3 shape and 1 or 32 rows (and the
    large-row entries at 64 rows, a short prefill, where launch() trims pipeline stages
    to fit shared memory): the config a converted model runs computes its GEMM (the pair
    is q_a + kv_a, N2 = 576)."""
    mode, N, K, small = key
    if big and small:
        pytest.skip("the <= 16-row entries never see 64 rows")
    cfg, M = linear.CONFIGS[key], (64 if big else 1 if small else 32)
    g = torch.Generator(device=DEV).manual_seed(N + K + M)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=DEV) * scale).to(torch.bfloat16)
    x = rnd(M, K)
    Ns = (N - 576, 576) if mode == 1 else (N, N) if mode == 2 else (N,)
    ws = [rnd(n, K, scale=K ** -0.5) for n in Ns]
    prods = [x.double() @ w.double().T for w in ws]
    S = linear.split_k_of(cfg)
    if mode == 2:
        ref = F.silu(prods[0]) * prods[1]
        y = torch.empty(M, N, device=DEV, dtype=torch.bfloat16)
        linear.launch(x, ws[0], ws[1], 2, y, None, cfg)
    else:
        ref = torch.cat(prods, -1)
        y = torch.full((S, M, sum(Ns)), float("nan"), device=DEV)          # fp32 partials
        linear.launch(x, ws[0], ws[1] if mode else None, mode, y if S > 1 else y[0], None,
                      cfg, y2_col0=Ns[0] if mode else 0)
        y = y.sum(0)
    assert _rel(y, ref) < 2e-2


def test_converted_hf_layer_uses_the_ops():
    """convert() routes q_a + kv_a, o_proj and the SiLU MLPs (dense and shared experts)
    through the ops, and the decoder layers' norms and residual adds (fuse_norms);
    fuse_mlp=False leaves the MLPs to HF; a biased MLP stays HF's."""
    pytest.importorskip("transformers")
    import mla_ops.hf as H
    from hf_models import build_pair, tiny_config
    _, model = build_pair(tiny_config("v3"))
    H.convert(model)
    fused = [n for n, m in model.named_modules() if type(m).__name__.startswith("FusedDeepseek")]
    assert fused == ["model.layers.0", "model.layers.0.mlp", "model.layers.1",
                     "model.layers.1.mlp", "model.layers.1.mlp.shared_experts"]   # + MoE block
    norms = [n for n, m in model.named_modules() if type(m).__name__ == "DecodeDeepseekV3RMSNorm"]
    assert norms == ["model.layers.0.input_layernorm", "model.layers.0.post_attention_layernorm",
                     "model.layers.1.input_layernorm", "model.layers.1.post_attention_layernorm",
                     "model.norm"]
    assert type(model.lm_head).__name__ == "DecodeLinear"             # the output head too
    x = torch.randn(2, 1, 256)
    with torch.no_grad():
        assert torch.equal(model.lm_head(x), F.linear(x, model.lm_head.weight))
    keys = set(model.state_dict())
    H.convert(model)                                                   # twice: a no-op
    assert type(model.lm_head).__name__ == "DecodeLinear" and set(model.state_dict()) == keys
    _, model = build_pair(tiny_config("v3"))
    H.convert(model, fuse_mlp=False, decode_head=False, fuse_norms=False, fuse_experts=False)
    assert not any(type(m).__name__.startswith(("Fused", "Decode")) for m in model.modules())
    assert type(model.lm_head) is torch.nn.Linear
    cfg = tiny_config("v2")
    cfg.mlp_bias = True
    _, model = build_pair(cfg)
    H.convert(model, fuse_experts=False)          # (the MoE block itself is no biased MLP)
    assert not any(type(m).__name__.startswith("Fused") and "mlp" in n
                   for n, m in model.named_modules())


def test_impl_choice_is_part_of_the_traced_graph():
    """lowering.config.linear_impl is read in the traced Python: the graph of "torch" holds
    the modules' own linears, and flipping the setting between calls of one compiled
    function recompiles rather than reusing the graph of the other choice."""
    pytest.importorskip("transformers")
    import lowering.config as mla_config
    import mla_ops.hf as H
    from hf_models import build_pair, tiny_config
    _, model = build_pair(tiny_config("v3"))
    H.convert(model)
    mlp = model.model.layers[0].mlp
    x = torch.randn(2, 1, 256)
    targets = []

    def backend(gm, example_inputs):
        targets.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(mlp, backend=backend, fullgraph=True)
    for impl in ("auto", "torch", "auto"):
        with mla_config.patch(linear_impl=impl), torch.no_grad():
            out = compiled(x)
        assert torch.equal(out, mlp.hf_forward(x))
    assert len(targets) == 2                      # one graph per choice, the first reused
    assert {"mla.decode_gate_up", "mla.decode_linear"} <= targets[0]
    assert not any("mla.decode" in t for t in targets[1])


def test_linear_unmet_names_the_condition():
    import lowering.config as mla_config
    x, w = torch.randn(2, 48, dtype=torch.bfloat16), torch.randn(32, 48, dtype=torch.bfloat16)
    assert "CUDA" in linear.linear_unmet(x, w)
    assert "[N, K]" in linear.linear_unmet(x, w[:, :40])
    with mla_config.patch(linear_impl="torch"):
        assert "linear_impl" in linear.linear_unmet(x, w)
    if DEV == "cuda":
        xc, wc = x.cuda(), w.cuda()
        assert linear.linear_unmet(xc, wc) is None
        assert "rows" in linear.linear_unmet(torch.randn(65, 48, dtype=x.dtype, device=DEV), wc)
        assert "bf16" in linear.linear_unmet(xc.float(), wc.float())
        assert "contiguous" in linear.linear_unmet(xc, wc.t().contiguous().t())
    assert linear.linear_split_k(x, w[:, :40]) == 1        # mismatched shapes: no split


def test_opcheck_decode_gemm_ops():
    x = torch.randn(3, 2, 48)
    w1, w2 = torch.randn(32, 48), torch.randn(32, 48)
    for op, args in ((torch.ops.mla.decode_linear.default, (x, w1)),
                     (torch.ops.mla.decode_linear_pair.default, (x, w1, w2[:16])),
                     (torch.ops.mla.decode_linear_partials.default, (x, w1, 3)),
                     (torch.ops.mla.decode_linear_pair_partials.default, (x, w1, w2[:16], 2)),
                     (torch.ops.mla.decode_gate_up.default, (x, w1, w2)),
                     (torch.ops.mla.decode_linear_residual.default, (x, w1, torch.randn(3, 2, 32)))):
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
