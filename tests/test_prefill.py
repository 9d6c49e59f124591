"""The prefill path (lowering.prefill) vs an independent float64 reference, on the CPU.

The dense op runs its "reference" route here (the cuDNN route is a GPU test), so these
check everything around it: the ragged pad/unpad index maps, the context windows, the
gather and merge kernels (Triton under TRITON_INTERPRET=1, and their torch references),
fp8 caches, mixed decode + prefill batches. Inputs are random, never zeros.
"""
from __future__ import annotations

import os

import pytest
import torch

import mla_ops  # noqa: F401
from lowering.prefill import (PrefillShape, dense_attention, mla_prefill, prefill_shape,
                              varlen_attention)
from mla_ops.prefill import reference_prefill
from mla_reference import rel_err
from prefill_cases import dense64, make_prefill_case, prefill_ref64

triton = pytest.importorskip("triton")

TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def skip_unless_interpreted(kernels):
    """The Triton kernels take CPU tensors only under TRITON_INTERPRET=1 (set by conftest
    where there is no GPU); on a GPU machine test_prefill_gpu.py runs them on CUDA."""
    if kernels == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton kernels on CPU tensors need TRITON_INTERPRET=1")


@pytest.mark.parametrize("causal,key_lens", [(True, None), (False, None), (False, [5, 0, 13])])
def test_dense_reference_route(causal, key_lens):
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(3, 2, 13, 24, generator=g), torch.randn(3, 2, 13, 24, generator=g)
    v = torch.randn(3, 2, 13, 8, generator=g)
    kl = None if key_lens is None else torch.tensor(key_lens, dtype=torch.int32)
    out, lse = dense_attention(q, k, v, kl, 0.3, causal, "reference")
    ref, ref_lse = dense64(q, k, v, 0.3, causal, kl)
    assert out.shape == (3, 13, 2, 8) and lse.shape == (3, 2, 13) and lse.dtype == torch.float32
    live = torch.ones(3, dtype=torch.bool) if kl is None else kl > 0
    assert rel_err(out[live], ref[live]) < 1e-5
    assert torch.allclose(lse[live].double(), ref_lse[live], atol=1e-4)
    if kl is not None:                   # a batch row that sees no key: lse -inf
        assert torch.isneginf(lse[~live]).all()


def test_dense_explicit_cudnn_on_cpu_says_why():
    q = torch.randn(1, 2, 4, 16)
    with pytest.raises(ValueError, match="cudnn"):
        dense_attention(q, q, q, None, 1.0, True, "cudnn")
    with pytest.raises(ValueError, match="route must be one of"):
        dense_attention(q, q, q, None, 1.0, True, "flash")


@pytest.mark.parametrize("lens", [[1], [37, 1, 100, 5], [64, 64, 64], [70, 3]])
def test_varlen_attention_pads_and_unpads(lens):
    g = torch.Generator().manual_seed(sum(lens))
    T, N = sum(lens), 3
    q, k = torch.randn(T, N, 24, generator=g), torch.randn(T, N, 24, generator=g)
    v = torch.randn(T, N, 16, generator=g)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    out, lse = varlen_attention(q, k, v, cu, max(lens), 0.2, "reference")
    assert out.shape == (T, N, 16) and lse.shape == (T, N)
    for b, n in enumerate(lens):
        a = int(cu[b])
        ref, ref_lse = dense64(q[None, a:a + n].transpose(1, 2), k[None, a:a + n].transpose(1, 2),
                               v[None, a:a + n].transpose(1, 2), 0.2, True)
        assert rel_err(out[a:a + n], ref[0]) < 1e-5
        assert torch.allclose(lse[a:a + n].double(), ref_lse[0].t(), atol=1e-4)


def test_varlen_attention_traces_without_graph_breaks():
    lens = [5, 9]
    q = torch.randn(14, 2, 24)
    cu = torch.tensor([0, 5, 14], dtype=torch.int32)
    fn = torch.compile(varlen_attention, fullgraph=True, backend="aot_eager")
    out, lse = fn(q, q, q[..., :16], cu, max(lens), 0.2, "reference")
    ref, ref_lse = varlen_attention(q, q, q[..., :16], cu, max(lens), 0.2, "reference")
    assert torch.allclose(out, ref) and torch.allclose(lse, ref_lse)


def run_step(c, workspace_rows, kernels, route="reference"):
    shape = prefill_shape(c.query_start_loc, c.seq_lens, c.num_decode_tokens)
    return mla_prefill(*c.args(workspace_rows), shape, route=route, kernels=kernels)


