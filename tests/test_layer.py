"""The MLA layer end to end (both ops, decode + prefill) vs the float64 dense reference."""
import pytest
import torch

import mla_ops.prefill as prefill_mod
from scenario import Dims, Step, make_layer

D = Dims()


def rel_err(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


def run(step, layer):
    q, kv_c, k_pe = step.inputs()
    return layer(q, kv_c, k_pe, step.cache.kv[0], step.cache.k_scale, step.meta)


@pytest.mark.parametrize("contexts,query_lens", [
    ([5], [1]),                    # single decode
    ([0], [1]),                    # seq_len 1: decode with empty context
    ([0], [7]),                    # prefill, empty context, length not a multiple of block size
    ([9], [6]),                    # chunked prefill with cached context
    ([3, 0, 11, 8], [1, 1, 5, 1]),  # would put decode after prefill: reordered below
])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_layer_matches_dense_reference(contexts, query_lens, block_size):
    order = sorted(range(len(contexts)), key=lambda i: query_lens[i] > 1)
    contexts = [contexts[i] for i in order]
    query_lens = [query_lens[i] for i in order]
    layer, kv_b = make_layer(D, torch.float32)
    step = Step(D, contexts, query_lens, block_size=block_size)
    out = run(step, layer)
    assert out.shape == (sum(query_lens), D.N * D.V)
    assert rel_err(out, step.reference(kv_b, layer.softmax_scale)) < 1e-5


def test_mixed_batch_and_multi_token_decode():
    # two multi-token decode rows (speculative verify, s=3 and s=2), one single, two prefills
    layer, kv_b = make_layer(D, torch.float32)
    step = Step(D, [10, 7, 4, 0, 13], [3, 2, 1, 6, 9], block_size=4, decode_threshold=3)
    assert step.meta.num_decode_tokens == 6
    out = run(step, layer)
    assert rel_err(out, step.reference(kv_b, layer.softmax_scale)) < 1e-5


def test_chunked_context_tiny_budget_bounds_workspace(monkeypatch):
    seen = []
    orig = prefill_mod.up_project

    def spy(kv_c, *a):
        seen.append(kv_c.shape[0])
        return orig(kv_c, *a)

    monkeypatch.setattr(prefill_mod, "up_project", spy)
    layer, kv_b = make_layer(D, torch.float32, workspace_rows=3)
    step = Step(D, [17, 0, 10], [4, 5, 2], block_size=4, decode_threshold=0)
    out = run(step, layer)
    assert rel_err(out, step.reference(kv_b, layer.softmax_scale)) < 1e-5
    # per request: its new tokens, then the context, each in chunks of at most 3 rows
    assert seen == [3, 1, 3, 3, 3, 3, 3, 2, 3, 2, 2, 3, 3, 3, 1]


@pytest.mark.parametrize("score_budget", [1, 7, 40])
def test_long_prefill_with_tiny_score_budget(monkeypatch, score_budget):
    """Queries split into blocks (down to one query per block), keys into chunks of 5:
    every (query block, key chunk) pair still merges to the dense causal result."""
    monkeypatch.setattr(prefill_mod, "SCORE_BUDGET", score_budget * D.N)
    layer, kv_b = make_layer(D, torch.float32, workspace_rows=5)
    step = Step(D, [3, 0, 12], [1, 23, 17], block_size=4)
    out = run(step, layer)
    assert rel_err(out, step.reference(kv_b, layer.softmax_scale)) < 1e-5


def test_real_dims_bf16():
    d = Dims(N=2, P=128, R=64, V=128, L=512)
    layer, kv_b = make_layer(d, torch.bfloat16)
    step = Step(d, [70, 0], [1, 9], block_size=64, dtype=torch.bfloat16)
    out = run(step, layer)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, step.reference(kv_b, layer.softmax_scale)) < 2e-2


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_dtypes(dtype):
    layer, kv_b = make_layer(D, dtype)
    step = Step(D, [6, 5], [1, 3], block_size=4, dtype=dtype)
    assert rel_err(run(step, layer), step.reference(kv_b, layer.softmax_scale)) < 2e-2


