"""A decode step's plan and commit as one kernel each (mla_ops/hf/step_plan.py) against
the torch ops of mla_ops/hf/step.py (the plan every other step and device uses): rows at
and off block boundaries, empty rows, rows at max_cache_len, an exhausted pool, tiles
smaller than the batch and the table width (CPU: the Triton interpreter); the plan
buffer's named layout. On a GPU: the compiled decode steps' plans and state through the
ops equal the torch ops' of the same steps on a CPU twin."""
import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("transformers")

from hf_models import tiny_config  # noqa: E402
from lowering import bound_decode_inputs  # noqa: E402
from mla_ops.hf import step as step_ops  # noqa: E402
from mla_ops.hf import step_plan  # noqa: E402
from mla_ops.hf.cache import PagedMLACache  # noqa: E402
from mla_ops.hf.step_layout import PackLayout, step_layout  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _cache(lengths, max_len, block_size, num_blocks, device="cpu", extra_rows=1):
    c = PagedMLACache(tiny_config(layers=1), max_batch_size=len(lengths) + extra_rows,
                      max_cache_len=max_len, block_size=block_size, num_blocks=num_blocks,
                      device=device, dtype=torch.float32)
    c.occupy(lengths)
    return c


# lengths, max_cache_len, block_size, num_blocks, tile caps (plan_block_b, *_block_m):
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
def test_plan_and_commit_kernels_equal_torch_ops(lengths, max_len, bs, nblocks, tiles, bound,
                                                  monkeypatch):
    B = len(lengths)
    c = _cache(lengths, max_len, bs, nblocks)
    twin = _cache(lengths, max_len, bs, nblocks)
    step = step_ops.plan(c, B, 1, None, check=False, flashmla=False, fp8q=False)   # torch ops
    M = c.max_blocks
    layout = step_layout(B, M, bound)
    pack = torch.full((layout.size,), -7, dtype=torch.int32, device=DEV)
    slots = torch.full((B,), -7, dtype=torch.int64, device=DEV)
    bb, bm = tiles
    for key, cap in (("plan_block_b", bb), ("plan_block_m", bm), ("commit_block_m", bm)):
        if cap is not None:
            monkeypatch.setitem(step_plan.CONFIGS, key, cap)
    state = [t.to(DEV) for t in twin.state()]                 # the kernels' copy of the state
    step_plan.launch_plan(state[1], state[0], state[2], B, bs, nblocks, max_len, bound,
                          pack, slots)
    pack, slots = pack.cpu(), slots.cpu()
    f = layout.views(pack)
    assert torch.equal(f["table"].view(B, M), step.table)
    assert torch.equal(f["seq_lens"], step.meta.seq_lens)
    assert torch.equal(f["query_start_loc"], step.meta.query_start_loc)
    assert torch.equal(slots, step.meta.slot_mapping)
    assert int(f["taken"][0]) == int(step.num_new_blocks)          # blocks taken
    if bound:
        want_t, want_l = bound_decode_inputs(c.pool.kv[0], step.table, step.meta.seq_lens)
        assert torch.equal(f["bounded_table"].view(B, M), want_t)
        assert torch.equal(f["bounded_lens"], want_l)
    unwritten = [b for b in range(B) if slots[b] < 0]
    assert unwritten == [b for b, n in enumerate(lengths) if n >= max_len] or nblocks == 12
    if nblocks == 12:
        assert len(unwritten) == 3                  # the pool ran out: no shared block

    c.commit(step, B, 1)                                      # torch ops
    step_plan.launch_commit(*state, pack.to(DEV), layout, B, 1)
    for a, b in zip(c.state(), state):
        assert torch.equal(a, b.cpu())
    assert int(state[1][B]) == 0 and (state[0][B] == -1).all()   # rows past B kept


