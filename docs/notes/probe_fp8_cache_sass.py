"""The fp8-cache decode configs compiled for SM90 without a GPU: registers, spills, shared
memory, whether the tile loads became asynchronous copies, and the shared-memory
wavefronts of the main loop per key (what bounds a kernel that reads its tiles through
shared memory several times; an H200 SM serves one wavefront of 128 bytes per clock).

    python docs/notes/probe_fp8_cache_sass.py [NAME ...]     (names: the sweep's candidates)

Run without TRITON_INTERPRET. Static counts: the main loop is the longest backward branch
of the SASS; each LDS / STS / LDSM / LDL / STL warp instruction counts max(1, bytes / 128)
wavefronts (no bank conflicts assumed), times the warps, over the tile's keys.
"""
from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from lowering.decode.triton_decode_kernel import mla_decode_stage1_kernel  # noqa: E402
from lowering.decode.triton_fp8_cache_kernel import mla_decode_fp8_cache_kernel  # noqa: E402
from sweep_fp8_cache_decode import CANDIDATES  # noqa: E402

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
WIDTH = {".128": 16, ".64": 8, ".U16": 2, ".S16": 2, ".U8": 1, ".S8": 1}


def compile_config(cfg, H=16, direct=False):
    sig = {"q_ptr": "*bf16", "kv_ptr": "*fp8e4nv", "block_table_ptr": "*i32",
           "seqlens_ptr": "*i32", "q_scale_ptr": "*fp32", "k_scale_ptr": "*fp32",
           "out_ptr": "*bf16" if direct else "*fp32", "lse_ptr": "*fp32", "sm_scale": "fp32",
           "stride_qb": "i32", "stride_bt": "i32", "max_blocks": "i32", "num_blocks": "i32",
           "num_splits": "i32"}
    consts = dict(S_Q=1, H=H, L=512, R=64, PAGE=64, CAUSAL=True, DIRECT=direct, FIXED_CHUNK=0,
                  BLOCK_N=cfg["BLOCK_N"], DOT_F32=False)
    if cfg.get("kernel") == "fp8_cache":
        kernel = mla_decode_fp8_cache_kernel
        consts.update(FP8_Q=False, BLOCK_M=cfg.get("BLOCK_M", 16),
                      RELOAD_V=cfg.get("RELOAD_V", False))
    else:
        kernel = mla_decode_stage1_kernel
        consts.update(KV_KIND=1, BLOCK_M=cfg.get("BLOCK_M", 64 if H >= 64 else 16), V_PARTS=1)
    names = list(sig)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if sig[n].startswith("*") or n == "stride_qb"}
    sig.update({k: "constexpr" for k in consts})
    k = triton.compile(ASTSource(kernel, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        usage = subprocess.run([str(BIN / "cuobjdump"), "--dump-resource-usage", f.name],
                               capture_output=True, text=True).stdout
        sass = subprocess.run([str(BIN / "cuobjdump"), "-sass", f.name],
                              capture_output=True, text=True).stdout
    return k, usage, sass


def loop_wavefronts(sass: str) -> int:
    lines = [ln for ln in sass.splitlines() if re.search(r"/\*[0-9a-f]{4,}\*/", ln)]

    def addr(ln):
        return int(re.search(r"/\*([0-9a-f]{4,})\*/", ln).group(1), 16)
    span = None
    for ln in lines:
        m = re.search(r"BRA\s+0x([0-9a-f]+)", ln)
        if m and int(m.group(1), 16) < addr(ln):
            lo, hi = int(m.group(1), 16), addr(ln)
            if span is None or hi - lo > span[1] - span[0]:
                span = (lo, hi)
    total = 0
    for ln in lines:
        m = re.search(r"\b(LDSM|LDS|STS|STSM|LDL|STL)(\.[.A-Z0-9]*)?\s", ln)
        if span is None or not m or not span[0] <= addr(ln) <= span[1]:
            continue
        op, suffix = m.group(1), m.group(2) or ""
        size = next((v for s, v in WIDTH.items() if s in suffix), 4)
        if op in ("LDSM", "STSM"):
            size = 16 if ".4" in suffix else 8 if ".2" in suffix else 4
        total += max(1, size * 32 // 128)
    return total


def main(names):
    print(f"triton {triton.__version__}, SM90, 16 heads, bf16 q, fp8 cache, split path")
    print(f"{'candidate':26s} {'regs':>4s} {'spill B':>7s} {'smem KB':>7s} {'async':>5s} "
          f"{'wavefronts/key':>14s}")
    for name in names:
        width, cfg = CANDIDATES[name]
        k, usage, sass = compile_config(cfg, H=16 if width == "narrow" else 128)
        regs = re.search(r"REG:(\d+)", usage).group(1)
        stack = re.search(r"STACK:(\d+)", usage).group(1)
        per_key = loop_wavefronts(sass) * cfg["num_warps"] / cfg["BLOCK_N"]
        print(f"{name:26s} {regs:>4s} {stack:>7s} {k.metadata.shared / 1024:7.1f} "
              f"{sass.count('LDGSTS'):5d} {per_key:14.1f}")


if __name__ == "__main__":
    main(sys.argv[1:] or list(CANDIDATES))
