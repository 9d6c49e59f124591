"""A MoE block's decode rows with the shared experts on a second stream (H200 probe, not
maintained): the converted block as it runs (router, routed experts, shared experts in
one stream) against the same ops with the shared experts forked onto a side stream and
joined before the sum, each captured in a CUDA graph. µs per block from events over 200
replays, and whether the two outputs are bit-equal.

    python docs/notes/probe_moe_streams.py v2-lite:32,v2-lite:1,v3-moe:1,v3-moe:32
"""
import sys
import torch
sys.path.insert(0, "benchmarks")                    # run from the repository root
import mla_ops.hf
from timing import capture
from mla_ops.hf.models import build_model, make_config
from mla_ops.hf.moe import route, routed_experts

dev, dtype = torch.device("cuda"), torch.bfloat16


def replay_us(fn, n=200):
    """(µs a replay from events over n, the captured call's output)."""
    box = []
    g = capture(lambda: box.append(fn()), 3)
    out = box[-1]
    for _ in range(10):
        g.replay()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        g.replay()
    b.record(); b.synchronize()
    return a.elapsed_time(b) / n * 1e3, out


@torch.no_grad()
def main(spec):
    for shape, T in (r.split(":") for r in spec.split(",")):
        T = int(T)
        cfg = make_config(shape, 2)
        cfg._experts_implementation = "grouped_mm"
        model = build_model(cfg, dev, dtype)
        mla_ops.hf.convert(model)
        block = model.model.layers[1].mlp
        x = torch.randn(1, T, cfg.hidden_size, device=dev, dtype=dtype)
        side = torch.cuda.Stream()

        def serial():
            return block(x)

        def forked():
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                shared = block.shared_experts(x)
            x2 = x.view(T, -1)
            idx, w = route(block, x2)
            routed = routed_experts(block, x2, idx, w).view(x.shape)
            torch.cuda.current_stream().wait_stream(side)
            return routed + shared
        us_a, a = replay_us(serial)
        us_b, b = replay_us(forked)
        print(f"{shape} T={T}: one stream {us_a:7.1f} µs, shared on a side stream {us_b:7.1f} µs "
              f"({us_a / us_b:.3f}x), bit-equal {torch.equal(a, b)}", flush=True)
        del model, block
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1])
