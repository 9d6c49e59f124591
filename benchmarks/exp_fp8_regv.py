"""Experiment: the fp8 pair kernel with V^T as a register operand
(lowering/gluon_fp8_regv_decode_kernel.py): float64 checks or timing against our kernels
and FlashMLA's fp8 kernel, on the GPU.

    python3 benchmarks/exp_fp8_regv.py check|time      (from the repository root)
"""
import sys
sys.path[:0] = ['.', 'tests', 'benchmarks']
import torch, lowering
from lowering import gluon_decode as gd
from lowering import gluon_fp8_regv_decode_kernel as gk8_regv
from mla_reference import make_case, decode_ref64, poison_unwritten_rows, rel_err
from timing import graph_time_us
SCALE = 192 ** -0.5
def q8(x):
    s = (x.float().abs().amax() / 448.0).reshape(1)
    return (x.float() / s).to(torch.float8_e4m3fn), s
PICK = lambda page, n: (gk8_regv.mla_decode_fp8_pair_kernel, gd.PAIR_CONFIG)
def regv(qq, kk, bt, cl, qs, ks, causal=True, splits=0):
    return gd._launch(PICK, qq, kk, bt, cl, (qs, ks), SCALE, causal, splits)
if sys.argv[1] == "check":
    CASES = [(4, 1, 128, 64, [3000, 2999, 1, 64], 0, True), (3, 1, 64, 64, [1, 100, 777], 4, True),
             (2, 2, 128, 64, [1500, 33], 0, True), (1, 3, 64, 128, [700], 0, True),
             (2, 1, 128, 64, [5000, 40], 48, True), (2, 1, 128, 64, [4096, 33], 1, True),
             (3, 1, 128, 64, [65, 128, 129], 1, True), (2, 2, 128, 64, [900, 130], 0, False),
             (2, 1, 128, 64, [4096, 4096], 0, True)]
    for B, s_q, H, page, lens, splits, causal in CASES:
        q, kv, bt, cl = make_case(B, s_q, H, 512, 64, page, lens, "cuda", seed=B * 13 + H + page)
        qq, qs = q8(q); kk, ks = q8(kv)
        ref, rl = decode_ref64(qq.double() * qs.double(), kk.double() * ks.double(), bt, cl, SCALE, causal, 512)
        out, lse = regv(qq, poison_unwritten_rows(kk, bt, cl), bt, cl, qs, ks, causal, splits)
        torch.cuda.synchronize()
        e, le = rel_err(out, ref), (lse.double() - rl).abs().max().item()
        ok = torch.isfinite(out).all().item() and e < 5e-2 and le < 1e-2
        print(f"{'OK ' if ok else 'BAD'} B={B} s_q={s_q} H={H} page={page} lens={lens} splits={splits} causal={causal}: err {e:.2e} lse {le:.2e}", flush=True)
else:
    import lowering.flashmla as fm
    for B, S in [(1, 4096), (32, 4096), (64, 8192), (8, 32768)]:
        q, kv, bt, cl = make_case(B, 1, 128, 512, 64, 64, [S] * B, "cuda", seed=1)
        qq, qs = q8(q); kk, ks = q8(kv)
        sched = fm.flashmla_schedule(bt, cl, 64, 128, fp8=True)
        fns = {"bf16 pair": lambda: lowering.mla_decode(q, kv, bt, cl, SCALE, backend="gluon"),
               "fp8 (landed)": lambda: lowering.mla_decode_fp8q(qq, kk, bt, cl, SCALE, q_scale=qs, k_scale=ks, backend="gluon"),
               "fp8 regv": lambda: regv(qq, kk, bt, cl, qs, ks),
               "flashmla fp8 kernels": lambda: fm.flashmla_fp8q_decode(qq, kk, bt, cl, SCALE, q_scale=qs, k_scale=ks, causal=True, schedule=sched, bounded=True)}
        res = {n: [] for n in fns}
        for r in range(2):
            for n, f in fns.items():
                res[n].append(graph_time_us(f))
        base = min(res["bf16 pair"])
        print(f"B={B} S={S}: " + "; ".join(f"{n} {min(v):.1f}-{max(v):.1f} ({base / min(v):.2f}x bf16)" for n, v in res.items()), flush=True)