def test_fp8_cache_matches_dequantized_reference():
    layer, kv_b = make_layer(D, torch.float32, kv_cache_dtype="fp8")
    step = Step(D, [9, 5, 0], [1, 1, 6], block_size=4, kv_cache_dtype="fp8", k_scale=0.02)
    out = run(step, layer)
    # decode rows read every key from the fp8 cache; prefill rows use the new latents unrounded
    ref = step.reference(kv_b, layer.softmax_scale)
    assert rel_err(out[:2], ref[:2]) < 1e-5
    assert rel_err(out[2:], ref[2:]) < 5e-2
    # the rows written this step are fp8(x / k_scale)
    assert step.cache.kv[0].dtype == torch.float8_e4m3fn


def test_softmax_scale_is_models_not_latent_width():
    from mla_ops import mla_softmax_scale, yarn_mscale
    assert mla_softmax_scale(192) == pytest.approx(192 ** -0.5)
    rs = {"rope_type": "yarn", "factor": 40.0, "mscale_all_dim": 1.0}
    m = 0.1 * torch.log(torch.tensor(40.0)).item() + 1
    assert yarn_mscale(40.0, 1.0) == pytest.approx(m)
    assert mla_softmax_scale(192, rs) == pytest.approx(192 ** -0.5 * m * m)


