"""Per-head GEMM for the few rows of a decode step: y[t, n, :J] = a[t, n, :K] @ w[n].

    a [T, N, K (+ COPY)], w [N, K, J] (J contiguous), y [T, N, J (+ COPY)]; fp32 accumulation.

MLA's weight absorption runs twice per decode step with this shape: the query
q_nope [T, N, P] @ W_UK_T [N, P, L] (K = P, J = L) and the output
o_latent [T, N, L] @ W_UV [N, L, V] (K = L, J = V). At decode batch sizes each is a read
of a per-head weight (16.8 MB at DeepSeek-V3 sizes) used by a handful of rows, so, as in
linear_kernel.py, the weight is the tall operand: program (n, j, t) streams the
[K, BLOCK_J] column block j of w[n] in BLOCK_K steps and multiplies its transpose by the
rows' a tile ([BLOCK_J, BLOCK_K] x [BLOCK_K, BLOCK_T]) into an fp32 [BLOCK_J, BLOCK_T]
accumulator.

COPY > 0 also copies a[t, n, K : K + COPY] to y[t, n, J : J + COPY] (done by the j = 0
programs): the absorbed MQA query is [q_nope @ W_UK_T | q_pe], built by one launch.

    grid = (N, J // BLOCK_J, cdiv(T, BLOCK_T))
"""
import triton
import triton.language as tl


@triton.jit
def head_gemm_kernel(
    a_ptr, w_ptr, y_ptr,
    T, stride_at, stride_an, stride_wn, stride_wk, stride_yt, stride_yn,
    K: tl.constexpr, J: tl.constexpr, COPY: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    n = tl.program_id(0)
    j0 = tl.program_id(1) * BLOCK_J
    rows = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)                # [BLOCK_T]
    cols = j0 + tl.arange(0, BLOCK_J)                                        # [BLOCK_J]
    offs_k = tl.arange(0, BLOCK_K)                                           # [BLOCK_K]
    r_ok = rows < T
    a_row = a_ptr + rows.to(tl.int64) * stride_at + n * stride_an           # [BLOCK_T]
    a_ptrs = a_row[None, :] + offs_k[:, None]                                # [BLOCK_K, BLOCK_T]
    w_ptrs = (w_ptr + n.to(tl.int64) * stride_wn
              + offs_k[None, :] * stride_wk + cols[:, None])                # [BLOCK_J, BLOCK_K]
    acc = tl.zeros((BLOCK_J, BLOCK_T), dtype=tl.float32)
    for _ in range(0, K // BLOCK_K):
        w = tl.load(w_ptrs)
        a = tl.load(a_ptrs, mask=r_ok[None, :], other=0.0)
        if DOT_F32:      # the CPU interpreter mis-multiplies 16-bit dots
            acc = tl.dot(w.to(tl.float32), a.to(tl.float32), acc)
        else:
            acc = tl.dot(w, a, acc)                                          # [BLOCK_J, BLOCK_T]
        w_ptrs += BLOCK_K * stride_wk
        a_ptrs += BLOCK_K
    y_row = y_ptr + rows.to(tl.int64) * stride_yt + n * stride_yn           # [BLOCK_T]
    tl.store(y_row[None, :] + cols[:, None], acc.to(y_ptr.dtype.element_ty),
             mask=r_ok[None, :])
    if COPY > 0:
        if j0 == 0:
            offs_c = tl.arange(0, COPY)                                      # [COPY]
            tail = tl.load(a_row[:, None] + K + offs_c[None, :], mask=r_ok[:, None])
            tl.store(y_row[:, None] + J + offs_c[None, :], tail, mask=r_ok[:, None])
