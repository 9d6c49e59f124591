"""The Gluon decode kernels (bf16: the pair and the ring kernel; fp8 q x fp8 cache) without
a GPU: they compile for SM90 with the installed triton (Gluon has no CPU interpreter; their numerics are tested
on the GPU in test_gpu_gluon.py), and both routes refuse CPU tensors with a reason."""
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


def _compile_for_sm90(constexprs, kind):
    """Compile a kernel ("pair", "ring", "fp8", "fp8-bf16q" or "rows") for SM90 and return its facts (run in a
    child process: the test session's TRITON_INTERPRET=1 turns triton's own helpers into
    interpreted ones, which a compiled kernel cannot call)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    if kind == "rows":
        return _compile_rows(constexprs, triton, GPUTarget, gl, GluonASTSource)
    fp8 = kind in ("fp8", "fp8-bf16q")
    bf16q = kind == "fp8-bf16q"
    pair = kind in ("pair", "pair-fp8")
    if fp8:
        from lowering.decode.gluon_fp8_kernel import mla_decode_fp8_kernel as kernel
        el, ty = gl.float8e4nv, "fp8e4nv"
    elif pair:
        from lowering.decode.gluon_pair_kernel import mla_decode_pair_kernel as kernel
        el, ty = gl.bfloat16, "bf16"
    else:
        from lowering.decode.gluon_ring_kernel import mla_decode_gluon_kernel as kernel
        el, ty = gl.bfloat16, "bf16"
    el_kv, ty_kv = (gl.float8e4nv, "fp8e4nv") if kind == "pair-fp8" else (el, ty)
    bn = constexprs["BN"]
    layouts = {"q": gl.NVMMASharedLayout.get_default_for([64, 64], el),
               "kv": gl.NVMMASharedLayout.get_default_for([bn, 64], el_kv)}
    sig = {"q_desc": f"tensordesc<{ty}[64, 64],{layouts['q']!r}>",
           "kv_desc": f"tensordesc<{ty_kv}[{bn}, 64],{layouts['kv']!r}>",
           "table_ptr": "*i32", "lens_ptr": "*i32"}
    if fp8:                                 # BF16Q: q's two e4m3 terms, scales per row
        constexprs = dict(constexprs, BF16Q=bf16q)
        sig.update(qs_ptr="*fp32", ks_ptr="*fp32")
    elif pair:                              # FP8: an e4m3 cache, its scale at ks_ptr
        constexprs = dict(constexprs, FP8=kind == "pair-fp8")
        sig.update(ks_ptr="*fp32")
    sig.update({"o_ptr": "*bf16" if constexprs["DIRECT"] else "*fp32", "lse_ptr": "*fp32",
                "scale_log2": "fp32", "stride_bt": "i32", "max_blocks": "i32",
                "num_blocks": "i32", "num_splits": "i32"})
    if fp8:
        sig = {("sm_scale_log2" if k == "scale_log2" else k): v for k, v in sig.items()}
    sig.update({k: "constexpr" for k in constexprs})
    src = GluonASTSource(kernel, signature=sig, constexprs=constexprs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    return _facts(k)


def _compile_rows(constexprs, triton, GPUTarget, gl, GluonASTSource):
    from lowering.decode.gluon_rows_kernel import mla_decode_rows_kernel as kernel
    bn = constexprs["BN"]
    el, ty = (gl.float8e4nv, "fp8e4nv") if constexprs["FP8"] else (gl.bfloat16, "bf16")
    lay = gl.NVMMASharedLayout.get_default_for([bn, 64], el)
    sig = {"q_ptr": "*bf16", "kv_desc": f"tensordesc<{ty}[{bn}, 64],{lay!r}>",
           "table_ptr": "*i32", "lens_ptr": "*i32", "ks_ptr": "*fp32",
           "o_ptr": "*bf16" if constexprs["DIRECT"] else "*fp32", "lse_ptr": "*fp32",
           "sm_scale_log2": "fp32", "stride_bt": "i32", "max_blocks": "i32",
           "num_blocks": "i32", "num_splits": "i32"}
    sig.update({k: "constexpr" for k in constexprs})
    src = GluonASTSource(kernel, signature=sig, constexprs=constexprs)
    return _facts(triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                 options=dict(num_warps=4)))


def _facts(k):
    import triton
    ptx = k.asm["ptx"]
    # bytes of local memory per thread (spilled registers), where triton ships cuobjdump
    stack = sp_reads = None
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    if (bin_dir / "cuobjdump").exists():
        import tempfile
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(k.asm["cubin"])
            f.flush()
            usage = subprocess.run([str(bin_dir / "cuobjdump"), "--dump-resource-usage",
                                    f.name], capture_output=True, text=True).stdout
            sass = (subprocess.run([str(bin_dir / "nvdisasm"), "-c", f.name],
                                   capture_output=True, text=True).stdout
                    if (bin_dir / "nvdisasm").exists() else None)
        found = re.search(r"STACK:(\d+)", usage)
        stack = int(found.group(1)) if found else None
        # R1 holds the stack pointer (set once, from the constant bank): an instruction
        # that widens it as e4m3 data is ptxas miscompiling a cast's packed registers
        if sass:
            sp_reads = len(re.findall(r"UNPACK_B R\d+, R1\b", sass))
    return {"wgmma": len(re.findall(r"wgmma\.mma_async", ptx)),
            "waits": sorted(set(int(n) for n in
                                re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+);", ptx))),
            "tma": "cp.async.bulk.tensor" in ptx, "shared": k.metadata.shared, "stack": stack,
            "sp_reads": sp_reads}


def _compiled_facts(cs, kind):
    """_compile_for_sm90(cs, kind) in a child process (skips where this triton cannot
    compile Gluon kernels offline)."""
    try:
        import triton.experimental.gluon._runtime  # noqa: F401
        from triton.backends.compiler import GPUTarget  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"this triton cannot compile Gluon kernels offline: {exc}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, __file__, json.dumps(cs), json.dumps(kind)], env=env,
                         cwd=root, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kind,s_q,H,page,direct,causal", [
    ("pair", 1, 128, 64, False, True), ("pair", 2, 64, 128, True, False),
    ("pair-fp8", 1, 128, 64, False, True), ("pair-fp8", 2, 64, 128, True, False),
    ("ring", 1, 128, 64, False, True), ("ring", 2, 64, 32, True, False),
    ("fp8", 1, 128, 64, False, True), ("fp8", 2, 64, 32, True, False),
    ("fp8-bf16q", 1, 128, 64, False, True), ("fp8-bf16q", 2, 64, 32, True, False)])
def test_kernel_compiles_for_sm90(kind, s_q, H, page, direct, causal):
    """Each kernel at its configs: fp8 with 64-key tiles (page 64) and with 32-key ones;
    its BF16Q mode at its config (32-key tiles) on either page."""
    pytest.importorskip("triton")
    from lowering.decode.gluon_decode import BF16Q_CONFIG, CONFIG, PAIR_CONFIG, fp8_config
    config = {"fp8": fp8_config(page, 4096), "fp8-bf16q": BF16Q_CONFIG, "pair": PAIR_CONFIG,
              "pair-fp8": PAIR_CONFIG, "ring": CONFIG}[kind]
    cs = dict(S_Q=s_q, H=H, PAGE=page, BN=config["BN"], STAGES=config["STAGES"],
              DIRECT=direct, CAUSAL=causal)
    facts = _compiled_facts(cs, kind)
    if kind == "fp8":
        assert config["BN"] == page
        # per consumer step 9 QK instructions (k = 32) and one P V of N = 256 per tile, in
        # both warpgroups' first-tile, steady and last-tile paths
        assert facts["wgmma"] >= 50
        assert 1 in facts["waits"], "the QK / P V overlap (wait until 1 group remains) is gone"
    elif kind == "fp8-bf16q":
        # QK as 9 MMAs over q's hi term and 9 over its lo term, in the same three paths
        assert facts["wgmma"] >= 100
        assert 1 in facts["waits"], "the QK / P V overlap (wait until 1 group remains) is gone"
        # the runtime zero in the lo terms' indices keeps ptxas from hoisting (and
        # spilling) the 18 descriptors (0-16 bytes of stack with it at 32-key tiles)
        if facts["stack"] is not None:
            assert facts["stack"] <= 128, f"the BF16Q mode spills {facts['stack']} bytes"
    elif kind in ("pair", "pair-fp8"):
        # per pair and warpgroup a QK of 36 instructions (9 boxes x k = 16) and two P V of
        # 16, plus each warpgroup's first QK and warpgroup 1's last-block path
        assert facts["wgmma"] >= 200
        assert 4 in facts["waits"], "the P V / next QK overlap (wait until 4 remain) is gone"
        # with constant shared-memory indices ptxas hoists every wgmma descriptor out of
        # the loop and spills them: 688-728 bytes of local memory, 1.65x slower on an H200.
        # Triton 3.6 compiles it with none (FP8: 0-8 bytes, the widener's registers
        # shared out of 64 K); 3.9 spills ~160 bytes of scalars (FP8 ~320).
        if facts["stack"] is not None:
            limit = 400 if kind == "pair-fp8" else 256
            assert facts["stack"] <= limit, f"the {kind} kernel spills {facts['stack']} bytes"
    else:
        # per consumer step 9 QK and 8 P V wgmma groups (BN = 32: 4 and 2 instructions
        # each), in both warpgroups' first-tile, steady and last-tile paths
        assert facts["wgmma"] >= 100
        assert 4 in facts["waits"], "the QK / P V overlap (wait until 4 groups remain) is gone"
    assert facts["tma"]
    assert 0 < facts["shared"] <= HOPPER_SMEM


@pytest.mark.parametrize("s_q,H,page,direct,causal", [
    (1, 16, 64, False, True), (2, 16, 128, True, True), (1, 8, 64, True, False)])
def test_fp8_cache_kernel_compiles_for_sm90(s_q, H, page, direct, causal):
    """The fp8-cache kernel at both row paddings: QK as 9 chunks of 2 fp8 MMAs (k = 32) over
    the ring slot, P V as 8 chunks of 4 fp16 MMAs (k = 16), each twice (tile 0 is peeled
    from the pipelined loop, and the last P V follows it), the loop's wait for QK while
    P V runs, TMA tile copies, and its ring and widened values within a Hopper CTA's
    shared memory."""
    pytest.importorskip("triton")
    from lowering.decode.gluon_decode import rows_config
    nr, config = rows_config(s_q * H, True)
    cs = dict(S_Q=s_q, H=H, PAGE=page, NR=nr, DIRECT=direct, CAUSAL=causal, FP8=True, **config)
    facts = _compiled_facts(cs, "rows")
    assert facts["wgmma"] == 2 * (9 * 2 + 8 * 4)
    assert 8 in facts["waits"], "the QK / P V overlap (wait until P V's 8 groups remain) is gone"
    # the query's lo term is built from hi read back from shared memory: widening the
    # registers the e4m3 cast packed made ptxas 12.8 (triton 3.6) widen the stack pointer
    if facts["sp_reads"] is not None:
        assert facts["sp_reads"] == 0, "the kernel reads the stack pointer as e4m3 data"
    assert facts["tma"]
    assert 0 < facts["shared"] <= HOPPER_SMEM


def test_fp8_cache_kernel_conditions():
    """What the fp8-cache kernels serve (read off the call's shapes and dtypes; the GPU
    and Gluon checks come first on a real call): bf16 q, rows of 576; up to 32 query rows
    on pages of whole 64-key tiles (the few-rows kernel), past them a head count that is
    a multiple of 64 on pages of whole 32-key tiles (the fp8 kernel's BF16Q mode)."""
    pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    from lowering.decode import gluon_serves as gd
    from lowering.decode.registry import DecodeCall

    def unmet(s_q=1, H=16, page=64, dtype=torch.bfloat16, width=576, head_dim_v=512):
        q = torch.empty(2, s_q, H, width, dtype=dtype)
        kv = torch.empty(4, page, width, dtype=torch.float8_e4m3fn)
        return gd.gluon_unmet(DecodeCall(q, kv, None, None, 1.0, True, "fp8", None, head_dim_v))

    assert unmet() is None and unmet(s_q=2) is None and unmet(H=8, page=128) is None
    assert unmet(H=64) is None and unmet(H=128) is None and unmet(s_q=2, H=128) is None
    assert unmet(H=128, page=32) is None                       # BF16Q's 32-key tiles
    assert "head count that is a multiple of 64" in unmet(s_q=3)   # 48 rows of 16 heads
    assert "block_size to be a multiple of 32" in unmet(H=128, page=16)
    assert "block_size to be a multiple of 64" in unmet(page=32)
    assert "bfloat16" in unmet(dtype=torch.float16)
    assert "576" in unmet(width=192, head_dim_v=128)


def test_few_rows_bf16_conditions_and_auto_preference(monkeypatch):
    """Over a bf16 cache the few-rows kernel serves up to 32 query rows on pages of whole
    64-key tiles (more rows: the pair / ring kernels' rule, H a multiple of 64); where it
    serves, backend="auto" passes over FlashMLA (checked as on an SM90 GPU: the GPU checks
    stubbed), which still serves it by name and keeps the calls of more rows."""
    pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    from lowering.decode import gluon_serves as gd
    from lowering.decode import registry
    from lowering.decode.registry import DecodeCall

    def call(s_q=1, H=16, page=64, width=576, B=2, dtype=torch.bfloat16):
        q = torch.empty(B, s_q, H, width, dtype=dtype)
        kv = torch.empty(4, page, width, dtype=dtype)
        return DecodeCall(q, kv, torch.zeros(B, 4, dtype=torch.int32), None, 1.0, True, "auto",
                          None, width - 64)

    assert gd.gluon_unmet(call()) is None and gd.gluon_unmet(call(s_q=2)) is None
    assert gd.gluon_unmet(call(H=4, page=128)) is None
    assert "block_size to be a multiple of 64" in gd.gluon_unmet(call(page=32))
    assert "head count to be a multiple of 64" in gd.gluon_unmet(call(s_q=3))      # 48 rows
    assert gd.gluon_unmet(call(H=128)) is None                                    # pair kernel
    monkeypatch.setattr(registry, "hopper_unmet", lambda q, what: None)           # as on an H100
    monkeypatch.setattr(registry, "_flashmla_check", lambda: lambda call: None)
    assert "few-rows kernel is faster" in registry._flashmla_unmet(call(), True)
    assert "few-rows kernel is faster" in registry._flashmla_unmet(call(s_q=2), True)
    assert registry._flashmla_unmet(call(), False) is None                      # asked by name
    assert registry.choose_route(call(), "bf16", "auto").name == "gluon"
    # 128 heads: the pair kernel up to FEW_REQUESTS requests, FlashMLA past them, and for
    # fp16 (the pair kernel takes bf16 only) at any batch
    few, many = registry.FEW_REQUESTS, registry.FEW_REQUESTS + 1
    assert "pair kernel is faster" in registry._flashmla_unmet(call(H=128, B=few), True)
    assert registry.choose_route(call(H=128, B=1), "bf16", "auto").name == "gluon"
    assert registry.choose_route(call(H=128, B=few), "bf16", "auto").name == "gluon"
    assert registry._flashmla_unmet(call(H=128, B=many), True) is None
    assert registry.choose_route(call(H=128, B=many), "bf16", "auto").name == "flashmla"
    assert registry.choose_route(call(H=128, B=1, dtype=torch.float16), "bf16",
                                 "auto").name == "flashmla"
    assert registry._flashmla_unmet(call(H=128, B=1), False) is None          # asked by name
    monkeypatch.setattr(registry, "_gluon_check", lambda: lambda call: "stubbed: no gluon")
    assert registry._flashmla_unmet(call(H=128, B=1), True) is None  # FlashMLA, not triton
    monkeypatch.undo()
    monkeypatch.setattr(registry, "hopper_unmet", lambda q, what: None)
    monkeypatch.setattr(registry, "_flashmla_check", lambda: lambda call: None)
    # pages the kernel cannot tile: the Triton / FlashMLA size rule decides as before
    assert "few-rows" not in (registry._flashmla_unmet(call(page=32), True) or "")


@pytest.mark.parametrize("s_q,H,page,direct,causal", [(1, 16, 64, False, True),
                                                      (2, 16, 128, True, False)])
def test_few_rows_bf16_kernel_compiles_for_sm90(s_q, H, page, direct, causal):
    """The few-rows kernel over a bf16 cache: the MMAs read the ring slots (no widened
    copy), the same 68 MMAs, without spills, within a CTA's shared memory."""
    pytest.importorskip("triton")
    from lowering.decode.gluon_decode import rows_config
    nr, config = rows_config(s_q * H, False)
    cs = dict(S_Q=s_q, H=H, PAGE=page, NR=nr, DIRECT=direct, CAUSAL=causal, FP8=False, **config)
    facts = _compiled_facts(cs, "rows")
    assert facts["wgmma"] == 9 * 4 + 8 * 4
    assert facts["tma"] and facts["stack"] in (0, None)
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
    print(json.dumps(_compile_for_sm90(json.loads(sys.argv[1]), json.loads(sys.argv[2]))))


def test_fp8q_routes_on_cpu():
    """On CPU, backend="gluon" or "flashmla" names what is missing, an unknown route is a
    ValueError; "auto" takes the Triton kernel (the interpreter here) and agrees with it
    called directly."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton route on CPU tensors needs TRITON_INTERPRET=1 (a CPU session)")
    g = torch.Generator().manual_seed(4)
    q8 = (torch.randn(1, 1, 64, 96, generator=g) * 20).to(torch.float8_e4m3fn)
    kv8 = (torch.randn(3, 16, 96, generator=g) * 20).to(torch.float8_e4m3fn)
    bt = torch.tensor([[2, 0, 1]], dtype=torch.int32)
    cl = torch.tensor([37], dtype=torch.int32)
    qs, ks = torch.tensor([0.05]), torch.tensor([0.04])
    for route in ("gluon", "flashmla"):
        with pytest.raises(lowering.BackendUnavailable, match=f"{route}.*CUDA"):
            lowering.mla_decode_fp8q(q8, kv8, bt, cl, 0.1, q_scale=qs, k_scale=ks,
                                     head_dim_v=64, backend=route)
    with pytest.raises(ValueError, match="'flashmla', 'gluon' or 'triton'"):
        lowering.mla_decode_fp8q(q8, kv8, bt, cl, 0.1, q_scale=qs, k_scale=ks, head_dim_v=64,
                                 backend="cuda")
    n = lowering.backend_choices["triton-fp8q"]
    out, lse = lowering.mla_decode_fp8q(q8, kv8, bt, cl, 0.1, q_scale=qs, k_scale=ks,
                                        head_dim_v=64)
    assert lowering.backend_choices["triton-fp8q"] == n + 1
    out_t, lse_t = lowering.mla_decode_fp8q(q8, kv8, bt, cl, 0.1, q_scale=qs, k_scale=ks,
                                            head_dim_v=64, backend="triton")
    assert torch.equal(out, out_t) and torch.equal(lse, lse_t)


def test_fp8_config_by_split_length():
    from lowering.decode.gluon_decode import FP8_CONFIGS, FP8_LONG_SPLIT, fp8_config
    long_tiles, short_tiles = FP8_CONFIGS
    assert fp8_config(64, FP8_LONG_SPLIT) is long_tiles
    assert fp8_config(128, 8192) is long_tiles
    assert fp8_config(64, FP8_LONG_SPLIT - 1) is short_tiles      # short splits: a deep ring
    assert fp8_config(32, 8192) is short_tiles                      # a page holds whole tiles
    assert long_tiles["BN"] == 64 and short_tiles["BN"] == 32


def test_bf16_kernel_by_page():
    """The pair kernel where a page holds whole 64-key blocks, the ring kernel otherwise."""
    pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    from lowering.decode import gluon_decode as gd
    from lowering.decode.gluon_ring_kernel import mla_decode_gluon_kernel
    from lowering.decode.gluon_pair_kernel import mla_decode_pair_kernel
    assert gd.bf16_kernel(64, 4096) == (mla_decode_pair_kernel, gd.PAIR_CONFIG)
    assert gd.bf16_kernel(128, 64) == (mla_decode_pair_kernel, gd.PAIR_CONFIG)
    assert gd.bf16_kernel(32, 4096) == (mla_decode_gluon_kernel, gd.CONFIG)
    assert gd.bf16_kernel(96, 4096) == (mla_decode_gluon_kernel, gd.CONFIG)


def test_bf16q_kernel_by_page():
    """A bf16 query over an fp8 cache past 32 rows: the pair kernel (FP8 mode) where a page
    holds whole 64-key blocks, else the fp8 kernel's BF16Q mode."""
    pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    from lowering.decode import gluon_decode as gd
    from lowering.decode.gluon_fp8_kernel import mla_decode_fp8_kernel
    from lowering.decode.gluon_pair_kernel import mla_decode_pair_kernel
    assert gd.bf16q_kernel(64, 4096) == (mla_decode_pair_kernel, gd.PAIR_CONFIG)
    assert gd.bf16q_kernel(128, 64) == (mla_decode_pair_kernel, gd.PAIR_CONFIG)
    assert gd.bf16q_kernel(32, 4096) == (mla_decode_fp8_kernel, gd.BF16Q_CONFIG)
    assert gd.bf16q_kernel(96, 4096) == (mla_decode_fp8_kernel, gd.BF16Q_CONFIG)


def test_few_rows_splits_at_one_request():
    """The few-rows kernel's split count: a split per 64-key tile at one request (up to the
    SMs and MAX_SPLITS), the Triton backend's MIN_SPLIT_KEYS sizing from two requests on;
    never more splits than tiles, and one split where one tile holds the request."""
    from lowering.decode import gluon_decode as gd
    from lowering.decode.triton_decode import MAX_SPLITS, choose_num_splits
    assert gd.ONE_REQUEST_SPLIT_KEYS == gd.ROWS_CONFIGS[16]["BN"] == gd.FP8_CACHE_CONFIGS[16]["BN"]
    assert gd.rows_splits(1, 1024, 132) == 16                      # 4 before (256-key splits)
    assert gd.rows_splits(1, 4096, 132) == 64 == MAX_SPLITS
    assert gd.rows_splits(1, 4096, 48) == 48                       # no more than the SMs
    assert gd.rows_splits(1, 64, 132) == 1 and gd.rows_splits(1, 100, 132) == 2
    for B, cap in ((2, 4096), (4, 4096), (8, 4096), (32, 1024), (128, 4096)):
        assert gd.rows_splits(B, cap, 132) == choose_num_splits(
            B, 1, cap, 132, min_split_keys=gd.MIN_SPLIT_KEYS)
    for B in (1, 2, 3):
        for cap in (64, 640, 1000, 4096, 1 << 20):
            n = gd.rows_splits(B, cap, 132)
            assert 1 <= n <= min(MAX_SPLITS, -(-cap // 64))          # no split without a tile