CASES = [
    # q_lens, ctx_lens, num_decode, workspace_rows
    ([1], [0], 0, 64),                              # one token, no context
    ([37, 1, 20, 5], [0, 0, 0, 0], 0, 64),          # ragged, no context
    ([16, 16], [0, 0], 0, 64),                      # uniform: the reshape fast path
    ([9], [45], 0, 8),                              # context in six windows
    ([7, 13, 2], [30, 0, 17], 0, 12),               # unequal contexts: key masks, empty rows
    ([1, 1, 11, 6], [20, 5, 33, 19], 2, 10),        # decode rows first, then prefill
    ([5, 5], [24, 24], 0, 16),                      # equal contexts: no mask needed
]


@pytest.mark.parametrize("kernels", ["triton", "torch"])
@pytest.mark.parametrize("q_lens,ctx_lens,num_decode,ws", CASES)
def test_step_matches_fp64(q_lens, ctx_lens, num_decode, ws, kernels):
    skip_unless_interpreted(kernels)
    c = make_prefill_case(q_lens, ctx_lens, num_decode=num_decode, dtype=torch.float32,
                          seed=len(q_lens) * 7 + ws)
    out = run_step(c, ws, kernels)
    ref, _ = prefill_ref64(c)
    assert out.shape == (c.q.shape[0] - c.num_decode_tokens, ref.shape[1] * ref.shape[2])
    assert torch.isfinite(out).all()
    assert rel_err(out, ref.reshape(out.shape)) < TOL[torch.float32]


@pytest.mark.parametrize("kind", ["auto", "fp8"])
def test_step_bf16_and_fp8_cache(kind):
    skip_unless_interpreted("triton")
    c = make_prefill_case([7, 13, 2], [30, 0, 17], kind=kind, dtype=torch.bfloat16, seed=3)
    out = run_step(c, 12, "triton")
    ref, _ = prefill_ref64(c)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, ref.reshape(out.shape)) < TOL[torch.bfloat16]
    # the library's own torch reference agrees too
    lib = reference_prefill(*c.args(12))
    assert rel_err(out, lib) < TOL[torch.bfloat16]


def test_prefill_shape_reads_the_host_ints():
    c = make_prefill_case([1, 1, 11, 6], [20, 5, 33, 19], num_decode=2, seed=0)
    assert prefill_shape(c.query_start_loc, c.seq_lens, 2) == PrefillShape(2, 11, 33, 19)
    assert prefill_shape(c.query_start_loc, c.seq_lens, 0) == PrefillShape(4, 11, 33, 5)


def test_longer_ragged_batch_several_windows():
    c = make_prefill_case([130, 1, 77, 64], [100, 3, 0, 129], dtype=torch.float32, seed=9)
    out = run_step(c, 96, "torch")
    ref, _ = prefill_ref64(c)
    assert rel_err(out, ref.reshape(out.shape)) < TOL[torch.float32]


def test_varlen_attention_rejects_bad_arguments():
    q = torch.randn(6, 2, 24)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="k must be"):
        varlen_attention(q, q[:5], q[..., :16], cu, 4, 0.2)
    with pytest.raises(TypeError, match="cu_seqlens"):
        varlen_attention(q, q, q[..., :16], cu.long(), 4, 0.2)
    with pytest.raises(ValueError, match="max_len"):
        varlen_attention(q, q, q[..., :16], cu, 0, 0.2)
    with pytest.raises(TypeError, match="v must"):
        varlen_attention(q, q, q[..., :16].double(), cu, 4, 0.2)


@pytest.mark.parametrize("T,N", [(1, 1), (5, 3), (9, 16), (4, 12)])
def test_keys_kernel_places_every_head(T, N):
    """The keys kernel against an element-wise construction: heads not a multiple of its
    block, one token, k_pe a strided view (the cache row's rope columns)."""
    skip_unless_interpreted("triton")
    from lowering.prefill.keys_kernel import keys_unmet, prefill_keys
    P, R, L = 32, 16, 64
    g = torch.Generator().manual_seed(T * 31 + N)
    k_nope = torch.randn(T, N * P, generator=g).to(torch.bfloat16).view(T, N, P)
    row = torch.randn(T, L + R, generator=g).to(torch.bfloat16)
    k_pe = row[:, L:]                                      # row stride L + R
    assert keys_unmet(k_nope, k_pe) is None
    k = prefill_keys(k_nope, k_pe)
    want = torch.empty(T, N, P + R, dtype=torch.bfloat16)
    for t in range(T):
        for h in range(N):
            want[t, h, :P] = k_nope[t, h]
            want[t, h, P:] = row[t, L:]
    assert k.shape == (T, N, P + R) and k.is_contiguous()
    assert torch.equal(k, want)


def test_keys_unmet_names_the_layout():
    from lowering.prefill.keys_kernel import keys_unmet
    k_nope = torch.randn(3, 4, 32).transpose(0, 1)         # heads not contiguous per token
    assert "contiguous" in keys_unmet(k_nope, torch.randn(4, 16))
    assert "powers of two" in keys_unmet(torch.randn(3, 4, 24), torch.randn(3, 16))
