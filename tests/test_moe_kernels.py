"""The MoE decode kernels and op (lowering/moe/) against a float64 reference written here.
CPU: the kernels under the Triton interpreter in fp32 (it mis-multiplies 16-bit dots) and
the op's torch path; GPU: the kernels in bf16, the op compiled fullgraph and captured in a
CUDA graph."""
import pytest
import torch

pytest.importorskip("triton")

from lowering.moe import experts  # noqa: E402
from mla_reference import nan_empty  # noqa: E402

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# The fp32 kernel tests run where the kernels run: under the interpreter on CPU, compiled on a
# GPU (where fp32 dots go through TF32, hence the looser bound there).
DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 5e-3 if DEV == "cuda" else 1e-5


def moe_fp64(x, idx, w, gate_up, down):
    """sum_k w[t, k] * down[e] @ (silu(gate[e] @ x[t]) * (up[e] @ x[t])), token by token."""
    x, gate_up, down, w = x.double(), gate_up.double(), down.double(), w.double()
    I = gate_up.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            g, u = gate_up[e, :I] @ x[t], gate_up[e, I:] @ x[t]
            out[t] += w[t, k] * (down[e] @ (g * torch.sigmoid(g) * u))
    return out


def problem(T, K, E, I, H, seed, same_expert=False):
    """Random x, distinct experts per token (repeated across tokens), weights, never zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    gate_up = torch.randn(E, 2 * I, H, generator=g, dtype=torch.float64) / H ** 0.5
    down = torch.randn(E, H, I, generator=g, dtype=torch.float64) / I ** 0.5
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    if same_expert:                       # every token picks expert 1: a run longer than BLOCK_M
        for t in range(T):
            if not (idx[t] == 1).any():
                idx[t, 0] = 1
    w = torch.rand(T, K, generator=g, dtype=torch.float64) + 0.1
    return x, idx, w, gate_up, down


def rel(a, ref):
    return ((a.double().cpu() - ref).abs().max() / ref.abs().max()).item()


# T, K, E, I, H: T 1 / 3 / 17, sizes not multiples of the blocks, experts shared by tokens
CASES = [(1, 2, 8, 40, 72, False), (3, 3, 5, 100, 130, False), (17, 4, 6, 33, 70, False),
         (17, 2, 4, 48, 256, True)]


@pytest.mark.parametrize("T,K,E,I,H,same", CASES)
def test_kernels_vs_fp64(T, K, E, I, H, same):
    x, idx, w, gate_up, down = problem(T, K, E, I, H, seed=T * 100 + I, same_expert=same)
    if same:
        assert (idx == 1).any(1).all()
    ref = moe_fp64(x, idx, w, gate_up, down)
    f32 = [t.float().to(DEV) for t in (x, w, gate_up, down)]
    got = experts.run_kernels(f32[0], idx.to(DEV), f32[1], f32[2], f32[3])
    assert got.dtype == torch.float32 and got.shape == (T, H)
    assert rel(got, ref) < TOL
    cpu = [t.cpu() for t in f32]
    op = torch.ops.mla.moe_experts_decode(cpu[0], idx.int(), cpu[1], cpu[2], cpu[3])
    assert rel(op, ref) < 1e-5                                    # CPU: the torch reference


def test_kernel_pair_rows_and_gate_up_rounding():
    """The gate + up kernel alone: each pair's row of h, in the pairs' own order."""
    T, K, E, I, H = 5, 2, 3, 37, 50
    x, idx, _, gate_up, _ = problem(T, K, E, I, H, seed=3)
    pairs = experts.flat_pairs(idx.to(DEV))
    h = torch.full((T * K, I), float("nan"), device=DEV)
    experts.launch_gate_up(x.float().to(DEV), gate_up.float().to(DEV), pairs, K, h, (16, 32, 4, 1))
    for p in range(T * K):
        e, t = int(idx.view(-1)[p]), p // K
        g, u = gate_up[e, :I] @ x[t], gate_up[e, I:] @ x[t]
        assert rel(h[p], g * torch.sigmoid(g) * u) < TOL


def test_expert_repeated_within_a_token():
    """Not what a router picks, but served: every pair counts, runs longer than T included."""
    T, K, E, I, H = 6, 4, 3, 24, 40
    x, _, w, gate_up, down = problem(T, K, E, I, H, seed=12)
    idx = torch.randint(0, E, (T, K), generator=torch.Generator().manual_seed(1))
    idx[:, :3] = 2                                   # expert 2: a run of 18 slots or more
    got = experts.run_kernels(*(t.float().to(DEV) for t in (x,)), idx.to(DEV),
                              *(t.float().to(DEV) for t in (w, gate_up, down)))
    assert rel(got, moe_fp64(x, idx, w, gate_up, down)) < TOL


def test_out_of_range_experts_add_nothing(monkeypatch):
    """The kernels bound what they read: a pair whose expert id is outside [0, E) adds zero
    (its row of the pairs' outputs is written as zeros: the buffer is not zero-filled)."""
    T, K, E, I, H = 3, 2, 4, 20, 40
    x, idx, w, gate_up, down = problem(T, K, E, I, H, seed=9)
    bad = idx.clone()
    bad[1, 0], bad[2, 1] = E + 3, -1
    nan_empty(monkeypatch)
    got = experts.run_kernels(x.float().to(DEV), bad.to(DEV),
                              *(t.float().to(DEV) for t in (w, gate_up, down)))
    keep = torch.ones(T, K, dtype=torch.float64)
    keep[1, 0] = keep[2, 1] = 0
    ref = moe_fp64(x, idx, w * keep, gate_up, down)
    assert torch.isfinite(got).all() and rel(got, ref) < TOL


def test_op_argument_errors():
    x, idx, w, gate_up, down = (t.float() if t.is_floating_point() else t
                                for t in problem(2, 2, 4, 8, 16, seed=1))
    op = torch.ops.mla.moe_experts_decode
    with pytest.raises(ValueError, match="x must be"):
        op(x[0], idx, w, gate_up, down)
    with pytest.raises(ValueError, match="down must be"):
        op(x, idx, w, gate_up, down[:, :, :4])
    with pytest.raises(ValueError, match="gate_up must be"):
        op(x, idx, w, gate_up[:, :, :8], down)
    with pytest.raises(ValueError, match="topk_weight must be"):
        op(x, idx, w[:, :1], gate_up, down)
    with pytest.raises(TypeError, match="topk_idx must be"):
        op(x, idx.float(), w, gate_up, down)
    with pytest.raises(TypeError, match="gate_up is"):
        op(x, idx, w, gate_up.double(), down)


# ------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("T,K,E,I,H,same", CASES + [(32, 8, 64, 1408, 2048, False),
                                                    (64, 6, 64, 176, 320, True)])
