"""The persistent MoE block kernel and its launcher (probe, not maintained): see
probe_moe_persistent.py for what it does and how it is checked and timed."""
import torch
import triton
import triton.language as tl

from lowering.moe.router_select_kernel import select_experts
from lowering.moe.expert_run import run_rows
from probe_moe_persistent_parts import (_dot1, _dot1q, _dot2, _dot2q, _expert_run,
                                        _gu_slices, _residual_norm, _silu_mul, _wait)


@triton.jit
def moe_block_persistent_kernel(
    x_ptr, res_ptr, out_ptr,            # x, residual, out [T, H] (residual: RESIDUAL only)
    a_ptr, wo_ptr, nw_ptr,              # FRONT: attention rows [T, NV], o_proj [H, NV], norm [H]
    wos_ptr,                            # FP8_O: o_proj's block scales [cdiv(H, 128), cdiv(NV, 128)]
    po_ptr, h1_ptr, fres_ptr,           # FRONT: o slices [KS_O, T, H] fp32, h1 [T, H]; the
                                        #   final residual (h1 with FRONT, else res_ptr)
    wr_ptr, bias_ptr,                   # router [E, H] (x's dtype or fp32), bias [E] (MODE 0)
    gu_ptr, dn_ptr,                     # gate_up [E, 2I, H], down [E, H, I]
    sg_ptr, su_ptr, sd_ptr,             # shared gate, up [S, H], down [H, S]
    gus_ptr, dns_ptr,                   # FP8: the weights e4m3 and their block scales: gate_up
    sgs_ptr, sus_ptr, sds_ptr,          #   [E, 2 cdiv(I, 128), cdiv(H, 128)], down [E, cdiv(H,
                                        #   128), cdiv(I, 128)], shared [cdiv(N, 128), cdiv(K, 128)]
    pgs_ptr, pgr_ptr,                   # scratch: g+u slices [KS_G, T, 2S], [KS_G, P, 2I] fp32,
    lp_ptr, idx_ptr, wgt_ptr,           #   logit partials [SPLIT_R, T, E] fp32,
    hs_ptr, hr_ptr, pr_ptr, ps_ptr,     #   idx [P] i32, wgt [P] fp32, hs [T, S], hr [P, I],
    sync_ptr,                           #   pr [P, H] fp32, ps [KS, T, H] fp32; counters [NSYNC]
    T, H, E, I, S, TOP_K, GROUP_SIZE, N_GROUP, TOPK_GROUP, scale, CH_R, CH_S,
    NV, CH_O, eps, CH_G,
    FRONT: tl.constexpr, BN_O: tl.constexpr, BLOCK_NORM: tl.constexpr,
    FP8: tl.constexpr, GROUP_N: tl.constexpr,         # FP8: BLOCK_K is the scales' K block
    FP8_O: tl.constexpr,                              # FRONT with an e4m3 o_proj
    MODE: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr, W_F32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_ER: tl.constexpr, BN_G: tl.constexpr, BN_D: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_TK: tl.constexpr, BLOCK_SYNC: tl.constexpr, GROUPS_2D: tl.constexpr,
    BLOCK_R: tl.constexpr,                # >= P: the pairs expert_run looks over
    LIBDEVICE: tl.constexpr, DOT_F32: tl.constexpr, NAP: tl.constexpr,
):
    # counters: [0] tickets, [1] programs done, [2] router items done, [3] chosen,
    # [4] shared g+u items done, [5] o_proj items done, [6] normed (FRONT),
    # [7 + p] pair p's g+u tiles done, [7 + P + j] tile j's items done, then the g+u
    # tiles' slices done (c_sg: shared, c_rg: routed), when H is cut in slices of CH_G
    P = T * TOP_K
    n_er = tl.cdiv(E, BLOCK_ER)
    split_r = tl.cdiv(H, CH_R)
    n_g = tl.cdiv(I, BN_G)
    n_sg = tl.cdiv(S, BN_G)
    n_d = tl.cdiv(H, BN_D)
    ks = tl.cdiv(S, CH_S)
    ks_o = tl.cdiv(NV, CH_O)
    end_o = tl.cdiv(H, BN_O) * ks_o if FRONT else 0
    end_r = end_o + n_er * split_r
    ks_g = tl.cdiv(H, CH_G)
    end_sg = end_r + n_sg * ks_g
    end_rg = end_sg + P * n_g * ks_g
    c_sg = 7 + P + n_d                    # counters of the shared g+u tiles' slices
    c_rg = c_sg + n_sg                    # counters of the routed g+u tiles' slices
    end_sd = end_rg + ks * n_d
    total = end_sd + P * n_d
    dt = out_ptr.dtype.element_ty
    offs_m = tl.arange(0, BLOCK_M)                                            # [BLOCK_M]
    m_ok = offs_m < T

    tk = tl.atomic_add(sync_ptr, 1)
    while tk < total:
        if tk < end_o:                    # FRONT o_proj: rows jo * BN_O of H over slice so
            jo = tk // ks_o
            k0o = (tk % ks_o) * CH_O
            offs_o = jo * BN_O + tl.arange(0, BN_O)
            o_ok = offs_o < H
            if FP8_O:                     # e4m3 o_proj, its 128 x 128 block scales at wos_ptr
                acc_o = _dot1q(wo_ptr + offs_o.to(tl.int64)[:, None] * NV + k0o,
                               wos_ptr + (offs_o // GROUP_N) * tl.cdiv(NV, BLOCK_K)
                               + k0o // BLOCK_K, o_ok, a_ptr + offs_m[None, :] * NV + k0o,
                               m_ok, tl.minimum(CH_O, NV - k0o), wo_ptr, BN_O, BLOCK_M,
                               BLOCK_K, DOT_F32, False)                          # [BN_O, M]
            else:
                acc_o = _dot1(wo_ptr + offs_o.to(tl.int64)[:, None] * NV + k0o, o_ok,
                              a_ptr + offs_m[None, :] * NV + k0o, m_ok,
                              tl.minimum(CH_O, NV - k0o), BN_O, BLOCK_M, BLOCK_K, DOT_F32,
                              False)                                             # [BN_O, M]
            tl.store(po_ptr + ((tk % ks_o) * T + offs_m[None, :]) * H + offs_o[:, None], acc_o,
                     mask=o_ok[:, None] & m_ok[None, :])
            tl.debug_barrier()
            if tl.atomic_add(sync_ptr + 5, 1, sem="acq_rel") == end_o - 1:   # the last: norm
                _residual_norm(po_ptr, res_ptr, nw_ptr, h1_ptr, x_ptr, T, H, ks_o, eps,
                               BLOCK_NORM, dt)
                tl.debug_barrier()
                tl.atomic_xchg(sync_ptr + 6, 1, sem="release")
        elif tk < end_r:                  # router: logits of BLOCK_ER experts over a slice
            if FRONT:
                _wait(sync_ptr + 6, 1, NAP)
            i = (tk - end_o) // split_r
            r = (tk - end_o) % split_r
            offs_e = i * BLOCK_ER + tl.arange(0, BLOCK_ER)
            e_ok = offs_e < E
            h0 = r * CH_R
            acc = _dot1(wr_ptr + offs_e.to(tl.int64)[:, None] * H + h0, e_ok,
                        x_ptr + offs_m[None, :] * H + h0, m_ok, tl.minimum(CH_R, H - h0),
                        BLOCK_ER, BLOCK_M, BLOCK_K, W_F32 or DOT_F32, FRONT)  # [BLOCK_ER, M]
            tl.store(lp_ptr + (r * T + offs_m[None, :]) * E + offs_e[:, None], acc,
                     mask=e_ok[:, None] & m_ok[None, :])
            tl.debug_barrier()
            if tl.atomic_add(sync_ptr + 2, 1, sem="acq_rel") == end_r - end_o - 1:  # the last
                lanes = tl.arange(0, BLOCK_E)
                klanes = tl.arange(0, BLOCK_TK)
                for t in range(T):
                    logits = tl.zeros([BLOCK_E], dtype=tl.float32)
                    for sr in range(split_r):                                # in split order
                        logits += tl.load(lp_ptr + (sr * T + t) * E + lanes, mask=lanes < E,
                                          other=0.0, cache_modifier=".cg")
                    top_i, top_w = select_experts(
                        logits, bias_ptr, E, GROUP_SIZE, N_GROUP, TOPK_GROUP, TOP_K, scale,
                        MODE, NORM, BLOCK_E, BLOCK_G, BLOCK_TK, GROUPS_2D, LIBDEVICE)
                    tl.store(idx_ptr + t * TOP_K + klanes, top_i, mask=klanes < TOP_K)
                    tl.store(wgt_ptr + t * TOP_K + klanes, top_w, mask=klanes < TOP_K)
                tl.debug_barrier()
                tl.atomic_xchg(sync_ptr + 3, 1, sem="release")
        elif tk < end_sg:                 # shared gate + up: rows of S, all T rows, a slice
            if FRONT:
                _wait(sync_ptr + 6, 1, NAP)
            u = tk - end_r
            n_t = u // ks_g
            k0g = (u % ks_g) * CH_G
            kg = tl.minimum(CH_G, H - k0g)
            offs_s = n_t * BN_G + tl.arange(0, BN_G)
            s_ok = offs_s < S
            rows_s = offs_s.to(tl.int64)[:, None] * H + k0g
            if FP8:
                srow = (offs_s // GROUP_N) * tl.cdiv(H, BLOCK_K) + k0g // BLOCK_K
                sg_acc, su_acc = _dot2q(sg_ptr + rows_s, su_ptr + rows_s, sgs_ptr + srow,
                                        sus_ptr + srow, s_ok, x_ptr + offs_m[None, :] * H + k0g,
                                        m_ok, kg, sg_ptr, BN_G, BLOCK_M, BLOCK_K, DOT_F32, FRONT)
            else:
                sg_acc, su_acc = _dot2(sg_ptr + rows_s, su_ptr + rows_s, s_ok,
                                       x_ptr + offs_m[None, :] * H + k0g, m_ok, kg, BN_G, BLOCK_M,
                                       BLOCK_K, DOT_F32, FRONT)
            done_s = tk >= 0
            if ks_g > 1:                  # slices: the last one sums them in order
                done_s, sg_acc, su_acc = _gu_slices(
                    sg_acc, su_acc, pgs_ptr, u % ks_g, ks_g, T * 2 * S,
                    offs_m[None, :] * (2 * S) + offs_s[:, None], s_ok[:, None] & m_ok[None, :],
                    S, sync_ptr + c_sg + n_t, BN_G, BLOCK_M)                    # into [T, 2S]
            if done_s:
                tl.store(hs_ptr + offs_m[None, :] * S + offs_s[:, None],
                         _silu_mul(sg_acc, su_acc, dt), mask=s_ok[:, None] & m_ok[None, :])
                tl.debug_barrier()
                tl.atomic_add(sync_ptr + 4, 1, sem="release")
        elif tk < end_rg:                 # routed gate + up: pair q's run, rows of I, a slice
            u = tk - end_sg
            q = u // (n_g * ks_g)
            ni = (u // ks_g) % n_g
            k0r = (u % ks_g) * CH_G
            kr = tl.minimum(CH_G, H - k0r)
            offs_i = ni * BN_G + tl.arange(0, BN_G)
            i_ok = offs_i < I
            _wait(sync_ptr + 3, 1, NAP)
            # pair q serves every pair of its expert if it is the first to choose it
            # (lowering/moe/expert_run.py): the expert's rows are read once
            e_g, run_g, match_g = _expert_run(idx_ptr, q, P, E, BLOCK_R)
            if run_g > 0:
                pair_g, tok_g, ok_g = run_rows(match_g, 0, run_g, P, TOP_K, BLOCK_M)
                rows_r = (gu_ptr + e_g.to(tl.int64) * (2 * I * H)
                          + offs_i.to(tl.int64)[:, None] * H + k0r)
                x_r = x_ptr + tok_g[None, :] * H + k0r                           # [1, M]
                if FP8:
                    nkh = tl.cdiv(H, BLOCK_K)
                    s0 = (gus_ptr + e_g.to(tl.int64) * (2 * tl.cdiv(I, GROUP_N) * nkh)
                          + k0r // BLOCK_K)
                    rg_acc, ru_acc = _dot2q(rows_r, rows_r + I * H,
                                            s0 + (offs_i // GROUP_N) * nkh,
                                            s0 + (tl.cdiv(I, GROUP_N) + offs_i // GROUP_N) * nkh,
                                            i_ok, x_r, ok_g, kr, gu_ptr, BN_G, BLOCK_M, BLOCK_K,
                                            DOT_F32, FRONT)
                else:
                    rg_acc, ru_acc = _dot2(rows_r, rows_r + I * H, i_ok, x_r, ok_g, kr,
                                           BN_G, BLOCK_M, BLOCK_K, DOT_F32, FRONT)
                cols_r = pair_g[None, :] * (2 * I) + offs_i[:, None]       # into [P, 2I]
                msk_r = i_ok[:, None] & ok_g[None, :]
                done_r = tk >= 0
                if ks_g > 1:              # slices: the last one sums them in order
                    done_r, rg_acc, ru_acc = _gu_slices(
                        rg_acc, ru_acc, pgr_ptr, u % ks_g, ks_g, P * 2 * I, cols_r, msk_r, I,
                        sync_ptr + c_rg + q * n_g + ni, BN_G, BLOCK_M)
                if done_r:
                    tl.store(hr_ptr + pair_g[None, :] * I + offs_i[:, None],
                             _silu_mul(rg_acc, ru_acc, dt), mask=msk_r)
                    tl.debug_barrier()
                    tl.atomic_add(sync_ptr + 7 + q, 1, sem="release")
        else:                             # the down projections, then their tile's finish
            if tk < end_sd:               # shared down: slice s of S, rows j * BN_D of H
                s = (tk - end_rg) // n_d
                j = (tk - end_rg) % n_d
                offs_n = j * BN_D + tl.arange(0, BN_D)
                n_ok = offs_n < H
                _wait(sync_ptr + 4, n_sg, NAP)
                k0 = s * CH_S
                if FP8:
                    acc = _dot1q(sd_ptr + offs_n.to(tl.int64)[:, None] * S + k0,
                                 sds_ptr + (offs_n // GROUP_N) * tl.cdiv(S, BLOCK_K)
                                 + k0 // BLOCK_K, n_ok, hs_ptr + offs_m[None, :] * S + k0, m_ok,
                                 tl.minimum(CH_S, S - k0), sd_ptr, BN_D, BLOCK_M, BLOCK_K,
                                 DOT_F32, True)                                  # [BN_D, M]
                else:
                    acc = _dot1(sd_ptr + offs_n.to(tl.int64)[:, None] * S + k0, n_ok,
                                hs_ptr + offs_m[None, :] * S + k0, m_ok,
                                tl.minimum(CH_S, S - k0), BN_D, BLOCK_M, BLOCK_K, DOT_F32,
                                True)                                            # [BN_D, M]
                tl.store(ps_ptr + (s * T + offs_m[None, :]) * H + offs_n[:, None], acc,
                         mask=n_ok[:, None] & m_ok[None, :])
            else:                         # routed down: pair p's run, rows j * BN_D of H
                p = (tk - end_sd) // n_d
                j = (tk - end_sd) % n_d
                offs_n = j * BN_D + tl.arange(0, BN_D)
                n_ok = offs_n < H
                _wait(sync_ptr + 3, 1, NAP)
                e, run_d, match_d = _expert_run(idx_ptr, p, P, E, BLOCK_R)
                if run_d > 0:             # the run's first pair: every pair of its expert
                    _wait(sync_ptr + 7 + p, n_g, NAP)
                    pair_d, tok_d, ok_d = run_rows(match_d, 0, run_d, P, TOP_K, BLOCK_M)
                    wt = tl.load(wgt_ptr + pair_d, mask=ok_d, other=0.0,
                                 cache_modifier=".cg")                           # [M]
                    d_rows = (dn_ptr + e.to(tl.int64) * (H * I)
                              + offs_n.to(tl.int64)[:, None] * I)
                    if FP8:
                        nki = tl.cdiv(I, BLOCK_K)
                        acc_d = _dot1q(d_rows, dns_ptr + e.to(tl.int64)
                                       * (tl.cdiv(H, GROUP_N) * nki) + (offs_n // GROUP_N) * nki,
                                       n_ok, hr_ptr + pair_d[None, :] * I, ok_d, I, dn_ptr,
                                       BN_D, BLOCK_M, BLOCK_K, DOT_F32, True)    # [BN_D, M]
                    else:
                        acc_d = _dot1(d_rows, n_ok, hr_ptr + pair_d[None, :] * I, ok_d, I,
                                      BN_D, BLOCK_M, BLOCK_K, DOT_F32, True)     # [BN_D, M]
                    tl.store(pr_ptr + pair_d[None, :] * H + offs_n[:, None],
                             acc_d.to(dt).to(tl.float32) * wt[None, :],
                             mask=n_ok[:, None] & ok_d[None, :])
            tl.debug_barrier()
            if tl.atomic_add(sync_ptr + 7 + P + j, 1, sem="acq_rel") == P + ks - 1:
                tile = offs_m[None, :] * H + offs_n[:, None]                     # [BN_D, M]
                mask = n_ok[:, None] & m_ok[None, :]
                routed = tl.zeros((BN_D, BLOCK_M), dtype=tl.float32)
                for k in range(TOP_K):                                           # in k order
                    routed += tl.load(pr_ptr + (offs_m[None, :] * TOP_K + k) * H + offs_n[:, None],
                                      mask=mask, other=0.0, cache_modifier=".cg")
                shared = tl.zeros((BN_D, BLOCK_M), dtype=tl.float32)
                for s2 in range(ks):                                             # in slice order
                    shared += tl.load(ps_ptr + s2 * T * H + tile, mask=mask, other=0.0,
                                      cache_modifier=".cg")
                y = (routed.to(dt).to(tl.float32) + shared.to(dt).to(tl.float32)).to(dt)
                if RESIDUAL:
                    y = (tl.load(fres_ptr + tile, mask=mask, other=0.0,
                                 cache_modifier=".cg").to(tl.float32) + y.to(tl.float32)).to(dt)
                tl.store(out_ptr + tile, y, mask=mask)
                tl.store(sync_ptr + 7 + P + j, 0)          # no one counts this tile again
        tk = tl.atomic_add(sync_ptr, 1)

    if tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel") == tl.num_programs(0) - 1:
        offs = tl.arange(0, BLOCK_SYNC)   # every other program has left: reset the counters
        tl.store(sync_ptr + offs, tl.zeros([BLOCK_SYNC], tl.int32), mask=offs < c_rg + P * n_g)


# (BLOCK_ER, CH_R, BN_G, BN_D, BLOCK_K, CH_S, num_warps, num_stages, programs per SM[,
# CH_G: gate + up items over slices of H this long, summed by the last; 2048 if left out]).
# Offline SM90 build (triton 3.6, the launch's divisibility by 16 of the pointers and of
# H, E, I, S given): 184-190 registers, no spills, 60 KB of shared memory, the K loops
# pipelined with cp.async; two programs fit an SM.
CONFIG = (16, 512, 32, 64, 128, 2048, 4, 3, 2)
# FP8 weights: 255 registers, no spills at 64-row tiles (32 rows spill 104 bytes)
FP8_CONFIG = (16, 512, 64, 64, 128, 2048, 4, 3, 2, 2048)
# the front's o_proj items: (BN_O rows of H, CH_O of NV); 32 KB items, one wave at
# V2-Lite's 2048 x 2048 (V3's 7168 x 16384 would want larger ones: --sweep tries them)
FRONT_CONFIG = (32, 512)
_SYNC: dict = {}


def persistent_block(x, router_weight, bias, mode, top_k, n_group, topk_group, norm_topk_prob,
                     scale, gate_up, down, sg, su, sd, residual=None, config=CONFIG,
                     programs=None, front=None, front_config=FRONT_CONFIG, scales=None):
    """(out [T, H] in x's dtype, idx [P] int32, wgt [P] fp32, x, h1): the block's output as
    mla_ops/hf/moe.py sums the op's outputs (+ residual, rounded, where given), the
    experts chosen and their weights, the block's input rows and the residual it added.
    front = (a [T, NV], wo [H, NV], res0 [T, H], norm weight [H], eps): x and residual are
    made in the launch instead, h1 = round(res0 + round(a @ wo.T)) and x = RMSNorm(h1),
    and out = h1 + the block of x (a decoder layer after its attention's W_UV; x may be
    None); a sixth entry, o_proj's block scales, makes wo e4m3 (W8A8). scales = (gate_up,
    down, shared gate, up, down scales): the experts' weights are e4m3 with 128 x 128
    block scales (W8A8). Either FP8 form needs BLOCK_K 128. Contiguous tensors; T <= 16."""
    T, H = (front[0].shape[0], front[1].shape[0]) if front is not None else x.shape
    assert T <= 16, "one dot column per row: at most 16 rows"
    E, I, S = router_weight.shape[0], gate_up.shape[1] // 2, sg.shape[0]
    P = T * top_k
    block_er, ch_r, bn_g, bn_d, block_k, ch_s, warps, stages, per_sm, ch_g = (
        tuple(config) + (2048,))[:10]
    bn_o, ch_o = front_config
    ch_r = triton.cdiv(min(ch_r, H), block_k) * block_k
    ch_s = triton.cdiv(min(ch_s, S), block_k) * block_k
    ch_g = triton.cdiv(min(ch_g, H), block_k) * block_k
    ks_g = triton.cdiv(H, ch_g)
    dt, dev = (front[0] if front is not None else x).dtype, gate_up.device
    fp8_o = front is not None and len(front) > 5          # (..., eps, o_proj's scales)
    assert (scales is None and not fp8_o) or block_k == 128, "FP8: BLOCK_K 128"
    gus, dns, sgs, sus, sds = scales if scales is not None else (gate_up,) * 5
    f32 = dict(dtype=torch.float32, device=dev)
    if front is not None:
        a, wo, res0, nw, eps = front[:5]
        wos = front[5] if fp8_o else wo
        NV = a.shape[1]
        ch_o = triton.cdiv(min(ch_o, NV), block_k) * block_k
        x = torch.empty((T, H), dtype=dt, device=dev)                           # [T, H]
        h1 = torch.empty((T, H), dtype=dt, device=dev)                          # [T, H]
        po = torch.empty((triton.cdiv(NV, ch_o), T, H), **f32)                  # [KS_O, T, H]
        residual = res0
        fres = h1
    else:
        a = wo = wos = nw = po = h1 = x
        NV, ch_o, eps = 1, block_k, 0.0
        fres = residual if residual is not None else x
    lp = torch.empty((triton.cdiv(H, ch_r), T, E), **f32)                      # [SPLIT_R, T, E]
    idx = torch.empty(P, dtype=torch.int32, device=dev)
    wgt = torch.empty(P, **f32)
    hs = torch.empty((T, S), dtype=dt, device=dev)
    hr = torch.empty((P, I), dtype=dt, device=dev)
    pr = torch.empty((P, H), **f32)
    ps = torch.empty((triton.cdiv(S, ch_s), T, H), **f32)                      # [KS, T, H]
    out = torch.empty((T, H), dtype=dt, device=dev)
    pgs = torch.empty((ks_g, T, 2 * S) if ks_g > 1 else (1,), **f32)            # [KS_G, T, 2S]
    pgr = torch.empty((ks_g, P, 2 * I) if ks_g > 1 else (1,), **f32)            # [KS_G, P, 2I]
    nsync = (7 + P + triton.cdiv(H, bn_d) + triton.cdiv(S, bn_g)
             + P * triton.cdiv(I, bn_g))
    key = (dev, nsync)
    if key not in _SYNC:                  # zero once; every launch leaves it zero
        _SYNC[key] = torch.zeros(nsync, dtype=torch.int32, device=dev)
    if programs is None:
        programs = (torch.cuda.get_device_properties(dev).multi_processor_count * per_sm
                    if dev.type == "cuda" else 3)
    grouped = mode != 1
    lanes_e = max(16, triton.next_power_of_2(E))
    lanes_g = max(2, triton.next_power_of_2(n_group if grouped else 1))
    on_gpu = dev.type == "cuda"
    moe_block_persistent_kernel[(programs,)](
        x, residual if residual is not None else x, out, a, wo, nw, wos, po, h1, fres,
        router_weight, bias if mode == 0 else router_weight, gate_up, down, sg, su, sd,
        gus, dns, sgs, sus, sds, pgs, pgr, lp, idx, wgt, hs, hr, pr, ps, _SYNC[key],
        T, H, E, I, S, top_k, E // n_group if grouped else E, n_group if grouped else 1,
        topk_group if grouped else 1, float(scale), ch_r, ch_s, NV, ch_o, float(eps), ch_g,
        FRONT=front is not None, BN_O=bn_o, BLOCK_NORM=1024, FP8=scales is not None,
        GROUP_N=128, FP8_O=fp8_o,
        MODE=mode, NORM=bool(norm_topk_prob) and mode == 0, RESIDUAL=residual is not None,
        W_F32=router_weight.dtype == torch.float32, BLOCK_M=16, BLOCK_ER=block_er,
        BN_G=bn_g, BN_D=bn_d, BLOCK_K=block_k, BLOCK_E=lanes_e, BLOCK_G=lanes_g,
        BLOCK_TK=max(2, triton.next_power_of_2(top_k)),
        BLOCK_SYNC=triton.next_power_of_2(nsync), BLOCK_R=max(16, triton.next_power_of_2(P)),
        GROUPS_2D=grouped and E == lanes_e and n_group == lanes_g, LIBDEVICE=on_gpu,
        DOT_F32=not on_gpu, NAP=on_gpu, num_warps=warps, num_stages=stages)
    return out, idx, wgt, x, fres
