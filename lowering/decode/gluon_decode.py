"""Backend "gluon": the Hopper decode kernels as custom ops: mla::gluon_decode (bf16 q
and cache), mla::gluon_decode_fp8_cache (bf16 q, fp8 cache; both are the "gluon" route of
lowering.mla_decode, conditions in gluon_serves.py's gluon_unmet()) and
mla::gluon_decode_fp8q (fp8 q and cache with per-tensor scales, gluon_fp8_kernel.py; the
"gluon-fp8q" route of lowering.mla_decode_fp8q, conditions in gluon_fp8q_unmet()).

Up to 32 query rows (s_q x H: 16 heads) both caches take gluon_rows_kernel.py, keys as
the MMAs' M side (1.0-1.09x FlashMLA's kernels at 16 heads on an H200, its scheduler not
counted). More rows over a bf16 cache take one of two kernels, picked by the page size
(bf16_kernel()): where a page holds whole 64-key blocks, gluon_pair_kernel.py (64-key
blocks in pairs, two buffers refilled by halves; 0.81-0.86x of FlashMLA's kernels at the
compute-bound 128-head shapes); with pages of 32, gluon_ring_kernel.py (32-key tiles in a
ring of 4 fed by a producer warp; 0.75-0.79x). More rows over an fp8 cache (bf16q_kernel())
take the pair kernel in its FP8 mode where a page holds whole 64-key blocks: a third
partition widens each tile to bf16 in shared memory, so the products are the bf16
kernel's over the dequantized cache (0.69-0.94x the bf16 pair kernel on an H100, bound by
shared memory at 128 heads); with pages of 32, the fp8 kernel (gluon_fp8_kernel.py) in
its BF16Q mode: q_terms_kernel.py first writes the bf16 query as two e4m3 terms scaled
per row, and QK chains fp8 MMAs over both (0.66-0.92x, with P rounded to e4m3). Helpers
they share: gluon_common.py.

Serves: q on an SM90 GPU, triton with Gluon's Hopper API, q bf16, rows of 576 = 512 +
64, head_dim_v 512; a bf16 cache (kind "auto") at up to 32 query rows with pages of whole
64-key tiles, else H a multiple of 64 and pages a multiple of 32; an fp8 cache (kind
"fp8", gluon_serves.fp8_cache_unmet()) the same way (the few-rows kernel, else the pair kernel's FP8
mode or the fp8 kernel's BF16Q mode). Anything else
is named by gluon_serves.gluon_unmet() (so backend="auto" moves on to the next backend). q and the
cache must also start 16-byte aligned (TMA); the op checks that (a ValueError) where it
sees the real tensors.

The ops are opaque to torch.compile (Gluon kernels cannot go through wrap_triton); they
have fake impls (eager calls run the launchers directly, no dispatch), and they capture
in CUDA graphs: the grid and the TMA descriptors depend on shapes and addresses only,
and each request's split size is derived on the device from its length, so replays with
changing lengths stay correct. Lengths and page ids are
bounded in the kernels (as in the Triton kernel), so no clamp kernels run before them.
Splits: as the Triton backend sizes them (batch x row blocks x splits about fills the
GPU once), with at least MIN_SPLIT_KEYS keys per split (the few-rows kernel at one
request: ONE_REQUEST_SPLIT_KEYS); the partials are merged by triton_merge_kernel.
"""
from __future__ import annotations

import torch

