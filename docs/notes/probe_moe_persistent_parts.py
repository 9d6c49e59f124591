"""The device functions of probe_moe_persistent_kernel.py (probe, not maintained): the
waits, the weight-streaming dots (16-bit, and W8A8 over e4m3 weights with 128 x 128 block
scales), SiLU * up with HF's roundings, and the front's residual norm."""
import triton
import triton.language as tl

from lowering.gemm.fp8_linear_kernel import quant_act_tile


@triton.jit
def _nap(c):
    """c, after ~128 ns asleep (the GPU's nanosleep): spinning programs leave the L2 slice
    of the counter to the ones that work."""
    return tl.inline_asm_elementwise("nanosleep.u32 128; mov.u32 $0, $1;", "=r,r", [c],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _wait(ptr, target, NAP: tl.constexpr):
    """Spin until the counter at ptr reaches target (acquire), or give up after 2^22 reads
    (seconds): a broken wait then shows as a wrong result, not a hung GPU. NAP: sleep
    between reads (on the GPU; the interpreter has no inline assembly)."""
    c = tl.atomic_add(ptr, 0, sem="acquire")
    n = 0
    while (c < target) & (n < 4194304):
        if NAP:
            c = _nap(c)
        c = tl.atomic_add(ptr, 0, sem="acquire")
        n += 1


@triton.jit
def _expert_run(idx_ptr, s, P, E, BLOCK_R: tl.constexpr):
    """lowering/moe/expert_run.expert_run over the choice written in this launch (.cg
    loads): (pair s's expert, the pairs that chose it where s is the first of them else 0,
    match [BLOCK_R] 1 for those pairs)."""
    offs = tl.arange(0, BLOCK_R)
    ids = tl.load(idx_ptr + offs, mask=offs < P, other=-1, cache_modifier=".cg")
    e = tl.load(idx_ptr + s, cache_modifier=".cg")
    match = ((ids == e) & (offs < P)).to(tl.int32)
    first = tl.min(tl.where(match != 0, offs, BLOCK_R), axis=0)
    run = tl.sum(match, axis=0)
    return e, tl.where((first == s) & (e >= 0) & (e < E), run, 0), match


@triton.jit
def _x_tile(x_cols, kk, k_ok, m_ok, CG: tl.constexpr):
    """X[kk, cols] [BLOCK_K, BLOCK_M] (zeros outside k_ok, m_ok); CG: written in this
    launch, so read from L2 (.cg), past any stale L1 line."""
    mask = m_ok[None, :] & k_ok[:, None]
    if CG:
        x = tl.load(x_cols + kk[:, None], mask=mask, other=0.0, cache_modifier=".cg")
    else:
        x = tl.load(x_cols + kk[:, None], mask=mask, other=0.0)
    return x


@triton.jit
def _dot1(w_rows, n_ok, x_cols, m_ok, K,
          BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
          IEEE: tl.constexpr, CG: tl.constexpr):
    """[BLOCK_N, BLOCK_M] fp32 = W[rows, :K] @ X[:K, cols]: w_rows [BLOCK_N, 1] and x_cols
    [1, BLOCK_M] pointers to K-contiguous rows. IEEE: both widened, an IEEE fp32 dot (an
    fp32 weight; the interpreter, which mis-multiplies 16-bit dots); CG: X written in
    this launch."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < K
        w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = _x_tile(x_cols, kk, k_ok, m_ok, CG)
        if IEEE:
            acc = tl.dot(w.to(tl.float32), x.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, x.to(w.dtype), acc)
    return acc


@triton.jit
def _dot2(g_rows, u_rows, n_ok, x_cols, m_ok, K,
          BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
          IEEE: tl.constexpr, CG: tl.constexpr):
    """_dot1 for two weights over the same X (gate and up), X loaded once a tile."""
    offs_k = tl.arange(0, BLOCK_K)
    acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < K
        wmask = n_ok[:, None] & k_ok[None, :]
        wg = tl.load(g_rows + kk[None, :], mask=wmask, other=0.0)
        wu = tl.load(u_rows + kk[None, :], mask=wmask, other=0.0)
        x = _x_tile(x_cols, kk, k_ok, m_ok, CG)
        if IEEE:
            acc_g = tl.dot(wg.to(tl.float32), x.to(tl.float32), acc_g, input_precision="ieee")
            acc_u = tl.dot(wu.to(tl.float32), x.to(tl.float32), acc_u, input_precision="ieee")
        else:
            acc_g = tl.dot(wg, x, acc_g)
            acc_u = tl.dot(wu, x, acc_u)
    return acc_g, acc_u


@triton.jit
def _dot1q(w_rows, s_rows, n_ok, x_cols, m_ok, K, q_ptr,
           BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
           DOT_F32: tl.constexpr, CG: tl.constexpr):
    """_dot1 over e4m3 weights with 128 x 128 block scales, W8A8 as HF's FP8Linear (and
    lowering/moe/fp8_*_kernel.py): each BLOCK_K (= the scale block) tile of X quantized per
    column in registers (quant_act_tile), an fp8 dot, scaled by the weight's block scale
    (s_rows [BLOCK_N] pointers to each row's scale row, one scale a K tile) and X's."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        kk = kb * BLOCK_K + offs_k
        k_ok = kk < K
        w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = _x_tile(x_cols, kk, k_ok, m_ok, CG)
        xq, xs = quant_act_tile(x.to(tl.float32), q_ptr, not DOT_F32)          # [BK, BM], [BM]
        wsc = tl.load(s_rows + kb, mask=n_ok, other=0.0)                       # [BLOCK_N]
        if DOT_F32:      # the interpreter: fp8 x fp8 products are exact in fp32
            part = tl.dot(w.to(tl.float32), xq.to(tl.float32))
        else:
            part = tl.dot(w, xq)
        acc += part * wsc[:, None] * xs[None, :]
    return acc


@triton.jit
def _dot2q(g_rows, u_rows, gs_rows, us_rows, n_ok, x_cols, m_ok, K, q_ptr,
           BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
           DOT_F32: tl.constexpr, CG: tl.constexpr):
    """_dot1q for gate and up over the same X, X loaded and quantized once a tile."""
    offs_k = tl.arange(0, BLOCK_K)
    acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        kk = kb * BLOCK_K + offs_k
        k_ok = kk < K
        wmask = n_ok[:, None] & k_ok[None, :]
        wg = tl.load(g_rows + kk[None, :], mask=wmask, other=0.0)
        wu = tl.load(u_rows + kk[None, :], mask=wmask, other=0.0)
        x = _x_tile(x_cols, kk, k_ok, m_ok, CG)
        xq, xs = quant_act_tile(x.to(tl.float32), q_ptr, not DOT_F32)
        gsc = tl.load(gs_rows + kb, mask=n_ok, other=0.0)
        usc = tl.load(us_rows + kb, mask=n_ok, other=0.0)
        if DOT_F32:
            pg = tl.dot(wg.to(tl.float32), xq.to(tl.float32))
            pu = tl.dot(wu.to(tl.float32), xq.to(tl.float32))
        else:
            pg = tl.dot(wg, xq)
            pu = tl.dot(wu, xq)
        acc_g += pg * gsc[:, None] * xs[None, :]
        acc_u += pu * usc[:, None] * xs[None, :]
    return acc_g, acc_u


@triton.jit
def _gu_slices(acc_g, acc_u, part_ptr, sl, KS, stride, cols, mask, half, cnt_ptr,
               BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """Gate + up over KS slices of H: store slice sl's fp32 sums (at part_ptr + sl * stride
    + cols, up's `half` columns on), count it at cnt_ptr, and return (done, gate, up):
    done for the slice that completes the tile, with the sums of every slice in order
    (and the counter zeroed for the next launch)."""
    tl.store(part_ptr + sl * stride + cols, acc_g, mask=mask)
    tl.store(part_ptr + sl * stride + cols + half, acc_u, mask=mask)
    tl.debug_barrier()
    done = tl.atomic_add(cnt_ptr, 1, sem="acq_rel") == KS - 1
    if done:
        acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for s in range(KS):                                                   # in slice order
            acc_g += tl.load(part_ptr + s * stride + cols, mask=mask, other=0.0,
                             cache_modifier=".cg")
            acc_u += tl.load(part_ptr + s * stride + cols + half, mask=mask, other=0.0,
                             cache_modifier=".cg")
        tl.store(cnt_ptr, 0)
    return done, acc_g, acc_u


@triton.jit
def _silu_mul(acc_g, acc_u, dt: tl.constexpr):
    """round(round(SiLU(round(g))) * round(u)), HF's modules' roundings."""
    g = acc_g.to(dt).to(tl.float32)
    act = (g * tl.sigmoid(g)).to(dt).to(tl.float32)
    return (act * acc_u.to(dt).to(tl.float32)).to(dt)


@triton.jit
def _residual_norm(po_ptr, res_ptr, nw_ptr, h1_ptr, x_ptr, T, H, KS_O, eps,
                   BLOCK_N: tl.constexpr, dt: tl.constexpr):
    """For each of the T rows: h1 = round(res + round(o)), o the o_proj slices summed in
    order, and x = RMSNorm(h1) with HF's roundings (rms_norm_kernel.normalized_row), in
    chunks of BLOCK_N: one pass writes h1 and sums its squares, a second reads it back."""
    offs = tl.arange(0, BLOCK_N)
    for t in range(T):
        sq = tl.zeros([BLOCK_N], dtype=tl.float32)
        for n0 in range(0, H, BLOCK_N):
            cols = n0 + offs
            ok = cols < H
            o = tl.zeros([BLOCK_N], dtype=tl.float32)
            for s in range(KS_O):                                        # in slice order
                o += tl.load(po_ptr + (s * T + t) * H + cols, mask=ok, other=0.0,
                             cache_modifier=".cg")
            r = tl.load(res_ptr + t * H + cols, mask=ok, other=0.0).to(tl.float32)
            h = (r + o.to(dt).to(tl.float32)).to(dt)
            tl.store(h1_ptr + t * H + cols, h, mask=ok)
            hf = h.to(tl.float32)
            sq += hf * hf
        rstd = tl.math.rsqrt(tl.sum(sq, axis=0) / H + eps)
        tl.debug_barrier()
        for n0 in range(0, H, BLOCK_N):
            cols = n0 + offs
            ok = cols < H
            h = tl.load(h1_ptr + t * H + cols, mask=ok, other=0.0, cache_modifier=".cg")
            w = tl.load(nw_ptr + cols, mask=ok, other=0.0).to(tl.float32)
            y = w * (h.to(tl.float32) * rstd).to(dt).to(tl.float32)
            tl.store(x_ptr + t * H + cols, y.to(dt), mask=ok)
