"""silu_mul (lowering/fused/silu_mul.py): F.silu(g) * u in one kernel for a prefill's MLP and
routed experts. CPU: the kernel under the Triton interpreter against a float64 reference
rounded where torch rounds (numpy's exp there, not libdevice's: within an ulp); GPU: bit
for bit torch's two kernels."""
import pytest
import torch
import torch.nn.functional as F

from lowering.fused.silu_mul import BLOCK_N, silu_mul

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def reference(g, u):
    """F.silu(g) rounded to g's dtype, times u, rounded: in float64."""
    g64 = g.double()
    s = (g64 / (1 + torch.exp(-g64))).to(g.dtype).double()
    return (s * u.double()).to(g.dtype)


# rows, columns (one, a block's, past it and ragged), dtype; sliced: g and u the two halves
# of one tensor (a grouped GEMM's [gate | up]), as the MoE prefill passes them
CASES = [(1, 7, torch.float32), (3, BLOCK_N, torch.float16), (5, BLOCK_N + 37, torch.float32),
         (2, 3 * BLOCK_N - 1, torch.float16)]


@pytest.mark.parametrize("sliced", [False, True])
@pytest.mark.parametrize("M,N,dtype", CASES)
def test_kernel_vs_reference(M, N, dtype, sliced):
    gen = torch.Generator().manual_seed(M * N)
    if sliced:
        gu = (torch.randn(M, 2 * N, generator=gen) * 4).to(DEV, dtype)
        g, u = gu[:, :N], gu[:, N:]
    else:
        g = (torch.randn(M, N, generator=gen) * 4).to(DEV, dtype)
        u = (torch.randn(M, N, generator=gen) * 4).to(DEV, dtype)
    y = silu_mul(g, u, kernel=True)
    assert y.dtype == dtype and y.shape == (M, N)
    ref = reference(g.cpu(), u.cpu())
    # fp16: at most one rounding step off (an fp32 SiLU a few ulps off can land across a
    # rounding boundary); fp32: the few ulps of fp32 exp, add and divide
    ulps = 1 if dtype == torch.float16 else 8
    tol = ulps * torch.finfo(dtype).eps * ref.double().abs() + 1e-30
    assert ((y.cpu().double() - ref.double()).abs() <= tol).all()


def test_batched_shapes_and_the_torch_path():
    """[B, S, N] inputs keep their shape; off the kernel (kernel=False, or inputs it does not
    take: a strided last dim) it is torch's expression itself."""
    g = torch.randn(2, 3, 40, dtype=torch.float32).to(DEV)
    u = torch.randn(2, 3, 40, dtype=torch.float32).to(DEV)
    y = silu_mul(g, u, kernel=True)
    assert y.shape == (2, 3, 40)
    assert torch.allclose(y, F.silu(g) * u, rtol=1e-6, atol=1e-6)
    assert torch.equal(silu_mul(g, u, kernel=False), F.silu(g) * u)
    gt, ut = g.transpose(1, 2), u.transpose(1, 2)               # last stride 40, not 1
    assert torch.equal(silu_mul(gt, ut, kernel=True), F.silu(gt) * ut)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_bit_for_bit_torch(dtype):
    """On CUDA the kernel is torch's F.silu(g) * u exactly, at a prefill MLP's width."""
    g = torch.randn(300, 10944, device="cuda").mul_(6).to(dtype)
    u = torch.randn(300, 10944, device="cuda").mul_(6).to(dtype)
    assert torch.equal(silu_mul(g, u), F.silu(g) * u)
    gu = torch.cat([g, u], dim=1)
    assert torch.equal(silu_mul(gu[:, :10944], gu[:, 10944:]), F.silu(g) * u)