@pytest.mark.parametrize("lengths,max_len,bs,nblocks,tiles", CASES)
@pytest.mark.parametrize("S", [2, 5, 70])
def test_prefill_plan_kernel_equals_torch_ops(lengths, max_len, bs, nblocks, tiles, S,
                                              monkeypatch):
    """S real tokens per row (an eager prefill without pads): the kernel's plan, its room
    values and the commit after it equal the torch ops' (tokens past max_cache_len and
    past an exhausted pool unwritten; slot tiles smaller than S where the caps are set)."""
    B = len(lengths)
    c = _cache(lengths, max_len, bs, nblocks)
    twin = _cache(lengths, max_len, bs, nblocks)
    step = step_ops.plan(c, B, S, None, check=False, flashmla=False, fp8q=False)   # torch ops
    M = c.max_blocks
    layout = step_layout(B, M, False)
    pack = torch.full((layout.size,), -7, dtype=torch.int32, device=DEV)
    slots = torch.full((B * S,), -7, dtype=torch.int64, device=DEV)
    room = torch.full((6,), -7, dtype=torch.int64, device=DEV)
    bb, bm = tiles
    for key, cap in (("plan_block_b", bb), ("plan_block_m", bm), ("plan_block_s", bm),
                     ("commit_block_m", bm)):
        if cap is not None:
            monkeypatch.setitem(step_plan.CONFIGS, key, cap)
    state = [t.to(DEV) for t in twin.state()]
    step_plan.launch_plan(state[1], state[0], state[2], B, bs, nblocks, max_len, False,
                          pack, slots, S, room)
    pack, slots, room = pack.cpu(), slots.cpu(), room.cpu()
    f = layout.views(pack)
    assert torch.equal(f["table"].view(B, M), step.table)
    assert torch.equal(f["seq_lens"], step.meta.seq_lens)
    assert torch.equal(f["query_start_loc"], step.meta.query_start_loc)
    assert torch.equal(slots, step.meta.slot_mapping)
    assert int(f["taken"][0]) == int(step.num_new_blocks)
    after = torch.tensor(lengths) + S
    want = [int(after.max()), int(after.argmax()), int(step.num_new_blocks), int(c.num_used),
            max(lengths), min(lengths)]
    assert room.tolist() == want
    past = [b * S + j for b, n in enumerate(lengths) for j in range(S) if n + j >= max_len]
    assert (slots[past] == -1).all()
    written = slots[slots >= 0]
    assert written.unique().numel() == written.numel()          # no slot given twice
    assert (written < nblocks * bs).all()

    c.commit(step, B, S)
    step_plan.launch_commit(*state, pack.to(DEV), layout, B, S)
    for a, b in zip(c.state(), state):
        assert torch.equal(a, b.cpu())


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
    with pytest.raises(ValueError, match="runs on CUDA"):
        torch.ops.mla.prefill_step_plan(c.lens, c.block_table, c.num_used, 2, 3, 4, 40, 37)
    with pytest.raises(ValueError, match="tokens"):
        torch.ops.mla.prefill_step_plan(c.lens, c.block_table, c.num_used, 2, 0, 4, 40, 37)
    with pytest.raises(TypeError, match="block_table"):
        torch.ops.mla.prefill_step_plan(c.lens, c.block_table.long(), c.num_used, 2, 3, 4, 40,
                                        37)
    with pytest.raises(TypeError, match="seen"):
        torch.ops.mla.decode_step_commit(c.block_table, c.lens, c.num_used, c.seen.int(),
                                         torch.zeros(100, dtype=torch.int32), 2, 1)
    with pytest.raises(ValueError, match="pack"):
        torch.ops.mla.decode_step_commit(c.block_table, c.lens, c.num_used, c.seen,
                                         torch.zeros(100, dtype=torch.int32), 2, 1)


def test_step_layout_names_the_fields_once():
    """Offsets, total size and views of the plan buffer come from the one layout; the
    torch path's buffer has that layout too."""
    B, M = 3, 5
    lay = step_layout(B, M, False)
    assert [n for n, _ in lay.fields] == ["table", "seq_lens", "query_start_loc", "taken"]
    assert lay.offsets == {"table": 0, "seq_lens": 15, "query_start_loc": 18, "taken": 22}
    assert lay.size == 23
    bound = step_layout(B, M, True)
    assert bound.size == lay.size + B * M + B and bound.offset("taken") == bound.size - 1
    assert "bounded_table" in bound and "bounded_table" not in lay
    pack = torch.arange(bound.size, dtype=torch.int32)
    v = bound.views(pack)
    assert v["bounded_lens"].tolist() == list(range(bound.offset("bounded_lens"),
                                                    bound.offset("bounded_lens") + B))
    again = bound.pack(**{n: t.clone() for n, t in v.items()})
    assert torch.equal(again, pack)
    with pytest.raises(ValueError, match="fields"):
        lay.pack(table=torch.zeros(B * M))
    with pytest.raises(ValueError, match="holds"):
        PackLayout([("a", 2)]).pack(a=torch.zeros(3))
    with pytest.raises(ValueError, match="1-D of 23"):
        lay.views(torch.zeros(24, dtype=torch.int32))
    c = _cache([3, 5, 0], 37, 4, 40)
    step = step_ops.plan(c, 3, 2, None, check=False, flashmla=False, fp8q=False)
    assert step.pack is None and step.meta.seq_lens.tolist() == [5, 7, 2]


