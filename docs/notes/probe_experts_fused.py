"""The routed experts' gate + up and down in one launch at a decode step's few rows, against
the shipped two kernels (probe, not maintained; the kernel lives here, not in lowering/).

Today (lowering/moe/experts.py) gate_up_kernel.py writes h [P, I] and down_kernel.py reads
it back: two launches, each with its own ramp and tail (V2-Lite at one row on an H100:
29.3 + 14.0 µs for 69 + 35 MB, a 0.3 µs gap). Here program (s, j) of the run of pair s's
expert (expert_run.py) owns h's columns j * BLOCK_I of that expert for the run's tokens:

    h_j      = round(SiLU(round(x @ W_gate[e, j].T)) * round(x @ W_up[e, j].T))  [BLOCK_I, M]
    part[j]  = W_down[e][:, j] @ h_j                                                [H, M] fp32

so a program streams its gate and up rows, then the matching columns of down, and h never
goes to memory. The down product is split over I: part [I / BLOCK_I, P, H] fp32, which
the caller sums over the slices, rounds to x's dtype (HF's linear output, as
down_kernel.py rounds its full product) and weights by the routing weight, then sums over
k: one pointwise-and-reduce pass that, in the MoE block, would be the block's own final
sum (Inductor fuses it there). A pair whose expert is outside [0, E) gets zero slices, as
down_kernel.py writes its zero row. Same roundings as the two kernels except the fp32
order of the down sum (slices, then within them).

    python docs/notes/probe_experts_fused.py --check          # CPU: TRITON_INTERPRET=1
    python docs/notes/probe_experts_fused.py [--shapes v2-lite:1,v2-lite:2,v3:1] [--sweep]

--check runs the kernel under the interpreter on small shapes (ragged I, H; repeated and
out-of-range experts; 1 and 5 tokens) against float64 and against the shipped kernels. On
a GPU: µs of the two shipped kernels (alone, and with their sum) against the fused kernel
(alone and with its sum), each captured in a CUDA graph, profiler span, L2 flushed.
Measured on an H100 (BENCHMARKS.md, "16-head decode: the few-rows kernel's stores ..."):
~2 µs under the two kernels at one V2-Lite row before its slices' sum; not adopted.
"""
import argparse, os, sys

if "--check" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"
import torch
import triton
import triton.language as tl

sys.path[:0] = ["benchmarks", "docs/notes"]         # run from the repository root
from lowering.moe import experts as ex
from lowering.moe.expert_run import expert_run, run_rows


@triton.jit
def moe_gate_up_down_kernel(
    x_ptr, gu_ptr, d_ptr, part_ptr,          # x [T, H], gate_up [E, 2I, H], down [E, H, I],
    topk_idx_ptr,                            # part [I / BLOCK_I, P, H] fp32; [P] experts
    P, E, I, H, TOP_K,
    stride_xt, stride_gue, stride_gun, stride_de, stride_dn, stride_ps, stride_pp,
    BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr,
):
    s = tl.program_id(0)
    j = tl.program_id(1)
    e, run, match = expert_run(topk_idx_ptr, s, P, E, BLOCK_R)
    offs_i = j * BLOCK_I + tl.arange(0, BLOCK_I)                               # [BLOCK_I]
    offs_k = tl.arange(0, BLOCK_K)                                             # [BLOCK_K]
    offs_nn = tl.arange(0, BLOCK_N)                                            # [BLOCK_N]
    i_ok = offs_i < I
    g_rows = gu_ptr + e.to(tl.int64) * stride_gue + offs_i.to(tl.int64)[:, None] * stride_gun
    u_rows = g_rows + I * stride_gun                                           # the up half
    d_cols = d_ptr + e.to(tl.int64) * stride_de + offs_i[None, :]             # [1, BLOCK_I]
    dt = x_ptr.dtype.element_ty
    part_j = part_ptr + j.to(tl.int64) * stride_ps
    for m0 in range(0, run, BLOCK_M):
        pair, token, m_ok = run_rows(match, m0, run, P, TOP_K, BLOCK_M)
        x_rows = x_ptr + token.to(tl.int64)[None, :] * stride_xt               # [1, BLOCK_M]
        acc_g = tl.zeros((BLOCK_I, BLOCK_M), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_I, BLOCK_M), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            kk = k0 + offs_k
            k_ok = kk < H
            wg = tl.load(g_rows + kk[None, :], mask=i_ok[:, None] & k_ok[None, :], other=0.0)
            wu = tl.load(u_rows + kk[None, :], mask=i_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_rows + kk[:, None], mask=m_ok[None, :] & k_ok[:, None], other=0.0)
            if DOT_F32:      # the CPU interpreter mis-multiplies 16-bit dots
                acc_g = tl.dot(wg.to(tl.float32), x.to(tl.float32), acc_g)
                acc_u = tl.dot(wu.to(tl.float32), x.to(tl.float32), acc_u)
            else:
                acc_g = tl.dot(wg, x, acc_g)                                   # [BLOCK_I, BLOCK_M]
                acc_u = tl.dot(wu, x, acc_u)
        g = acc_g.to(dt).to(tl.float32)
        act = (g * tl.sigmoid(g)).to(dt).to(tl.float32)                        # SiLU(gate)
        h = (act * acc_u.to(dt).to(tl.float32)).to(dt)                         # [BLOCK_I, BLOCK_M]
        p_rows = part_j + pair.to(tl.int64)[None, :] * stride_pp              # [1, BLOCK_M]
        for n0 in range(0, H, BLOCK_N):
            offs_n = n0 + offs_nn
            n_ok = offs_n < H
            wd = tl.load(d_cols + offs_n.to(tl.int64)[:, None] * stride_dn,
                         mask=n_ok[:, None] & i_ok[None, :], other=0.0)       # [BLOCK_N, BLOCK_I]
            if DOT_F32:
                y = tl.dot(wd.to(tl.float32), h.to(tl.float32))
            else:
                y = tl.dot(wd, h)                                              # [BLOCK_N, BLOCK_M]
            tl.store(p_rows + offs_n[:, None], y, mask=m_ok[None, :] & n_ok[:, None])
    if (e < 0) | (e >= E):          # no program serves this pair: its slices add zero
        for n0 in range(0, H, BLOCK_N):
            offs_n = n0 + offs_nn
            tl.store(part_j + s.to(tl.int64) * stride_pp + offs_n,
                     tl.zeros([BLOCK_N], dtype=tl.float32), mask=offs_n < H)


