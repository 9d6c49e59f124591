"""A/B of the 16-head decode route inside whole DecodeGraph steps (H200 probe, not
maintained): the V2-Lite steps with backend "auto" as shipped (FlashMLA past
SMALL_DECODE_POSITIONS cached positions a call, its scheduler once a step) against the
threshold raised so the Triton kernel takes every call; step µs from events over 100
replays, each compiled once (rounds: ROUNDS, alternating).

    python docs/notes/probe_decode16_route.py v2-lite:32:1024,v2-lite:8:4096 [ROUNDS]

Since the Gluon few-rows kernel (2026-12-04, later) "auto" gives these calls to it on
SM90 before either: probe_decode16_rows.py forces each route instead.
"""
import sys, torch
sys.path[:0] = ["benchmarks", "docs/notes"]         # run from the repository root
from lowering.decode import registry
from probe_step_kernels import replay_us

SHIPPED = registry.SMALL_DECODE_POSITIONS


def step_us(shape, B, S, positions):
    registry.SMALL_DECODE_POSITIONS = positions
    return replay_us(shape, B, S)


for item in sys.argv[1].split(","):
    shape, B, S = item.split(":")
    B, S = int(B), int(S)
    res = {"shipped": [], "triton": []}
    for _ in range(int(sys.argv[2]) if len(sys.argv) > 2 else 1):
        res["shipped"].append(step_us(shape, B, S, SHIPPED))
        res["triton"].append(step_us(shape, B, S, 1 << 40))
    print(f"{shape} {B}x{S}: " + ", ".join(f"{k} {min(v):.1f} µs (runs {', '.join(f'{x:.1f}' for x in v)})"
                                        for k, v in res.items()), flush=True)