def test_kernels_bf16_vs_fp64(T, K, E, I, H, same):
    x, idx, w, gate_up, down = problem(T, K, E, I, H, seed=T + I, same_expert=same)
    args = [t.cuda().to(torch.bfloat16) for t in (x, gate_up, down)]
    xs, gus, dns = args
    x, gate_up, down = (t.double().cpu() for t in args)                  # the rounded inputs
    ref = moe_fp64(x, idx, w, gate_up, down)
    got = torch.ops.mla.moe_experts_decode(xs, idx.cuda(), w.float().cuda(), gus, dns)
    assert experts.kernel_serves(xs, gus, dns)
    assert got.dtype == torch.bfloat16 and rel(got, ref) < 2e-2


@pytest.mark.gpu
@GPU
def test_op_compiles_fullgraph_and_captures():
    import torch._dynamo
    torch._dynamo.reset()
    x, idx, w, gate_up, down = problem(4, 6, 64, 176, 320, seed=2)
    xs, gus, dns = (t.cuda().to(torch.bfloat16) for t in (x, gate_up, down))
    idx, w = idx.cuda(), w.float().cuda()

    def step(x, idx, w):
        return torch.ops.mla.moe_experts_decode(x, idx, w, gus, dns) + x

    eager = step(xs, idx, w)
    compiled = torch.compile(step, fullgraph=True)
    got = compiled(xs, idx, w)            # Inductor may sum over k in another order
    assert ((got.float() - eager.float()).abs().max() / eager.float().abs().max()).item() < 1e-2
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = step(xs, idx, w)
    idx2 = idx.flip(0).contiguous()
    idx.copy_(idx2)
    g.replay()
    assert torch.equal(out, step(xs, idx2, w))
    torch._dynamo.reset()
