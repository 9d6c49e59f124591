"""The fp8-cache decode kernel at the config table's 16-head entries, compiled for SM90
without a GPU: it compiles (bf16 and fp8 query, split and direct), its P V runs as
warpgroup MMAs, it does not spill heavily, and ctas_per_sm CTAs fit an SM's shared memory,
which the table's split sizing assumes. The compile runs in a child process: this
session's TRITON_INTERPRET=1 would interpret triton's own helpers."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

HOPPER_SMEM_PER_SM = 233472      # bytes of shared memory on an H100 / H200 SM
MAX_STACK = 512                  # bytes of spills allowed (the entry of 32-key tiles: none
                                 # with triton 3.9; 64-key tiles spill 320)


def compile_for_sm90(fp8_q: bool, direct: bool) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import lowering.decode.triton_decode as td
    from lowering.decode.triton_fp8_cache_kernel import mla_decode_fp8_cache_kernel as kernel
    cfg = td.CONFIGS[(2 if fp8_q else 1, "narrow", "gpu")]
    sig = {"q_ptr": "*fp8e4nv" if fp8_q else "*bf16", "kv_ptr": "*fp8e4nv",
           "block_table_ptr": "*i32", "seqlens_ptr": "*i32", "q_scale_ptr": "*fp32",
           "k_scale_ptr": "*fp32", "out_ptr": "*bf16" if direct else "*fp32",
           "lse_ptr": "*fp32", "sm_scale": "fp32", "stride_qb": "i32", "stride_bt": "i32",
           "max_blocks": "i32", "num_blocks": "i32", "num_splits": "i32"}
    consts = dict(S_Q=1, H=16, L=512, R=64, PAGE=64, CAUSAL=True, DIRECT=direct, FIXED_CHUNK=0,
                  FP8_Q=fp8_q, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                  RELOAD_V=cfg.get("RELOAD_V", False), DOT_F32=False)
    names = list(sig)
    # what a launch specializes on: 16-byte aligned pointers and q's batch stride
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if sig[n].startswith("*") or n == "stride_qb"}
    sig.update({k: "constexpr" for k in consts})
    src = ASTSource(kernel, signature=sig, constexprs=consts, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]))
    stack = None
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if tool.exists():
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(k.asm["cubin"])
            f.flush()
            usage = subprocess.run([str(tool), "--dump-resource-usage", f.name],
                                   capture_output=True, text=True).stdout
        found = re.search(r"STACK:(\d+)", usage)
        stack = int(found.group(1)) if found else None
    return {"wgmma": k.asm["ptx"].count("wgmma.mma_async"), "shared": k.metadata.shared,
            "stack": stack, "ctas_per_sm": cfg["ctas_per_sm"]}


@pytest.mark.parametrize("fp8_q,direct", [(False, False), (True, True)])
def test_table_config_compiles_for_sm90(fp8_q, direct):
    pytest.importorskip("triton")
    import lowering.decode.triton_decode as td
    if td.CONFIGS[(2 if fp8_q else 1, "narrow", "gpu")].get("kernel") != "fp8_cache":
        pytest.skip("the table's 16-head entry runs the stage-1 kernel")
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"this triton cannot compile for SM90 offline: {exc}")
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, __file__, json.dumps([fp8_q, direct])], env=env,
                         cwd=root, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    facts = json.loads(run.stdout.strip().splitlines()[-1])
    assert facts["wgmma"] >= 4, "P V no longer runs as warpgroup MMAs"
    assert facts["ctas_per_sm"] * facts["shared"] <= HOPPER_SMEM_PER_SM, facts
    if facts["stack"] is not None:
        assert facts["stack"] <= MAX_STACK, f"the kernel spills {facts['stack']} bytes"


if __name__ == "__main__":
    print(json.dumps(compile_for_sm90(*json.loads(sys.argv[1]))))
