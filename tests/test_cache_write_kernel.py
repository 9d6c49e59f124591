"""The one-kernel cache write (mla_ops/cache/write_kernel.py) vs a masked torch write.

Runs under TRITON_INTERPRET=1 on CPU (conftest) and natively on CUDA. Written rows must
equal the torch path bit for bit (fp8 included); pads (-1) and slots outside the cache
leave the cache untouched.
"""
import pytest
import torch

from mla_ops.quant import quant_fp8_static

K = pytest.importorskip("mla_ops.cache.write_kernel")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn


def case(T, L, R, nb, bs, dtype, fp8, seed, strided=False):
    g = torch.Generator().manual_seed(seed)
    src = torch.randn(T, L + R + 8, generator=g) * 40      # wide enough to saturate e4m3 / 0.05
    src = src.to(dtype).to(DEV)
    kv_c = src[:, :L] if strided else src[:, :L].contiguous()   # strided: row stride L+R+8
    k_pe = src[:, L + 8:].contiguous()
    store = FP8 if fp8 else dtype
    cache = (torch.randn(nb, bs, L + R, generator=g) * 2).to(store).to(DEV)
    return kv_c, k_pe, cache


def reference(kv_c, k_pe, cache, slots, k_scale):
    flat = cache.view(-1, cache.shape[-1]).clone()
    rows = torch.cat([kv_c, k_pe], -1)
    rows = quant_fp8_static(rows, k_scale) if cache.dtype == FP8 else rows.to(cache.dtype)
    ok = (slots >= 0) & (slots < flat.shape[0])
    flat[slots[ok]] = rows[ok]
    return flat


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("T,L,R,slots", [
    (1, 32, 16, [5]),                      # one token
    (5, 32, 16, [3, -1, 17, 0, 2]),        # padding in the middle
    (4, 24, 8, [-1, -1, 6, 15]),           # widths not powers of two
    (3, 32, 16, [99, 4, -7]),              # outside the cache: dropped
])
def test_cache_write_matches_torch(dtype, fp8, T, L, R, slots):
    if fp8 and dtype == torch.float32 and T == 1:
        pytest.skip("covered by the other fp8 cases")
    kv_c, k_pe, cache, = case(T, L, R, 4, 4, dtype, fp8, seed=T + L)
    sm = torch.tensor(slots, dtype=torch.int64, device=DEV)
    k_scale = torch.tensor([0.05], device=DEV)
    expect = reference(kv_c, k_pe, cache, sm, k_scale)
    K.write_cache_rows(kv_c, k_pe, cache, sm, k_scale if fp8 else None)
    got = cache.view(-1, L + R)
    assert torch.equal(got.view(torch.uint8), expect.view(torch.uint8))


def test_cache_write_strided_rows_and_empty_step():
    kv_c, k_pe, cache = case(3, 32, 16, 2, 4, torch.bfloat16, False, seed=1, strided=True)
    assert not kv_c.is_contiguous()
    sm = torch.tensor([7, 0, 3], device=DEV)
    expect = reference(kv_c, k_pe, cache, sm, None)
    K.write_cache_rows(kv_c, k_pe, cache, sm, None)
    assert torch.equal(cache.view(-1, 48), expect)
    before = cache.clone()
    K.write_cache_rows(kv_c[:0], k_pe[:0], cache, sm[:0], None)
    assert torch.equal(cache, before)
