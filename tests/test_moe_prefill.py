"""The routed experts of a prefill batch (lowering/moe/prefill.py): the combine kernel
against a float64 sum (CPU under the Triton interpreter, and CUDA), the whole grouped path
against HF's grouped_mm experts and a float64 re-implementation, and the converted block
taking it on the GPU."""
import pytest
import torch
import torch.nn.functional as F

import mla_ops.hf  # noqa: F401  (registers the ops)
from lowering.moe import prefill as moe_prefill

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def experts_fp64(x, idx, w, gate_up, down):
    """sum_k w[t, k] * down[e] @ (SiLU(gate[e] @ x[t]) * (up[e] @ x[t])) in float64, token by
    token, with each linear's output rounded to x's dtype as the GEMMs do."""
    I = gate_up.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            gu = (gate_up[e].double() @ x[t].double()).to(x.dtype).double()
            h = (F.silu(gu[:I]) * gu[I:]).to(x.dtype).double()
            y = (down[e].double() @ h).to(x.dtype).double()
            out[t] += w[t, k].double() * y
    return out


def case(T, K, E, H, I, seed, device=DEV, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    gate_up = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(dtype)
    down = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(dtype)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g) + 0.1
    return [t.to(device) for t in (x, idx, w, gate_up, down)]


@pytest.mark.parametrize("T,K,P,H", [(1, 1, 1, 7), (37, 6, 300, 2048 + 64), (5, 8, 40, 33)])
def test_combine_kernel_vs_fp64(T, K, P, H):
    """out[t] = sum_k w[t, k] y[slot[t, k]]: a top_k of 1 and one not a power of 2, a hidden
    size past one block and not a multiple of it; slots any permutation."""
    g = torch.Generator().manual_seed(T + K)
    y = torch.randn(P, H, generator=g).to(torch.bfloat16)
    slot = torch.randint(0, P, (T, K), generator=g)
    w = torch.rand(T, K, generator=g) * 3
    ref = (y.double()[slot] * w.double()[..., None]).sum(1)
    out = torch.empty(T, H, dtype=torch.bfloat16, device=DEV)
    moe_prefill.launch_combine(y.to(DEV), slot.to(DEV), w.to(DEV), out)   # the kernel itself
    op = torch.ops.mla.moe_combine(y.to(DEV), slot.to(DEV), w.to(DEV))   # kernel on CUDA
    for got in (out, op):
        assert got.dtype == torch.bfloat16 and got.shape == (T, H)
        # one bf16 rounding (the CPU interpreter truncates where a GPU rounds to nearest)
        assert ((got.cpu().double() - ref).abs().max() / ref.abs().max()).item() < 1e-2


def test_combine_rejects_bad_arguments():
    y = torch.randn(4, 8)
    with pytest.raises(ValueError, match="slot, weight"):
        torch.ops.mla.moe_combine(y, torch.zeros(2, 3, dtype=torch.long), torch.rand(2, 2))
    with pytest.raises(TypeError, match="slot must be"):
        torch.ops.mla.moe_combine(y, torch.zeros(2, 3), torch.rand(2, 3))


