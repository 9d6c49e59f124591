"""A bf16 decode query as two e4m3 terms per element, for the fp8 Gluon kernel's BF16Q mode
(gluon_fp8_kernel.py; called by gluon_decode.py's launcher).

Each row r of q [N, 576] gets s[r], the power of two that brings the row's largest |q|
into [128, 256), and two e4m3 rows: hi = e4m3(q s) and lo = e4m3(q s - hi). hi + lo keeps
a bf16's 8 significant bits wherever q s >= 1/4 (lo's grid is hi's ulp / 16). The true
query is (hi + lo) / s. Both roundings are done on fp32 values by bit arithmetic
(fp8_rounding.round_e4m3), so the casts are exact and nothing widens an e4m3 value back
(the ptxas that triton 3.6 ships miscompiled such a widening: gluon_rows_kernel.py).

ROWS rows a program; out [2 N, 576]: the hi rows, then the lo rows. Launcher: q_terms().
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowering.fused.fp8_rounding import round_e4m3, to_e4m3

# Query rows per program: 1 and 8 timed within 1 µs of each other at 128 heads, B = 1-64
# (H100; 6-17 µs a call: docs/notes/probe_fp8_bf16q.py).
ROWS_PER_PROGRAM = 1


@triton.jit
def q_terms_kernel(q_ptr, out_ptr, s_ptr, n_rows, D: tl.constexpr, BLOCK_D: tl.constexpr,
                   ROWS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)                    # [ROWS]
    cols = tl.arange(0, BLOCK_D)
    keep = (rows[:, None] < n_rows) & (cols[None, :] < D)
    offs = rows[:, None].to(tl.int64) * D + cols[None, :]
    x = tl.load(q_ptr + offs, mask=keep, other=0.0).to(tl.float32)        # [ROWS, BLOCK_D]
    amax = tl.max(tl.abs(x), axis=1)
    # s = 2^(7 - e), e = amax's binary exponent (from its bits: exact), so amax s is in
    # [128, 256); an all-zero row keeps s = 1
    e = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.maximum(e, -119)                              # s at most 2^126
    s = ((134 - e) << 23).to(tl.float32, bitcast=True)   # 2^(7 - e): exponent field 7 - e + 127
    s = tl.where(amax > 0.0, s, 1.0)
    xs = x * s[:, None]                                 # exact: s is a power of two
    hi = round_e4m3(xs)                                 # fp32 values on the e4m3 grid
    tl.store(out_ptr + offs, hi.to(out_ptr.dtype.element_ty), mask=keep)
    tl.store(out_ptr + n_rows.to(tl.int64) * D + offs, to_e4m3(xs - hi, out_ptr), mask=keep)
    tl.store(s_ptr + rows, s, mask=rows < n_rows)


def q_terms(q2):
    """q2 [N, 576] bf16 (contiguous) -> (its e4m3 terms [2 N, 576]: the hi rows, then the
    lo rows; s [N] fp32), q = (hi + lo) / s per row."""
    n, d = q2.shape
    terms = torch.empty((2 * n, d), dtype=torch.float8_e4m3fn, device=q2.device)
    q_s = torch.empty(n, dtype=torch.float32, device=q2.device)
    q_terms_kernel[(triton.cdiv(n, ROWS_PER_PROGRAM),)](
        q2, terms, q_s, n, D=d, BLOCK_D=triton.next_power_of_2(d), ROWS=ROWS_PER_PROGRAM,
        num_warps=4)
    return terms, q_s
