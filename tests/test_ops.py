"""mla::kv_cache_update and mla::attention_with_output: opcheck, semantics, bad input."""
import pytest
import torch

import mla_ops  # noqa: F401
from mla_ops.quant import quant_fp8_static
from scenario import Dims, Step, make_layer

D = Dims()


def cache_args(T=5, L=32, R=16, nb=4, bs=4, dtype=torch.float32, fp8=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    kv_c = torch.randn(T, L, generator=g).to(dtype)
    k_pe = torch.randn(T, 1, R, generator=g).to(dtype)
    store = torch.float8_e4m3fn if fp8 else dtype
    cache = (torch.randn(nb, bs, L + R, generator=g) * 2).to(store)
    slots = torch.randperm(nb * bs, generator=g)[:T]
    slots[1] = -1
    return kv_c, k_pe, cache, slots, torch.tensor([0.05])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kv_cache_update_writes_rows(dtype):
    kv_c, k_pe, cache, slots, k_scale = cache_args(dtype=dtype)
    before = cache.clone()
    dep = torch.ops.mla.kv_cache_update(kv_c, k_pe, cache, slots, "auto", k_scale)
    assert dep.numel() == 0 and dep.data_ptr() != cache.data_ptr()
    flat, ref = cache.view(-1, 48), before.view(-1, 48).clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            ref[s] = torch.cat([kv_c[t], k_pe[t, 0]])
    assert torch.equal(flat, ref)   # written rows exact; padding row (slot -1) and others untouched


@pytest.mark.parametrize("name", ["fp8", "fp8_e4m3"])
def test_kv_cache_update_fp8_saturates(name):
    kv_c, k_pe, cache, slots, k_scale = cache_args(fp8=True)
    kv_c[0, 0] = 1e4          # far above 448 * k_scale: must saturate, not become NaN/inf
    torch.ops.mla.kv_cache_update(kv_c, k_pe[:, 0], cache, slots, name, k_scale)
    row = cache.view(-1, 48)[slots[0]].float()
    assert row[0].item() == 448.0
    expect = ((torch.cat([kv_c[0], k_pe[0, 0]]).double() / 0.05).clamp(-448, 448))
    deq_err = (row[1:].double() - expect[1:]).abs() / expect[1:].abs().clamp(min=1)
    assert deq_err.max() < 0.07   # e4m3 has 3 mantissa bits
    assert torch.equal(cache.view(-1, 48)[slots[0]], quant_fp8_static(torch.cat([kv_c[0], k_pe[0, 0]])[None], k_scale)[0])


def test_opcheck_kv_cache_update():
    for args in (cache_args(), cache_args(dtype=torch.bfloat16), cache_args(fp8=True)):
        kv_c, k_pe, cache, slots, k_scale = args
        fp8 = cache.dtype == torch.float8_e4m3fn
        # torch's schema checker cannot compare float8 tensors on CPU ("mul" is not
        # implemented for Float8_e4m3fn); the fp8 cache gets every other opcheck test.
        utils = ("test_faketensor", "test_aot_dispatch_dynamic") if fp8 else (
            "test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
        torch.library.opcheck(torch.ops.mla.kv_cache_update.default,
                              (kv_c, k_pe, cache, slots, "fp8" if fp8 else "auto", k_scale),
                              test_utils=utils)


def attn_args(step, layer, out_dtype=None):
    q, kv_c, k_pe = step.inputs()
    m = step.meta
    out = torch.empty(q.shape[0], D.N * D.V, dtype=out_dtype or q.dtype)
    dep = torch.ops.mla.kv_cache_update(kv_c, k_pe, step.cache.kv[0], m.slot_mapping,
                                        step.cache.kind, step.cache.k_scale)
    return (q, kv_c, k_pe, step.cache.kv[0], layer.W_UK_T, layer.W_UV, m.block_table, m.seq_lens,
            m.query_start_loc, m.num_decode_tokens, layer.softmax_scale, step.cache.kind,
            step.cache.k_scale, dep, out)


@pytest.mark.parametrize("kind", ["auto", "fp8"])
def test_opcheck_attention_with_output(kind):
    layer, _ = make_layer(D, torch.float32, kv_cache_dtype=kind)
    step = Step(D, [6, 0, 3], [1, 1, 5], kv_cache_dtype=kind)
    utils = ("test_faketensor", "test_aot_dispatch_dynamic") if kind == "fp8" else (
        "test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.mla.attention_with_output.default, attn_args(step, layer),
                          test_utils=utils)


def test_output_quantization_static_and_group():
    layer, kv_b = make_layer(D, torch.float32)
    step = Step(D, [6, 0], [1, 4])
    ref = step.reference(kv_b, layer.softmax_scale)                        # [T, N*V]
    args = attn_args(step, layer, out_dtype=torch.float8_e4m3fn)
    scale = torch.tensor([0.01])
    torch.ops.mla.attention_with_output(*args, output_scale=scale)
    expect = (ref / 0.01).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert (args[-1].float() - expect.float()).abs().max() <= 0.0625 * expect.float().abs().max()
    # per-token-group: N*V = 60 columns, groups of 20
    args = attn_args(step, layer, out_dtype=torch.float8_e4m3fn)
    bscale = torch.empty(5, 3)
    torch.ops.mla.attention_with_output(*args, output_block_scale=bscale)
    gs = ref.view(5, 3, 20).abs().amax(-1) / 448
    assert torch.allclose(bscale.double(), gs, rtol=1e-4)
    deq = args[-1].float().view(5, 3, 20) * bscale[..., None]
    assert ((deq.double() - ref.view(5, 3, 20)).norm() / ref.norm()) < 0.05


# ------------------------------------------------------------------- bad input


def _bad(fn, exc, match):
    with pytest.raises(exc, match=match):
        fn()


def test_kv_cache_update_bad_input_writes_nothing():
    kv_c, k_pe, cache, slots, k_scale = cache_args()
    before = cache.clone()
    up = torch.ops.mla.kv_cache_update
    _bad(lambda: up(kv_c[:, :-1], k_pe, cache, slots, "auto", k_scale), ValueError, "width")
    _bad(lambda: up(kv_c, k_pe.double(), cache, slots, "auto", k_scale), TypeError, "k_pe")
    _bad(lambda: up(kv_c, k_pe, cache, slots.int(), "auto", k_scale), TypeError, "slot_mapping")
    _bad(lambda: up(kv_c, k_pe[:3], cache, slots, "auto", k_scale), ValueError, "tokens")
    big = slots.clone(); big[-1] = 10_000
    _bad(lambda: up(kv_c, k_pe, cache, big, "auto", k_scale), ValueError, "slot_mapping")
    neg = slots.clone(); neg[-1] = -2
    _bad(lambda: up(kv_c, k_pe, cache, neg, "auto", k_scale), ValueError, "slot_mapping")
    _bad(lambda: up(kv_c, k_pe, cache, slots, "int8", k_scale), ValueError, "kv_cache_dtype")
    _bad(lambda: up(kv_c, k_pe, cache, slots, "fp8", k_scale), TypeError, "kv_cache")
    _bad(lambda: up(kv_c, k_pe, cache.transpose(0, 1), slots, "auto", k_scale), ValueError, "contiguous")
    _bad(lambda: up(kv_c, k_pe, cache.to(torch.bfloat16), slots, "auto", k_scale), TypeError, "kv_cache")
    _bad(lambda: up(kv_c, k_pe[:, :, None], cache, slots, "auto", k_scale), ValueError, "k_pe")
    assert torch.equal(cache, before)


def test_attention_bad_input_names_argument():
    layer, _ = make_layer(D, torch.float32)
    step = Step(D, [6, 0], [1, 4])
    good = list(attn_args(step, layer))
    op = torch.ops.mla.attention_with_output

    def call(i, v, exc, match):
        a = list(good); a[i] = v
        _bad(lambda: op(*a), exc, match)

    call(0, good[0][..., :-1], ValueError, "q head size|k_pe")
    call(4, good[4].transpose(1, 2), ValueError, "W_UK_T")
    call(6, good[6].long(), TypeError, "block_table")
    call(7, good[7][:1], ValueError, "seq_lens")
    call(8, torch.tensor([0, 1, 6], dtype=torch.int32), ValueError, "query_start_loc")
    call(9, 3, ValueError, "num_decode_tokens")
    call(14, torch.empty(5, 7), ValueError, "output")
    call(14, torch.empty(5, 60, dtype=torch.float64), TypeError, "output")
    call(3, step.cache.kv[0].to(torch.float16), TypeError, "kv_cache")
    lens = good[7].clone(); lens[0] = 1000
    call(7, lens, ValueError, "seq_lens|blocks")
    bt = good[6].clone(); bt[0, 0] = 999
    call(6, bt, ValueError, "block ids")
    table = torch.randint(0, 9, (66, 8), dtype=torch.int32)
    _bad(lambda: op(*good, decode_schedule=table), ValueError, "decode_splits")
    _bad(lambda: op(*good, prefill_shape=[1, 4]), TypeError, "prefill_shape")
    _bad(lambda: op(*good, prefill_shape=[9, 4, 5, 0]), ValueError, "prefill_shape")


def test_attention_with_prefill_shape_as_without():
    """The caller's host ints of the prefill rows (MLAMetadata.build computes them) give
    the output the op gives when it reads them from the tensors itself."""
    layer, _ = make_layer(D, torch.float32)
    step = Step(D, [6, 0, 3, 9], [1, 4, 5, 2])
    assert step.meta.prefill_shape == (3, 5, 9, 0)
    args = attn_args(step, layer)
    torch.ops.mla.attention_with_output(*args)
    want = args[-1].clone()
    args[-1].zero_()
    torch.ops.mla.attention_with_output(*args, prefill_shape=list(step.meta.prefill_shape))
    assert torch.equal(args[-1], want)


@pytest.mark.parametrize("slots", [[0, -1], [-1, 5, -1, 0], [-1, -1], [3, 7]])
@pytest.mark.parametrize("fp8", [False, True])
def test_graph_capture_scatter_matches_masked_write(slots, fp8):
    """The sync-free write used under CUDA-graph capture: padding never clobbers a real row,
    even when a real token writes the slot padding is redirected to."""
    from mla_ops.ops import scatter_rows_no_sync
    g = torch.Generator().manual_seed(len(slots))
    dtype = torch.float8_e4m3fn if fp8 else torch.float32
    flat = torch.randn(8, 6, generator=g).to(dtype)
    rows = torch.randn(len(slots), 6, generator=g).to(dtype)
    sm = torch.tensor(slots)
    expect = flat.clone()
    expect[sm[sm >= 0]] = rows[sm >= 0]
    scatter_rows_no_sync(flat, rows, sm)
    assert torch.equal(flat.view(torch.uint8), expect.view(torch.uint8))


def test_graph_capture_scatter_reads_nothing_on_the_host():
    """Under fake tensors a value-dependent host read (.item(), boolean
    masking) raises (the masked eager path does); the capture path must run through."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from mla_ops.ops import scatter_rows_no_sync
    with FakeTensorMode():
        flat = torch.empty(8, 6)
        scatter_rows_no_sync(flat, torch.empty(3, 6), torch.zeros(3, dtype=torch.int64))


def test_graph_capture_scatter_drops_out_of_range_slots():
    from mla_ops.ops import scatter_rows_no_sync
    flat = torch.randn(8, 6)
    rows = torch.randn(3, 6)
    expect = flat.clone()
    expect[2] = rows[1]
    scatter_rows_no_sync(flat, rows, torch.tensor([99, 2, -1]))   # 99: past the cache
    assert torch.equal(flat, expect)


def test_scatter_drops_out_of_range_slots():
    """The sync-free write (CUDA without the value checks) drops slots outside the cache
    as it drops padding: nothing else is written."""
    from mla_ops.ops import scatter_rows_no_sync
    g = torch.Generator().manual_seed(3)
    flat = torch.randn(8, 6, generator=g)
    rows = torch.randn(4, 6, generator=g)
    expect = flat.clone()
    expect[2] = rows[1]
    scatter_rows_no_sync(flat, rows, torch.tensor([8, 2, -1, 1000]))
    assert torch.equal(flat, expect)
