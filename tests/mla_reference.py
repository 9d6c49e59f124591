"""Independent float64 references for the tests: dense, unabsorbed, unpaged MLA attention."""
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


def dense_decode_reference(q, kv, lens, scale, head_dim_v, causal=True):
    """mla_decode in float64 on dense per-request rows.

    q [B, s_q, H, D]; kv: list of [len_b, D] tensors (already dequantized).
    Returns out [B, s_q, H, head_dim_v], lse [B, H, s_q].
    """
    B, s_q, H, D = q.shape
    outs, lses = [], []
    for b in range(B):
        k = kv[b].double()                                             # [S, D]
        S = k.shape[0]
        sc = torch.einsum("qhd,sd->hqs", q[b].double(), k) * scale     # [H, s_q, S]
        if causal:
            lim = torch.arange(s_q)[:, None] + S - s_q                  # [s_q, 1]
            sc = sc.masked_fill(torch.arange(S)[None, :] > lim, float("-inf"))
        lse = torch.logsumexp(sc, -1)
        outs.append(torch.einsum("hqs,sv->qhv", torch.softmax(sc, -1), k[:, :head_dim_v]))
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)
