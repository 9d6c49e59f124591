"""The decode's merge and W_UV in one launch, against the two launches it would replace
(GPU probe, not maintained; not adopted: docs/notes/NOTES-v2lite-one-row.md, "The merge and
W_UV in one launch"). The kernel and its launcher are here, not in lowering/.

The kernel: merge a head's per-split partials by their log-sum-exp and multiply the merged
latent row, rounded to W_UV's dtype as mla_decode_merge_kernel's output is, by the head's
W_UV: for token t = b * S_Q + i and head n,

    y[t, n, :] = round(sum_s exp(lse_s - m) o_s / sum_s exp(lse_s - m)) @ W_UV[n]

Program (n, j, t) owns head n, value columns j * BLOCK_J and tokens t * BLOCK_T; it reads
the tokens' lse for all splits at once, then walks L in BLOCK_K steps (with BLOCK_K = L the
row's loads go out beside the lse's: one round trip); 16 or more tokens through tl.dot,
fewer through per-lane products.

The probe: the Gluon decode (stage 1 with its shipped split count) then the merge then
absorb_output, against stage 1 then the fused kernel, at 16 heads (V2-Lite, the few-rows
kernel) and 128 heads (V3, the pair kernel); µs from the first kernel's start to the last
one's end of one call captured in a CUDA graph (profiler, L2 flushed before each replay),
and the stage-2 part alone; --sweep times the fused kernel's tiles.

    python docs/notes/probe_merge_wuv.py [--shapes 16:1x4096,128:1x4096] [--sweep]
"""
import argparse, sys, torch, triton
import triton.language as tl
sys.path[:0] = ["benchmarks", "docs/notes"]         # run from the repository root
from timing import capture, kernel_time_us
from probe_decode16_rows import inputs
import lowering.decode.gluon_decode as gd
from lowering.gemm.head_gemm import absorb_output

