"""The MoE router's launch configs at the released models' shapes (GPU probe, not
maintained): lowering.moe.router's logits kernel (BLOCK_E, SPLIT, BLOCK_K, warps, stages),
in its dot form and, up to 4 rows, its per-lane ROW_FMA form, and the select kernel's
warps, each timed as the router's two launches captured 20 times in a CUDA graph (µs a
router call, the median of 5 replays), the shipped config first.
Every candidate's topk_idx must equal the shipped one's (printed otherwise).

    python docs/notes/probe_router_configs.py [v2-lite,v3,v2] [T,...] [shipped] [fp32]

The router weight is bf16, as in a model loaded in bf16 (HF's router casts it to fp32 in
its forward); with "fp32" an fp32 weight. With "shipped" only the shipped config is timed
(at 1, 2 and 4 select warps): run from another tree (PYTHONPATH) it times that tree's
kernels.
"""
import itertools
import sys
import torch
sys.path.insert(0, "benchmarks")                    # run from the repository root
from timing import capture                          # noqa: E402
from lowering.moe import router as moe_router      # noqa: E402

SHAPES = {  # E, H, mode, top_k, n_group, topk_group, norm, scale
    "v2-lite": (64, 2048, 1, 6, 1, 1, False, 1.0),
    "v3": (256, 7168, 0, 8, 8, 4, True, 2.5),
    "v2": (160, 5120, 2, 6, 8, 3, False, 16.0),
}


def graph_us(fn, reps=20):
    """µs a call of fn: reps calls captured in one CUDA graph (benchmarks/timing.py's
    capture), the median of 5 replays, no L2 flush between them."""
    g = capture(lambda: [fn() for _ in range(reps)])
    g.replay()
    torch.cuda.synchronize()
    return replay_us(g, reps)


def replay_us(g, reps):
    """µs a call of a graph g holding reps calls: the median of 5 replays."""
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / reps * 1000)
    return sorted(times)[2]


def main(shapes, rows, shipped_only=False, wdtype=torch.bfloat16):
    dev = torch.device("cuda")
    for name in shapes:
        E, H, mode, top_k, n_group, topk_group, norm, scale = SHAPES[name]
        w = (torch.randn(E, H, device=dev) / H ** 0.5).to(wdtype)
        bias = torch.randn(E, device=dev) * 0.1 if mode == 0 else None
        shipped = moe_router.logits_config(E, H)
        cands = [shipped] + [c for c in itertools.product(
            (16, 32, 64), (8, 16, 32, 64), (64, 128), (2, 4), (2,))
            if c != shipped and c[0] <= E and c[1] * c[2] <= H
            and (E // c[0]) * c[1] <= 512 and not shipped_only]
        for T in rows:
            x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
            args = (x, w, bias, mode, top_k, n_group, topk_group, norm, scale)
            ref = moe_router.launch(*args)[0].clone()
            res = []
            rule = moe_router.row_fma(T, w)
            forms = [rule] + ([not rule] if T <= 4 else [])
            for warps in (1, 2, 4):
                moe_router.SELECT_WARPS = warps
                for cfg, fma in ([(c, f) for f in forms for c in cands
                                  if f == rule or c[3] == 4] if warps == 1 else [(shipped, rule)]):
                    try:
                        idx = moe_router.launch(*args, config=cfg, fma=fma)[0]
                        if not torch.equal(idx, ref):
                            print(f"  {name} T={T} {cfg} select warps {warps}: other experts")
                        res.append((graph_us(lambda: moe_router.launch(*args, config=cfg,
                                                                       fma=fma)),
                                    cfg + (("fma",) if fma else ("dot",)), warps))
                    except Exception as exc:               # a config that does not compile
                        print(f"  {name} T={T} {cfg}: {type(exc).__name__}")
            moe_router.SELECT_WARPS = 1
            base = res[0][0]
            res_sorted = sorted(res)
            other = [r for r in res if r[1][:5] == shipped and r[2] == 1][1:]
            print(f"{name} T={T}: shipped {res[0][1]} select 1 warp {base:.2f} µs" +
                  "".join(f" (the other form {us:.2f})" for us, c, wp in other) + "; best: " +
                  "; ".join(f"{c} w{wp} {us:.2f} ({base / us:.2f}x)" for us, c, wp in res_sorted[:6]),
                  flush=True)
            print(f"  select warps: " + ", ".join(f"{wp}: {us:.2f}" for us, c, wp in res
                                                   if c == res[0][1]), flush=True)


if __name__ == "__main__":
    main(sys.argv[1].split(",") if len(sys.argv) > 1 else ["v2-lite", "v3"],
         [int(t) for t in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1],
         "shipped" in sys.argv[3:], torch.float32 if "fp32" in sys.argv[3:] else torch.bfloat16)
