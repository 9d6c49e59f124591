"""A lower bound on one prefill forward of bench_prefill.py's multi-turn row (lab note,
not maintained): the routed experts' weight bytes at the copy bandwidth, plus every other
GEMM's and the attention's FLOPs at the measured bf16 GEMM ceiling, with no overlap
between the two (the experts read their weights after the layers before them). Pure
arithmetic over the model's config; no GPU.

    python docs/notes/bound_prefill_multiturn.py [--new 512] [--context 4096]
        [--tflops 775] [--tbps 4.3] [--hf-ms 12.73]
"""
import argparse
import sys

sys.path.insert(0, ".")                               # run from the repository root
from mla_ops.hf.models import make_config             # noqa: E402


def gemm(m, k, n):
    return 2.0 * m * k * n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="v3-moe")
    ap.add_argument("--new", type=int, default=512)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--tflops", type=float, default=775.0, help="the bf16 GEMM ceiling")
    ap.add_argument("--tbps", type=float, default=4.3, help="the copy bandwidth")
    ap.add_argument("--hf-ms", type=float, nargs="*", default=[12.73, 14.23, 15.39],
                    help="HF's measured times of the row (BENCHMARKS.md)")
    a = ap.parse_args()
    c = make_config(a.model, None)
    T, C, D = a.new, a.context, c.hidden_size
    N, P, R, V, L = (c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim,
                     c.v_head_dim, c.kv_lora_rank)
    q_in = c.q_lora_rank or D
    keys = C + T
    attn = {
        "q_a + kv_a": gemm(T, D, (c.q_lora_rank or 0) + L + R),
        "q_b (or q_proj)": gemm(T, q_in, N * (P + R)),
        "kv_b over context + new": gemm(keys, L, N * (P + V)),
        # causal: every new token sees the context and the new tokens up to itself
        "QK and PV": 2.0 * N * (P + R + V) * (T * C + T * (T + 1) / 2),
        "o_proj": gemm(T, N * V, D),
    }
    layers = c.num_hidden_layers
    dense = c.first_k_dense_replace
    flops = {k: v * layers for k, v in attn.items()}
    flops["dense MLPs"] = dense * 3 * gemm(T, D, c.intermediate_size)
    moe_layers = layers - dense
    flops["shared experts"] = moe_layers * 3 * gemm(T, D, c.moe_intermediate_size * c.n_shared_experts)
    expert_bytes = moe_layers * c.n_routed_experts * 3 * D * c.moe_intermediate_size * 2
    pairs = T * c.num_experts_per_tok
    flops_ms = sum(flops.values()) / (a.tflops * 1e12) * 1e3
    bytes_ms = expert_bytes / (a.tbps * 1e12) * 1e3
    print(f"{a.model}: {layers} layers ({dense} dense), {T} new tokens on {C} cached")
    for k, v in flops.items():
        print(f"  {k:28s} {v / 1e9:8.1f} GFLOP  {v / (a.tflops * 1e12) * 1e3:6.3f} ms")
    print(f"  routed experts' weights    {expert_bytes / 1e9:8.2f} GB     {bytes_ms:6.3f} ms "
          f"({pairs} pairs over {c.n_routed_experts} experts: every expert is read)")
    bound = flops_ms + bytes_ms
    print(f"  bound: {flops_ms:.3f} + {bytes_ms:.3f} = {bound:.3f} ms "
          f"(at {a.tflops:.0f} TFLOP/s and {a.tbps} TB/s)")
    for hf in a.hf_ms:
        print(f"  HF {hf:.2f} ms: the best speedup possible is {hf / bound:.2f}x "
              f"(2x asks {hf / 2:.2f} ms)")


if __name__ == "__main__":
    main()
