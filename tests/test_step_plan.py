"""A decode step's plan and commit as one kernel each (mla_ops/hf/step_plan.py) against
PagedMLACache's torch ops (the plan every other step and device uses): rows at and off
block boundaries, empty rows, rows at max_cache_len, an exhausted pool, tiles smaller
than the batch and the table width (CPU: the Triton interpreter). On a GPU: the compiled
decode step's plan and state through the ops equal the torch ops'."""
import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("transformers")

from hf_models import tiny_config  # noqa: E402
from lowering import bound_decode_inputs  # noqa: E402
from mla_ops.hf import step_plan  # noqa: E402
from mla_ops.hf.cache import PagedMLACache  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _cache(lengths, max_len, block_size, num_blocks, device="cpu", extra_rows=1):
    c = PagedMLACache(tiny_config(layers=1), max_batch_size=len(lengths) + extra_rows,
                      max_cache_len=max_len, block_size=block_size, num_blocks=num_blocks,
                      device=device, dtype=torch.float32)
    c.occupy(lengths)
    return c


# lengths, max_cache_len, block_size, num_blocks, tile sizes (block_b, block_m):
# boundaries (0, 4, 8) and not, a row at max_cache_len, a pool that runs out mid-batch,
# one row, tiles smaller than the batch and than the table width
CASES = [
    ([0, 3, 4, 7, 8, 13], 37, 4, 40, (None, None)),
    ([4, 9, 37, 12, 0], 37, 4, 40, (2, 4)),
    ([8, 8, 3, 16, 0, 4], 40, 4, 12, (4, 2)),          # 2 free blocks, 5 rows need one
    ([63], 200, 64, 4, (None, None)),
    ([1, 64, 128, 5, 2, 0, 64], 300, 64, 40, (2, 2)),
]


@pytest.mark.parametrize("lengths,max_len,bs,nblocks,tiles", CASES)
@pytest.mark.parametrize("bound", [False, True])
def test_plan_and_commit_kernels_equal_torch_ops(lengths, max_len, bs, nblocks, tiles, bound):
    B = len(lengths)
    c = _cache(lengths, max_len, bs, nblocks)
    twin = _cache(lengths, max_len, bs, nblocks)
    step = c._plan(B, 1, None, check=False)                  # torch ops (CPU)
    M = c.max_blocks
    pack = torch.full((step_plan.pack_size(B, M, bound),), -7, dtype=torch.int32, device=DEV)
    slots = torch.full((B,), -7, dtype=torch.int64, device=DEV)
    bb, bm = tiles
    state = [t.to(DEV) for t in twin._state()]                # the kernels' copy of the state
    step_plan.launch_plan(state[1], state[0], state[2], B, bs, nblocks, max_len, bound,
                          pack, slots, wrap=False, block_b=bb, block_m=bm)
    pack, slots = pack.cpu(), slots.cpu()
    n = B * M + 2 * B + 1
    assert torch.equal(pack[:B * M].view(B, M), step.table)
    assert torch.equal(pack[B * M:B * M + B], step.meta.seq_lens)
    assert torch.equal(pack[B * M + B:n], step.meta.query_start_loc)
    assert torch.equal(slots, step.meta.slot_mapping)
    assert int(pack[-1]) == int(step.num_new_blocks)                # blocks taken
    if bound:
        want_t, want_l = bound_decode_inputs(c.pool.kv[0], step.table, step.meta.seq_lens)
        assert torch.equal(pack[n:n + B * M].view(B, M), want_t)
        assert torch.equal(pack[n + B * M:-1], want_l)
    unwritten = [b for b in range(B) if slots[b] < 0]
    assert unwritten == [b for b, n in enumerate(lengths) if n >= max_len] or nblocks == 12
    if nblocks == 12:
        assert len(unwritten) == 3                  # the pool ran out: no shared block

    c._commit(step, B, 1)                                     # torch ops
    step_plan.launch_commit(*state, pack.to(DEV), B, 1, wrap=False, block_m=bm)
    for a, b in zip(c._state(), state):
        assert torch.equal(a, b.cpu())
    assert int(state[1][B]) == 0 and (state[0][B] == -1).all()   # rows past B kept


def test_ops_refuse_bad_input():
    c = _cache([3, 5], 37, 4, 40)
    with pytest.raises(ValueError, match="runs on CUDA"):
        torch.ops.mla.decode_step_plan(c.lens, c.block_table, c.num_used, 2, 4, 40, 37, False)
    with pytest.raises(TypeError, match="lens"):
        torch.ops.mla.decode_step_plan(c.lens.long(), c.block_table, c.num_used, 2, 4, 40, 37,
                                       False)
    with pytest.raises(TypeError, match="num_used"):
        torch.ops.mla.decode_step_plan(c.lens, c.block_table, c.num_used.int(), 2, 4, 40, 37,
                                       False)
    with pytest.raises(ValueError, match="batch=4"):
        torch.ops.mla.decode_step_plan(c.lens, c.block_table, c.num_used, 4, 4, 40, 37, False)
    with pytest.raises(TypeError, match="seen"):
        torch.ops.mla.decode_step_commit(c.block_table, c.lens, c.num_used, c._seen.int(),
                                         torch.zeros(100, dtype=torch.int32), 2, 1)
    with pytest.raises(ValueError, match="pack"):
        torch.ops.mla.decode_step_commit(c.block_table, c.lens, c.num_used, c._seen,
                                         torch.zeros(100, dtype=torch.int32), 2, 1)


@gpu
@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_compiled_decode_steps_plan_as_torch_ops(backend, monkeypatch):
    """Twelve compiled decode steps (crossing block boundaries, one row reaching
    max_cache_len): the plan each step hands the layers and the state after it, through
    the ops and through the torch ops."""
    import mla_ops.hf.cache as hc
    lengths = [0, 3, 4, 30, 35, 75]
    states, metas = {}, {}
    for kernel in (True, False):
        monkeypatch.setattr(hc, "PLAN_KERNEL", kernel)
        torch._dynamo.reset()
        c = _cache(lengths, 80, 4, 60, device="cuda")
        seen = []

        def step(c=c):
            s = c._prepare(0, len(lengths), 1, None, torch.float32, c.device, backend=backend)
            c._layer_done(0, len(lengths), 1)
            return (s.table.clone(), s.meta.slot_mapping.clone(), s.meta.seq_lens.clone(),
                    s.meta.block_table.clone())
        fn = torch.compile(step, fullgraph=True)
        for _ in range(12):
            seen.append(fn())
        metas[kernel] = seen
        states[kernel] = [t.clone() for t in c._state()]
    for a, b in zip(metas[True], metas[False]):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    for x, y in zip(states[True], states[False]):
        assert torch.equal(x, y)