# (BLOCK_I, BLOCK_K, BLOCK_N, num_warps, num_stages)
CONFIG = (32, 128, 128, 4, 3)


def fused_parts(x, topk_idx, gate_up, down, config=CONFIG):
    """part [cdiv(I, BLOCK_I), P, H] fp32: the down product's slices (see the module)."""
    T, H = x.shape
    K = topk_idx.shape[1]
    E, I = gate_up.shape[0], gate_up.shape[1] // 2
    block_i, block_k, block_n, warps, stages = config
    pairs = ex.flat_pairs(topk_idx)                                          # [P]
    P = pairs.numel()
    part = torch.empty((triton.cdiv(I, block_i), P, H), dtype=torch.float32, device=x.device)
    moe_gate_up_down_kernel[(P, part.shape[0])](
        x, gate_up, down, part, pairs, P, E, I, H, K,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), down.stride(0), down.stride(1),
        part.stride(0), part.stride(1),
        BLOCK_R=max(16, triton.next_power_of_2(P)), BLOCK_M=ex.BLOCK_M, BLOCK_I=block_i,
        BLOCK_K=block_k, BLOCK_N=block_n, DOT_F32=not x.is_cuda,
        num_warps=warps, num_stages=stages)
    return part


def finish(part, topk_weight, dtype):
    """[T, H]: the slices summed and rounded per pair, weighted, summed over k."""
    T, K = topk_weight.shape
    y = part.sum(0).to(dtype).float() * topk_weight.reshape(-1, 1).float()   # [P, H]
    return y.view(T, K, -1).sum(1).to(dtype)


def fused(x, topk_idx, topk_weight, gate_up, down, config=CONFIG):
    return finish(fused_parts(x, topk_idx, gate_up, down, config), topk_weight, x.dtype)


def reference64(x, topk_idx, topk_weight, gate_up, down):
    """float64, with the kernels' roundings of gate, up, SiLU, h and each pair's product."""
    T, H = x.shape
    K = topk_idx.shape[1]
    E, I = gate_up.shape[0], gate_up.shape[1] // 2
    dt = x.dtype
    out = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for k in range(K):
            e = int(topk_idx[t, k])
            if not 0 <= e < E:
                continue
            gu = gate_up[e].double() @ x[t].double()                          # [2I]
            g, u = gu[:I].to(dt).double(), gu[I:].to(dt).double()
            h = ((g * torch.sigmoid(g)).to(dt).double() * u).to(dt).double()
            y = (down[e].double() @ h).to(dt).double()
            out[t] += y * float(topk_weight[t, k])
    return out