def test_absorb_dequantizes_block_fp8_kv_b_proj():
    from mla_ops import split_kv_b_proj
    from mla_ops.quant import FP8
    g = torch.Generator().manual_seed(5)
    N, P, V, L = 2, 128, 128, 192                       # weight [512, 192]: 4 x 2 blocks of 128
    w = torch.randn(N * (P + V), L, generator=g)
    scale_inv = torch.rand(4, 2, generator=g) * 0.01 + 0.001
    w8 = (w / scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)[:, :L]).clamp(-448, 448).to(FP8)
    W_UK_T, W_UV = split_kv_b_proj(w8, N, P, V, weight_scale_inv=scale_inv, dtype=torch.float32)
    deq = w8.double() * scale_inv.double().repeat_interleave(128, 0).repeat_interleave(128, 1)[:, :L]
    ref = deq.view(N, P + V, L)                          # rows of head n: [P nope | V value]
    torch.testing.assert_close(W_UK_T.double(), ref[:, :P, :], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(W_UV.double(), ref[:, P:, :].transpose(1, 2), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="weight_scale_inv"):
        split_kv_b_proj(w8, N, P, V)
    with pytest.raises(ValueError, match="kv_b_proj weight"):
        split_kv_b_proj(w[:-1], N, P, V)


def test_backward_through_the_layer_is_a_clear_error():
    """The attention has no backward: with grad enabled the forward runs and is unchanged,
    and a backward pass that reaches it raises instead of leaving q / kv without
    gradients; without grad the output is the op's own tensor (nothing added)."""
    from mla_ops.no_backward import MESSAGE
    layer, kv_b = make_layer(D, torch.float32)
    step = Step(D, [5, 0], [1, 4], block_size=4)
    q, kv_c, k_pe = step.inputs()
    q.requires_grad_(True)
    with torch.no_grad():
        plain = layer(q, kv_c, k_pe, step.cache.kv[0], step.cache.k_scale, step.meta)
    assert not plain.requires_grad
    step = Step(D, [5, 0], [1, 4], block_size=4)
    out = layer(q, kv_c, k_pe, step.cache.kv[0], step.cache.k_scale, step.meta)
    assert out.requires_grad and torch.equal(out.detach(), plain)
    with pytest.raises(RuntimeError, match="has no backward"):
        out.sum().backward()
    assert q.grad is None
    assert "torch.no_grad()" in MESSAGE


def test_prebuilt_decode_query():
    """decode_q (the absorbed query, as mla::decode_q_absorb builds it) stands in for the
    decode rows' q: with q given (a mixed step, q's decode rows overwritten with noise that
    must not be read) and with q=None (every row a decode row)."""
    from mla_ops.attention import build_decode_query
    layer, kv_b = make_layer(D, torch.float32)
    step = Step(D, [10, 7, 0], [1, 1, 5], block_size=4)
    nd = step.meta.num_decode_tokens
    q, kv_c, k_pe = step.inputs()
    decode_q = build_decode_query(q[:nd], layer.W_UK_T)                     # [nd, N, L+R]
    noisy = q.clone()
    noisy[:nd] = torch.randn_like(noisy[:nd]) * 10
    out = layer(noisy, kv_c, k_pe, step.cache.kv[0], step.cache.k_scale, step.meta,
                decode_q=decode_q)
    assert rel_err(out, step.reference(kv_b, layer.softmax_scale)) < 1e-5

    step = Step(D, [10, 3], [1, 1], block_size=4)
    q, kv_c, k_pe = step.inputs()
    decode_q = build_decode_query(q, layer.W_UK_T)
    out = layer(None, kv_c, k_pe, step.cache.kv[0], step.cache.k_scale, step.meta,
                decode_q=decode_q)
    assert rel_err(out, step.reference(kv_b, layer.softmax_scale)) < 1e-5
    with pytest.raises(ValueError, match="q may be None only"):
        layer(None, kv_c, k_pe, step.cache.kv[0], step.cache.k_scale, step.meta)
    layer.enable_fp8_decode_query(1.0)
    with pytest.raises(ValueError, match="not both"):
        layer(None, kv_c, k_pe, step.cache.kv[0], step.cache.k_scale, step.meta,
              decode_q=decode_q)


@pytest.mark.parametrize("fp8_query", [False, True])
def test_layer_passes_only_the_schedule_of_its_query_kind(fp8_query, monkeypatch):
    """A step's FlashMLA schedule reaches the decode only when it is of the kind the layer's
    query runs on (an FP8Schedule for an fp8 decode query, a plain pair otherwise); the
    other kind is dropped (the kernel then schedules itself), and the output is unchanged."""
    import dataclasses

    import mla_ops.attention as attn
    from lowering.decode.flashmla import FP8Schedule
    from mla_ops.attention import build_decode_query
    layer, kv_b = make_layer(D, torch.float32, kv_cache_dtype="fp8")
    step = Step(D, [10, 7, 3], [1, 1, 1], block_size=4, kv_cache_dtype="fp8")
    if fp8_query:
        q_mqa = build_decode_query(step.inputs()[0], layer.W_UK_T)
        layer.enable_fp8_decode_query(q_mqa.abs().amax() / 448.0)
    seen = []
    if fp8_query:                        # fp8 x fp8 (on CPU: then the dequantized query)
        real = attn._fp8_query_decode
        monkeypatch.setattr(attn, "_fp8_query_decode",
                            lambda *a, schedule=None: seen.append(schedule) or real(*a))
    else:
        real = attn.run_decode
        monkeypatch.setattr(attn, "run_decode",
                            lambda call, *a: seen.append(call.schedule) or real(call, *a))
    table = torch.zeros(8, 8, dtype=torch.int32)                  # stand-ins: never read here
    splits = torch.zeros(4, dtype=torch.int32)
    outs = []
    for sched in (None, (table, splits), FP8Schedule(table, splits)):
        meta = dataclasses.replace(step.meta, decode_schedule=sched)
        q, kv_c, k_pe = step.inputs()
        outs.append(layer(q, kv_c, k_pe, step.cache.kv[0], step.cache.k_scale, meta))
    mine = 2 if fp8_query else 1
    assert len(seen) == 3
    for i, got in enumerate(seen):
        if i == mine:
            assert got is not None and got[0] is table and got[1] is splits
        else:
            assert got is None
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_prebuilt_fp8_decode_query():
    """With enable_fp8_decode_query, decode_q may come quantized with the layer's q_scale
    (as mla::decode_q_absorb_fp8 builds it): the same output as the layer quantizing its
    own query, with q given or None; an fp8 decode_q without the layer's scale is refused."""
    from mla_ops.attention import build_decode_query
    from mla_ops.quant import quant_fp8_static
    layer, kv_b = make_layer(D, torch.float32, kv_cache_dtype="fp8")
    step = Step(D, [10, 3, 6], [1, 1, 1], block_size=4, kv_cache_dtype="fp8")
    q, kv_c, k_pe = step.inputs()
    q_mqa = build_decode_query(q, layer.W_UK_T)
    with pytest.raises(ValueError, match="needs enable_fp8_decode_query"):
        layer(None, kv_c, k_pe, step.cache.kv[0], step.cache.k_scale, step.meta,
              decode_q=quant_fp8_static(q_mqa, torch.tensor([0.01])))
    layer.enable_fp8_decode_query(q_mqa.abs().amax() / 448.0)
    own = layer(q, kv_c, k_pe, step.cache.kv[0], step.cache.k_scale, step.meta)
    q8 = quant_fp8_static(q_mqa, layer.q_scale)
    for q_in in (q, None):
        got = layer(q_in, kv_c, k_pe, step.cache.kv[0], step.cache.k_scale, step.meta,
                    decode_q=q8)
        assert got.dtype == own.dtype and torch.equal(got, own)
    assert rel_err(own, step.reference(kv_b, layer.softmax_scale)) < 6e-2
