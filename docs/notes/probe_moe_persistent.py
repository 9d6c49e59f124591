"""A MoE block's decode rows as one persistent kernel, against mla::moe_block_decode
(probe, not maintained; the kernel lives in probe_moe_persistent_kernel.py and
probe_moe_persistent_parts.py, not in lowering/).

Today (lowering/moe/block.py) a decode step's MoE block is five launches on two streams:
the router's logits and selection, the routed experts' gate + up and down, and the shared
experts' two decode GEMMs beside them; the caller then sums the pairs and the shared output
(one more launch in the step). At V2-Lite's one row each launch is latency-bound: the block
takes ~51 µs on an H200 for ~32 µs of bytes (NOTES-v2lite-one-row.md). Here one launch of
persistent programs takes work items from a queue (an atomic ticket) in an order where an
item only waits on items of lower tickets, so it cannot deadlock:

    router     (E / BLOCK_ER) x (H / CH_R) items: fp32 logit partials [SPLIT_R, T, E]; the
               last one to finish (an acq_rel counter) sums them in order, selects the
               experts as lowering/moe/router_select_kernel.select_experts does, and raises
               the "chosen" flag
    shared g+u (S / BN_G) x (H / CH_G) items: hs [T, S] = SiLU(x @ Wg.T) * (x @ Wu.T),
               rounded as the decode GEMM rounds; they need nothing, so they stream while
               the router runs
    routed g+u (P pairs) x (I / BN_G) x (H / CH_G) items: wait for "chosen", then hr
               [P, I] as lowering/moe/gate_up_kernel.py computes it; a pair works only if
               it is the first to choose its expert, and then for every pair of that
               expert (expert_run.py's runs: an expert's rows are read once however many
               tokens chose it); a counter per run. With H in slices of CH_G, each
               tile's last slice sums the fp32 slices in order before the SiLU, so an
               item stays small at V3's H = 7168
    shared dn  (S / CH_S slices) x (H / BN_D) items: wait for all of hs; fp32 slices
    routed dn  P x (H / BN_D) items: a run's first pair waits for the run's hr, then
               weight * round(hr @ Wd.T) for each pair of the run into pr [P, H] fp32, as
               lowering/moe/down_kernel.py leaves it
    finish     by the last of an H tile's P + slices items (a counter per tile):
               out = round(round(sum_k pr) + round(sum_s slices)) [+ residual, rounded],
               the expression mla_ops/hf/moe.py leaves in the graph after the op

With front=(a, o_proj, residual, norm weight, eps) the launch also takes the decoder
layer's step before the block, from the attention's output rows after W_UV:

    o_proj     (H / BN_O) x (NV / CH_O) items first: fp32 slices [KS_O, T, H]; the last to
               finish sums them, adds the residual (h1, rounded as HF's `residual + o_proj`),
               normalizes h1 as mla::residual_rms_norm does and raises "normed", which the
               router's and the shared experts' items wait for; the finish adds h1.

so one launch replaces o_proj, the residual norm, the block and its sum. With scales= the
experts' and shared experts' weights are e4m3 with 128 x 128 block scales (an FP8
checkpoint's block, against mla::moe_block_decode_fp8): every dot is W8A8 as HF's
FP8Linear computes it, the activations quantized per 128 columns in registers; a sixth
front entry (o_proj's scales) makes o_proj e4m3 too, the whole tail of an FP8 layer.

Waits spin on acquire atomics (with a nap between reads); every producer stores, syncs
its threads and then releases its counter; data written inside the launch is read with
.cg loads (from L2, past any stale L1 line). The last program to leave zeroes the
counters, so the next launch (a CUDA graph replay) starts clean. Under TRITON_INTERPRET=1
the programs run one after another: the first takes every ticket in order and finds each
wait already met.

    python docs/notes/probe_moe_persistent.py --check     # CPU: TRITON_INTERPRET=1
    python docs/notes/probe_moe_persistent.py [--shapes v2-lite:1,v2-lite:4,v3:1] [--sweep]
        [--fp8]

--check runs the kernel under the interpreter on small ragged shapes (1 to 16 tokens, the
three router modes, experts shared by tokens, fp32 and bf16, one and two shared slices, H
in one and in several slices, fp8 weights, with and without the front, fp8 o_proj)
against float64 and against the shipped ops. On a GPU: µs of the shipped op plus its sum
(and residual) against the persistent kernel, then the shipped o_proj + residual norm +
block + sum against the kernel with its front, and with --fp8 the same two for an FP8
checkpoint's layer (each captured in a CUDA graph: the profiler's kernel span and graph
replays, L2 flushed), with their differences.
"""
import argparse
import os
import sys

