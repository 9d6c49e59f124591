"""Small-batch decode (H200 probe, not maintained): the Triton kernel's split sizing
(min_split_keys, ctas_per_sm), BLOCK_N, and the merge over whole rows or 64 / 128-column
parts (a copy of the merge kernel with a third grid axis, as merge_kernel.py now has),
against FlashMLA, at 16 and 128 heads; per-kernel µs of the shipped and the best.

    python docs/notes/probe_decode_merge.py
"""
import sys, itertools, torch, triton, triton.language as tl
sys.path.insert(0, "benchmarks")                    # run from the repository root
from timing import capture, kernel_time_us
import lowering
import lowering.decode.triton_decode as td
from mla_ops.hf.eager import set_wrap_triton_enabled
from torch.profiler import profile, ProfilerActivity
L, R, PAGE = 512, 64, 64
scale = 192 ** -0.5

@triton.jit
def merge_parts(part_out_ptr, part_lse_ptr, out_ptr, lse_ptr, num_splits,
                S_Q: tl.constexpr, H: tl.constexpr, L: tl.constexpr, BL: tl.constexpr,
                SPLIT_BLOCK: tl.constexpr):
    ROWS: tl.constexpr = S_Q * H
    r = tl.program_id(0); b = tl.program_id(1); pl = tl.program_id(2)
    offs_l = pl * BL + tl.arange(0, BL)
    offs_s = tl.arange(0, SPLIT_BLOCK)
    base = b.to(tl.int64) * num_splits * ROWS + r
    m = tl.full([SPLIT_BLOCK], float("-inf"), tl.float32)
    for s0 in range(0, num_splits, SPLIT_BLOCK):
        s = s0 + offs_s
        m = tl.maximum(m, tl.load(part_lse_ptr + base + s * ROWS, mask=s < num_splits, other=float("-inf")))
    m = tl.max(m, axis=0)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    total = tl.zeros([SPLIT_BLOCK], dtype=tl.float32)
    acc = tl.zeros([BL], dtype=tl.float32)
    for s0 in range(0, num_splits, SPLIT_BLOCK):
        s = s0 + offs_s
        live = s < num_splits
        w = tl.exp(tl.load(part_lse_ptr + base + s * ROWS, mask=live, other=float("-inf")) - m_use)
        o_s = tl.load(part_out_ptr + (base + s[:, None] * ROWS) * L + offs_l[None, :], mask=live[:, None], other=0.0)
        acc += tl.sum(w[:, None] * o_s, axis=0)
        total += w
    total_sum = tl.sum(total, axis=0)
    has = total_sum > 0.0
    t_safe = tl.where(has, total_sum, 1.0)
    tl.store(out_ptr + (b.to(tl.int64) * ROWS + r) * L + offs_l, (acc / t_safe).to(out_ptr.dtype.element_ty))
    if pl == 0:
        tl.store(lse_ptr + b * ROWS + (r % H) * S_Q + r // H, tl.where(has, m_use + tl.log(t_safe), float("-inf")))

def inputs(B, H, S):
    q = torch.randn(B, 1, H, L + R, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(B * S // PAGE, PAGE, L + R, device="cuda", dtype=torch.bfloat16)
    bt = torch.randperm(B * S // PAGE, device="cuda").int().reshape(B, S // PAGE)
    lens = torch.full((B,), S, dtype=torch.int32, device="cuda")
    return q, kv, bt, lens

def t_graph(fn):
    return kernel_time_us(capture(fn, 2).replay, reps=20)

def per_kernel(fn):
    g = capture(fn, 2)
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(10): g.replay()
        torch.cuda.synchronize()
    agg = {}
    for e in p.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            agg[e.name[:40]] = agg.get(e.name[:40], 0) + e.device_time_total / 10
    return " ".join(f"{k}={v:.1f}" for k, v in agg.items())

orig_merge = td.mla_decode_merge_kernel
_wrap = torch.library.wrap_triton
MERGE_BL = [0]
class M:
    def __getitem__(self, grid):
        rows, b = grid
        BL = MERGE_BL[0]
        return lambda *a, **kw: merge_parts[(rows, b, L // BL)](*a, BL=BL, **kw)
def wrap(k):
    if k is orig_merge and MERGE_BL[0]:
        return M()
    return _wrap(k)
torch.library.wrap_triton = wrap
for B, H, S in ((1, 16, 4096), (4, 16, 4096), (1, 128, 4096), (2, 128, 4096), (1, 16, 16384)):
    q, kv, bt, lens = inputs(B, H, S)
    key = (0, "wide" if H >= 64 else "narrow", "gpu")
    base = dict(td.CONFIGS[key])
    with set_wrap_triton_enabled(False):
        ref = td.triton_decode(q, kv, bt, lens, None, None, scale, True, L, 0, False, torch.bfloat16)[0].float()
    sched = lowering.decode_schedule(kv, bt, lens, num_heads=H)
    fm = lambda: lowering.mla_decode(q, kv, bt, lens, scale, backend="flashmla", schedule=sched, bounded=True)
    fm_s = lambda: lowering.mla_decode(q, kv, bt, lens, scale, backend="flashmla", schedule=lowering.decode_schedule(kv, bt, lens, num_heads=H), bounded=True)
    def run():
        with set_wrap_triton_enabled(False):
            return td.triton_decode(q, kv, bt, lens, None, None, scale, True, L, 0, False, torch.bfloat16)
    print(f"\nB{B} H{H} S{S}: flashmla kernels {t_graph(fm):.1f}, with schedule {t_graph(fm_s):.1f}; triton shipped {t_graph(run):.1f} [{per_kernel(run)}]", flush=True)
    res = []
    for msk, cps, bn, bl in itertools.product((128, 64, 32), (1, 2, 4), (64, 128), (0, 128, 64)):
        if bn == 128 and H >= 64: continue
        td.CONFIGS[key] = dict(base, min_split_keys=msk, ctas_per_sm=cps, BLOCK_N=bn)
        MERGE_BL[0] = bl
        try:
            err = (run()[0].float() - ref).abs().max().item()
            res.append((t_graph(run), msk, cps, bn, bl, err))
        except Exception as e:
            print("  fail", msk, cps, bn, bl, type(e).__name__, str(e)[:100])
    MERGE_BL[0] = 0
    res.sort()
    for us, msk, cps, bn, bl, err in res[:8]:
        print(f"   {us:6.1f} µs  min_split_keys={msk} ctas_per_sm={cps} BLOCK_N={bn} merge_BL={bl or 'row'} err={err:.1e}")
    td.CONFIGS[key] = dict(base, min_split_keys=res[0][1], ctas_per_sm=res[0][2], BLOCK_N=res[0][3])
    MERGE_BL[0] = res[0][4]
    print("   best per kernel:", per_kernel(run))
    td.CONFIGS[key] = base; MERGE_BL[0] = 0
    del q, kv; torch.cuda.empty_cache()
