"""The fp8-cache kernel's QK stage alone, each step's result written out and checked
against torch (GPU probe, not maintained; NOTES-decode-fp8.md, "QK straight from the fp8
ring slot").

One CTA: `_q_terms` of lowering/decode/gluon_rows_kernel.py puts a bf16 query's
[NR, 576] rows into shared memory as e4m3 [hi; lo] with a power-of-two scale per row;
one 64-key e4m3 tile comes in by TMA; the fp8 MMA chain S^T = K [hi; lo]^T runs; the
halves are summed as the kernel sums them. Printed, per NR in (16, 32): whether the
scales and the shared-memory [hi; lo] rows equal torch's, whether hi / lo computed
from registers do, and the error of the raw S^T, of the hi-only chain and of the sum.
This is how the lo rows were found wrong under triton 3.6 (its ptxas widened the stack
pointer register in place of the packed hi).

    python docs/notes/probe_fp8_qk_terms.py            # on an SM90 GPU
    python docs/notes/probe_fp8_qk_terms.py --sass     # offline: the kernel's stack-pointer reads
"""
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier,
                                                              warpgroup_mma, warpgroup_mma_wait)

sys.path.insert(0, ".")                             # run from the repository root
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: E402

from lowering.decode.gluon_common import tma_load  # noqa: E402
from lowering.decode.gluon_rows_kernel import _q_terms  # noqa: E402


@gluon.jit
def qk_stages_kernel(q_ptr, kv_desc, raw_ptr, sum_ptr, s_ptr, qread_ptr, hionly_ptr, reg_ptr,
                     NR: gl.constexpr, BN: gl.constexpr, VIA_TMA: gl.constexpr):
    NCH: gl.constexpr = 9
    kv: gl.constexpr = gl.float8e4nv
    sK = gl.allocate_shared_memory(kv, [NCH, BN, 64], gl.NVMMASharedLayout.get_default_for([BN, 64], kv))
    sQ = gl.allocate_shared_memory(kv, [NCH, 2 * NR, 64], gl.NVMMASharedLayout.get_default_for([2 * NR, 64], kv))
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, NR, 16])
    s2_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 2 * NR, 32])
    s1_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, NR, 32])
    q_s = _q_terms(q_ptr, sQ, 0, NR, NR)
    # read sQ back
    r_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rr = gl.arange(0, 2 * NR, layout=gl.SliceLayout(1, r_l))
    rc = gl.arange(0, 64, layout=gl.SliceLayout(0, r_l))
    for c in gl.static_range(NCH):
        x = sQ.index(c).load(r_l)
        gl.store(qread_ptr + c * 2 * NR * 64 + rr[:, None] * 64 + rc[None, :], x.to(gl.float32))
    sl1: gl.constexpr = gl.SliceLayout(1, r_l)
    r1 = gl.arange(0, NR, layout=sl1)
    x0 = gl.load(q_ptr + r1[:, None] * 576 + rc[None, :]).to(gl.float32)
    sv = gl.convert_layout(q_s, sl1)
    xs = x0 * sv[:, None]
    hi = xs.to(gl.float8e4nv)
    lo = (xs - hi.to(gl.float32)).to(gl.float8e4nv)
    gl.store(reg_ptr + r1[:, None] * 64 + rc[None, :], hi.to(gl.float32))
    gl.store(reg_ptr + NR * 64 + r1[:, None] * 64 + rc[None, :], lo.to(gl.float32))
    gl.store(s_ptr + gl.arange(0, NR, layout=sl1), gl.convert_layout(q_s, sl1))
    if VIA_TMA:
        mbarrier.expect(bar, NCH * BN * 64)
        for c in gl.static_range(NCH):
            tma_load(kv_desc, [0, c * 64], bar, sK.index(c))
        mbarrier.wait(bar, 0)
    fence_async_shared()
    tok = warpgroup_mma(sK.index(0), sQ.index(0).permute((1, 0)),
                        gl.zeros([BN, 2 * NR], gl.float32, s2_l), is_async=True)
    for c in gl.static_range(1, NCH):
        tok = warpgroup_mma(sK.index(c), sQ.index(c).permute((1, 0)), tok, is_async=True)
    s2 = warpgroup_mma_wait(num_outstanding=0, deps=[tok])
    o_l: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
    kr = gl.arange(0, BN, layout=gl.SliceLayout(1, o_l))
    c2 = gl.arange(0, 2 * NR, layout=gl.SliceLayout(0, o_l))
    c1 = gl.arange(0, NR, layout=gl.SliceLayout(0, o_l))
    gl.store(raw_ptr + kr[:, None] * (2 * NR) + c2[None, :], gl.convert_layout(s2, o_l))
    hi, lo = gl.split(gl.permute(gl.reshape(s2, [BN, 2, NR]), [0, 2, 1]))
    sc = gl.convert_layout(hi + lo, s_l)
    gl.store(sum_ptr + kr[:, None] * NR + c1[None, :], gl.convert_layout(sc, o_l))
    tok1 = warpgroup_mma(sK.index(0), sQ.index(0).slice(0, NR).permute((1, 0)),
                         gl.zeros([BN, NR], gl.float32, s1_l), is_async=True)
    for c in gl.static_range(1, NCH):
        tok1 = warpgroup_mma(sK.index(c), sQ.index(c).slice(0, NR).permute((1, 0)), tok1, is_async=True)
    h1 = warpgroup_mma_wait(num_outstanding=0, deps=[tok1])
    gl.store(hionly_ptr + kr[:, None] * NR + c1[None, :], gl.convert_layout(h1, o_l))