if "--check" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"
import torch
import triton

sys.path[:0] = ["benchmarks", "docs/notes", "."]       # run from the repository root
import lowering.moe.block  # noqa: E402,F401  (registers mla::moe_block_decode)
from lowering.gemm.fp8_act_quant import quantize_rows_torch  # noqa: E402
from lowering.moe import router as moe_router  # noqa: E402
from probe_moe_persistent_kernel import (CONFIG, FP8_CONFIG, FRONT_CONFIG,  # noqa: E402
                                         persistent_block)


def shipped_block(args, residual=None):
    """mla::moe_block_decode and the sum mla_ops/hf/moe.py makes of it."""
    pairs, shared = torch.ops.mla.moe_block_decode(*args)
    x = args[0]
    shared = shared[0] if shared.shape[0] == 1 else shared.sum(0).to(x.dtype)
    out = pairs.sum(1).to(x.dtype) + shared
    return out if residual is None else residual + out


def shipped_block_fp8(args, scales, residual=None):
    """mla::moe_block_decode_fp8 and the same sum, for make_args' arguments with
    make_fp8's weights and scales."""
    import lowering.moe.fp8_block  # noqa: F401  (registers mla::moe_block_decode_fp8)
    gu, dn, sg, su, sd = args[9:]
    gus, dns, sgs, sus, sds = scales
    pairs, shared = torch.ops.mla.moe_block_decode_fp8(
        *args[:9], gu, gus, dn, dns, sg, sgs, su, sus, sd, sds, 128, 128)
    x = args[0]
    out = pairs.sum(1).to(x.dtype) + shared[0]
    return out if residual is None else residual + out


