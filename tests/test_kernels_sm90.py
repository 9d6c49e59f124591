"""Triton kernels compiled offline for Hopper (SM90), where a GPU-only compile failure or a
register spill would otherwise show only on the GPU: the fp8 producers (the norms and the
prologue that quantize for the fp8 GEMMs), the query kernel's W8A8 form, V2-Lite's
query-and-cache-row kernel, a prefill MLP's SiLU x up, and the prefill experts' grouped
GEMM (fp8 and bf16, its shipped configs), at DeepSeek's widths, each within the shared
memory a CTA may take. Their numerics are tested under the interpreter
(test_fp8_producer_quant.py, test_q_absorb.py, test_silu_mul.py, test_moe_prefill.py) and
on a GPU."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

from lowering.fused.q_absorb import Q_KV_CONFIG, W8A8_CONFIGS  # noqa: E402

_, W8A8_BLOCK_L, W8A8_WARPS, W8A8_STAGES = W8A8_CONFIGS[True]      # rows <= 16
QKV_BLOCK_L, QKV_SPLIT, QKV_WARPS, QKV_STAGES = Q_KV_CONFIG

# (module, kernel, signature, constexprs, num_warps or the launch options)
KERNELS = [
    ("lowering.fused.residual_norm_kernel", "residual_rms_norm_kernel",
     dict(p_ptr="*fp32", r_ptr="*bf16", w_ptr="*bf16", h_ptr="*bf16", y_ptr="*bf16",
          yq_ptr="*fp8e4nv", ys_ptr="*fp32", T="i32", N="i32", G="i32", stride_r="i32",
          eps="fp32"),
     dict(S=4, BLOCK=8192, QUANT_K=128, NATIVE_CAST=True), 8),
    ("lowering.fused.rms_norm_kernel", "rms_norm_kernel",
     dict(x_ptr="*bf16", w_ptr="*bf16", y_ptr="*bf16", N="i32", stride_x="i32", eps="fp32",
          yq_ptr="*fp8e4nv", ys_ptr="*fp32", G="i32"),
     dict(BLOCK=8192, QUANT_K=128, NATIVE_CAST=True), 8),
    ("lowering.fused.prologue_kernel", "qkv_prologue_kernel",
     dict(part_ptr="*fp32", wq_ptr="*bf16", wkv_ptr="*bf16", cos_ptr="*bf16", sin_ptr="*bf16",
          q_out_ptr="*bf16", kv_out_ptr="*bf16", qq_ptr="*fp8e4nv", qs_ptr="*fp32",
          stride_split="i32", stride_cs="i32", stride_cc="i32", eps_q="fp32", eps_kv="fp32"),
     dict(SPLIT=8, NQ=1536, L=512, R=64, BLOCK_Q=2048, BLOCK_L=512, BLOCK_H=32, ROPE=1,
          Q_ROPE=False, NH=1, HEADS=1, BLOCK_P=1, QUANT_K=128, QG=12, NATIVE_CAST=True), 4),
    ("lowering.fused.q_absorb_kernel", "q_absorb_kernel",
     dict(a_ptr="*fp8e4nv", w_ptr="*fp8e4nv", wuk_ptr="*bf16", cos_ptr="*bf16",
          sin_ptr="*bf16", y_ptr="*bf16", scale_ptr="*bf16", T="i32", N="i32",
          stride_at="i32", stride_cs="i32", ws_ptr="*fp32", xs_ptr="*fp32"),
     dict(Q=1536, P=128, R=64, L=512, BLOCK_T=16, BLOCK_K=128, BLOCK_L=W8A8_BLOCK_L, ROPE=1,
          DOT_F32=False, QUANT=False, W8A8=True, GROUP_N=128),
     dict(num_warps=W8A8_WARPS, num_stages=W8A8_STAGES)),
    ("lowering.fused.silu_mul_kernel", "silu_mul_kernel",
     dict(g_ptr="*bf16", u_ptr="*bf16", y_ptr="*bf16", N="i32", stride_g="i32",
          stride_u="i32", stride_y="i32"),
     dict(BLOCK_N=1024, LIBDEVICE=True), 4),
    ("lowering.fused.q_kv_absorb_kernel", "q_kv_absorb_kernel",
     dict(part_ptr="*fp32", wkv_ptr="*bf16", wuk_ptr="*bf16", cos_ptr="*fp32",
          sin_ptr="*fp32", y_ptr="*bf16", kv_ptr="*bf16", T="i32", N="i32",
          stride_split="i32", stride_cs="i32", stride_cc="i32", eps_kv="fp32"),
     dict(P=128, R=64, L=512, SPLIT=2, BLOCK_T=16, BLOCK_L=QKV_BLOCK_L, BLOCK_LK=512,
          BLOCK_H=32, ROPE=2, DOT_F32=False, L_SPLIT=QKV_SPLIT),
     dict(num_warps=QKV_WARPS, num_stages=QKV_STAGES)),
]
def _grouped_kernels():
    """The prefill experts' grouped GEMM with the configs it ships: W8A8
    (fp8_prefill.CONFIGS, grouped.CONFIG) and 16-bit (prefill.STREAM_CONFIGS at every tile
    stream_block_m picks), gate + up and down."""
    from lowering.gemm import grouped
    from lowering.moe import fp8_prefill, prefill
    out = []
    for w8a8 in (True, False):
        el = "*fp8e4nv" if w8a8 else "*bf16"
        sig = dict(a_ptr=el, as_ptr="*fp32", rows_ptr="*i32", w_ptr=el, ws_ptr="*fp32",
                   y_ptr="*bf16", starts_ptr="*i32", ends_ptr="*i32", tile_ends_ptr="*i32",
                   P="i32", N="i32", K="i32", E="i32", UP_ROW0="i32", UP_S_ROW0="i32",
                   TILES="i32", N_BLOCKS="i32", stride_a="i32", stride_as="i32", stride_we="i32", stride_wn="i32",
                   stride_se="i32", stride_sn="i32", stride_y="i32")
        if w8a8:    # (BLOCK_M, BLOCK_N, warps, stages), BLOCK_K the scale group
            cfgs = [(k, (bm, bn, 128, w, st)) for k, (bm, bn, w, st) in
                    [*fp8_prefill.CONFIGS.items(), ("gate_up", grouped.CONFIG)]]
        else:       # BLOCK_M -> {kernel: (BLOCK_N, BLOCK_K, warps, stages)}
            cfgs = [(k, (bm, *c)) for bm, by_kernel in prefill.STREAM_CONFIGS.items()
                    for k, c in by_kernel.items()]
        for kind, (bm, bn, bk, warps, stages) in dict.fromkeys(cfgs):
            out.append(("lowering.gemm.grouped_kernel", "grouped_kernel", sig,
                        dict(W8A8=w8a8, GATED=kind == "gate_up", BLOCK_E=256, BLOCK_M=bm,
                             BLOCK_N=bn, BLOCK_K=bk, GROUP_N=128, GROUP_T=8,
                             EVEN_K=True, ONE_GROUP=False, DOT_F32=False),
                        dict(num_warps=warps, num_stages=stages)))
        if w8a8:                    # an FP8 linear's prefill rows (grouped.prefill_linear)
            bm, bn, warps, stages = grouped.CONFIG
            out.append(("lowering.gemm.grouped_kernel", "grouped_kernel", sig,
                        dict(W8A8=True, GATED=False, BLOCK_E=1, BLOCK_M=bm, BLOCK_N=bn,
                             BLOCK_K=128, GROUP_N=128, GROUP_T=8, EVEN_K=True,
                             ONE_GROUP=True, DOT_F32=False),
                        dict(num_warps=warps, num_stages=stages)))
    return out


KERNELS += _grouped_kernels()
SMEM = 227 * 1024                       # the most shared memory a CTA may take on SM90


def _label(name: str, consts: dict) -> str:
    if name != "grouped_kernel":
        return name + ("_w8a8" if consts.get("W8A8") else "")
    kind = ("linear" if consts["ONE_GROUP"] else "gate_up" if consts["GATED"] else "down")
    return (f"{name}[{'w8a8' if consts['W8A8'] else 'bf16'},{kind},{consts['BLOCK_M']}x"
            f"{consts['BLOCK_N']}x{consts['BLOCK_K']}]")


def _compile_all() -> dict:
    """{kernel label: what is wrong with its SM90 build (spills to local memory, more
    shared memory than a CTA may take), or None}."""
    import importlib
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    out = {}
    for module, name, sig, consts, options in KERNELS:
        options = options if isinstance(options, dict) else dict(num_warps=options)
        kernel = getattr(importlib.import_module(module), name)
        # as a launch on the GPU specializes them (16-byte aligned pointers, strides of
        # DeepSeek's widths): without it no load is aligned enough to be pipelined
        attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]]
                 for n, t in sig.items() if t.startswith("*") or n.startswith("stride")}
        sig = {**sig, **{k: "constexpr" for k in consts}}
        k = triton.compile(ASTSource(kernel, signature=sig, constexprs=consts, attrs=attrs),
                           target=GPUTarget("cuda", 90, 32), options=options)
        out[_label(name, consts)] = (
            "spills" if ".local" in k.asm["ptx"] else
            f"{k.metadata.shared} bytes of shared memory" if k.metadata.shared > SMEM else None)
    return out


def test_kernels_compile_for_sm90_without_spills_within_shared_memory():
    """Compiled in a child process (the test session's TRITON_INTERPRET=1 would turn
    triton's own helpers into interpreted ones)."""
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"this triton cannot compile offline: {exc}")
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, __file__], env=env, cwd=root, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    faults = json.loads(run.stdout.strip().splitlines()[-1])
    assert faults == {_label(name, consts): None for _, name, _, consts, _ in KERNELS}


if __name__ == "__main__":
    print(json.dumps(_compile_all()))
