"""Independent float64 references for the tests.

dense_mla_reference: unabsorbed, unpaged MLA attention (the layer and ops tests).
decode_ref64: dense attention over a paged latent cache (the decode-kernel tests).
"""
from __future__ import annotations

import torch


def dense_mla_reference(q, kv_c, k_pe, kv_b_weight, num_heads, P, V, scale, positions, kv_len):
    """Plain MHA on up-projected K/V, float64, no cache, no absorption.

    q [s, N, P+R] for query tokens at sequence positions `positions` (list of ints);
    kv_c [S, L], k_pe [S, R]: the whole sequence's latents (positions 0..S-1);
    query at position p sees keys [0, p]. Returns [s, N*V] float64.
    """
    q, kv_c, k_pe, W = (t.double() for t in (q, kv_c, k_pe, kv_b_weight))
    S = kv_len
    kv = (kv_c[:S] @ W.t()).view(S, num_heads, P + V)                 # [S, N, P+V]
    k = torch.cat([kv[..., :P], k_pe[:S, None].expand(S, num_heads, -1)], -1)  # [S, N, P+R]
    v = kv[..., P:]                                                    # [S, N, V]
    scores = torch.einsum("snd,knd->nsk", q, k) * scale                # [N, s, S]
    pos = torch.tensor(positions)[:, None]
    mask = torch.arange(S)[None, :] <= pos                             # [s, S]
    scores = scores.masked_fill(~mask[None], float("-inf"))
    p = torch.softmax(scores, -1)
    return torch.einsum("nsk,knv->snv", p, v).reshape(len(positions), -1)


def decode_ref64(q, kv_values, block_table, cache_seqlens, scale, causal, head_dim_v):
    """out [B, s_q, H, L] float64, lse [B, H, s_q] float64.

    q [B, s_q, H, D] and kv_values [num_blocks, page, D] hold the true (dequantized) values.
    """
    B, s_q, H, D = q.shape
    page = kv_values.shape[1]
    S = block_table.shape[1] * page
    pos = torch.arange(S, device=q.device)                                   # [S]
    lens = cache_seqlens.long()
    blk = block_table.long()[:, pos // page]                                 # [B, S]
    valid_pos = pos[None, :] < lens[:, None]                                 # [B, S]
    blk = torch.where(valid_pos, blk, torch.zeros_like(blk))
    rows = kv_values.double()[blk, (pos % page)[None, :].expand(B, S)]       # [B, S, D]
    scores = torch.einsum("bthd,bsd->bhts", q.double(), rows) * scale       # [B, H, s_q, S]
    t = torch.arange(s_q, device=q.device)
    limit = (lens[:, None] - s_q + t[None, :] + 1) if causal else lens[:, None].expand(B, s_q)
    visible = pos[None, None, :] < limit[:, :, None]                         # [B, s_q, S]
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)                                    # [B, H, s_q]
    p = torch.exp(scores - lse[..., None])
    out = torch.einsum("bhts,bsl->bthl", p, rows[..., :head_dim_v])          # [B, s_q, H, L]
    return out, lse


