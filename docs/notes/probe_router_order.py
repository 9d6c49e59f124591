"""A/B of where a 16-bit MoE block's router runs against its shared experts' side stream
(GPU probe, not maintained). mla::moe_block_decode forks the shared experts' two GEMMs
onto a side stream and then launches the router on the caller's stream, so the router's
small kernels start while the shared gate + up holds most SMs. Variants, each captured
into the same compiled DecodeGraph step (the op's body runs at capture, so patching it
needs no recompile):

    shipped   fork, then the shared GEMMs (side) and the router + routed experts (main)
    serial    the router first on the main stream, then the fork
    early     the fork, the router launched (captured) before the shared GEMMs

Step µs from events over N back-to-back replays of the bare graph (the cache restored
before each timing), ROUNDS rounds alternating the variants; the first replay's logits
of every variant are compared with the shipped one's.

    python docs/notes/probe_router_order.py v2-lite:1:4096,v3-moe:1:4096 [ROUNDS] [N]
"""
import sys
import torch
sys.path[:0] = ["benchmarks", "docs/notes"]         # run from the repository root
import lowering.moe.block as blk
from lowering.moe import experts as moe_experts
from lowering.moe import router as moe_router
from probe_step_kernels import decode_graph

SHIPPED = (blk.fork_shared, blk._routed)
_FORK = {}


def routed_after_router(x, router_weight, bias, mode, top_k, n_group, topk_group,
                        norm_topk_prob, scale, gate_up, down, hr, pairs):
    """blk._routed with the fork (the variant's) between the router and the experts."""
    topk_idx, topk_weight = moe_router.launch(x, router_weight, bias, mode, top_k, n_group,
                                              topk_group, norm_topk_prob, scale)
    _FORK["now"]()
    T, H = x.shape
    I = gate_up.shape[1] // 2
    flat = moe_experts.flat_pairs(topk_idx)
    moe_experts.launch_gate_up(x, gate_up, flat, top_k, hr,
                               moe_experts.pick_config("gate_up", I, H, T))
    moe_experts.launch_down(hr, down, topk_weight.reshape(-1), flat, top_k,
                            pairs.view(T * top_k, H), moe_experts.pick_config("down", H, I, T))


def fork_variant(early: bool):
    def fork(x, shared, routed):
        main = torch.cuda.current_stream(x.device)
        side = blk.side_stream(x.device)
        if early:
            side.wait_stream(main)               # forked before the router

        def now():
            if not early:
                side.wait_stream(main)           # forked after the router
            with torch.cuda.stream(side):
                shared()
        _FORK["now"] = now
        routed()
        main.wait_stream(side)
    return fork


VARIANTS = {
    "shipped": SHIPPED,
    "serial": (fork_variant(False), routed_after_router),
    "early": (fork_variant(True), routed_after_router),
}


def use(name):
    blk.fork_shared, blk._routed = VARIANTS[name]


def timed(runner, cache, n):
    saved = cache.snapshot()
    g = runner._graph
    g.replay()
    first = runner.logits.clone()
    for _ in range(4):
        g.replay()
    torch.cuda.synchronize()
    cache.restore(saved)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    cache.restore(saved)
    return a.elapsed_time(b) / n * 1000, first


def main(spec, rounds, n):
    for item in spec.split(","):
        shape, B, S = item.split(":")
        B, S = int(B), int(S)
        torch.manual_seed(0)
        use("shipped")
        model, cache, runner, ids = decode_graph(shape, B, S)
        runner.input_ids.copy_(ids)
        res = {k: [] for k in VARIANTS}
        ref = None
        for _ in range(rounds):
            for name in VARIANTS:
                use(name)
                runner._capture(2)
                runner.input_ids.copy_(ids)
                us, first = timed(runner, cache, n)
                res[name].append(us)
                if ref is None:
                    ref = first
                elif not torch.equal(first, ref):
                    d = (first.float() - ref.float()).abs().max().item()
                    print(f"  {name}: logits differ from shipped by {d:.3g}", flush=True)
        use("shipped")
        base = sorted(res["shipped"])[len(res["shipped"]) // 2]
        print(f"{shape} {B}x{S}: " + "; ".join(
            f"{k} median {sorted(v)[len(v) // 2]:.1f} µs ({base / sorted(v)[len(v) // 2]:.3f}x; "
            f"runs {', '.join(f'{x:.1f}' for x in v)})" for k, v in res.items()), flush=True)
        del model, cache, runner
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 5,
         int(sys.argv[3]) if len(sys.argv) > 3 else 150)