# The ring kernel: BN keys per tile (one TMA box row count; a page holds whole tiles),
# STAGES tiles in the ring. 4 x 32 keys is what shared memory allows beside q (226 KB); 2
# and 3 stages ran 2.0x and 1.2x slower on an H200 (benchmarks/NOTES-decode.md).
CONFIG = dict(BN=32, STAGES=4)
# The pair kernel: two buffers of one 64-key block each.
PAIR_CONFIG = dict(BN=64, STAGES=2)
# fp8 tiles are half the bytes of bf16 ones: 3 x 64 or 8 x 32 keys fit beside q (224 KB).
# 64-key tiles halve the hand-overs between the warpgroups per key but leave a ring of 3;
# they win once a split holds FP8_LONG_SPLIT keys (H200: 1.13-1.19x at 2048-8192 keys per
# split, 0.88x at 256; benchmarks/NOTES-decode-fp8.md). See fp8_config().
FP8_CONFIGS = (dict(BN=64, STAGES=3), dict(BN=32, STAGES=8))
FP8_LONG_SPLIT = 1024
# The fp8 kernel's BF16Q mode (a bf16 query over an fp8 cache, past 32 query rows): q's
# two e4m3 terms take 72 KB beside the ring, which leaves 2 x 64 or 6 x 32 keys (218 KB).
# 32-key tiles at every split length: 2 x 64 ran 1.26-1.29x slower at 128 heads (H100;
# the fp8-query mode slows 1.4-1.6x from 3 x 64 to 2 x 64), while 6 x 32 ran as fast as
# 8 x 32 does in the fp8-query mode (docs/notes/NOTES-decode-fp8.md).
BF16Q_CONFIG = dict(BN=32, STAGES=6)
MIN_SPLIT_KEYS = 256
# The few-rows kernel at one request, bound by latency, not bytes: a split per 64-key
# tile (1.08-1.5x on an H100; BENCHMARKS.md, "16-head decode at one request").
ONE_REQUEST_SPLIT_KEYS = 64
NUM_WARPS = 4           # the default partition: consumer warpgroup 0
# The few-rows kernel (gluon_rows_kernel.py, bf16 q), by cache and query rows padded to NR
# = 16 or 32: tiles of 64 keys (the M side of its MMAs) in a ring of STAGES. Over an fp8
# cache a ring of 2 ran 1-7 % faster than 3 at 16 heads on an H200
# (docs/notes/probe_fp8_cache16.py), and 2 is what fits beside the widened values' two
# buffers (220 KB at 16 rows); over a bf16 cache a 64-key tile is 72 KB, so a ring of 2
# is what fits beside q.
FP8_CACHE_CONFIGS = {16: dict(BN=64, STAGES=2), 32: dict(BN=64, STAGES=2)}
ROWS_CONFIGS = {16: dict(BN=64, STAGES=2), 32: dict(BN=64, STAGES=2)}
ROWS_MAX = 32           # query rows (s_q x H) the few-rows kernel serves, either cache


def rows_config(rows: int, fp8: bool) -> tuple[int, dict]:
    """(NR, config) of the few-rows kernel for rows = s_q x H <= ROWS_MAX over an fp8 cache
    (FP8_CACHE_CONFIGS) or a bf16 one (ROWS_CONFIGS)."""
    nr = 16 if rows <= 16 else 32
    return nr, (FP8_CACHE_CONFIGS if fp8 else ROWS_CONFIGS)[nr]


def _check_tma_aligned(name: str, t: torch.Tensor) -> None:
    if t.data_ptr() % 16:
        raise ValueError(f"{name} must start at a 16-byte aligned address for the gluon "
                         f"backend's TMA loads (it is offset by {t.data_ptr() % 16} bytes)")


def gluon_decode(
    q: torch.Tensor,              # [B, s_q, H, 576] bf16
    kv_cache: torch.Tensor,       # [num_blocks, PAGE, 576] bf16
    block_table: torch.Tensor,    # [B, max_blocks] int32
    cache_seqlens: torch.Tensor,  # [B] int32
    softmax_scale: float,
    causal: bool,
    num_splits: int = 0,          # 0: from the shapes and SM count
) -> tuple[torch.Tensor, torch.Tensor]:
    if q.shape[1] * q.shape[2] <= ROWS_MAX:
        return _launch_rows(q, kv_cache, block_table, cache_seqlens, None, softmax_scale,
                            causal, num_splits)
    return _launch(bf16_kernel, q, kv_cache, block_table, cache_seqlens, (), softmax_scale,
                   causal, num_splits)