def check():
    torch.manual_seed(0)
    for T, K, E, H, I, cfg, dt in [(1, 6, 8, 96, 80, (32, 32, 32, 4, 1), torch.float32),
                                   (5, 3, 4, 64, 48, (16, 32, 64, 4, 1), torch.float32),
                                   (2, 4, 6, 130, 40, (32, 64, 32, 4, 1), torch.float32),
                                   (3, 6, 8, 96, 80, (32, 32, 32, 4, 1), torch.bfloat16)]:
        x = torch.randn(T, H).to(dt)
        gate_up = (torch.randn(E, 2 * I, H) / H ** 0.5).to(dt)
        down = (torch.randn(E, H, I) / I ** 0.5).to(dt)
        idx = torch.randint(0, E, (T, K))
        idx[0, -1] = E + 3                     # out of range: adds zero
        if T > 1:
            idx[1, 0] = idx[0, 0]              # an expert shared by two tokens
        w = torch.rand(T, K)
        got = fused(x, idx, w, gate_up, down, cfg)
        ref = reference64(x, idx, w, gate_up, down)
        err = ((got.double() - ref).abs().max() / ref.abs().max()).item()
        shipped = ex.run_kernels(x, idx, w, gate_up, down)
        d = ((got - shipped).abs().max() / shipped.abs().max()).item()
        print(f"{dt} T={T} K={K} E={E} H={H} I={I}: vs float64 {err:.1e}, vs the shipped "
              f"kernels {d:.1e}", flush=True)
        tol = 1e-5 if dt == torch.float32 else 2e-2      # bf16: an ulp where the sums' order flips
        assert err < tol and d < tol


SHAPES = {"v2-lite": (64, 6, 2048, 1408), "v3": (256, 8, 7168, 2048)}


def time_gpu(spec, sweep):
    from timing import capture, kernel_time_us
    for item in spec.split(","):
        name, T = item.split(":")
        E, K, H, I = SHAPES[name]
        T = int(T)
        g = torch.Generator(device="cuda").manual_seed(0)
        dt = torch.bfloat16
        x = torch.randn(T, H, device="cuda", generator=g).to(dt)
        gate_up = (torch.randn(E, 2 * I, H, device="cuda", generator=g) / H ** 0.5).to(dt)
        down = (torch.randn(E, H, I, device="cuda", generator=g) / I ** 0.5).to(dt)
        idx = torch.stack([torch.randperm(E, device="cuda", generator=g)[:K] for _ in range(T)])
        w = torch.rand(T, K, device="cuda", generator=g)
        ref = ex.run_kernels(x, idx, w, gate_up, down)

        def rel(a):
            return ((a.float() - ref.float()).abs().max() / ref.float().abs().max()).item()

        def timed(fn):
            return kernel_time_us(capture(fn).replay)
        cfgs = [CONFIG]
        if sweep:
            cfgs += [(bi, bk, bn, wp, st) for bi in (16, 32, 64) for bk in (64, 128)
                     for bn in (64, 128) for wp in (4, 8) for st in (2, 3)
                     if (bi, bk, bn, wp, st) != CONFIG]
        two = timed(lambda: ex.run_kernels(x, idx, w, gate_up, down))
        pairs = ex.flat_pairs(idx)
        h = torch.empty((T * K, I), dtype=dt, device="cuda")
        o = torch.empty((T * K, H), dtype=torch.float32, device="cuda")
        wf = w.reshape(-1).float()

        def kernels_only():
            ex.launch_gate_up(x, gate_up, pairs, K, h, ex.pick_config("gate_up", I, H, T))
            ex.launch_down(h, down, wf, pairs, K, o, ex.pick_config("down", H, I, T))
        print(f"{name} T={T}: the shipped two kernels alone {timed(kernels_only):.1f} µs",
              flush=True)
        res = []
        for cfg in cfgs:
            try:
                d = rel(fused(x, idx, w, gate_up, down, cfg))
            except Exception as e:  # noqa: BLE001  (a config that does not launch)
                print(f"    {cfg}: {type(e).__name__}")
                continue
            if not d < 1e-2:
                print(f"    {cfg}: differs {d:.1e}")
                continue
            res.append((timed(lambda cfg=cfg: fused_parts(x, idx, gate_up, down, cfg)),
                        timed(lambda cfg=cfg: fused(x, idx, w, gate_up, down, cfg)), cfg, d))
        res.sort()
        nbytes = len(set(idx.flatten().tolist())) * 3 * H * I * 2   # the chosen experts'
        for alone, total, cfg, d in res[:4]:
            print(f"{name} T={T}: shipped two kernels + sum {two:.1f} µs; fused {alone:.1f} "
                  f"alone, {total:.1f} with its sum ({two / total:.3f}x), {cfg}, rel diff "
                  f"{d:.1e}; {nbytes / alone / 1e3:.0f} GB/s alone", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--shapes", default="v2-lite:1,v2-lite:2,v2-lite:4,v3:1")
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    if args.check:
        check()
        return
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    time_gpu(args.shapes, args.sweep)


if __name__ == "__main__":
    main()
