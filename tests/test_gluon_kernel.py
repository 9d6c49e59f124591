"""The Gluon decode kernel without a GPU: it compiles for SM90 with the installed triton
(Gluon has no CPU interpreter; its numerics are tested on the GPU in test_gpu_gluon.py),
and the backend refuses CPU tensors with a reason."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lowering

HOPPER_SMEM = 232448        # bytes of shared memory one Hopper CTA may use


def _compile_for_sm90(constexprs):
    """Compile the kernel for SM90 and return its facts (run in a child process: the
    test session's TRITON_INTERPRET=1 turns triton's own helpers into interpreted ones,
    which a compiled kernel cannot call)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    from lowering.gluon_decode_kernel import mla_decode_gluon_kernel
    bn = constexprs["BN"]
    layouts = {n: gl.NVMMASharedLayout.get_default_for(shape, gl.bfloat16)
               for n, shape in (("q", [64, 64]), ("kv", [bn, 64]))}
    sig = {"q_desc": f"tensordesc<bf16[64, 64],{layouts['q']!r}>",
           "kv_desc": f"tensordesc<bf16[{bn}, 64],{layouts['kv']!r}>",
           "table_ptr": "*i32", "lens_ptr": "*i32",
           "o_ptr": "*bf16" if constexprs["DIRECT"] else "*fp32", "lse_ptr": "*fp32",
           "scale_log2": "fp32", "stride_bt": "i32", "max_blocks": "i32", "num_blocks": "i32",
           "num_splits": "i32"}
    sig.update({k: "constexpr" for k in constexprs})
    src = GluonASTSource(mla_decode_gluon_kernel, signature=sig, constexprs=constexprs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    ptx = k.asm["ptx"]
    return {"wgmma": len(re.findall(r"wgmma\.mma_async", ptx)),
            "wait4": bool(re.search(r"wgmma\.wait_group\.sync\.aligned 4;", ptx)),
            "tma": "cp.async.bulk.tensor" in ptx, "shared": k.metadata.shared}


@pytest.mark.parametrize("s_q,H,page,direct,causal", [(1, 128, 64, False, True),
                                                     (2, 64, 32, True, False)])
def test_kernel_compiles_for_sm90(s_q, H, page, direct, causal):
    pytest.importorskip("triton")
    from lowering.gluon_decode import CONFIG
    try:
        import triton.experimental.gluon._runtime  # noqa: F401
        from triton.backends.compiler import GPUTarget  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"this triton cannot compile Gluon kernels offline: {exc}")
    cs = dict(S_Q=s_q, H=H, PAGE=page, BN=CONFIG["BN"], STAGES=CONFIG["STAGES"],
              DIRECT=direct, CAUSAL=causal)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, __file__, json.dumps(cs)], env=env, cwd=root,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    facts = json.loads(run.stdout.strip().splitlines()[-1])
    # per consumer step 9 QK and 8 P V wgmma groups (BN = 32: 4 and 2 instructions each),
    # in both warpgroups' first-tile, steady and last-tile paths
    assert facts["wgmma"] >= 100
    assert facts["wait4"], "the QK / P V overlap (wait until 4 groups remain) is gone"
    assert facts["tma"]
    assert 0 < facts["shared"] <= HOPPER_SMEM


def test_backend_names_what_is_missing_on_cpu():
    q = torch.randn(1, 1, 128, 576, dtype=torch.bfloat16)
    kv = torch.randn(2, 64, 576, dtype=torch.bfloat16)
    bt = torch.zeros(1, 2, dtype=torch.int32)
    cl = torch.tensor([70], dtype=torch.int32)
    with pytest.raises(lowering.BackendUnavailable, match="gluon.*CUDA"):
        lowering.mla_decode(q, kv, bt, cl, 0.1, backend="gluon")
    assert lowering.select_backend(q, kv) == "reference"


if __name__ == "__main__":
    print(json.dumps(_compile_for_sm90(json.loads(sys.argv[1]))))
