"""Probes of a decode step's kernel chain on an H200 (DeepSeek-V3 shapes, bf16).

    --part pdl      the layer's weight GEMMs at 32 rows (q_a + kv_a split-K, q_b, o_proj,
                    gate + up, down) with small row kernels between them, two layers in
                    one CUDA graph: plain launches, against programmatic dependent launch
                    (each kernel waits on its predecessor with gdc_wait and lets the next
                    one launch), with and without an L2 bulk prefetch of each program's
                    first weight bytes before the wait. Step time per layer, 8 alternating
                    rounds, then one replay's kernel timeline per variant.
    --part attention  the same chain (plain launches) with three attention stand-ins
                    between q_b and o_proj: a row kernel, FlashMLA at (32, 4096, 128 heads)
                    and a compute-bound bf16 GEMM of about FlashMLA's time; each GEMM's
                    time per stand-in (do GEMMs after a compute-heavy kernel run slower?).
    --part prefetch   FlashMLA then a W_UV-sized GEMM before o_proj; variants ask the L2
                    for the first 1 / 2 / 4 KB of every o_proj row on a side stream beside
                    that GEMM (DRAM has room there): o_proj's and the step's times.
    --part flash-l2   the prefetch moved before FlashMLA (compute-bound, DRAM half idle):
                    the first 2 / 4 KB of every o_proj row asked of the L2 on a side stream
                    as the attention starts, with the default eviction priority or
                    evict_last (so the 151 MB of KV streaming through may not push the rows
                    out before o_proj reads them), or on the main stream just before it;
                    o_proj's, FlashMLA's and the step's times.
    --part k-order  o_proj, down_proj and gate + up alone (kernel timer, L2 flushed) with
                    program p starting its K loop at tile (p * ROT) % k_tiles, so that
                    programs do not read the same columns (rows 32 KB apart) at once.
    --part norm     lowering/fused/rms_norm_kernel.py alone at 32 / 1 rows by num_warps.

    python docs/notes/probe_kernel_chain.py [--part pdl,attention,prefetch,flash-l2,k-order,norm]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# A probe kept as it ran: the shared timing helpers are in benchmarks/ (lowering is the
# installed package).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "benchmarks"))
from timing import capture, kernel_time_us  # noqa: E402
from lowering.gemm import linear  # noqa: E402
from lowering.gemm.linear_kernel import decode_linear_kernel  # noqa: E402
from lowering.fused.rms_norm_kernel import rms_norm_kernel  # noqa: E402



@triton.jit
def _prefetch_rows(w_ptr, n0, N, stride_wn, k0, BLOCK_N: tl.constexpr, PF: tl.constexpr):
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_n = tl.minimum(offs_n, N - 1)
    p = w_ptr + offs_n.to(tl.int64) * stride_wn + k0
    tl.inline_asm_elementwise(
        f"cp.async.bulk.prefetch.L2.global [$1], {PF};\n mov.u32 $0, 0;",
        "=r,l", [p], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def pdl_linear_kernel(x_ptr, w1_ptr, w2_ptr, y1_ptr, y2_ptr, M, N1, N2, K,
                      stride_xm, stride_w1, stride_w2, stride_y1, stride_y2, stride_ys, N1_BLOCKS,
                      MODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, DOT_F32: tl.constexpr,
                      SPLIT_K: tl.constexpr, Y2_COL0: tl.constexpr,
                      PDL: tl.constexpr, PF: tl.constexpr):
    if PF > 0:
        pid = tl.program_id(0)
        k0 = tl.program_id(1) * tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
        if MODE == 1:
            if pid < N1_BLOCKS:
                _prefetch_rows(w1_ptr, pid * BLOCK_N, N1, stride_w1, k0, BLOCK_N, PF)
            else:
                _prefetch_rows(w2_ptr, (pid - N1_BLOCKS) * BLOCK_N, N2, stride_w2, k0, BLOCK_N, PF)
        else:
            _prefetch_rows(w1_ptr, pid * BLOCK_N, N1, stride_w1, k0, BLOCK_N, PF)
            if MODE == 2:
                _prefetch_rows(w2_ptr, pid * BLOCK_N, N1, stride_w2, k0, BLOCK_N, PF)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    decode_linear_kernel(x_ptr, w1_ptr, w2_ptr, y1_ptr, y2_ptr, M, N1, N2, K,
                         stride_xm, stride_w1, stride_w2, stride_y1, stride_y2, stride_ys,
                         N1_BLOCKS, x_ptr, 0, MODE, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K,
                         DOT_F32, SPLIT_K, Y2_COL0, False)


@triton.jit
def row_norm_kernel(x_ptr, y_ptr, N, XS, YS, NPART: tl.constexpr, BLOCK: tl.constexpr,
                    PDL: tl.constexpr):
    """y[t, :N] = rms_norm(sum over NPART partials of x[p, t, :N]) (a norm / prologue stand-in)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    t = tl.program_id(0)
    o = tl.arange(0, BLOCK)
    m = o < N
    acc = tl.zeros([BLOCK], tl.float32)
    for p in tl.static_range(NPART):
        acc += tl.load(x_ptr + p * XS + t * N + o, mask=m, other=0.0).to(tl.float32)
    var = tl.sum(acc * acc, 0) / N
    tl.store(y_ptr + t * YS + o, (acc * tl.math.rsqrt(var + 1e-6)).to(y_ptr.dtype.element_ty), mask=m)