@triton.jit
def mla_decode_merge_wuv_kernel(
    part_out_ptr,   # [B, num_splits, S_Q * H, L] fp32
    part_lse_ptr,   # [B, num_splits, S_Q * H] fp32, natural log
    w_ptr,          # [H, L, V] W_UV (V contiguous), strides stride_wn, stride_wk
    y_ptr,          # [B * S_Q, H, V] (V contiguous), strides stride_yt, stride_yn
    T, num_splits,  # T = B * S_Q tokens
    stride_wn, stride_wk, stride_yt, stride_yn,
    S_Q: tl.constexpr, H: tl.constexpr, L: tl.constexpr,
    SPLIT_BLOCK: tl.constexpr,   # >= num_splits, a power of two: every split in one tile
    BLOCK_T: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT: tl.constexpr,           # tl.dot (BLOCK_T >= 16) or per-lane products
    DOT_F32: tl.constexpr,       # the CPU interpreter: the dot in fp32
):
    ROWS: tl.constexpr = S_Q * H
    ONE_K: tl.constexpr = BLOCK_K == L
    n = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)               # [BLOCK_J]
    toks = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)               # [BLOCK_T]
    offs_s = tl.arange(0, SPLIT_BLOCK)                                       # [SB]
    offs_k = tl.arange(0, BLOCK_K)                                           # [BLOCK_K]
    t_ok = toks < T
    live = t_ok[:, None] & (offs_s < num_splits)[None, :]                    # [BLOCK_T, SB]
    base = (toks // S_Q).to(tl.int64) * num_splits * ROWS + (toks % S_Q) * H + n
    o_ptrs = (part_out_ptr + (base[:, None, None] + offs_s[None, :, None] * ROWS) * L
              + offs_k[None, None, :])                                       # [BLOCK_T, SB, BLOCK_K]
    w_ptrs = (w_ptr + n.to(tl.int64) * stride_wn + offs_k[None, :] * stride_wk
              + cols[:, None])                                               # [BLOCK_J, BLOCK_K]
    lse = tl.load(part_lse_ptr + base[:, None] + offs_s[None, :] * ROWS, mask=live,
                  other=float("-inf"))                                       # [BLOCK_T, SB]
    if ONE_K:    # the whole row in one step: its loads go out beside the lse's
        o_all = tl.load(o_ptrs, mask=live[:, :, None], other=0.0)
        w_all = tl.load(w_ptrs)
    m = tl.max(lse, axis=1)                                                  # [BLOCK_T]
    m_use = tl.where(m == float("-inf"), 0.0, m)
    wgt = tl.exp(lse - m_use[:, None])                                       # 0 where empty
    total = tl.sum(wgt, axis=1)                                              # [BLOCK_T]
    t_safe = tl.where(total > 0.0, total, 1.0)

    acc = tl.zeros((BLOCK_J, BLOCK_T), dtype=tl.float32)
    for k0 in range(0, L, BLOCK_K):
        if ONE_K:
            o_s = o_all
            w = w_all
        else:
            o_s = tl.load(o_ptrs + k0, mask=live[:, :, None], other=0.0)
            w = tl.load(w_ptrs + k0 * stride_wk)                             # [BLOCK_J, BLOCK_K]
        lat = tl.sum(wgt[:, :, None] * o_s, axis=1)                          # [BLOCK_T, BLOCK_K]
        lat = (lat / t_safe[:, None]).to(w_ptr.dtype.element_ty)             # the merge's output
        if DOT:
            if DOT_F32:  # the CPU interpreter mis-multiplies 16-bit dots
                acc = tl.dot(w.to(tl.float32), tl.trans(lat).to(tl.float32), acc)
            else:
                acc = tl.dot(w, tl.trans(lat), acc)                          # [BLOCK_J, BLOCK_T]
        else:
            acc += tl.sum(w.to(tl.float32)[:, :, None]
                          * tl.trans(lat).to(tl.float32)[None, :, :], axis=1)
    y_row = y_ptr + toks.to(tl.int64) * stride_yt + n * stride_yn           # [BLOCK_T]
    tl.store(y_row[None, :] + cols[:, None], acc.to(y_ptr.dtype.element_ty),
             mask=t_ok[None, :])


MAX_TOKENS = 64          # a decode step's few rows (head_gemm.py's MAX_ROWS)
MAX_SPLITS = 64          # the kernel holds a token's splits in one tile (triton_decode's cap)
FMA_TOKENS = 4           # up to this many tokens the kernel multiplies per lane, no dot

# few tokens (per-lane products) / more (tl.dot): (BLOCK_J, BLOCK_K, num_warps, num_stages)
CONFIGS = {
    True: (16, 512, 4, 1),
    False: (32, 32, 4, 2),
}


def merge_wuv(o1: torch.Tensor, l1: torch.Tensor, splits: int, W_UV: torch.Tensor,
              dst: torch.Tensor, s_q: int = 1,
              config: tuple | None = None) -> None:
    """dst [B * s_q, H * V] = the merged latent rows of o1 / l1 (see the module) @ W_UV;
    at most MAX_SPLITS splits and MAX_TOKENS tokens, V and L powers of two >= 16."""
    B, _, rows, L = o1.shape
    H, _, V = W_UV.shape
    T = B * s_q
    fma = T <= FMA_TOKENS
    block_j, block_k, warps, stages = config or CONFIGS[fma]
    block_j = min(block_j, V)
    block_t = triton.next_power_of_2(T) if fma else max(16, triton.next_power_of_2(T))
    y = dst.view(T, H, V)                                                    # [T, H, V]
    kernel = torch.library.wrap_triton(mla_decode_merge_wuv_kernel)
    kernel[(H, V // block_j, triton.cdiv(T, block_t))](
        o1, l1, W_UV, y, T, splits, W_UV.stride(0), W_UV.stride(1), y.stride(0), y.stride(1),
        S_Q=s_q, H=H, L=L, SPLIT_BLOCK=triton.next_power_of_2(splits), BLOCK_T=block_t,
        BLOCK_J=block_j, BLOCK_K=min(block_k, L), DOT=not fma, DOT_F32=not o1.is_cuda,
        num_warps=warps, num_stages=stages)


L, V = 512, 128
SHAPES = "16:1x4096,16:2x4096,16:4x4096,16:8x4096,16:32x1024,128:1x4096,128:2x4096,128:4x4096,128:8x4096"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    scale = 192 ** -0.5
    orig_merge = gd._merge
    for shape in args.shapes.split(","):
        H, bs = shape.split(":")
        H = int(H)
        B, S = (int(v) for v in bs.split("x"))
        q, kv, bt, lens = inputs(B, H, S)
        g = torch.Generator(device="cuda").manual_seed(1)
        W = (torch.randn(H, L, V, device="cuda", generator=g) / L ** 0.5).bfloat16()
        y_two = torch.empty(B, H * V, device="cuda", dtype=torch.bfloat16)
        y_one = torch.empty_like(y_two)
        seen = {}

        def two():
            out, _ = gd.gluon_decode(q, kv, bt, lens, scale, True)
            absorb_output(out[:, 0], W, y_two)

        def fused_merge(o1, l1, out, lse, splits, cfg=None):
            seen["splits"] = splits
            seen["parts"] = (o1, l1)
            merge_wuv(o1, l1, splits, W, y_one, config=cfg)

        def one(cfg=None):
            gd._merge = lambda *a: fused_merge(*a, cfg=cfg)
            try:
                gd.gluon_decode(q, kv, bt, lens, scale, True)
            finally:
                gd._merge = orig_merge

        two(); one(); torch.cuda.synchronize()
        splits = seen.get("splits", 1)
        if splits < 2:
            print(f"H={H} {B}x{S}: one split, nothing to merge"); continue
        diff = ((y_one.float() - y_two.float()).abs().max() / y_two.float().abs().max()).item()
        o1, l1 = seen["parts"]
        out = torch.empty(B, 1, H, L, device="cuda", dtype=torch.bfloat16)
        lse = torch.empty(B, H, 1, device="cuda")

        def stage2_two():
            orig_merge(o1, l1, out, lse, splits)
            absorb_output(out[:, 0], W, y_two)

        def timed(fn):
            return kernel_time_us(capture(fn).replay)
        t_two, t_one = timed(two), timed(one)
        s_two, s_one = timed(stage2_two), timed(lambda: merge_wuv(o1, l1, splits, W, y_one))
        print(f"H={H} {B}x{S} splits {splits}: decode+merge+W_UV {t_two:.1f} µs, "
              f"decode+merge_wuv {t_one:.1f} ({t_two / t_one:.3f}x); stage 2 alone "
              f"{s_two:.1f} vs {s_one:.1f} ({s_two / s_one:.2f}x); rel diff {diff:.1e}",
              flush=True)
        if args.sweep:
            res = []
            for bj in (8, 16, 32, 64):
                for bk in (128, 512):
                    for w in (4, 8):
                        for st in (1, 2):
                            cfg = (bj, bk, w, st)
                            try:
                                merge_wuv(o1, l1, splits, W, y_one, config=cfg)
                                torch.cuda.synchronize()
                            except Exception as e:
                                continue
                            d = ((y_one.float() - y_two.float()).abs().max()
                                 / y_two.float().abs().max()).item()
                            if not d < 1e-2:
                                print(f"    {cfg}: differs {d:.1e}"); continue
                            res.append((kernel_time_us(capture(
                                lambda cfg=cfg: merge_wuv(o1, l1, splits, W, y_one,
                                                             config=cfg)).replay, reps=15), cfg))
            res.sort()
            print("    best: " + "; ".join(f"{c} {t:.1f}" for t, c in res[:6]), flush=True)


if __name__ == "__main__":
    main()