def main():
    torch.manual_seed(0)
    dev = "cuda"
    BN = 64
    for NR in (16, 32):
        q = torch.randn(NR, 576, device=dev, dtype=torch.bfloat16)
        q[3] *= 1e4
        q[5] *= 1e-4
        kv = torch.randn(BN, 576, device=dev)
        kv8 = (kv / kv.abs().amax() * 448).to(torch.float8_e4m3fn)
        lay = gl.NVMMASharedLayout.get_default_for([BN, 64], gl.float8e4nv)
        desc = TensorDescriptor.from_tensor(kv8, [BN, 64], lay)
        raw = torch.full((BN, 2 * NR), float("nan"), device=dev)
        sm = torch.full((BN, NR), float("nan"), device=dev)
        s = torch.zeros(NR, device=dev)
        qread = torch.zeros(9, 2 * NR, 64, device=dev)
        h1 = torch.full((BN, NR), float("nan"), device=dev)
        reg = torch.zeros(2 * NR, 64, device=dev)
        qk_stages_kernel[(1,)](q, desc, raw, sm, s, qread, h1, reg, NR=NR, BN=BN, VIA_TMA=True, num_warps=4)
        torch.cuda.synchronize()
        qf = q.float()
        amax = qf.abs().amax(1).clamp_min(1e-30)
        s_ref = torch.exp2(torch.floor(torch.log2(256.0 / amax)))
        xs = qf * s_ref[:, None]
        hi = xs.to(torch.float8_e4m3fn).float()
        lo = (xs - hi).to(torch.float8_e4m3fn).float()
        qread_ref = torch.cat([hi, lo], 0).reshape(2 * NR, 9, 64).permute(1, 0, 2)
        K = kv8.float()
        raw_ref = K @ torch.cat([hi, lo], 0).T
        print(f"NR={NR} s match {torch.equal(s, s_ref)}  qread match "
              f"{torch.equal(qread, qread_ref)} (max diff {(qread - qread_ref).abs().max():.3g})")
        print("  regs hi/lo of chunk 0 match:", torch.equal(reg[:NR], hi[:, :64]), torch.equal(reg[NR:], lo[:, :64]),
              "qread hi", torch.equal(qread[:, :NR], qread_ref[:, :NR]), "qread lo", torch.equal(qread[:, NR:], qread_ref[:, NR:]))
        bad = (qread != qread_ref).nonzero()[:5].tolist()
        for c_, r_, k_ in bad:
            print("   bad", c_, r_, k_, float(qread[c_, r_, k_]), float(qread_ref[c_, r_, k_]))
        def err(a, b):
            return ((a - b).abs().max() / b.abs().max()).item()
        print(f"  raw vs K[hi;lo]^T  {err(raw, raw_ref):.3e}")
        print(f"  hi-only MMA vs K hi^T  {err(h1, K @ hi.T):.3e}")
        print(f"  sum vs K(hi+lo)^T  {err(sm, K @ (hi + lo).T):.3e}")
        print(f"  sum vs raw halves  {err(sm, raw[:, :NR] + raw[:, NR:]):.3e}")
        print(f"  sum vs K (q s)^T   {err(sm, K @ xs.T):.3e}")
        if err(raw, raw_ref) > 1e-3:
            # which columns of raw match which reference column
            for j in range(min(2 * NR, 8)):
                d = ((raw[:, j:j + 1] - raw_ref).abs().amax(0) / raw_ref.abs().amax(0))
                print(f"   raw col {j}: best ref col {int(d.argmin())} err {float(d.min()):.2e}")
            # transposed K?
            print("  raw vs (K^T-ish) tries:", err(raw, (K.reshape(BN, 9, 64).permute(1, 0, 2).reshape(9 * BN, 64)[:BN] @ torch.cat([hi, lo], 0)[:, :64].T)))


def sass():
    """Stack-pointer reads in the rows kernel's SASS, compiled offline for SM90 with the
    installed triton (whose ptxas and nvdisasm it ships)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from lowering.decode.gluon_rows_kernel import mla_decode_rows_kernel
    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    lay = gl.NVMMASharedLayout.get_default_for([64, 64], gl.float8e4nv)
    for nr, s_q in ((16, 1), (32, 2)):
        cs = dict(S_Q=s_q, H=16, PAGE=64, BN=64, NR=nr, STAGES=2, DIRECT=False, CAUSAL=True,
                  FP8=True)
        sig = {"q_ptr": "*bf16", "kv_desc": f"tensordesc<fp8e4nv[64, 64],{lay!r}>",
               "table_ptr": "*i32", "lens_ptr": "*i32", "ks_ptr": "*fp32", "o_ptr": "*fp32",
               "lse_ptr": "*fp32", "sm_scale_log2": "fp32", "stride_bt": "i32",
               "max_blocks": "i32", "num_blocks": "i32", "num_splits": "i32"}
        sig.update({k: "constexpr" for k in cs})
        k = triton.compile(GluonASTSource(mla_decode_rows_kernel, signature=sig, constexprs=cs),
                           target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(k.asm["cubin"])
            f.flush()
            text = subprocess.run([str(nvdisasm), "-c", f.name], capture_output=True,
                                  text=True).stdout
        print(f"triton {triton.__version__}, NR = {nr}: "
              f"{len(re.findall(r'UNPACK_B R[0-9]+, R1[^0-9]', text))} stack-pointer reads")


if __name__ == "__main__":
    sass() if "--sass" in sys.argv else main()
