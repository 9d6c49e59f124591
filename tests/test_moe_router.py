"""The MoE router op mla::moe_route (lowering/moe/router.py): its kernels against a float64
router written here (random inputs; exact ties between experts and between groups go to
the lower index), its argument checks, its torch path compiled fullgraph, and route()'s
dispatch to it. CPU: the kernels under the Triton interpreter (conftest sets
TRITON_INTERPRET=1 without CUDA); GPU: the kernels against HF's torch calls at DeepSeek
V3's and V2-Lite's shapes. HF's router modules against route_torch: tests/test_moe.py."""
import types

import pytest
import torch
import torch._dynamo

pytest.importorskip("triton")

from lowering.moe import router  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def route_fp64(x, weight, bias, mode, K, G, KG, norm, scale, with_margin=False):
    """Per token: (the experts in choice order, their weights), in float64 with Python
    sorting, equal values to the lower index; with_margin also the smallest gap at a cut
    (K-th vs (K+1)-th expert, topk_group-th vs next group)."""
    logits = x.double() @ weight.double().T                                   # [T, E]
    E = weight.shape[0]
    out = []
    for row in logits:
        if mode == 0:
            scores = torch.sigmoid(row).tolist()
            choice = [s + b for s, b in zip(scores, bias.double().tolist())]
        else:
            scores = torch.softmax(row, -1).tolist()
            choice = list(scores)
        gaps = []
        if mode != 1:
            per = E // G
            gs = [sorted(choice[g * per:(g + 1) * per])[-2:] for g in range(G)]
            gs = [sum(v) if mode == 0 else v[-1] for v in gs]
            order = sorted(range(G), key=lambda g: (-gs[g], g))
            kept = set(order[:KG])
            gaps += [gs[order[KG - 1]] - gs[order[KG]]] if KG < G else []
            fill = float("-inf") if mode == 0 else 0.0
            choice = [c if e // per in kept else fill for e, c in enumerate(choice)]
            if mode == 2:
                scores = choice
        order = sorted(range(E), key=lambda e: (-choice[e], e))
        gaps.append(choice[order[K - 1]] - choice[order[K]])
        w = torch.tensor([scores[e] for e in order[:K]], dtype=torch.float64)
        if mode == 0 and norm:
            w = w / w.sum()
        out.append((order[:K], w * scale, min(gaps)) if with_margin else (order[:K], w * scale))
    return out


def check_vs_fp64(idx, wgt, ref, order=True):
    for t, (e_ref, w_ref) in enumerate(ref):
        got = idx[t].tolist()
        assert sorted(got) == sorted(e_ref), (t, got, e_ref)
        if order:
            assert got == e_ref, (t, got, e_ref)           # descending, ties lower first
        w = dict(zip(got, wgt[t].double().tolist()))
        w = torch.tensor([w[e] for e in e_ref], dtype=torch.float64)
        assert ((w - w_ref).abs() / w_ref.abs()).max().item() < 1e-5


# mode, E, n_group, topk_group, top_k, norm, H; scale 2.5. The select kernel ranks groups
# as rows where E, n_group and the group size are powers of two (GROUPS_2D), else one
# group at a time: the "ragged" cases (groups of 6 and 5, like V2's 160 experts in 8).
CASES = {"v3": (0, 64, 8, 3, 6, True, 96), "v3_no_norm": (0, 64, 8, 3, 6, False, 160),
         "v2_greedy": (1, 32, 1, 1, 4, False, 160), "v2_group": (2, 32, 4, 2, 3, False, 96),
         "v3_ragged": (0, 48, 8, 3, 5, True, 96), "v2_group_ragged": (2, 40, 8, 3, 4, False, 96)}


def problem(E, H, T, wdtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    weight = (torch.randn(E, H, generator=g) / H ** 0.5).to(wdtype)
    bias = torch.rand(E, generator=g) * 0.5 + 0.01
    return x, weight, bias


@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T", [1, 5, 17, 70])
@pytest.mark.parametrize("case", list(CASES))
def test_kernels_vs_fp64(case, T, wdtype):
    """Decode rows (the logits kernel) and a prefill's (T > MAX_ROWS: torch's fp32 GEMM,
    then the same selection kernel)."""
    mode, E, G, KG, K, norm, H = CASES[case]
    x, weight, bias = problem(E, H, T, wdtype, seed=T * 10 + mode)
    args = (mode, K, G, KG, norm, 2.5)
    idx, wgt = router.launch(x.to(DEV), weight.to(DEV), bias.to(DEV), *args)
    assert idx.dtype == torch.int64 and wgt.dtype == torch.float32
    assert idx.shape == wgt.shape == (T, K)
    check_vs_fp64(idx.cpu(), wgt.cpu(), route_fp64(x, weight, bias, *args))


@pytest.mark.parametrize("config,H", [((16, 4, 16, 4, 1), 160), ((16, 5, 32, 4, 1), 160),
                                      ((32, 2, 32, 4, 1), 128)])
def test_kernels_other_configs(config, H):
    """Other slicings of H: a ragged last slice, whole slices (EVEN_K), BLOCK_E 32."""
    mode, E, G, KG, K, norm, _ = CASES["v3"]
    x, weight, bias = problem(E, H, 3, torch.bfloat16, seed=9)
    args = (mode, K, G, KG, norm, 1.0)
    idx, wgt = router.launch(x.to(DEV), weight.to(DEV), bias.to(DEV), *args, config=config)
    check_vs_fp64(idx.cpu(), wgt.cpu(), route_fp64(x, weight, bias, *args))


@pytest.mark.parametrize("fma", [True, False])
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T,config,H", [(1, None, 96), (3, (16, 5, 32, 4, 1), 160),
                                        (4, (32, 2, 32, 4, 1), 128)])