def gluon_decode_fp8q(
    q: torch.Tensor,              # [B, s_q, H, 576] float8_e4m3fn (true value = q * q_scale)
    kv_cache: torch.Tensor,       # [num_blocks, PAGE, 576] float8_e4m3fn (x k_scale)
    block_table: torch.Tensor,    # [B, max_blocks] int32
    cache_seqlens: torch.Tensor,  # [B] int32
    q_scale: torch.Tensor,        # [1] fp32
    k_scale: torch.Tensor,        # [1] fp32
    softmax_scale: float,
    causal: bool,
    num_splits: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch(fp8_kernel, q, kv_cache, block_table, cache_seqlens, (q_scale, k_scale),
                   softmax_scale, causal, num_splits)


def gluon_decode_fp8_cache(
    q: torch.Tensor,              # [B, s_q, H, 576] bf16 (s_q * H <= 32, or H % 64 == 0)
    kv_cache: torch.Tensor,       # [num_blocks, PAGE, 576] float8_e4m3fn (x k_scale)
    block_table: torch.Tensor,    # [B, max_blocks] int32
    cache_seqlens: torch.Tensor,  # [B] int32
    k_scale: torch.Tensor,        # [1] fp32
    softmax_scale: float,
    causal: bool,
    num_splits: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    if q.shape[1] * q.shape[2] <= ROWS_MAX:
        return _launch_rows(q, kv_cache, block_table, cache_seqlens, k_scale, softmax_scale,
                            causal, num_splits)
    return _launch(bf16q_kernel, q, kv_cache, block_table, cache_seqlens, (k_scale,),
                   softmax_scale, causal, num_splits, bf16q=True)


gluon_decode_op = torch.library.custom_op("mla::gluon_decode", mutates_args=())(gluon_decode)
gluon_decode_fp8_cache_op = torch.library.custom_op(
    "mla::gluon_decode_fp8_cache", mutates_args=())(gluon_decode_fp8_cache)
gluon_decode_fp8q_op = torch.library.custom_op("mla::gluon_decode_fp8q",
                                               mutates_args=())(gluon_decode_fp8q)


def bf16_kernel(page: int, keys_per_split: int):
    """(kernel, config) for the bf16 op: the pair kernel where a page holds whole 64-key
    blocks, else the ring kernel."""
    if page % PAIR_CONFIG["BN"] == 0:
        from lowering.decode.gluon_pair_kernel import mla_decode_pair_kernel
        return mla_decode_pair_kernel, PAIR_CONFIG
    from lowering.decode.gluon_ring_kernel import mla_decode_gluon_kernel
    return mla_decode_gluon_kernel, CONFIG


def fp8_kernel(page: int, keys_per_split: int):
    """(kernel, config) for the fp8 op: its tile config by split length (fp8_config)."""
    from lowering.decode.gluon_fp8_kernel import mla_decode_fp8_kernel
    return mla_decode_fp8_kernel, fp8_config(page, keys_per_split)


def bf16q_kernel(page: int, keys_per_split: int):
    """(kernel, config) for a bf16 query over an fp8 cache past ROWS_MAX rows: the pair
    kernel in its FP8 mode (the tiles widened to bf16 beside the MMAs) where a page holds
    whole 64-key blocks, else the fp8 kernel in BF16Q mode (q as two e4m3 terms)."""
    if page % PAIR_CONFIG["BN"] == 0:
        from lowering.decode.gluon_pair_kernel import mla_decode_pair_kernel
        return mla_decode_pair_kernel, PAIR_CONFIG
    from lowering.decode.gluon_fp8_kernel import mla_decode_fp8_kernel
    return mla_decode_fp8_kernel, BF16Q_CONFIG


def fp8_config(page: int, keys_per_split: int) -> dict:
    """The fp8 kernel's tile size and ring depth for splits of up to keys_per_split keys."""
    long_tiles, short_tiles = FP8_CONFIGS
    if page % long_tiles["BN"] == 0 and keys_per_split >= FP8_LONG_SPLIT:
        return long_tiles
    return short_tiles


def _launch(pick, q, kv_cache, block_table, cache_seqlens, scales, softmax_scale, causal,
            num_splits, bf16q=False):
    """Stage 1 and, with more than one split, the merge. Returns (out, lse).
    pick: (page, keys per split) -> (kernel, dict(BN, STAGES)); scales: () for the bf16
    kernels, (q_scale, k_scale) for the fp8 kernel; with bf16q (a bf16 query over an fp8
    cache) (k_scale,): the pair kernel (PAIR_CONFIG) takes it in FP8 mode, the fp8 kernel
    takes q as its two e4m3 terms, with their per-row scales."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from lowering.decode.gluon_common import LOG2E
    from lowering.decode.registry import sm_count
    from lowering.decode.triton_decode import choose_num_splits, stage1_outputs

    B, s_q, H, D = q.shape
    num_blocks, page, _ = kv_cache.shape
    rows = s_q * H
    m_blocks = rows // 64
    capacity = block_table.shape[1] * page                      # keys the table can address
    splits = num_splits or choose_num_splits(B, m_blocks, capacity, sm_count(q.device),
                                             min_split_keys=MIN_SPLIT_KEYS)
    kernel, config = pick(page, -(-capacity // splits))
    L, BN = 512, config["BN"]
    q2 = q.contiguous().view(B * rows, D)                                       # [B * rows, 576]
    _check_tma_aligned("kv_cache", kv_cache)
    el_kv = gl.bfloat16 if kv_cache.dtype == torch.bfloat16 else gl.float8e4nv
    lay_k = gl.NVMMASharedLayout.get_default_for([BN, 64], el_kv)
    kv_desc = TensorDescriptor.from_tensor(kv_cache.view(num_blocks * page, D), [BN, 64], lay_k)
    if config is PAIR_CONFIG:                   # the pair kernel; FP8 over an fp8 cache
        scales = (scales[0] if bf16q else None,)               # ks_ptr: the cache's scale
        modes = dict(FP8=bf16q)
        _check_tma_aligned("q", q2)
    elif bf16q:
        from lowering.decode.q_terms_kernel import q_terms
        q2, q_s = q_terms(q2)                           # [2 B rows, 576] e4m3, [B rows] fp32
        scales = (q_s, *scales)
        modes = dict(BF16Q=True)
    else:
        _check_tma_aligned("q", q2)
        modes = dict(BF16Q=False) if scales else {}             # the fp8 kernel's mode
    el_q = gl.bfloat16 if q2.dtype == torch.bfloat16 else gl.float8e4nv
    lay_q = gl.NVMMASharedLayout.get_default_for([64, 64], el_q)
    q_desc = TensorDescriptor.from_tensor(q2, [64, 64], lay_q)
    out, lse, o1, l1 = stage1_outputs(B, s_q, H, L, splits, torch.bfloat16, q.device)
    kernel[(m_blocks, B, splits)](
        q_desc, kv_desc, block_table, cache_seqlens, *scales, o1, l1, softmax_scale * LOG2E,
        block_table.stride(0), block_table.shape[1], num_blocks, splits,
        S_Q=s_q, H=H, PAGE=page, BN=BN, STAGES=config["STAGES"], DIRECT=splits == 1,
        CAUSAL=causal, num_warps=NUM_WARPS, **modes)
    if splits > 1:
        _merge(o1, l1, out, lse, splits)
    return out, lse


def _merge(o1, l1, out, lse, splits):
    """The splits' fp32 partials o1 / l1 -> out [B, s_q, H, 512], lse [B, H, s_q]."""
    import triton

    from lowering.decode.merge_kernel import mla_decode_merge_kernel
    from lowering.decode.triton_decode import merge_block_l

    B, s_q, H, L = out.shape
    rows = s_q * H
    bl = merge_block_l(B, rows, L, False)
    mla_decode_merge_kernel[(rows, B, L // bl)](
        o1, l1, out, lse, splits, S_Q=s_q, H=H, L=L,
        SPLIT_BLOCK=min(16, triton.next_power_of_2(splits)), BLOCK_L=bl, num_warps=4)


def rows_splits(B: int, capacity: int, sms: int) -> int:
    """The few-rows kernel's splits for B requests whose table addresses capacity keys:
    the Triton backend's sizing, with a split as short as one tile at one request."""
    from lowering.decode.triton_decode import choose_num_splits
    keys = ONE_REQUEST_SPLIT_KEYS if B == 1 else MIN_SPLIT_KEYS
    return choose_num_splits(B, 1, capacity, sms, min_split_keys=keys)


def _launch_rows(q, kv_cache, block_table, cache_seqlens, k_scale, softmax_scale, causal,
                 num_splits):
    """gluon_rows_kernel.py (one CTA per request and split; an fp8 cache where k_scale is
    given, else bf16) and the merge."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from lowering.decode.gluon_common import LOG2E
    from lowering.decode.gluon_rows_kernel import mla_decode_rows_kernel
    from lowering.decode.registry import sm_count
    from lowering.decode.triton_decode import stage1_outputs

    B, s_q, H, D = q.shape
    num_blocks, page, _ = kv_cache.shape
    fp8 = k_scale is not None
    NR, config = rows_config(s_q * H, fp8)
    BN, STAGES = config["BN"], config["STAGES"]
    if page % BN:
        raise ValueError(f"the gluon few-rows kernel needs block_size to be a multiple of {BN}, "
                         f"kv_cache has block_size {page}")
    splits = num_splits or rows_splits(B, block_table.shape[1] * page, sm_count(q.device))
    _check_tma_aligned("kv_cache", kv_cache)
    el = gl.float8e4nv if fp8 else gl.bfloat16
    lay_k = gl.NVMMASharedLayout.get_default_for([BN, 64], el)
    kv_desc = TensorDescriptor.from_tensor(kv_cache.view(num_blocks * page, D), [BN, 64], lay_k)
    out, lse, o1, l1 = stage1_outputs(B, s_q, H, 512, splits, torch.bfloat16, q.device)
    mla_decode_rows_kernel[(B, splits)](
        q.contiguous(), kv_desc, block_table, cache_seqlens, k_scale if fp8 else cache_seqlens,
        o1, l1, softmax_scale * LOG2E, block_table.stride(0), block_table.shape[1], num_blocks,
        splits, S_Q=s_q, H=H, PAGE=page, BN=BN, NR=NR, STAGES=STAGES,
        DIRECT=splits == 1, CAUSAL=causal, FP8=fp8, num_warps=NUM_WARPS)
    if splits > 1:
        _merge(o1, l1, out, lse, splits)
    return out, lse


def _fake(q, kv_cache, *args):
    B, s_q, H, _ = q.shape
    return (torch.empty((B, s_q, H, 512), dtype=torch.bfloat16, device=q.device),
            q.new_empty((B, H, s_q), dtype=torch.float32))


gluon_decode_op.register_fake(_fake)
gluon_decode_fp8_cache_op.register_fake(_fake)
gluon_decode_fp8q_op.register_fake(_fake)


def run_gluon(call):
    """Route "gluon" of lowering.mla_decode (a checked DecodeCall)."""
    if call.kind == "fp8":
        compiling = torch.compiler.is_compiling()
        decode = gluon_decode_fp8_cache_op if compiling else gluon_decode_fp8_cache
        return decode(call.q, call.kv_cache, call.block_table, call.cache_seqlens,
                      call.k_scale.reshape(1), call.softmax_scale, call.causal)
    decode = gluon_decode_op if torch.compiler.is_compiling() else gluon_decode
    return decode(call.q, call.kv_cache, call.block_table, call.cache_seqlens,
                  call.softmax_scale, call.causal)


def run_gluon_fp8q(call):
    """Route "gluon-fp8q" of lowering.mla_decode_fp8q (a checked DecodeCall)."""
    decode = gluon_decode_fp8q_op if torch.compiler.is_compiling() else gluon_decode_fp8q
    return decode(call.q, call.kv_cache, call.block_table, call.cache_seqlens,
                  call.q_scale.reshape(1), call.k_scale.reshape(1), call.softmax_scale,
                  call.causal)