def make_case(B, s_q, H, L, R, page, lens, device, dtype=torch.bfloat16, seed=0, spare_blocks=3):
    """Random q and paged cache (shuffled pages, -1 padding past each length)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    lens = torch.tensor(lens, dtype=torch.int32)
    need = (lens + page - 1) // page
    max_blocks = int(need.max()) + 1
    nb = int(need.sum()) + spare_blocks
    kv = torch.randn(nb, page, L + R, generator=g).to(dtype)
    q = torch.randn(B, s_q, H, L + R, generator=g).to(dtype)
    perm = torch.randperm(nb, generator=g)
    bt = torch.full((B, max_blocks), -1, dtype=torch.int32)
    k = 0
    for b in range(B):
        n = int(need[b])
        bt[b, :n] = perm[k:k + n].int()
        k += n
    return q.to(device), kv.to(device), bt.to(device), lens.to(device)


def poison_unwritten_rows(kv, block_table, cache_seqlens):
    """A copy of kv with NaN in every row past a request's length in its last page (what
    an unwritten or freed slot may hold; e4m3's NaN byte for an fp8 cache): a kernel must
    not let it reach P @ V."""
    page = kv.shape[1]
    kv = kv.clone()
    raw = kv.view(torch.uint8) if kv.dtype == torch.float8_e4m3fn else None
    for b, n in enumerate(cache_seqlens.tolist()):
        if n % page:
            blk = int(block_table[b, n // page])
            if raw is not None:
                raw[blk, n % page:] = 0x7F                                   # e4m3fn NaN
            else:
                kv[blk, n % page:] = float("nan")
    return kv


def quantize_e4m3(x, amax_to=448.0):
    """x as e4m3 with a per-tensor scale: (stored [x's shape] e4m3, scale [1] fp32), true
    value = stored * scale; x's largest magnitude maps to amax_to."""
    scale = (x.float().abs().amax() / amax_to).reshape(1)
    return (x.float() / scale).to(torch.float8_e4m3fn), scale


def misaligned_copy(t):
    """A copy of contiguous t whose data starts 8 bytes past a 16-byte boundary (for the
    TMA alignment errors)."""
    n = t.numel() * t.element_size()
    flat = torch.empty(n + 16, device=t.device, dtype=torch.uint8)
    out = flat[8:8 + n].view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def check_compiled_and_graphed(run, kernel_name, q, kv, bt, cl):
    """run(q, kv, bt, cl) -> (out, lse) under torch.compile(fullgraph=True) (its generated
    code names kernel_name) and under mode="reduce-overhead" (CUDA graphs) replayed with
    changing lengths (cl is refilled): both match eager."""
    from torch._inductor.utils import run_and_get_code

    def step(q, kv, bt, cl):
        out, lse = run(q * 1.0, kv, bt, cl)
        return out.float().sum(-1), lse

    compiled = torch.compile(step, fullgraph=True)
    (c_out, c_lse), codes = run_and_get_code(compiled, q, kv, bt, cl)
    assert any(kernel_name in c for c in codes)
    e_out, e_lse = step(q, kv, bt, cl)
    assert torch.allclose(c_out, e_out, rtol=1e-3, atol=1e-2) and torch.allclose(c_lse, e_lse)
    graphed = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    for n in (1500, 700, 1499, 3):
        cl.fill_(n)
        for _ in range(2):
            g_out, g_lse = graphed(q, kv, bt, cl)
        e_out, e_lse = step(q, kv, bt, cl)
        assert torch.allclose(g_out, e_out, rtol=1e-3, atol=1e-2)
        assert torch.allclose(g_lse, e_lse)


def nan_empty(monkeypatch):
    """torch.empty filling with NaN, so a row a kernel leaves unwritten shows."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t
    monkeypatch.setattr(torch, "empty", poisoned)


def heads_of_any_scale(q, far_head=None, far_scale=10.0):
    """q [B, s_q, H, D] with heads of very different magnitudes, as bf16: head 0 x 1e4,
    head 1 x 1e-4, head 2 all zero, head 3 x 1e-3 with one entry of 50, and far_head (if
    given) x far_scale."""
    q = q.float()
    q[:, :, 0] *= 1e4
    q[:, :, 1] *= 1e-4
    q[:, :, 2] = 0.0
    q[:, :, 3] *= 1e-3
    q[:, :, 3, 7] = 50.0
    if far_head is not None:
        q[:, :, far_head] *= far_scale
    return q.to(torch.bfloat16)


def lse_rel_err(lse, ref_lse):
    """Largest LSE error relative to the reference's magnitude (at least 1)."""
    return ((lse.double() - ref_lse).abs() / ref_lse.abs().clamp_min(1.0)).max().item()


def refused_by_gluon_then_triton(q, kv8, k_scale, bt, cl, scale, match, ref, tol):
    """An fp8-cache call backend="gluon" refuses (BackendUnavailable matching `match`),
    which backend="auto" gives the Triton kernel: its output within tol of ref."""
    import pytest

    import lowering
    with pytest.raises(lowering.BackendUnavailable, match=match):
        lowering.mla_decode(q, kv8, bt, cl, scale, kv_cache_dtype="fp8", k_scale=k_scale,
                            backend="gluon")
    n = lowering.backend_choices["triton"]
    out, _ = lowering.mla_decode(q, kv8, bt, cl, scale, kv_cache_dtype="fp8", k_scale=k_scale)
    assert lowering.backend_choices["triton"] == n + 1
    assert rel_err(out, ref) < tol

