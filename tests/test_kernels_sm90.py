"""Triton kernels compiled offline for Hopper (SM90), where a GPU-only compile failure or a
register spill would otherwise show only on the GPU: the fp8 producers (the norms and the
prologue that quantize for the fp8 GEMMs), the query kernel's W8A8 form, V2-Lite's
query-and-cache-row kernel and the fp8 experts' grouped prefill GEMM, at DeepSeek's widths. Their numerics are tested under the
interpreter (test_fp8_producer_quant.py, test_q_absorb.py) and on a GPU."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

# (module, kernel, signature, constexprs, num_warps)
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
     dict(Q=1536, P=128, R=64, L=512, BLOCK_T=16, BLOCK_K=128, BLOCK_L=128, ROPE=1,
          DOT_F32=False, QUANT=False, W8A8=True, GROUP_N=128), 8),
    ("lowering.fused.q_kv_absorb_kernel", "q_kv_absorb_kernel",
     dict(part_ptr="*fp32", wkv_ptr="*bf16", wuk_ptr="*bf16", cos_ptr="*fp32",
          sin_ptr="*fp32", y_ptr="*bf16", kv_ptr="*bf16", T="i32", N="i32",
          stride_split="i32", stride_cs="i32", stride_cc="i32", eps_kv="fp32"),
     dict(P=128, R=64, L=512, SPLIT=2, BLOCK_T=16, BLOCK_L=128, BLOCK_LK=512, BLOCK_H=32,
          ROPE=2, DOT_F32=False, L_SPLIT=4), 4),
]
_GROUPED_SIG = dict(a_ptr="*fp8e4nv", as_ptr="*fp32", rows_ptr="*i32", w_ptr="*fp8e4nv",
                    ws_ptr="*fp32", y_ptr="*bf16", starts_ptr="*i32", ends_ptr="*i32",
                    tile_ends_ptr="*i32", P="i32", N="i32", K="i32", E="i32",
                    UP_ROW0="i32", UP_S_ROW0="i32", stride_a="i32", stride_as="i32",
                    stride_we="i32", stride_wn="i32", stride_se="i32", stride_sn="i32",
                    stride_y="i32")
for _gated in (True, False):       # an FP8 checkpoint's prefill experts: gate + up, down
    KERNELS.append(("lowering.gemm.fp8_grouped_kernel", "grouped_fp8_kernel", _GROUPED_SIG,
                    dict(GATED=_gated, BLOCK_E=256, BLOCK_M=64, BLOCK_N=128, BLOCK_K=128,
                         GROUP_N=128, EVEN_K=True, DOT_F32=False), 8))


def _compile_all() -> dict:
    """{kernel name: whether its SM90 PTX uses local memory (spills)}."""
    import importlib
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    out = {}
    for module, name, sig, consts, warps in KERNELS:
        name = name + ("_gated" if consts.get("GATED") else "")
        kernel = getattr(importlib.import_module(module), name.removesuffix("_gated"))
        sig = {**sig, **{k: "constexpr" for k in consts}}
        k = triton.compile(ASTSource(kernel, signature=sig, constexprs=consts),
                           target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
        out[name] = ".local" in k.asm["ptx"]
    return out


def test_kernels_compile_for_sm90_without_spills():
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
    spills = json.loads(run.stdout.strip().splitlines()[-1])
    assert spills == {name + ("_gated" if consts.get("GATED") else ""): False
                      for _, name, _, consts, _ in KERNELS}


if __name__ == "__main__":
    print(json.dumps(_compile_all()))
