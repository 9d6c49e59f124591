"""q_terms_kernel (a bf16 decode query as two e4m3 terms scaled per row, for the fp8 Gluon
kernel's BF16Q mode) against a float64 reference written here: the per-row power of two,
both terms bit for bit, and q recovered from them to a bf16's precision. Runs under
TRITON_INTERPRET=1 on the CPU (conftest) and natively on CUDA."""
from __future__ import annotations

import math
import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton kernels on CPU tensors need TRITON_INTERPRET=1")


def _reference(q):
    """q [N, D] -> (hi [N, D] e4m3, lo [N, D] e4m3, s [N] float64): s = 2^(7 - e), e the
    binary exponent of the row's largest |q| (1 for a zero row); hi = e4m3(q s), lo =
    e4m3(q s - hi), each rounded to nearest even (torch's own cast of a float64)."""
    q = q.double()
    s = []
    for row in q:
        amax = row.abs().max().item()
        s.append(2.0 ** (7 - (math.frexp(amax)[1] - 1)) if amax > 0 else 1.0)
    s = torch.tensor(s, dtype=torch.float64)
    xs = q * s[:, None]
    hi = xs.to(torch.float8_e4m3fn)
    lo = (xs - hi.double()).to(torch.float8_e4m3fn)
    return hi, lo, s


def _run(q):
    from lowering.decode.q_terms_kernel import q_terms
    terms, s = q_terms(q.to(DEVICE))
    n = q.shape[0]
    return terms[:n].cpu(), terms[n:].cpu(), s.cpu()


def _rows():
    """Rows of random bf16 at very different scales, an all-zero row, a row whose largest
    entry is a power of two, one large entry among tiny ones, and subnormal-scale entries."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(12, 576, generator=g)
    q[1] *= 1e4
    q[2] *= 1e-4
    q[3] = 0.0
    q[4] *= 1e-3
    q[4, 7] = 50.0
    q[5] /= q[5].abs().max()
    q[5, 100] = -1.0                                   # amax exactly 1
    q[6] *= 1e-30
    q[7, :300] *= 1e-6                                 # half the row far below its max
    return q.to(torch.bfloat16)


def test_terms_match_the_float64_reference_bit_for_bit():
    q = _rows()
    hi, lo, s = _run(q)
    ref_hi, ref_lo, ref_s = _reference(q)
    assert hi.dtype == lo.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert torch.equal(s.double(), ref_s)
    assert torch.equal(hi.view(torch.uint8), ref_hi.view(torch.uint8))
    assert torch.equal(lo.view(torch.uint8), ref_lo.view(torch.uint8))


def test_terms_keep_a_bf16_query():
    """(hi + lo) / s is q within a bf16's rounding wherever q s >= 1/4; every row's
    largest |q s| lies in [128, 256), so no term overflows e4m3."""
    q = _rows()
    hi, lo, s = _run(q)
    x = q.double()
    back = (hi.double() + lo.double()) / s.double()[:, None]
    xs = x * s.double()[:, None]
    big = xs.abs() >= 0.25
    rel = ((back - x).abs() / x.abs().clamp_min(1e-300))[big]
    assert rel.max().item() <= 2.0 ** -8
    nz = x.abs().amax(1) > 0
    top = xs.abs().amax(1)[nz]
    assert bool(((top >= 128) & (top < 256)).all())
    assert torch.isfinite(hi.double()).all() and torch.isfinite(lo.double()).all()
    # the scores' error the terms leave, against the query's own norm: far below e4m3's
    err = (back - x).norm(dim=1) / x.norm(dim=1).clamp_min(1e-300)
    assert err[nz].max().item() < 2e-3
