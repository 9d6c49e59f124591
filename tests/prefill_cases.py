"""Random prefill steps over a paged latent cache, and an independent float64 reference.

The reference up-projects every key (cached context and new tokens) in float64 with
einsums and runs softmax attention per request with an explicit causal mask; it shares
no code with the library.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from mla_reference import quantize_e4m3


@dataclass
class PrefillCase:
    q: torch.Tensor                 # [T, N, P + R]
    kv_c: torch.Tensor              # [T, L]
    k_pe: torch.Tensor              # [T, R]
    kv_cache: torch.Tensor          # [num_blocks, page, L + R]
    k_scale: torch.Tensor           # [1] fp32
    kind: str
    W_UK_T: torch.Tensor            # [N, P, L]
    W_UV: torch.Tensor              # [N, L, V]
    block_table: torch.Tensor       # [B, max_blocks] int32, -1 past the end
    seq_lens: torch.Tensor          # [B] int32
    query_start_loc: torch.Tensor   # [B + 1] int32
    num_decode_tokens: int
    scale: float

    def args(self, workspace_rows):
        return (self.q, self.kv_c, self.k_pe, self.kv_cache, self.W_UK_T, self.W_UV,
                self.block_table, self.seq_lens, self.query_start_loc, self.num_decode_tokens,
                self.scale, self.kind, self.k_scale, workspace_rows)


def make_prefill_case(q_lens, ctx_lens, *, N=4, P=32, R=16, L=64, V=32, page=16,
                      dtype=torch.bfloat16, kind="auto", num_decode=0, device="cpu", seed=0):
    """Requests [0, num_decode) are decode rows (query length 1), the rest prefill."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, s=1.0):
        return (torch.randn(*shape, generator=g) * s)

    B, T = len(q_lens), sum(q_lens)
    seq = [c + s for c, s in zip(ctx_lens, q_lens)]
    nblk = [-(-n // page) for n in seq]
    max_blocks = max(nblk) + 1
    num_blocks = sum(nblk) + 3
    perm = torch.randperm(num_blocks, generator=g)
    bt = torch.full((B, max_blocks), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(nblk):
        bt[b, :n] = perm[used:used + n].to(torch.int32)
        used += n
    rows = rnd(num_blocks, page, L + R, s=0.5)
    k_scale = torch.ones(1)
    if kind == "fp8":
        cache, k_scale = quantize_e4m3(rows)
    else:
        cache = rows.to(dtype)
    qsl = [0]
    for s in q_lens:
        qsl.append(qsl[-1] + s)
    to = dict(device=device)
    return PrefillCase(
        q=rnd(T, N, P + R).to(dtype).to(**to), kv_c=rnd(T, L, s=0.5).to(dtype).to(**to),
        k_pe=rnd(T, R, s=0.5).to(dtype).to(**to), kv_cache=cache.to(**to),
        k_scale=k_scale.to(**to), kind=kind,
        W_UK_T=(rnd(N, P, L) / L ** 0.5).to(dtype).to(**to),
        W_UV=(rnd(N, L, V) / L ** 0.5).to(dtype).to(**to),
        block_table=bt.to(**to), seq_lens=torch.tensor(seq, dtype=torch.int32, **to),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, **to),
        num_decode_tokens=sum(q_lens[:num_decode]), scale=(P + R) ** -0.5)


def cache_rows64(c: PrefillCase, b: int, n: int) -> torch.Tensor:
    """Positions [0, n) of request b from the paged cache, dequantized, float64 [n, L + R]."""
    page = c.kv_cache.shape[1]
    pos = torch.arange(n, device=c.kv_cache.device)
    blk = c.block_table[b].long()[pos // page]
    rows = c.kv_cache[blk, pos % page].double()
    return rows * c.k_scale.double().reshape(()) if c.kind == "fp8" else rows


REF_SCORE_BYTES = 1 << 30      # float64 scores of one query block (tests run side by side)


def prefill_ref64(c: PrefillCase):
    """-> out [T - num_decode_tokens, N, V] float64 and lse [T - nd, N] of the prefill rows
    (on the inputs' device)."""
    qsl = c.query_start_loc.tolist()
    lens = c.seq_lens.tolist()
    W_UK_T, W_UV = c.W_UK_T.double(), c.W_UV.double()
    dev = c.q.device
    L = W_UK_T.shape[-1]
    outs, lses = [], []
    for b in range(len(lens)):
        a, e = qsl[b], qsl[b + 1]
        if e <= c.num_decode_tokens or a == e:
            continue
        s = e - a
        ctx = lens[b] - s
        new = torch.cat([c.kv_c[a:e].double(), c.k_pe[a:e].double()], -1)
        rows = torch.cat([cache_rows64(c, b, ctx), new])                  # [ctx + s, L + R]
        k_nope = torch.einsum("cl,npl->cnp", rows[:, :L], W_UK_T)
        k = torch.cat([k_nope, rows[:, None, L:].expand(-1, k_nope.shape[1], -1)], -1)
        v = torch.einsum("cl,nlv->cnv", rows[:, :L], W_UV)
        # queries in blocks: a block's scores [N, blk, c] stay within REF_SCORE_BYTES
        blk = max(1, REF_SCORE_BYTES // (8 * k.shape[1] * (ctx + s)))
        for q0 in range(0, s, blk):
            q1 = min(q0 + blk, s)
            sc = torch.einsum("snd,cnd->nsc", c.q[a + q0:a + q1].double(), k) * c.scale
            see = (torch.arange(ctx + s, device=dev)[None, :]
                   <= (ctx + torch.arange(q0, q1, device=dev))[:, None])           # [blk, c]
            sc = sc.masked_fill(~see, float("-inf"))
            lse = torch.logsumexp(sc, -1)                                 # [N, blk]
            outs.append(torch.einsum("nsc,cnv->snv", torch.exp(sc - lse[..., None]), v))
            lses.append(lse.t())
    return torch.cat(outs), torch.cat(lses)


def dense64(q, k, v, scale, causal, key_lens=None):
    """q [B, N, Sq, D], k [B, N, Sk, D], v [B, N, Sk, V] -> float64 out [B, Sq, N, V] and
    lse [B, N, Sq]; causal: query i sees keys j <= i; key_lens: keys past them hidden."""
    s = torch.einsum("bnqd,bnkd->bnqk", q.double(), k.double()) * scale
    Sq, Sk = s.shape[-2:]
    if causal:
        s = s.masked_fill(torch.ones(Sq, Sk, dtype=torch.bool, device=q.device).triu(1),
                          float("-inf"))
    if key_lens is not None:
        hidden = torch.arange(Sk, device=q.device)[None, :] >= key_lens[:, None]
        s = s.masked_fill(hidden[:, None, None], float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return torch.einsum("bnqk,bnkv->bqnv", p, v.double()), lse