def lin(x, w1, w2, mode, y1, y2, cfg, pdl, pf):
    M, K = x.shape
    bn, bk, warps, stages = cfg[:4]
    sk = cfg[4] if len(cfg) > 4 else 1
    N1 = w1.shape[0]
    N2 = w2.shape[0] if w2 is not None else 0
    nb = triton.cdiv(N1, bn)
    grid = (nb + (triton.cdiv(N2, bn) if mode == 1 else 0), sk)
    w2_ = w2 if w2 is not None else w1
    y2_ = y2 if y2 is not None else x
    col0 = N1 if (mode == 1 and y2 is None) else 0
    kw = dict(launch_pdl=True) if pdl else {}
    pdl_linear_kernel[grid](x, w1, w2_, y1, y2_, M, N1, N2, K, x.stride(0), w1.stride(0),
                            w2_.stride(0), y1.stride(-2), y2_.stride(-2),
                            y1.stride(0) if sk > 1 else 0, nb, MODE=mode, BLOCK_M=32,
                            BLOCK_N=bn, BLOCK_K=bk, EVEN_K=K % (bk * sk) == 0, DOT_F32=False,
                            SPLIT_K=sk, Y2_COL0=col0, PDL=pdl, PF=pf, num_warps=warps,
                            num_stages=stages, **kw)


def norm(x, y, N, npart, pdl):
    kw = dict(launch_pdl=True) if pdl else {}
    T = y.shape[0]
    row_norm_kernel[(T,)](x, y, N, x.stride(0) if npart > 1 else 0, y.stride(0), NPART=npart,
                          BLOCK=triton.next_power_of_2(N), PDL=pdl, num_warps=8, **kw)