def make_fp8(args, seed=0):
    """make_args' arguments with the experts' weights as e4m3 and random 128 x 128 block
    scales: (args, scales)."""
    g = torch.Generator(device=args[0].device).manual_seed(seed + 200)

    def q(w):
        e4m3 = (torch.randn(w.shape, generator=g, device=w.device) * 100).clamp(-448, 448)
        lead, (N, K) = w.shape[:-2], w.shape[-2:]
        if len(lead) and w.shape[-2] == args[9].shape[1]:        # gate_up: gate's, up's blocks
            rows = 2 * triton.cdiv(N // 2, 128)
        else:
            rows = triton.cdiv(N, 128)
        sc = torch.rand(*lead, rows, triton.cdiv(K, 128), generator=g, device=w.device)
        return e4m3.to(torch.float8_e4m3fn), sc * 0.02 / 100 + 1e-5
    pairs = [q(w) for w in args[9:]]
    return (*args[:9], *[w for w, _ in pairs]), tuple(sc for _, sc in pairs)


def shipped_front(front, rest):
    """The shipped decoder layer after W_UV at decode rows: o_proj's split-K partials
    (mla::decode_linear_partials), mla::residual_rms_norm, then shipped_block of the
    normed rows with h1 as the residual; rest = the block's arguments after x."""
    from lowering.fused import norm  # noqa: F401  (registers mla::residual_rms_norm)
    from lowering.gemm import linear as gemm
    a, wo, res0, nw, eps = front
    parts = torch.ops.mla.decode_linear_partials(a, wo, max(1, gemm.linear_split_k(a, wo)))
    h1, x = torch.ops.mla.residual_rms_norm(parts, res0, nw, eps)
    return shipped_block((x, *rest), residual=h1), x, h1


def shipped_front_fp8(front, rest, scales):
    """An FP8 checkpoint's layer tail as the converted model runs it at decode rows:
    o_proj's fp8 split-K partials, mla::residual_rms_norm_fp8 (h1, x and x quantized for
    the block), mla::moe_block_decode_fp8 reading that, and the sum with h1."""
    from lowering.fused import norm  # noqa: F401  (registers mla::residual_rms_norm_fp8)
    from lowering.gemm import fp8_linear  # noqa: F401  (mla::decode_linear_fp8_partials)
    import lowering.moe.fp8_block  # noqa: F401
    a, wq, res0, nw, eps, wos = front
    parts = torch.ops.mla.decode_linear_fp8_partials(a, wq, wos, 128, 128)
    h1, x, xq, xs = torch.ops.mla.residual_rms_norm_fp8(parts, res0, nw, eps, 128)
    gu, dn, sg, su, sd = rest[8:]
    gus, dns, sgs, sus, sds = scales
    pairs, shared = torch.ops.mla.moe_block_decode_fp8(
        x, *rest[:8], gu, gus, dn, dns, sg, sgs, su, sus, sd, sds, 128, 128, xq, xs)
    return h1 + (pairs.sum(1).to(x.dtype) + shared[0])


def make_front(T, H, NV, dt, dev="cpu", seed=0):
    """(a [T, NV], wo [H, NV], res0 [T, H], norm weight [H], eps), random."""
    g = torch.Generator(device=dev).manual_seed(seed + 100)

    def rnd(*shape, s=1.0, m=0.0):
        return (m + torch.randn(*shape, generator=g, device=dev) * s).to(dt)
    return rnd(T, NV), rnd(H, NV, s=NV ** -0.5), rnd(T, H), rnd(H, s=0.1, m=1.0), 1e-6


def block_fp64(args, idx, wgt):
    """float64 with HF's roundings (gate, up, SiLU, h, each pair's product) for the choice
    (idx [T, K], wgt [T, K])."""
    x, *_, gate_up, down, sg, su, sd = args
    dt, (T, H), I = x.dtype, x.shape, gate_up.shape[1] // 2

    def mlp(xt, g_w, u_w, d_w):
        g, u = (g_w.double() @ xt).to(dt).double(), (u_w.double() @ xt).to(dt).double()
        h = ((g * torch.sigmoid(g)).to(dt).double() * u).to(dt).double()
        return d_w.double() @ h
    out = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        xt = x[t].double()
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            y = mlp(xt, gate_up[e, :I], gate_up[e, I:], down[e]).to(dt).double()
            out[t] += y * float(wgt[t, k])
        out[t] += mlp(xt, sg, su, sd)
    return out


def make_args(kind, T, H, E, I, S, dt, dev="cpu", seed=0):
    """Random block arguments for mla::moe_block_decode: kind v3 (sigmoid, bias, groups,
    norm, scale), v2 (softmax greedy) or v2g (group-limited greedy)."""
    g = torch.Generator(device=dev).manual_seed(seed)

    def rnd(*shape, s=1.0):
        return (torch.randn(*shape, generator=g, device=dev) * s).to(dt)
    route = {"v3": lambda: (rnd(E, s=0.1).float(), 0, 8 if E >= 64 else 3, 8 if E >= 64 else 4,
                            4 if E >= 64 else 2, True, 2.5),
             "v2": lambda: (None, 1, 6 if E >= 64 else 3, 1, 1, False, 1.0),
             "v2g": lambda: (None, 2, 3, 4, 2, False, 1.5)}[kind]()
    return (rnd(T, H), rnd(E, H, s=H ** -0.5), *route, rnd(E, 2 * I, H, s=H ** -0.5),
            rnd(E, H, I, s=I ** -0.5), rnd(S, H, s=H ** -0.5), rnd(S, H, s=H ** -0.5),
            rnd(H, S, s=S ** -0.5))


def check():
    torch.manual_seed(0)
    cases = [  # kind, T, H, E, I, S, dtype, config
        ("v2", 1, 96, 8, 40, 72, torch.float32, (16, 64, 16, 32, 32, 2048, 4, 1, 2)),
        ("v3", 5, 96, 16, 40, 72, torch.float32, (16, 32, 16, 32, 32, 32, 4, 1, 2, 32)),
        ("v2g", 3, 80, 16, 24, 56, torch.float32, (16, 2048, 16, 16, 32, 32, 4, 1, 2)),
        ("v3", 2, 96, 16, 40, 72, torch.bfloat16, (16, 64, 16, 32, 32, 64, 4, 1, 2, 64)),
        ("v2", 16, 64, 24, 32, 48, torch.float32, (16, 32, 16, 16, 32, 32, 4, 1, 2, 32)),
    ]                             # the last: 16 rows (the most), E not a multiple of BLOCK_ER
    for n, (kind, T, H, E, I, S, dt, cfg) in enumerate(cases):
        args = make_args(kind, T, H, E, I, S, dt, seed=n)
        residual = torch.randn(T, H).to(dt) if n % 2 else None
        for programs in (1, 3):
            out, idx, wgt = persistent_block(*args, residual=residual, config=cfg,
                                             programs=programs)[:3]
            x, w_r, bias, mode, K, G, KG, norm, scale = args[:9]
            ref_idx, ref_w = moe_router.launch(x, w_r, bias, mode, K, G, KG, norm, scale)
            assert torch.equal(idx.view(T, K).long(), ref_idx), (idx, ref_idx)
            assert torch.allclose(wgt.view(T, K), ref_w, rtol=1e-6, atol=0), (wgt, ref_w)
            ref = block_fp64(args, ref_idx, ref_w)
            if residual is not None:
                ref = ref + residual.double()
            err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
            shipped = shipped_block(args, residual)
            d = ((out.double() - shipped.double()).abs().max()
                 / shipped.double().abs().max()).item()
            base = ((shipped.double() - ref).abs().max() / ref.abs().max()).item()
            shared_pairs = T * args[4] - len(set(ref_idx.flatten().tolist()))
            print(f"{kind} {dt} T={T} H={H} E={E} I={I} S={S} ({shared_pairs} pairs share an "
                  f"expert) {programs} programs: vs float64 "
                  f"{err:.1e} (the shipped op {base:.1e}), vs the shipped op {d:.1e}",
                  flush=True)
            assert err < (1e-5 if dt == torch.float32 else 2 * base + 1e-2), err
    for n, (kind, T, H, E, I, S, dt) in enumerate([
            ("v2", 1, 256, 8, 128, 192, torch.float32), ("v3", 3, 256, 16, 192, 256, torch.float32),
            ("v3", 2, 256, 16, 128, 192, torch.bfloat16)]):
        args, scales = make_fp8(make_args(kind, T, H, E, I, S, dt, seed=20 + n), seed=n)
        cfg = (16, 128, 16, 32, 128, 128 if n else 2048, 4, 1, 2, 128 if n else 2048)
        residual = torch.randn(T, H).to(dt) if n % 2 else None
        shipped = shipped_block_fp8(args, scales, residual)
        for programs in (1, 3):
            out, idx, wgt = persistent_block(*args, residual=residual, config=cfg,
                                             programs=programs, scales=scales)[:3]
            ref_idx, ref_w = moe_router.launch(*args[:9])
            assert torch.equal(idx.view(T, -1).long(), ref_idx), (idx, ref_idx)
            d = ((out.double() - shipped.double()).abs().max()
                 / shipped.double().abs().max()).item()
            print(f"fp8 {kind} {dt} T={T} H={H} E={E} I={I} S={S} {programs} programs: vs the "
                  f"shipped op {d:.1e}", flush=True)
            assert d < (1e-5 if dt == torch.float32 else 2e-2), d
    # an FP8 checkpoint's layer tail: e4m3 o_proj and experts, against float64 W8A8 for
    # h1 and x (on the CPU the shipped o_proj dequantizes, so it is no reference here)
    for n, (kind, T, H, E, I, S, NV, dt) in enumerate([
            ("v3", 2, 256, 16, 128, 192, 384, torch.float32),
            ("v2", 1, 256, 8, 128, 192, 256, torch.bfloat16)]):
        args, scales = make_fp8(make_args(kind, T, H, E, I, S, dt, seed=30 + n), seed=n)
        a, _, res0, nw, eps = make_front(T, H, NV, dt, seed=n)
        g = torch.Generator().manual_seed(300 + n)
        wq = (torch.randn(H, NV, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        wos = torch.rand(triton.cdiv(H, 128), triton.cdiv(NV, 128), generator=g) * 2e-4 + 1e-5
        front = (a, wq, res0, nw, eps, wos)
        cfg = (16, 128, 16, 32, 128, 128, 4, 1, 2, 128)
        for programs in (1, 3):
            out, idx, wgt, x, h1 = persistent_block(None, *args[1:], config=cfg,
                                                    programs=programs, front=front,
                                                    front_config=(16, 128), scales=scales)
            aq, a_s = quantize_rows_torch(a, 128)                         # W8A8 in float64
            a64 = aq.double() * a_s.double().repeat_interleave(128, -1)[..., :NV]
            w64 = wq.double() * wos.double().repeat_interleave(128, 0)[:H].repeat_interleave(
                128, 1)[:, :NV]
            h1_ref = (res0.double() + (a64 @ w64.T).to(dt).double()).to(dt)
            tol = 2.0 ** -6 if dt == torch.bfloat16 else 1e-5
            dev = ((h1.double() - h1_ref.double()).abs().max() / h1_ref.double().abs().max())
            assert dev <= tol, ("h1", dev.item())
            shipped = shipped_block_fp8((x, *args[1:]), scales, h1)
            d = ((out.double() - shipped.double()).abs().max()
                 / shipped.double().abs().max()).item()
            print(f"fp8 front + {kind} {dt} T={T} H={H} NV={NV} {programs} programs: h1 vs "
                  f"float64 W8A8 {dev.item():.1e}, vs the shipped fp8 block on its x, h1 "
                  f"{d:.1e}", flush=True)
            assert d < (1e-5 if dt == torch.float32 else 2e-2), d
    for n, (kind, T, H, E, I, S, NV, dt, cfg, fcfg) in enumerate([
            ("v2", 1, 96, 8, 40, 72, 80, torch.float32, (16, 64, 16, 32, 32, 2048, 4, 1, 2),
             (32, 32)),
            ("v3", 4, 96, 16, 40, 72, 64, torch.float32, (16, 32, 16, 32, 32, 32, 4, 1, 2, 32),
             (16, 2048)),
            ("v2g", 3, 80, 16, 24, 56, 96, torch.bfloat16, (16, 2048, 16, 16, 32, 32, 4, 1, 2),
             (16, 64))]):
        args = make_args(kind, T, H, E, I, S, dt, seed=10 + n)
        front = make_front(T, H, NV, dt, seed=n)
        shipped, x_ref, h1_ref = shipped_front(front, args[1:])
        for programs in (1, 3):
            out, idx, wgt, x, h1 = persistent_block(None, *args[1:], config=cfg,
                                                    programs=programs, front=front,
                                                    front_config=fcfg)
            # h1 and x as the shipped ones up to o_proj's summation order (in bf16 a flipped
            # rounding of o, then of h1, x and its weight product: a few ulps at most)
            tol = 2.0 ** -6 if dt == torch.bfloat16 else 1e-5
            for name, got, want in (("h1", h1, h1_ref), ("x", x, x_ref)):
                dev = (got.double() - want.double()).abs().max() / want.double().abs().max()
                assert dev <= tol, (name, dev.item())
            ref_idx, ref_w = moe_router.launch(x, *args[1:9])
            assert torch.equal(idx.view(T, -1).long(), ref_idx), (idx, ref_idx)
            ref = block_fp64((x, *args[1:]), ref_idx, ref_w) + h1.double()
            err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
            same = shipped_block((x, *args[1:]), residual=h1)
            base = ((same.double() - ref).abs().max() / ref.abs().max()).item()
            d = ((out.double() - same.double()).abs().max() / same.double().abs().max()).item()
            d_layer = ((out.double() - shipped.double()).abs().max()
                       / shipped.double().abs().max()).item()
            print(f"front + {kind} {dt} T={T} H={H} NV={NV} E={E} I={I} S={S} {programs} "
                  f"programs: vs float64 of its own h1, x {err:.1e} (the shipped block "
                  f"{base:.1e}), vs the shipped block on them {d:.1e}, vs the shipped layer "
                  f"{d_layer:.1e}", flush=True)
            assert err < (1e-5 if dt == torch.float32 else 2 * base + 1e-2), err


SHAPES = {  # E, H, I, S, kind, NV (heads x v_head_dim, o_proj's input)
    "v2-lite": (64, 2048, 1408, 2816, "v2", 2048),
    "v3": (256, 7168, 2048, 2048, "v3", 16384),
}


def _rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def _timed(cfgs, run, ref, both, label="", tol=2e-2):
    """[(kernel-span µs, graph µs, config, rel diff)] sorted, of the configs whose run(cfg)
    launches and matches ref (relative max error < tol); the others are reported."""
    res = []
    for cfg in cfgs:
        try:
            d = _rel(run(cfg), ref)
        except Exception as e:  # noqa: BLE001  (a config that does not launch)
            print(f"    {label}{cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            continue
        if not d < tol:
            print(f"    {label}{cfg}: differs {d:.1e}", flush=True)
            continue
        res.append((*both(lambda cfg=cfg: run(cfg)), cfg, d))
    return sorted(res)


def time_fp8(name, T, sweep, both):
    """The FP8 block: mla::moe_block_decode_fp8 + sum against the kernel's FP8 mode."""
    E, H, I, S, kind, _ = SHAPES[name]
    args, scales = make_fp8(make_args(kind, T, H, E, I, S, torch.bfloat16, dev="cuda", seed=T),
                            seed=T)
    residual = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    ref = shipped_block_fp8(args, scales, residual)
    n_experts = len(set(moe_router.launch(*args[:9])[0].flatten().tolist()))
    nbytes = n_experts * 3 * H * I + 3 * H * S + E * H * 2
    sk, sg_ = both(lambda: shipped_block_fp8(args, scales, residual))
    print(f"{name} T={T} fp8 ({nbytes / 1e6:.1f} MB): shipped block + sum {sk:.1f} µs kernel "
          f"span / {sg_:.1f} graph ({nbytes / sk / 1e3:.0f} GB/s)", flush=True)
    cfgs = [FP8_CONFIG] + ([(16, 512, bn_g, bn_d, 128, 2048, w, 3, ps, ch_g)
                            for bn_g, bn_d, w, ps in ((64, 64, 4, 1), (32, 64, 4, 2),
                                                      (32, 32, 4, 2), (64, 64, 8, 1))
                            for ch_g in (1024, 2048, 8192)] if sweep else [])
    res = _timed(cfgs, lambda cfg: persistent_block(*args, residual=residual, config=cfg,
                                                      scales=scales)[0], ref, both, "fp8 ")
    for k_us, g_us, cfg, d in res[:4]:
        print(f"{name} T={T}: persistent fp8 block {k_us:.1f} µs ({sk / k_us:.3f}x), {g_us:.1f} "
              f"graph ({sg_ / g_us:.3f}x), {cfg}, rel diff {d:.1e}; "
              f"{nbytes / k_us / 1e3:.0f} GB/s", flush=True)
    if not res:
        return
    # the layer's tail with an e4m3 o_proj in front
    NV = SHAPES[name][5]
    g = torch.Generator(device="cuda").manual_seed(300 + T)
    a, _, res0, nw, eps = make_front(T, H, NV, torch.bfloat16, dev="cuda", seed=T)
    wq = (torch.randn(H, NV, generator=g, device="cuda") * 100).clamp(-448, 448).to(
        torch.float8_e4m3fn)
    wos = torch.rand(triton.cdiv(H, 128), triton.cdiv(NV, 128), generator=g,
                     device="cuda") * 2e-4 + 1e-5
    front = (a, wq, res0, nw, eps, wos)
    ref_layer = shipped_front_fp8(front, args[1:], scales)
    lk, lg = both(lambda: shipped_front_fp8(front, args[1:], scales))
    print(f"{name} T={T} fp8: shipped o_proj + norm + block + sum {lk:.1f} µs kernel span / "
          f"{lg:.1f} graph", flush=True)
    fcfgs = [(32, 512)] + ([(32, 1024), (32, 2048), (64, 1024)] if sweep else [])
    for k_us, g_us, fcfg, d in _timed(
            fcfgs, lambda fcfg: persistent_block(None, *args[1:], config=res[0][2], front=front,
                                                 front_config=fcfg, scales=scales)[0],
            ref_layer, both, "fp8 front ", tol=3e-2):
        print(f"{name} T={T}: persistent fp8 o_proj + norm + block {k_us:.1f} µs "
              f"({lk / k_us:.3f}x), {g_us:.1f} graph ({lg / g_us:.3f}x), front {fcfg}, "
              f"rel diff {d:.1e}", flush=True)


def time_gpu(spec, sweep, fp8):
    from timing import capture, graph_time_us, kernel_time_us

    def both(fn):
        """(µs of the profiler's kernel span, µs of graph replays), L2 flushed."""
        return kernel_time_us(capture(fn).replay), graph_time_us(fn)
    for item in spec.split(","):
        name, T = item.split(":")
        E, H, I, S, kind, NV = SHAPES[name]
        T = int(T)
        dt = torch.bfloat16
        args = make_args(kind, T, H, E, I, S, dt, dev="cuda", seed=T)
        residual = torch.randn(T, H, device="cuda").to(dt)
        front = make_front(T, H, NV, dt, dev="cuda", seed=T)
        ref = shipped_block(args, residual)
        ref_layer = shipped_front(front, args[1:])[0]
        K = args[4]
        n_experts = len(set(moe_router.launch(*args[:9])[0].flatten().tolist()))
        nbytes = (n_experts * 3 * H * I + 3 * H * S + E * H) * 2
        obytes = H * NV * 2
        sk, sg_ = both(lambda: shipped_block(args, residual))
        lk, lg = both(lambda: shipped_front(front, args[1:]))
        print(f"{name} T={T} (K={K}, {n_experts} experts, block {nbytes / 1e6:.1f} MB, o_proj "
              f"{obytes / 1e6:.1f} MB): shipped block + sum {sk:.1f} µs kernel span / {sg_:.1f} "
              f"graph ({nbytes / sk / 1e3:.0f} GB/s); shipped o_proj + norm + block + sum "
              f"{lk:.1f} / {lg:.1f}", flush=True)
        cfgs = [CONFIG]
        if sweep:
            cfgs += [(16, 512, bn_g, bn_d, bk, 2048, w, st, ps)
                     for bn_g, bn_d, bk, w, st, ps in (
                         (32, 64, 128, 4, 2, 2), (32, 64, 128, 4, 4, 1), (32, 64, 64, 4, 3, 3),
                         (32, 64, 64, 4, 4, 3), (32, 64, 64, 4, 3, 2), (16, 32, 128, 4, 3, 2),
                         (16, 32, 128, 4, 3, 3), (32, 32, 128, 4, 3, 2), (64, 64, 64, 4, 3, 2),
                         (32, 64, 128, 8, 3, 1), (32, 128, 64, 4, 3, 2))]
            cfgs += [(16, ch_r, 32, 64, 128, ch_s, 4, 3, 2) for ch_r in (256, 1024, 8192)
                     for ch_s in (1024, 4096)]
            cfgs += [(16, 512, 32, 64, 128, 2048, 4, 3, 2, ch_g) for ch_g in (512, 1024, 4096)]
        res = _timed(cfgs, lambda cfg: persistent_block(*args, residual=residual,
                                                          config=cfg)[0], ref, both)
        for k_us, g_us, cfg, d in res[:5]:
            print(f"{name} T={T}: persistent block {k_us:.1f} µs ({sk / k_us:.3f}x), {g_us:.1f} "
                  f"graph ({sg_ / g_us:.3f}x), {cfg}, rel diff {d:.1e}; "
                  f"{nbytes / k_us / 1e3:.0f} GB/s", flush=True)
        if fp8:
            try:
                time_fp8(name, T, sweep, both)
            except Exception as e:  # noqa: BLE001  (keep the run's other rows)
                print(f"{name} T={T} fp8: {type(e).__name__}: {str(e)[:200]}", flush=True)
        if not res:
            continue
        best = res[0][2]
        fcfgs = [FRONT_CONFIG] + ([(16, 512), (32, 1024), (32, 2048), (64, 1024), (64, 2048)]
                                  if sweep else [])
        for k_us, g_us, fcfg, d in _timed(
                fcfgs, lambda fcfg: persistent_block(None, *args[1:], config=best, front=front,
                                                     front_config=fcfg)[0],
                ref_layer, both, "front ", tol=3e-2):
            print(f"{name} T={T}: persistent o_proj + norm + block {k_us:.1f} µs "
                  f"({lk / k_us:.3f}x), {g_us:.1f} graph ({lg / g_us:.3f}x), front {fcfg}, "
                  f"rel diff {d:.1e}; {(nbytes + obytes) / k_us / 1e3:.0f} GB/s", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--shapes", default="v2-lite:1,v2-lite:4,v3:1")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--fp8", action="store_true", help="also the FP8 block (e4m3 experts)")
    args = ap.parse_args()
    if args.check:
        check()
        return
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    time_gpu(args.shapes, args.sweep, args.fp8)


if __name__ == "__main__":
    main()