@pytest.mark.parametrize("path", ["streamed", "grouped_mm"])
@pytest.mark.parametrize("T,K,E", [(1, 2, 4), (29, 6, 16), (64, 8, 32)])
def test_grouped_experts_vs_hf_and_fp64(T, K, E, path, monkeypatch):
    """Both forms of the grouped path (the weight-streaming kernel at few pairs per expert,
    torch's grouped GEMM past STREAM_PAIRS) against HF's grouped_mm experts forward on the
    same module weights, and against float64: some experts get no pair, one token only."""
    grouped = pytest.importorskip("transformers.integrations.moe").grouped_mm_experts_forward
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts
    monkeypatch.setattr(moe_prefill, "STREAM_PAIRS", 10 ** 6 if path == "streamed" else 0)
    calls = []
    real = moe_prefill.streamed_experts
    monkeypatch.setattr(moe_prefill, "streamed_experts",
                        lambda *a: calls.append(1) or real(*a))
    H, I = 64, 48
    x, idx, w, gate_up, down = case(T, K, E, H, I, seed=T)
    cfg = DeepseekV3Config(hidden_size=H, moe_intermediate_size=I, n_routed_experts=E,
                           num_local_experts=E)
    experts = DeepseekV3Experts(cfg).to(DEV, torch.bfloat16)
    with torch.no_grad():
        experts.gate_up_proj.copy_(gate_up)
        experts.down_proj.copy_(down)
        ours = moe_prefill.grouped_experts(x, idx, w, gate_up, down)
        hf = grouped(experts, x, idx, w)
    assert len(calls) == (path == "streamed")
    ref = experts_fp64(*(t.cpu() for t in (x, idx, w, gate_up, down)))
    assert ours.dtype == x.dtype
    scale = ref.abs().max()
    # the CPU interpreter truncates to bf16 where a GPU rounds to nearest: at the kernel's
    # four roundings that is ~2 % low (test_streamed_experts_vs_fp64 checks it in fp32)
    tol = 3e-2 if path == "streamed" and DEV == "cpu" else 1e-2
    assert ((ours.cpu().double() - ref).abs().max() / scale).item() < tol
    # HF's sum of the same GEMM outputs: equal up to the last rounding
    assert ((ours.float() - hf.float()).abs().max() / scale).item() < tol - 2e-3


# tokens, k, experts, H, I, (BLOCK_M, BLOCK_N, BLOCK_K): several tiles per expert (a hot
# expert), experts with no pair, H and I not multiples of the tiles; one token; fp16. bf16
# runs as fp32 on the CPU, whose interpreter truncates to bf16 (the rounding points checked
# exactly there), and as bf16 on a GPU
# exercise the kernel's tile groups: several of GROUP_T tiles, and a last one shorter (3)
WIDE = torch.bfloat16 if DEV == "cuda" else torch.float32
STREAM_CASES = [(40, 3, 6, 72, 40, (16, 32, 32), WIDE, 8),
                (1, 4, 8, 64, 48, (16, 16, 64), WIDE, 8),
                (19, 2, 5, 100, 24, (32, 16, 16), torch.float16, 3)]