@gpu
@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_compiled_decode_steps_plan_as_torch_ops(backend, flashmla_at_every_size):
    """Twelve compiled decode steps on CUDA (the plan and commit kernels; crossing block
    boundaries, one row reaching max_cache_len at the last step): the plan each step hands
    the layers and the state after it equal those of the same steps on a CPU twin (the
    torch ops, whose eager room check would refuse a step past max_cache_len)."""
    lengths = [0, 3, 4, 30, 35, 68]
    B = len(lengths)
    torch._dynamo.reset()
    c = _cache(lengths, 80, 4, 60, device="cuda")
    twin = _cache(lengths, 80, 4, 60)
    flashmla = backend in c._flashmla_backends

    def step(c=c):
        s = c.prepare(0, B, 1, None, torch.float32, c.device, backend=backend)
        c.layer_done(0, B, 1)
        return (s.table.clone(), s.meta.slot_mapping.clone(), s.meta.seq_lens.clone(),
                s.meta.block_table.clone())
    fn = torch.compile(step, fullgraph=True)
    for _ in range(12):
        got = fn()
        s = twin.prepare(0, B, 1, None, torch.float32, twin.device, backend=backend)
        want = [s.table, s.meta.slot_mapping, s.meta.seq_lens, s.meta.block_table]
        if flashmla:                  # the CUDA plan carries the decode inputs bounded
            want[2:] = bound_decode_inputs(twin.pool.kv[0], s.table, s.meta.seq_lens)[::-1]
        twin.layer_done(0, B, 1)
        for x, y in zip(got, want):
            assert torch.equal(x.cpu(), y)
    for x, y in zip(c.state(), twin.state()):
        assert torch.equal(x.cpu(), y)


def test_schedule_per_step_argument(monkeypatch):
    """PagedMLACache(schedule_per_step=False): no decode backend gets the plan's FlashMLA
    schedule, so each layer's call computes its own (here FlashMLA is made to serve)."""
    import lowering
    monkeypatch.setattr(lowering, "uses_flashmla", lambda *a, **k: True)
    on = PagedMLACache(tiny_config(layers=1), max_batch_size=2, max_cache_len=16, block_size=4)
    off = PagedMLACache(tiny_config(layers=1), max_batch_size=2, max_cache_len=16, block_size=4,
                        schedule_per_step=False)
    assert on._flashmla_backends == {"auto", "flashmla"} == on._flashmla_fp8q_backends
    assert not off._flashmla_backends and not off._flashmla_fp8q_backends


@gpu
def test_eager_prefill_plans_by_kernel_on_cuda():
    """An eager prefill step on CUDA (layer 0 checks the room): tokens all real (no mask, or
    a mask without pads) are planned by mla::prefill_step_plan, with the same plan, the
    same prefill shape and the same state after it as the torch ops on a CPU twin; a mask
    with pads takes the torch plan; a step that does not fit raises before any write."""
    lengths = [0, 3, 4, 30, 35, 68]
    B, S = len(lengths), 9
    masks = {"none": None, "all real": torch.ones(B, 80, dtype=torch.long)}
    padded = torch.ones(B, 80, dtype=torch.long)
    padded[2, -S:-S + 3] = 0                           # row 2: three pads first
    masks["pads"] = padded
    for name, mask in masks.items():
        c = _cache(lengths, 120, 4, 60, device="cuda")
        twin = _cache(lengths, 120, 4, 60)
        s = c.prepare(0, B, S, None if mask is None else mask.cuda(), torch.float32, c.device)
        t = twin.prepare(0, B, S, mask, torch.float32, twin.device)
        assert (s.pack is not None) == (name != "pads"), name
        assert (s.perm is None) == (name != "pads") and (t.perm is None) == (mask is None)
        if s.perm is None and t.perm is not None:      # the twin orders an all-real step
            assert torch.equal(t.perm, torch.arange(B * S))
        assert s.meta.prefill_shape == t.meta.prefill_shape == (B, S, 68, 0), name
        for x, y in ((s.table, t.table), (s.meta.slot_mapping, t.meta.slot_mapping),
                     (s.meta.seq_lens, t.meta.seq_lens),
                     (s.meta.query_start_loc, t.meta.query_start_loc)):
            assert torch.equal(x.cpu(), y), name
        c.layer_done(0, B, S)
        twin.layer_done(0, B, S)
        for x, y in zip(c.state(), twin.state()):
            assert torch.equal(x.cpu(), y), name
    for max_len, nblocks, err, match in (
            (72, 60, ValueError, "sequence 5 would hold 77 tokens"),
            (120, 40, step_ops.CacheFullError, "needs 15 more blocks of 4 tokens, 4 of 40")):
        c = _cache(lengths, max_len, 4, nblocks, device="cuda")
        before = [x.clone() for x in c.state()]
        with pytest.raises(err, match=match):
            c.prepare(0, B, S, None, torch.float32, c.device)
        for x, y in zip(c.state(), before):
            assert torch.equal(x, y)
