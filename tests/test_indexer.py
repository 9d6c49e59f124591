"""mla::indexer_scores (DeepSeek-V3.2's lightning-indexer scores over the paged key pool)
against a float64 reference written here; select_slots with the kernel picks the torch
path's slots. On CPU the kernel runs under the Triton interpreter."""
import pytest
import torch

import lowering.decode.indexer as ix
from lowering.decode.indexer import indexer_scores, indexer_scores_reference
from mla_ops.hf.dsa import select_slots

NEG = float("-inf")


def scores64(q, w, pool, table, limit, scale):
    """float64, one key at a time: [B, S, M * bs] (-inf: past the limit or no block)."""
    B, S, Hi, Di = q.shape
    bs = pool.shape[1]
    n = table.shape[1] * bs
    out = torch.full((B, S, n), NEG, dtype=torch.float64)
    for b in range(B):
        for s in range(S):
            for j in range(min(n, int(limit[b, s]) + 1)):
                blk = int(table[b, j // bs])
                if blk < 0:
                    continue
                key = pool[blk, j % bs].double()                            # [Di]
                dots = q[b, s].double() @ key * scale                       # [Hi]
                out[b, s, j] = (w[b, s].double() * dots.clamp(min=0)).sum()
    return out


def assert_close(got, exp, q, w, pool, scale, rtol=2e-6):
    """Same -inf pattern; finite values within fp32 summation error of sum |w| |q| |k|."""
    assert got.dtype == torch.float32 and got.shape == exp.shape
    assert torch.equal(torch.isinf(got), torch.isinf(exp))
    fin = torch.isfinite(exp)
    assert fin.any()
    bound = (w.abs().double().sum(-1) * q.double().norm(dim=-1).amax(-1)
             * pool.double().norm(dim=-1).max() * scale)                     # [B, S]
    err = (got.double() - exp).abs().masked_fill(~fin, 0)
    assert (err <= rtol * bound[..., None] + 1e-6).all(), err.max().item()


def make_case(Hi, Di, dtype, S, seed=0, bs=16, M=6, nb=30):
    g = torch.Generator().manual_seed(seed)
    B = 4
    q = torch.randn(B, S, Hi, Di, generator=g).to(dtype)
    w = torch.randn(B, S, Hi, generator=g) * Hi ** -0.5
    pool = torch.randn(nb, bs, Di, generator=g).to(dtype)
    table = torch.randperm(nb, generator=g)[:B * M].view(B, M).to(torch.int32)
    table[1, 1:] = -1                                  # one block only
    table[2, 2] = -1                                   # a hole inside the prefix: no keys
    table[3, 4:] = -1
    # row 0: the whole table and past it; row 1: length 1; row 2: mid-block limits
    # around the hole; row 3: none at all for its first token, then mid-block
    last = torch.tensor([M * bs + 5, 0, 3 * bs + 7, 2 * bs + 3])
    limit = last[:, None] - (S - 1) + torch.arange(S)                      # [B, S]
    limit[1] = 0
    limit[3, 0] = -1
    return q, w, pool, table, limit, Di ** -0.5


@pytest.mark.parametrize("Hi,Di,dtype,S", [
    (4, 32, torch.bfloat16, 1),
    (8, 64, torch.float16, 3),           # three tokens a program
    (5, 48, torch.bfloat16, 2),          # head count and width padded in the kernel
])
def test_kernel_matches_float64(Hi, Di, dtype, S):
    q, w, pool, table, limit, scale = make_case(Hi, Di, dtype, S)
    got = indexer_scores(q, w, pool, table, limit, scale)
    exp = scores64(q, w, pool, table, limit, scale)
    assert_close(got, exp, q, w, pool, scale)
    assert torch.isinf(got[1, :, 1:]).all() and torch.isfinite(got[1, :, 0]).all()
    assert torch.isinf(got[2, :, 2 * 16:3 * 16]).all()          # the -1 block
    assert torch.isinf(got[3, 0]).all()


def test_several_tiles_per_program_and_limit_int32(monkeypatch):
    """Programs of 3 tiles (some wholly past a limit, so written -inf unread), int32
    limits, a block table that is a column slice; the module's torch reference gives
    the same numbers."""
    monkeypatch.setitem(ix.CONFIGS, "cpu", dict(ix.CONFIGS["cpu"], MAX_TILES=3))
    q, w, pool, table, limit, scale = make_case(6, 32, torch.bfloat16, 2, seed=3, M=7)
    shape = ix.launch_shape(4, 2, 6, 7 * 16, ix.CONFIGS["cpu"], ix.CPU_SM_COUNT)
    assert shape["TILES"] == 3 and shape["grid"][0] == 3
    wide = torch.cat([table, torch.full_like(table, 10 ** 6)], dim=1)     # [B, 2M]
    got = indexer_scores(q, w, pool, wide[:, :7], limit.int(), scale)
    exp = scores64(q, w, pool, table, limit, scale)
    assert_close(got, exp, q, w, pool, scale)
    ref = indexer_scores_reference(q, w, pool, table, limit, scale)
    assert_close(ref, exp, q, w, pool, scale)


def test_out_of_range_table_entries_past_the_limit_are_never_read():
    """A block id past the pool, beyond the limits: no out-of-bounds access (the
    interpreter raises on one); within the limits the keys are scored as usual."""
    q, w, pool, table, limit, scale = make_case(4, 32, torch.bfloat16, 1, seed=5)
    table[0, 5] = 10 ** 6
    limit[0] = 5 * 16 - 1                              # the last block unseen
    got = indexer_scores(q, w, pool, table, limit, scale)
    assert torch.isinf(got[0, 0, 5 * 16:]).all()
    assert_close(got, scores64(q, w, pool, table, limit, scale), q, w, pool, scale)


def test_op_under_torch_compile_fullgraph():
    q, w, pool, table, limit, scale = make_case(4, 32, torch.bfloat16, 2, seed=7)
    torch._dynamo.reset()

    def fn(q, w, limit):
        return torch.ops.mla.indexer_scores(q, w, pool, table, limit, scale) * 2.0

    try:
        got = torch.compile(fn, fullgraph=True, backend="aot_eager")(q, w, limit)
    finally:
        torch._dynamo.reset()
    exp = scores64(q, w, pool, table, limit, scale) * 2.0
    assert_close(got, exp, q, w, pool, scale * 2.0)


def distinct_case(g, B, S, Hi, Di, bs, M, nb, dtype):
    """Random inputs whose head-0 dot products are mostly positive (few exact zeros)."""
    q = torch.randn(B, S, Hi, Di, generator=g)
    q[..., 0, 0] = 4.0
    pool = torch.randn(nb, bs, Di, generator=g)
    pool[..., 0] = 4.0
    w = torch.rand(B, S, Hi, generator=g) + 0.1
    table = torch.randperm(nb, generator=g)[:B * M].view(B, M).to(torch.int32)
    return q.to(dtype), w, pool.to(dtype), table


@pytest.mark.parametrize("chunked", [False, True])
def test_select_slots_kernel_picks_the_torch_slots(chunked, monkeypatch):
    import mla_ops.hf.dsa as dsa
    if chunked:                                   # one query token per chunk of scores
        monkeypatch.setattr(dsa, "SCORE_ELEMENTS", 1)
    g = torch.Generator().manual_seed(11)
    B, S, Hi, Di, bs, M, nb, topk = 3, 2, 8, 32, 16, 5, 24, 20
    q, w, pool, table = distinct_case(g, B, S, Hi, Di, bs, M, nb, torch.bfloat16)
    table[2, 3:] = -1
    lens_new = torch.tensor([71, 1, 40])
    seq_lens = torch.tensor([71, 2, 41], dtype=torch.int32)        # rows 1, 2: a pad
    got = select_slots(q, w, pool, table, seq_lens, lens_new, topk, Di ** -0.5,
                       backend="triton")
    exp = select_slots(q, w, pool, table, seq_lens, lens_new, topk, Di ** -0.5,
                       backend="torch")
    assert got.shape == (B * S, topk) and got.dtype == torch.int32
    pos = seq_lens.long()[:, None] - S + torch.arange(S)
    limit = torch.minimum(pos, lens_new[:, None] - 1)
    ref = scores64(q, w, pool, table, limit, Di ** -0.5)                  # [B, S, n]
    checked = 0
    for b in range(B):
        for s in range(S):
            r = ref[b, s]
            top = r.topk(topk + 1).values
            if top[topk - 1] > NEG and top[topk - 1] - top[topk] < 1e-3:
                continue                                    # a near-tie at the boundary
            checked += 1
            want = {int(table[b, j // bs]) * bs + j % bs
                    for j in r.topk(topk).indices.tolist() if r[j] > NEG}
            row = got[b * S + s].tolist()
            assert {x for x in row if x >= 0} == want, (b, s)
            assert row.count(-1) == topk - len(want)
            assert sorted(row) == sorted(exp[b * S + s].tolist())
    assert checked >= B * S - 1


def test_routes():
    q = torch.randn(1, 1, 4, 32)
    w, pool = torch.randn(1, 1, 4), torch.randn(3, 16, 32)
    table, lens = torch.zeros(1, 2, dtype=torch.int32), torch.tensor([5])
    from mla_ops.hf.dsa import indexer_route
    assert indexer_route(q.bfloat16(), w, pool.bfloat16(), "auto") == "torch"      # CPU
    assert indexer_route(q.bfloat16(), w, pool.bfloat16(), "triton") == "triton"
    assert indexer_route(q, w, pool, "auto") == "torch"
    with pytest.raises(ValueError, match="bf16"):
        select_slots(q, w, pool, table, lens, lens, 4, 0.1, backend="triton")
    with pytest.raises(ValueError, match="backend"):
        select_slots(q, w, pool, table, lens, lens, 4, 0.1, backend="cuda")


def test_rejects_bad_arguments():
    q = torch.randn(2, 1, 4, 32).bfloat16()
    w, pool = torch.randn(2, 1, 4), torch.randn(3, 16, 32).bfloat16()
    table, limit = torch.zeros(2, 2, dtype=torch.int32), torch.zeros(2, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="w must"):
        indexer_scores(q, w[:, :, :3], pool, table, limit, 0.1)
    with pytest.raises(ValueError, match="pool row width"):
        indexer_scores(q, w, pool[..., :16], table, limit, 0.1)
    with pytest.raises(TypeError, match="block_table"):
        indexer_scores(q, w, pool, table.long(), limit, 0.1)
    with pytest.raises(ValueError, match="block_table"):
        indexer_scores(q, w, pool, table[:1], limit, 0.1)
    with pytest.raises(ValueError, match="limit"):
        indexer_scores(q, w, pool, table, limit[:, :0], 0.1)
    with pytest.raises(ValueError, match="scale"):
        indexer_scores(q, w, pool, table, limit, 0.0)
    with pytest.raises(TypeError, match="pool"):
        indexer_scores(q, w, pool.half(), table, limit, 0.1)
    with pytest.raises(TypeError, match="w"):
        indexer_scores(q, w.double(), pool, table, limit, 0.1)


# ------------------------------------------------------------------ GPU, DeepSeek's shapes

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def gpu_case(B, S, seed=0):
    """Hi 64, Di 128, pages of 64, 8192 positions a row, random page order."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    Hi, Di, bs, M = 64, 128, 64, 128
    q = torch.randn(B, S, Hi, Di, device="cuda", generator=g).bfloat16()
    w = torch.randn(B, S, Hi, device="cuda", generator=g) * Hi ** -0.5
    pool = torch.randn(B * M + 3, bs, Di, device="cuda", generator=g).bfloat16()
    table = torch.randperm(B * M + 3, device="cuda", generator=g)[:B * M].view(B, M).int()
    table[1, 100:] = -1
    last = torch.tensor([8191, 100 * 64 - 1, 4000, 0], device="cuda")[:B]
    limit = last[:, None] - (S - 1) + torch.arange(S, device="cuda")       # [B, S]
    return q, w, pool, table, limit.clamp(min=-1), Di ** -0.5


def gpu_scores64(q, w, pool, table, limit, scale):
    """float64 over the gathered keys: [B, S, n]."""
    B, S, Hi, Di = q.shape
    bs = pool.shape[1]
    n = table.shape[1] * bs
    keys = pool.double()[table.long().clamp(min=0)].reshape(B, 1, n, Di)
    dots = torch.einsum("bshd,bznd->bshn", q.double(), keys) * scale
    out = torch.einsum("bsh,bshn->bsn", w.double(), dots.clamp(min=0))
    seen = (torch.arange(n, device=q.device) <= limit[..., None]) \
        & (table >= 0).repeat_interleave(bs, 1)[:, None]
    return out.masked_fill(~seen, NEG)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("S", [1, 2, 5])
def test_gpu_kernel_matches_float64_at_deepseek_shapes(S):
    q, w, pool, table, limit, scale = gpu_case(4, S)
    got = indexer_scores(q, w, pool, table, limit, scale)
    exp = gpu_scores64(q, w, pool, table, limit, scale)
    assert torch.equal(torch.isinf(got), torch.isinf(exp))
    fin = torch.isfinite(exp)
    err = (got.double() - exp).abs()[fin]
    assert err.max() <= 1e-5 * exp.abs()[fin].max()


@pytest.mark.gpu
@needs_cuda
def test_gpu_select_slots_and_graph_capture():
    """select_slots on CUDA (the kernel: its default route there) picks the torch path's
    slots on rows without a near-tie; the op replays in a CUDA graph and compiles with Inductor."""
    q, w, pool, table, limit, scale = gpu_case(3, 2, seed=1)
    q[..., 0, 0], pool[..., 0], w = 4.0, 4.0, w.abs() + 0.1              # few zero scores
    lens = torch.tensor([8192, 6400, 4001], device="cuda")
    from mla_ops.hf.dsa import indexer_route
    assert indexer_route(q, w, pool, "auto") == "triton"                 # the CUDA default
    got = select_slots(q, w, pool, table, lens, lens, 2048, scale)
    exp = select_slots(q, w, pool, table, lens, lens, 2048, scale, backend="torch")
    pos = lens[:, None] - 2 + torch.arange(2, device="cuda")
    ref = gpu_scores64(q, w, pool, table, pos, scale).flatten(0, 1)          # [6, n]
    top = ref.topk(2049).values
    clear = (top[:, 2047] - top[:, 2048]) > 1e-4                              # [6]
    assert clear.sum() >= 4
    same = [sorted(a) == sorted(b) for a, b in zip(got.tolist(), exp.tolist())]
    assert all(s for s, c in zip(same, clear.tolist()) if c)
    static = indexer_scores(q, w, pool, table, limit, scale)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.mla.indexer_scores(q, w, pool, table, limit, scale)
    limit.sub_(1)
    graph.replay()
    assert torch.equal(out, indexer_scores(q, w, pool, table, limit, scale))
    assert not torch.equal(out, static)
    torch._dynamo.reset()
    try:
        fn = torch.compile(lambda q: torch.ops.mla.indexer_scores(q, w, pool, table, limit,
                                                                  scale), fullgraph=True)
        assert torch.equal(fn(q), out)
    finally:
        torch._dynamo.reset()