def test_kernels_row_fma_and_dot_forms(T, config, H, wdtype, fma):
    """The logits kernel's two forms (per-lane sums, ROW_FMA; the dot) at a few rows, with a
    ragged last slice (160 in 5) and whole slices, either weight dtype."""
    mode, E, G, KG, K, norm, _ = CASES["v3"]
    x, weight, bias = problem(E, H, T, wdtype, seed=40 + T)
    args = (mode, K, G, KG, norm, 2.5)
    assert router.row_fma(T, weight) == (wdtype == torch.float32)
    idx, wgt = router.launch(x.to(DEV), weight.to(DEV), bias.to(DEV), *args, config=config,
                             fma=fma)
    check_vs_fp64(idx.cpu(), wgt.cpu(), route_fp64(x, weight, bias, *args))


def tie_problem(kind, wdtype, T=5, H=96):
    """x > 0 and router rows that are positive multiples of one positive row, so the ranking
    is the same for every token; equal rows (and biases) give exactly equal logits.
    The row and its multiples have few mantissa bits (k / 1024 times a quarter-step
    multiple), so every product with x and every partial sum is exact in fp32: equal rows
    tie whatever order a dot sums in (numpy's matmul under the interpreter sums some
    output columns in another order than others).
    Returns (x, weight, bias, (mode, K, G, KG), the experts to be chosen)."""
    g = torch.Generator().manual_seed(3)
    x = (1.0 + torch.rand(T, H, generator=g)).to(torch.bfloat16)
    base = torch.randint(1, 16, (H,), generator=g).float() / 1024
    mode, E, G, KG, K = {"v3": (0, 64, 8, 3, 4), "v2_greedy": (1, 32, 1, 1, 4),
                         "v2_group": (2, 32, 4, 2, 4), "v3_groups": (0, 64, 8, 1, 4),
                         "v2_groups": (2, 32, 4, 1, 3), "v3_top2": (0, 64, 8, 1, 2),
                         "v3_groups_ragged": (0, 48, 8, 1, 4),
                         "v2_groups_ragged": (2, 24, 4, 1, 3),
                         "v3_top2_ragged": (0, 48, 8, 1, 2)}[kind]
    weight = torch.randn(E, H, generator=g) * 0.1 / H ** 0.5
    bias = torch.rand(E, generator=g) * 0.01
    if "_groups" in kind:             # two equal groups lead: the lower one is kept
        per = E // G
        a, b = (3, 5) if mode == 0 else (1, 3)
        for j in range(per):
            weight[a * per + j] = base * (3.0 - 0.25 * j)
        weight[b * per:(b + 1) * per] = weight[a * per:(a + 1) * per]
        bias[b * per:(b + 1) * per] = bias[a * per:(a + 1) * per]
        want = list(range(a * per, a * per + K))
    elif kind.startswith("v3_top2"):  # group 2's top-2 is one value twice: 2 s > s' + s''
        per = E // G
        a, b, c = 2 * per + 1, 2 * per + 4, 6 * per       # (per 8: experts 17, 20, 48)
        weight[a] = weight[b] = base * 2.0
        weight[c], weight[c + 1] = base * 2.25, base * 1.5
        bias[[b, c, c + 1]] = bias[a].item()
        want = [a, b]
    else:                             # 3 leaders, then experts 9 and 12 (or 20) equal
        for e, c in ((0, 3.0), (1, 2.75), (2, 2.5)):
            weight[e] = base * c
        b = 20 if mode == 1 else 12
        weight[9] = weight[b] = base * 2.0
        bias[b] = bias[9]
        want = [0, 1, 2, 9]
    return x, weight.to(wdtype), bias, (mode, K, G, KG), want


