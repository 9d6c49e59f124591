"""W_UK_T / W_UV of an FP8 checkpoint read as e4m3 blocks vs dequantized to bf16 at
convert (the form before), in the V3-shaped decode step of bench_fp8_weights.py (probe,
not maintained): the same converted fp8 model with its absorbed weights swapped between
the two forms, each form captured as DecodeGraph (compiled) and timed in alternation;
the bf16-weight model beside them for the issue's ratio. Also the two forms' greedy
tokens, and the two absorbed GEMMs alone (head GEMM, q_b + absorption).

    python docs/notes/probe_fp8_absorbed.py [B,B...] [S]        # default 1,32 4096

Needs the e4m3 absorbed weights of commit 3599ed5 (reverted on main: no gain): run it at
that commit, where the probe is the self-contained version the recorded numbers came from.
"""
import sys, argparse, torch
sys.path.insert(0, "benchmarks")                    # run from the repository root
import mla_ops.hf
from mla_ops.hf.fp8_models import quantize_fp8
from mla_ops.hf.models import build_model
from bench_fp8_weights import v3_moe_config, step_bytes, HBM_BYTES_PER_S
from probe_common import graph_us_write_flush, step_ms
from lowering.gemm.head_gemm import dequantize_heads


def forms(model):
    """{form: [(mla, W_UK_T, W_UV, s_uk, s_uv)]} for the model's converted layers."""
    e4m3, bf16 = [], []
    for m in model.modules():
        mla = getattr(m, "mla_attn", None)
        if mla is None or mla.W_UK_T_scale is None:
            continue
        e4m3.append((mla, mla.W_UK_T, mla.W_UV, mla.W_UK_T_scale, mla.W_UV_scale))
        bf16.append((mla, dequantize_heads(mla.W_UK_T, mla.W_UK_T_scale, 2, torch.bfloat16),
                     dequantize_heads(mla.W_UV, mla.W_UV_scale, 1, torch.bfloat16), None, None))
    return {"e4m3": e4m3, "bf16-absorbed": bf16}


def use(form):
    for mla, uk, uv, su, sv in form:
        mla.W_UK_T, mla.W_UV, mla.W_UK_T_scale, mla.W_UV_scale = uk, uv, su, sv


def kernels(model, dev):
    """The two absorbed GEMMs of one layer alone, both forms, 1 and 32 rows."""
    from lowering.gemm.head_gemm import absorb_output
    from lowering.gemm.fp8_act_quant import quantize_rows_torch
    attn = next(m for m in model.modules() if hasattr(m, "mla_attn"))
    mla, fm = attn.mla_attn, forms(model)
    e, b = fm["e4m3"][0], fm["bf16-absorbed"][0]
    N, L = mla.num_heads, mla.kv_lora_rank
    w, ws = attn.q_b_proj.weight, attn.q_b_proj.weight_scale_inv
    for t in (1, 32):
        o = torch.randn(t, N, L, device=dev, dtype=torch.bfloat16)
        out = torch.empty(t, N * mla.v_head_dim, device=dev, dtype=torch.bfloat16)
        q_a = torch.randn(t, w.shape[1], device=dev, dtype=torch.bfloat16)
        q_q, q_s = quantize_rows_torch(q_a, 128)
        cos = torch.randn(t, 64, device=dev, dtype=torch.bfloat16)
        sin = torch.randn(t, 64, device=dev, dtype=torch.bfloat16)
        row = {}
        for name, (_, uk, uv, su, sv) in (("bf16", b), ("e4m3", e)):
            row[name + " W_UV"] = graph_us_write_flush(lambda: absorb_output(o, uv, out, sv), 50)
            row[name + " q_b+W_UK_T"] = graph_us_write_flush(
                lambda: torch.ops.mla.decode_q_absorb_w8a8(q_a, q_q, q_s, w, ws, uk, cos, sin,
                                                          1, 128, 128, None, su), 50)
        print(f"  absorbed GEMMs alone, {t} rows (µs, L2 flushed): "
              + ", ".join(f"{k} {v:.1f}" for k, v in row.items()), flush=True)


def main():
    Bs = [int(b) for b in (sys.argv[1] if len(sys.argv) > 1 else "1,32").split(",")]
    S = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
    args = argparse.Namespace(layers=2, dense_layers=1, experts=256, top_k=8)
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    cfg = v3_moe_config(args)
    torch.manual_seed(0)
    bf16 = build_model(cfg, dev, torch.bfloat16)
    fp8 = mla_ops.hf.convert(quantize_fp8(bf16), fuse_experts=True)
    bf16 = mla_ops.hf.convert(bf16, fuse_experts=True)
    fm = forms(fp8)
    print(f"{len(fm['e4m3'])} layers keep e4m3 W_UK_T / W_UV", flush=True)
    kernels(fp8, dev)
    for B in Bs:
        res, toks = {}, {}
        for rnd in range(2):                                 # alternate, twice
            for name in ("bf16-absorbed", "e4m3"):
                use(fm[name])
                ms, toks[name] = step_ms(fp8, cfg, B, S, dev, tokens=8)
                res.setdefault(name, []).append(ms)
                if rnd == 0 and name == "e4m3":
                    floor = step_bytes(fp8, cfg, B, S) / HBM_BYTES_PER_S * 1e3
            if rnd == 0:
                ms, _ = step_ms(bf16, cfg, B, S, dev)
                res["bf16 weights"] = [ms]
        same = torch.equal(toks["e4m3"], toks["bf16-absorbed"])
        print(f"B={B} S={S} ms/step: " + ", ".join(f"{k} {'/'.join(f'{v:.4f}' for v in vs)}"
                                                  for k, vs in res.items())
              + f"; e4m3 floor {floor:.4f} (4.3 TB/s); greedy tokens equal: {same}", flush=True)
        best = {k: min(v) for k, v in res.items()}
        print(f"  bf16 / fp8: e4m3 {best['bf16 weights'] / best['e4m3']:.3f}x, "
              f"bf16-absorbed {best['bf16 weights'] / best['bf16-absorbed']:.3f}x; "
              f"e4m3 / floor {best['e4m3'] / floor:.2f}x", flush=True)


if __name__ == "__main__":
    main()