@pytest.mark.parametrize("T,K,E,H,I,tile,dtype,group_t", STREAM_CASES)
def test_streamed_experts_vs_fp64(T, K, E, H, I, tile, dtype, group_t, monkeypatch):
    """The weight-streaming grouped kernel's path against float64 with each GEMM's output
    rounded as the modules round; the pairs of one expert span several tiles (half of the
    tokens choose expert 0); a pair whose expert is outside [0, E) adds zero."""
    from lowering.gemm import grouped
    monkeypatch.setattr(grouped, "GROUP_T", group_t)
    x, idx, w, gate_up, down = case(T, K, E, H, I, seed=T + E, device="cpu", dtype=dtype)
    idx[: (T + 1) // 2, 0] = 0                                  # a hot expert: many tiles
    idx[: (T + 1) // 2, 1:] = torch.where(idx[: (T + 1) // 2, 1:] == 0, E - 1,
                                          idx[: (T + 1) // 2, 1:])
    cfg = {k: (*tile, 4, 2) for k in ("gate_up", "down")}
    dev = [t.to(DEV) for t in (x, idx, w, gate_up, down)]
    got = moe_prefill.streamed_experts(*dev, configs=cfg)
    assert got.dtype == dtype and got.shape == (T, H)
    ref = experts_fp64(x, idx, w, gate_up, down)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert ((got.cpu().double() - ref).abs().max() / ref.abs().max()).item() < tol
    bad, keep = idx.clone(), torch.ones(T, K)
    bad[0, 0], keep[0, 0] = -1, 0                             # outside [0, E): below
    bad[-1, -1], keep[-1, -1] = E, 0                          # and above
    got = moe_prefill.streamed_experts(dev[0], bad.to(DEV), *dev[2:], configs=cfg)
    ref = experts_fp64(x, idx, w * keep, gate_up, down)
    assert torch.isfinite(got).all()
    assert ((got.cpu().double() - ref).abs().max() / ref.abs().max()).item() < tol


@pytest.mark.parametrize("T,bm", [(8, 16), (30, 32), (90, 64), (120, 128)])
def test_streamed_experts_shipped_tiles_vs_fp64(T, bm):
    """streamed_experts with its own tiles (STREAM_CONFIGS at the BLOCK_M the pairs per
    expert pick: 4, 15, 45 and 60 over 4 experts), H and I not multiples of them."""
    K, E, H, I = 2, 4, 72, 40
    assert moe_prefill.stream_block_m(T * K, E) == bm
    x, idx, w, gate_up, down = case(T, K, E, H, I, seed=T, device="cpu", dtype=WIDE)
    got = moe_prefill.streamed_experts(*(t.to(DEV) for t in (x, idx, w, gate_up, down)))
    ref = experts_fp64(x, idx, w, gate_up, down)
    tol = 1e-5 if WIDE == torch.float32 else 1e-2
    assert ((got.cpu().double() - ref).abs().max() / ref.abs().max()).item() < tol


def test_stream_tile_follows_the_pairs_per_expert():
    """One tile holds about every expert's pairs at the mean the batch gives."""
    assert moe_prefill.stream_block_m(1 * 8, 256) == 16          # a token over 256 experts
    assert moe_prefill.stream_block_m(512 * 8, 256) == 32        # 16 pairs an expert
    assert moe_prefill.stream_block_m(512 * 6, 64) == 64         # 48 pairs an expert
    assert moe_prefill.stream_block_m(2048 * 8, 256) == 128      # 64 pairs an expert
    assert set(moe_prefill.STREAM_CONFIGS) >= {16, 32, 64, 128}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["v3", "v2"])
def test_converted_block_takes_grouped_path_at_prefill_rows(family):
    """The converted block at 200 rows (past the decode op's 64) in bf16: the grouped path
    serves it, and its output is HF's block's within bf16 rounding."""
    from test_moe import moe_pair
    from mla_ops.hf.moe import convert_moe
    ref, model = moe_pair(family)
    ref, model = (m.to("cuda", torch.bfloat16) for m in (ref, model))
    for m in (ref, model):
        m.config._experts_implementation = "grouped_mm"
    convert_moe(model)
    hf_block, block = ref.model.layers[1].mlp, model.model.layers[1].mlp
    x = torch.randn(1, 200, 256, device="cuda", dtype=torch.bfloat16)
    assert moe_prefill.serves(x.view(200, -1), block.experts.gate_up_proj, block.experts.down_proj)
    calls = []
    real = moe_prefill.grouped_experts
    moe_prefill.grouped_experts = lambda *a: calls.append(1) or real(*a)
    try:
        with torch.no_grad():
            a, b = hf_block(x).float(), block(x).float()
    finally:
        moe_prefill.grouped_experts = real
    assert calls
    assert ((a - b).abs().max() / a.abs().max()).item() < 2e-2


@pytest.mark.parametrize("path", [
    "grouped_mm",
    pytest.param("streamed", marks=pytest.mark.skipif(
        DEV != "cuda", reason="needs CUDA: the interpreter's kernels do not trace"))])
def test_grouped_experts_compile_fullgraph(path, monkeypatch):
    """The grouped path traces whole (sort, histc, the grouped GEMMs or the streaming
    kernels, the combine op)."""
    import torch._dynamo
    monkeypatch.setattr(moe_prefill, "STREAM_PAIRS", 10 ** 6 if path == "streamed" else 0)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    x, idx, w, gate_up, down = case(9, 3, 8, 32, 16, seed=5)

    def f(x, idx, w):
        return moe_prefill.grouped_experts(x, idx, w, gate_up, down) * 2

    out = torch.compile(f, fullgraph=True, backend="aot_eager")(x, idx, w)
    assert torch.equal(out, f(x, idx, w))
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