TIE_KINDS = ["v3", "v2_greedy", "v2_group", "v3_groups", "v2_groups", "v3_top2",
             "v3_groups_ragged", "v2_groups_ragged", "v3_top2_ragged"]


@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", TIE_KINDS)
def test_kernels_exact_ties_go_to_the_lower_index(kind, wdtype, T):
    """T = 1 over an fp32 weight runs the logits kernel's ROW_FMA form."""
    x, weight, bias, (mode, K, G, KG), want = tie_problem(kind, wdtype, T=T)
    args = (mode, K, G, KG, True, 2.5)
    idx, wgt = router.launch(x.to(DEV), weight.to(DEV), bias.to(DEV), *args)
    ref = route_fp64(x, weight, bias, *args)
    assert all(e == want for e, _ in ref)
    check_vs_fp64(idx.cpu(), wgt.cpu(), ref)


def test_op_checks_name_the_argument():
    x, w, b = torch.randn(2, 32), torch.randn(16, 32), torch.rand(16)
    op = torch.ops.mla.moe_route
    good = (0, 4, 4, 2, True, 1.0)
    op(x, w, b, *good)
    bad = [((x, w, b, 3, 4, 4, 2, True, 1.0), ValueError, "mode"),
           ((x, torch.randn(16, 31), b, *good), ValueError, "weight"),
           ((x, w.int(), b, *good), TypeError, "weight"),
           ((x[0], w, b, *good), ValueError, "x must"),
           ((x, w, None, *good), ValueError, "bias"),
           ((x, w, torch.rand(15), *good), ValueError, "bias"),
           ((x, w, b, 0, 4, 3, 2, True, 1.0), ValueError, "n_group"),
           ((x, w, b, 0, 4, 4, 5, True, 1.0), ValueError, "topk_group"),
           ((x, w, b, 0, 9, 4, 2, True, 1.0), ValueError, "top_k"),
           ((x, w, b, 1, 17, 1, 1, False, 1.0), ValueError, "top_k"),
           ((x, w, b, 0, 4, 16, 2, True, 1.0), ValueError, "n_group")]
    for args, exc, name in bad:
        with pytest.raises(exc, match=name):
            op(*args)
    op(x, w, None, 1, 16, 1, 1, False, 1.0)            # greedy: no bias, no groups


def test_kernel_serves_says_why_not():
    w = torch.randn(16, 32)
    assert "CUDA" in router.kernel_serves(torch.randn(2, 32), w)
    if torch.cuda.is_available():
        xc, wc = torch.randn(2, 32, device="cuda"), w.cuda()
        assert "bf16" in router.kernel_serves(xc, wc)
        assert router.kernel_serves(xc.bfloat16(), wc) is None
        assert router.kernel_serves(torch.randn(65, 32, device="cuda").bfloat16(), wc) is None
        assert "rows" in router.kernel_serves(torch.randn(0, 32, device="cuda").bfloat16(), wc)
        assert "experts" in router.kernel_serves(xc.bfloat16(), torch.randn(513, 32).cuda())