def _chain():
    """Two DeepSeek-V3 decode layers' weight GEMMs at 32 rows, with row kernels between
    them: (weights, step(pdl, pf, attention), output buffer)."""
    torch.manual_seed(0)
    dev, dt, M = "cuda", torch.bfloat16, 32
    Hd, QL, KV, I = 7168, 1536, 576, 18432

    def W(n, k):
        return torch.randn(n, k, device=dev, dtype=dt) * 0.02

    layers = []
    for _ in range(2):
        layers.append(dict(qa=W(QL, Hd), kva=W(KV, Hd), qb=W(24576, QL), o=W(Hd, 16384),
                           g=W(I, Hd), u=W(I, Hd), d=W(Hd, I)))
    x0 = torch.randn(M, Hd, device=dev, dtype=dt)
    h = torch.empty(M, Hd, device=dev, dtype=dt)
    parts = torch.empty(4, M, QL + KV, device=dev, dtype=torch.float32)
    qa = torch.empty(M, QL, device=dev, dtype=dt)
    qb = torch.empty(M, 24576, device=dev, dtype=dt)
    att = torch.randn(M, 16384, device=dev, dtype=dt)
    ob = torch.empty(M, Hd, device=dev, dtype=dt)
    act = torch.empty(M, I, device=dev, dtype=dt)
    db = torch.empty(M, Hd, device=dev, dtype=dt)
    C = {"pair": (64, 128, 4, 4, 4), "qb": (64, 128, 4, 5), "o": (64, 128, 4, 6),
         "gu": (64, 64, 8, 3), "d": (64, 128, 4, 6)}

    def small_attention(L):                         # a row kernel, no PDL (as FlashMLA)
        norm(qb, att, 16384, 1, False)

    def step(pdl, pf, attention=small_attention):
        src = x0
        for L in layers:
            norm(src, h, Hd, 1, pdl)
            lin(h, L["qa"], L["kva"], 1, parts, None, C["pair"], pdl, pf)
            norm(parts, qa, QL, 4, pdl)
            lin(qa, L["qb"], None, 0, qb, None, C["qb"], pdl, pf)
            attention(L)
            lin(att, L["o"], None, 0, ob, None, C["o"], pdl, pf)
            norm(ob, h, Hd, 1, pdl)
            lin(h, L["g"], L["u"], 2, act, None, C["gu"], pdl, pf)
            lin(act, L["d"], None, 0, db, None, C["d"], pdl, pf)
            src = db

    return step, db, att


def _capture(fn):
    fn()
    torch.cuda.synchronize()
    g = capture(fn)
    g.replay()
    torch.cuda.synchronize()
    return g


def _alternate(graphs, rounds=8, reps=20):
    """Median µs per layer of each graph's replays, timed in alternating rounds."""
    times = {n: [] for n in graphs}
    for _ in range(rounds):
        for name, g in graphs.items():
            for _ in range(3):
                g.replay()
            e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
            e0.record()
            for _ in range(reps):
                g.replay()
            e1.record()
            torch.cuda.synchronize()
            times[name].append(e0.elapsed_time(e1) / reps * 1000 / 2)
    return times


