"""The prefill path on a CUDA device: the cuDNN route and the whole step vs float64.

Realistic MLA head sizes (q/k 192 = 128 + 64, v 128, L 512), ragged lengths up to 8k
(1, not multiples of 64), cached context in several windows, fp8 caches, and the layer's
public op on a mixed decode + prefill step. The float64 references run on the GPU.
"""
from __future__ import annotations

import pytest
import torch

import mla_ops  # noqa: F401
from lowering.prefill import cudnn_unmet, dense_attention, mla_prefill, prefill_shape
from mla_ops.prefill import prefill_attention
from mla_reference import rel_err
from prefill_cases import dense64, make_prefill_case, prefill_ref64

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

MLA = dict(N=16, P=128, R=64, L=512, V=128, page=64)


def need_cudnn():
    q = torch.empty(1, 1, 1, 192, device="cuda", dtype=torch.bfloat16)
    why = cudnn_unmet(q, q[..., :128])
    if why is not None:
        pytest.skip(why)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal,key_lens", [(True, None), (False, None), (False, [300, 0, 77])])
def test_cudnn_route_matches_fp64(dtype, causal, key_lens):
    need_cudnn()
    g = torch.Generator(device="cuda").manual_seed(0)
    B, N, S = 3, 8, 300
    # [B, S, N, D] storage seen as [B, N, S, D], as the ragged layout passes it
    q = torch.randn(B, S, N, 192, device="cuda", generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(B, S, N, 192, device="cuda", generator=g).to(dtype).transpose(1, 2)
    v = torch.randn(B, S, N, 128, device="cuda", generator=g).to(dtype).transpose(1, 2)
    kl = None if key_lens is None else torch.tensor(key_lens, dtype=torch.int32, device="cuda")
    out, lse = dense_attention(q, k, v, kl, 192 ** -0.5, causal, "cudnn")
    ref, ref_lse = dense64(q, k, v, 192 ** -0.5, causal, kl)
    live = torch.ones(B, dtype=torch.bool, device="cuda") if kl is None else kl > 0
    assert out.dtype == dtype and out.shape == (B, S, N, 128)
    assert rel_err(out[live], ref[live]) < 1e-2
    assert (lse[live].double() - ref_lse[live]).abs().max().item() < 2e-2
    if kl is not None:
        assert torch.isneginf(lse[~live]).all()


@pytest.mark.parametrize("q_lens,ctx_lens,num_decode,ws", [
    ([8192], [0], 0, 8192),                              # one long prompt
    ([1, 1000, 4097, 63], [0, 0, 0, 0], 0, 8192),        # ragged, no context
    ([2048] * 4, [0] * 4, 0, 8192),                      # uniform: reshape, no pad
    ([512], [4096], 0, 8192),                            # multi-turn: 4096 cached, 512 new
    ([300, 17, 1000], [2500, 0, 333], 0, 1024),          # context in several windows, masks
    ([1, 1, 700, 129], [900, 12, 1500, 64], 2, 2048),    # decode rows first
])
@pytest.mark.parametrize("kind", ["auto", "fp8"])
def test_step_on_gpu_matches_fp64(q_lens, ctx_lens, num_decode, ws, kind):
    need_cudnn()
    c = make_prefill_case(q_lens, ctx_lens, num_decode=num_decode, kind=kind,
                          dtype=torch.bfloat16, device="cuda", seed=len(q_lens), **MLA)
    shape = prefill_shape(c.query_start_loc, c.seq_lens, c.num_decode_tokens)
    out = mla_prefill(*c.args(ws), shape)
    ref, _ = prefill_ref64(c)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref.reshape(out.shape)) < 2e-2
    # the op's entry derives the shape itself and gives the same rows
    again = prefill_attention(*c.args(ws))
    assert torch.equal(out, again)