def test_op_torch_path_compiles_fullgraph():
    """On CPU the op is route_torch; it traces with no graph break (its fake: shapes)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    g = torch.Generator().manual_seed(2)
    x, w, b = torch.randn(5, 64, generator=g), torch.randn(32, 64, generator=g), torch.rand(32)

    def f(x):
        idx, wgt = torch.ops.mla.moe_route(x, w, b, 0, 4, 4, 2, True, 2.5)
        return idx + 1, wgt * 2

    got = torch.compile(f, fullgraph=True, backend="aot_eager")(x)
    exp_idx, exp_w = router.route_torch(x, w, b, 0, 4, 4, 2, True, 2.5)
    assert torch.equal(got[0], exp_idx + 1) and torch.equal(got[1], exp_w * 2)
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
    torch._dynamo.reset()


@pytest.mark.parametrize("family,method", [("v3", None), ("v2", "greedy"),
                                           ("v2", "group_limited_greedy")])
def test_route_dispatches_to_the_op(monkeypatch, family, method):
    """route() takes mla::moe_route where the kernels serve (here: told they serve fp32,
    on CPU under the interpreter) with the mode of the block's router, and HF's torch
    calls when grad is wanted for the router's weight."""
    from transformers import DeepseekV2Config, DeepseekV3Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from mla_ops.hf.moe import route
    kw = dict(hidden_size=64, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
              topk_group=2, routed_scaling_factor=2.5)
    if family == "v3":
        gate = DeepseekV3TopkRouter(DeepseekV3Config(**kw))
    else:
        gate = DeepseekV2TopkRouter(DeepseekV2Config(topk_method=method, **kw))
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        gate.weight.copy_(torch.randn(gate.weight.shape, generator=g) / 8)
        if family == "v3":
            gate.e_score_correction_bias.copy_(torch.rand(16, generator=g) * 0.3)
    gate = gate.to(DEV)
    block = types.SimpleNamespace(gate=gate, mla_family=family)
    x = torch.randn(7, 64, generator=g).to(DEV)
    calls = []
    launch = router.launch
    monkeypatch.setattr(router, "kernel_serves", lambda x, w: None)
    monkeypatch.setattr(router, "launch", lambda *a, **k: calls.append(a[3]) or launch(*a, **k))
    _, hf_w, hf_idx = gate(x)
    idx, w = route(block, x)                           # grad wanted: HF's calls
    assert not calls and torch.equal(idx, hf_idx) and torch.equal(w, hf_w)
    with torch.no_grad():
        idx, w = route(block, x)
    assert calls == [{"v3": 0, "greedy": 1, "group_limited_greedy": 2}[method or "v3"]]
    hf_idx, order = hf_idx.sort(-1)
    idx, got = idx.sort(-1)
    assert torch.equal(idx, hf_idx)
    assert torch.allclose(w.gather(1, got), hf_w.detach().gather(1, order), rtol=1e-5, atol=0)


# ------------------------------------------------------------------------- GPU

GPU_CASES = {"v3": (0, 256, 7168, 8, 4, 8, True), "v2_lite": (1, 64, 2048, 1, 1, 6, False),
             "v2": (2, 160, 5120, 8, 3, 6, False)}


@GPU
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T", [1, 3, 8, 32, 64, 65, 2048])
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_gpu_kernels_vs_torch_at_model_shapes(case, T, wdtype):
    """The op's kernels against HF's torch calls on CUDA: the same experts except on rows
    where a float64 cut margin is below 1e-5, weights within 1e-5 relative."""
    mode, E, H, G, KG, K, norm = GPU_CASES[case]
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=g).to("cuda", torch.bfloat16)
    weight = (torch.randn(E, H, generator=g) / H ** 0.5).to("cuda", wdtype)
    bias = (torch.randn(E, generator=g) * 0.05).cuda()
    assert router.kernel_serves(x, weight) is None
    args = (x, weight, bias if mode == 0 else None, mode, K, G, KG, norm, 2.5)
    idx, wgt = torch.ops.mla.moe_route(*args)
    ref_idx, ref_w = router.route_torch(*args)
    ref = route_fp64(x.cpu(), weight.cpu(), bias.cpu(), mode, K, G, KG, norm, 2.5, True)
    checked = 0
    for t in range(T):
        if ref[t][2] < 1e-5:
            continue
        checked += 1
        a, ia = idx[t].sort()
        b, ib = ref_idx[t].sort()
        assert torch.equal(a, b), (t, a, b)
        wa, wb = wgt[t][ia].double(), ref_w[t][ib].double()
        assert ((wa - wb).abs() / wb.abs()).max().item() < 1e-5
    assert checked >= max(1, T // 2)


@GPU
@pytest.mark.parametrize("kind", TIE_KINDS)
def test_gpu_exact_ties_as_torch_topk(kind):
    """Exact ties on CUDA: the kernels keep the experts torch's own CUDA topk keeps."""
    x, weight, bias, (mode, K, G, KG), want = tie_problem(kind, torch.bfloat16, T=8, H=512)
    args = (x.cuda(), weight.cuda(), bias.cuda(), mode, K, G, KG, True, 2.5)
    idx, _ = torch.ops.mla.moe_route(*args)
    ref_idx, _ = router.route_torch(*args)
    assert torch.equal(idx.sort(-1)[0], ref_idx.sort(-1)[0])
    assert idx.sort(-1)[0].tolist() == [want] * 8


@GPU
def test_gpu_op_compiles_fullgraph():
    torch._dynamo.reset()
    x, weight, bias, (mode, K, G, KG), _ = tie_problem("v3", torch.bfloat16, T=4, H=256)
    args = (weight.cuda(), bias.cuda(), mode, K, G, KG, True, 2.5)

    def f(x):
        return torch.ops.mla.moe_route(x, *args)

    got = torch.compile(f, fullgraph=True)(x.cuda())
    exp = f(x.cuda())
    assert torch.equal(got[0], exp[0]) and torch.equal(got[1], exp[1])
    torch._dynamo.reset()