def _kernels(g):
    """(name, µs) of one replay's GPU kernels in start order."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        g.replay()
        torch.cuda.synchronize()
    evs = sorted((e for e in prof.events() if e.device_type.name == "CUDA"),
                 key=lambda e: e.time_range.start)
    return [(e.name, e.time_range.elapsed_us()) for e in evs]


def _flashmla_standin():
    """FlashMLA's decode at (32, 4096, 128 heads), bf16, page 64, as a chain's attention;
    None (and why) where flash_mla is not importable."""
    dev, dt = "cuda", torch.bfloat16
    try:
        import lowering
        B, S, H = 32, 4096, 128
        kv = torch.randn(B * S // 64, 64, 576, device=dev, dtype=dt)
        table = torch.randperm(B * S // 64, device=dev, dtype=torch.int32).view(B, S // 64)
        lens = torch.full((B,), S, device=dev, dtype=torch.int32)
        q = torch.randn(B, 1, H, 576, device=dev, dtype=dt)
        sched = lowering.decode_schedule(kv, table, lens, num_heads=H)

        def flashmla(L):
            lowering.mla_decode(q, kv, table, lens, 192 ** -0.5, backend="flashmla",
                                schedule=sched)
        flashmla(None)
        return flashmla
    except Exception as exc:
        print(f"FlashMLA not run: {exc}")
        return None


@triton.jit
def l2_prefetch_kernel(w_ptr, N, stride_w, PF: tl.constexpr, BLOCK: tl.constexpr,
                       EVICT_LAST: tl.constexpr = False):
    """Ask the L2 for the first PF bytes of BLOCK rows of w, one thread per row (with
    EVICT_LAST, tagged to be evicted after other lines)."""
    rows = tl.minimum(tl.program_id(0) * BLOCK + tl.arange(0, BLOCK), N - 1)
    p = w_ptr + rows.to(tl.int64) * stride_w
    if EVICT_LAST:
        tl.inline_asm_elementwise(
            "{ .reg .b64 pol; createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
            f"cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], {PF}, pol; mov.u32 $0, 0; }}",
            "=r,l", [p], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise(
            f"cp.async.bulk.prefetch.L2.global [$1], {PF};\n mov.u32 $0, 0;",
            "=r,l", [p], dtype=tl.int32, is_pure=False, pack=1)


def _wuv_chain():
    """The chain with FlashMLA as its attention stand-in and a W_UV-sized GEMM's inputs
    ([32, 512] @ [512, 16384]: 16.8 MB) and a side stream; None where flash_mla is not
    importable. Returns (flash, step, att, lat, w_uv, side)."""
    flash = _flashmla_standin()
    if flash is None:
        return None
    step, _, att = _chain()
    dev, dt = "cuda", torch.bfloat16
    lat = torch.randn(32, 512, device=dev, dtype=dt)
    w_uv = torch.randn(16384, 512, device=dev, dtype=dt) * 0.05
    return flash, step, att, lat, w_uv, torch.cuda.Stream()


def attention_prefetch():
    """FlashMLA, then a W_UV-sized GEMM ([32, 512] @ [512, 16384]: 16.8 MB) before o_proj,
    which uses ~half the DRAM rate. Variants prefetch the first PF bytes of every o_proj
    row into L2 on a side stream beside that GEMM: does o_proj gain more than the GEMM
    loses?"""
    parts = _wuv_chain()
    if parts is None:
        return
    flash, step, att, lat, w_uv, side = parts

    def attention(pf):
        def run(L):
            flash(L)
            main = torch.cuda.current_stream()
            if pf:
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    w = L["o"]
                    l2_prefetch_kernel[(triton.cdiv(w.shape[0], 128),)](
                        w, w.shape[0], w.stride(0), PF=pf, BLOCK=128, num_warps=4)
            lin(lat, w_uv, None, 0, att, None, linear.DEFAULT_CONFIG, False, 0)
            if pf:
                main.wait_stream(side)
        return run

    graphs = {pf: _capture(lambda f=attention(pf): step(False, 0, f))
              for pf in (0, 1024, 2048, 4096)}
    times = _alternate(graphs)
    base = statistics.median(times[0])
    for pf, g in graphs.items():
        gemms = [us for k, us in _kernels(g) if "pdl_linear_kernel" in k]
        per = [round(statistics.mean(gemms[i::6]), 1) for i in range(6)]
        m = statistics.median(times[pf])
        print(f"prefetch {pf:4d} B/row ({pf * 7168 / 1e6:4.1f} MB): step {m:7.1f} µs/layer "
              f"({m / base:.3f}x); GEMMs (q_a+kv_a, q_b, W_UV, o_proj, gate+up, down) {per}")


def flash_l2():
    """o_proj rows asked of the L2 as FlashMLA starts (side stream), then W_UV, o_proj."""
    parts = _wuv_chain()
    if parts is None:
        return
    flash, step, att, lat, w_uv, side = parts

    def attention(pf, last, same_stream=False):
        def run(L):
            main = torch.cuda.current_stream()
            fork = pf and not same_stream
            if pf and same_stream:                  # a kernel of its own before FlashMLA
                w = L["o"]
                l2_prefetch_kernel[(triton.cdiv(w.shape[0], 128),)](
                    w, w.shape[0], w.stride(0), PF=pf, BLOCK=128, EVICT_LAST=last, num_warps=4)
            if fork:
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    w = L["o"]
                    l2_prefetch_kernel[(triton.cdiv(w.shape[0], 128),)](
                        w, w.shape[0], w.stride(0), PF=pf, BLOCK=128, EVICT_LAST=last,
                        num_warps=4)
            flash(L)
            lin(lat, w_uv, None, 0, att, None, linear.DEFAULT_CONFIG, False, 0)
            if fork:
                main.wait_stream(side)
        return run

    variants = {"none": (0, False), "2 KB": (2048, False), "4 KB": (4096, False),
                "2 KB evict_last": (2048, True), "4 KB evict_last": (4096, True),
                "2 KB e_l, 1 stream": (2048, True, True), "4 KB e_l, 1 stream": (4096, True, True)}
    graphs = {n: _capture(lambda f=attention(*v): step(False, 0, f)) for n, v in variants.items()}
    times = _alternate(graphs)
    base = statistics.median(times["none"])
    for name, g in graphs.items():
        ks = _kernels(g)
        gemms = [us for k, us in ks if "pdl_linear_kernel" in k]
        per = [round(statistics.mean(gemms[i::6]), 1) for i in range(6)]
        fl = [us for k, us in ks if "flash" in k.lower() and "combine" not in k.lower()
              and "metadata" not in k.lower()]
        m = statistics.median(times[name])
        print(f"{name:18s} step {m:7.1f} µs/layer ({m / base:.3f}x, spread "
              f"{min(times[name]):.1f}-{max(times[name]):.1f}); FlashMLA "
              f"{[round(x, 1) for x in fl]}; GEMMs (q_a+kv_a, q_b, W_UV, o_proj, gate+up, down) "
              f"{per}", flush=True)
    print("kernel names:", sorted({k[:50] for k, _ in _kernels(graphs["none"])}))


def attention_standins():
    """The chain with the attention stand-in a row kernel, FlashMLA at (32, 4096, 128
    heads) and a compute-bound bf16 GEMM of about FlashMLA's time: do the weight GEMMs
    after a compute-heavy kernel stream slower (power, clocks) than after a light one?"""
    step, _, _ = _chain()
    dev, dt = "cuda", torch.bfloat16
    a, b = torch.randn(2048, 4096, device=dev, dtype=dt), torch.randn(4096, 2560, device=dev, dtype=dt)
    mm_out = torch.empty(2048, 2560, device=dev, dtype=dt)

    def matmul(L):                                  # 43 GFLOP: ~65-70 µs on an H200
        torch.mm(a, b, out=mm_out)

    standins = {"row kernel": None, "bf16 GEMM": matmul}
    flash = _flashmla_standin()
    if flash is not None:
        standins["FlashMLA"] = flash
    graphs = {n: _capture(lambda f=f: step(False, 0) if f is None else step(False, 0, f))
              for n, f in standins.items()}
    times = _alternate(graphs)
    for name, g in graphs.items():
        gemms = [us for k, us in _kernels(g) if "pdl_linear_kernel" in k]
        per = [round(statistics.mean(gemms[i::5]), 1) for i in range(5)]
        print(f"{name:11s} step {statistics.median(times[name]):7.1f} µs/layer; GEMMs "
              f"(q_a+kv_a, q_b, o_proj, gate+up, down) {per} µs")


def pdl_chain():
    """The chain with plain launches, with PDL, and with PDL plus an L2 prefetch."""
    step, db, _ = _chain()
    variants = {"plain": (False, 0), "pdl": (True, 0), "pdl+pf1k": (True, 1024),
                "pdl+pf4k": (True, 4096), "pf4k": (False, 4096)}
    graphs, outs = {}, {}
    for name, (pdl, pf) in variants.items():
        step(pdl, pf)
        torch.cuda.synchronize()
        outs[name] = db.clone()
        graphs[name] = _capture(lambda pdl=pdl, pf=pf: step(pdl, pf))
        print(name, "graph vs eager max diff", (db - outs[name]).abs().max().item(),
              "vs plain", (outs[name] - outs["plain"]).abs().max().item(), flush=True)
    times = _alternate(graphs)
    base = statistics.median(times["plain"])
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"{name:10s} {m:8.1f} us/layer  ({m / base:.3f}x)  spread {min(ts):.1f}-{max(ts):.1f}")
    for name in ("plain", "pdl+pf1k"):
        print(f"--- {name}: one replay's kernels (µs)")
        for k, us in _kernels(graphs[name])[:20]:
            print(f"  {us:7.1f} {k[:40]}")


@triton.jit
def rot_kernel(x_ptr, w1_ptr, w2_ptr, y_ptr, M, N, K, stride_xm, stride_w, stride_y,
               GATED: tl.constexpr, ROT: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    n0 = pid * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    m_ok = offs_m < M
    k_tiles = K // BLOCK_K
    start = (pid * ROT) % k_tiles
    w_off = offs_n.to(tl.int64)[:, None] * stride_w + offs_k[None, :]
    x_off = offs_m[None, :] * stride_xm + offs_k[:, None]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(0, k_tiles):
        kk = k + start
        kk = tl.where(kk >= k_tiles, kk - k_tiles, kk) * BLOCK_K
        x = tl.load(x_ptr + x_off + kk, mask=m_ok[None, :], other=0.0)
        w = tl.load(w1_ptr + w_off + kk, mask=n_ok[:, None], other=0.0)
        acc = tl.dot(w, x, acc)
        if GATED:
            w2 = tl.load(w2_ptr + w_off + kk, mask=n_ok[:, None], other=0.0)
            acc2 = tl.dot(w2, x, acc2)
    dt = y_ptr.dtype.element_ty
    if GATED:
        g = acc.to(dt).to(tl.float32)
        acc = (g * tl.sigmoid(g)).to(dt).to(tl.float32) * acc2.to(dt).to(tl.float32)
    y_ptrs = y_ptr + offs_m[None, :] * stride_y + offs_n[:, None]
    tl.store(y_ptrs, acc.to(dt), mask=m_ok[None, :] & n_ok[:, None])


def k_order():
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    shapes = {"o_proj": (7168, 16384, False), "down": (7168, 18432, False),
              "gate_up": (18432, 7168, True)}
    for M in (32, 1):
        for name, (N, K, gated) in shapes.items():
            w1 = torch.randn(N, K, device=dev, dtype=dt) * 0.02
            w2 = torch.randn(N, K, device=dev, dtype=dt) * 0.02 if gated else w1
            x = torch.randn(M, K, device=dev, dtype=dt)
            mode = 2 if gated else 0
            cfg = linear.pick_config(mode, N, K, M)
            y0 = torch.empty(M, N, device=dev, dtype=dt)
            run0 = lambda: linear.launch(x, w1, w2 if gated else None, mode, y0, None, cfg)
            run0()
            t0 = kernel_time_us(run0)
            mb = (2 if gated else 1) * N * K * 2 / 1e6
            print(f"M={M} {name} cfg {cfg}: landed {t0:.1f} us ({mb / t0:.2f} TB/s)", flush=True)
            bn, bk, warps, stages = cfg[:4]
            for rot in (0, 1, 3, 8, 29):
                y = torch.empty(M, N, device=dev, dtype=dt)
                run = lambda: rot_kernel[(triton.cdiv(N, bn),)](
                    x, w1, w2, y, M, N, K, x.stride(0), w1.stride(0), y.stride(0), GATED=gated,
                    ROT=rot, BLOCK_M=max(16, triton.next_power_of_2(M)), BLOCK_N=bn,
                    BLOCK_K=bk, num_warps=warps, num_stages=stages)
                run()
                err = ((y.float() - y0.float()).abs().max() / y0.float().abs().max()).item()
                t = kernel_time_us(run)
                print(f"   rot {rot:3d}: {t:.1f} us ({mb / t:.2f} TB/s, {t / t0:.3f}x) err {err:.1e}", flush=True)


def norm_warps():
    """The rms_norm kernel alone at 32 / 1 rows of 7168, by num_warps."""
    dev, dt = "cuda", torch.bfloat16
    for T in (32, 1):
        x = torch.randn(T, 7168, device=dev, dtype=dt)
        w = torch.rand(7168, device=dev, dtype=dt) + 0.5
        y = torch.empty_like(x)
        for warps in (2, 4, 8, 16):
            run = lambda: rms_norm_kernel[(T,)](x, w, y, 7168, x.stride(0), 1e-6, y, y, 1, BLOCK=8192,
                                                QUANT_K=0, NATIVE_CAST=True, num_warps=warps)
            run()
            print(f"rms_norm T={T} warps {warps}: {kernel_time_us(run):.2f} us", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", default="pdl,attention,prefetch,flash-l2,k-order,norm")
    args = ap.parse_args()
    parts = {"pdl": pdl_chain, "attention": attention_standins,
             "prefetch": attention_prefetch, "flash-l2": flash_l2, "k-order": k_order, "norm": norm_warps}
    for p in args.part.split(","):
        if p not in parts:
            raise SystemExit(f"--part takes {', '.join(parts)}; got {p!r}")
        parts[p]()


if __name__ == "__main__":
    main()
