"""Block allocator, metadata builder and cache sizes."""
import pytest
import torch

from mla_ops import BlockAllocator, CacheFullError, MLAMetadata, PagedLatentCache


def test_allocate_free_and_slots():
    a = BlockAllocator(4, 3)
    s0 = a.allocate("x", 4)                  # blocks 0, 1
    assert s0 == [0, 1, 2, 3]
    s1 = a.allocate("y", 2)                  # block 2
    assert s1 == [6, 7]
    assert a.allocate("x", 2) == [4, 5]      # fills block 1
    assert a.allocate("x", 1) == [9]         # block 3
    assert a.num_free_blocks == 0
    t = a.block_table(["x", "y"])
    assert t.dtype == torch.int32 and t.tolist() == [[0, 1, 3], [2, -1, -1]]
    a.free("y")
    assert a.num_free_blocks == 1 and a.allocate("z", 3) == [6, 7, 8]


def test_cache_full_is_an_error_and_changes_nothing():
    a = BlockAllocator(2, 4)
    a.allocate("x", 6)
    with pytest.raises(CacheFullError, match="cache is full"):
        a.allocate("y", 3)
    assert a.seq_len("y") == 0 and a.num_free_blocks == 0 and a.seq_len("x") == 6
    with pytest.raises(CacheFullError):
        MLAMetadata.build(a, ["x"], [3])
    assert a.seq_len("x") == 6


def test_metadata_build_orders_and_positions():
    a = BlockAllocator(16, 4)
    a.allocate(1, 5)
    m = MLAMetadata.build(a, [1, 2], [1, 6])
    assert m.num_decode_tokens == 1
    assert m.seq_lens.tolist() == [6, 6] and m.query_start_loc.tolist() == [0, 1, 7]
    assert m.slot_mapping.dtype == torch.int64 and m.slot_mapping.tolist()[0] == 5
    assert m.prefill_shape == (1, 6, 0, 0)          # one prefill request, no context yet
    m2 = MLAMetadata.build(a, [2, 1, 5], [3, 2, 4])
    assert m2.num_decode_tokens == 0 and m2.prefill_shape == (3, 4, 6, 0)
    assert MLAMetadata.build(a, [1, 2], [1, 1]).prefill_shape is None     # decode only
    with pytest.raises(ValueError, match="decode requests"):
        MLAMetadata.build(a, [3, 4], [5, 1])
    with pytest.raises(ValueError, match="positive"):
        MLAMetadata.build(a, [3], [0])


@pytest.mark.parametrize("kind,bytes_", [("auto", 1152), ("fp8", 576)])
def test_bytes_per_token(kind, bytes_):
    c = PagedLatentCache(2, 3, 64, dtype=torch.bfloat16, kv_cache_dtype=kind)
    assert c.bytes_per_token_per_layer() == bytes_
    assert c.kv[0].shape == (3, 64, 576) and len(c.kv) == 2


def test_bad_construction():
    with pytest.raises(ValueError, match="block_size"):
        BlockAllocator(4, 0)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        PagedLatentCache(1, 2, 4, kv_cache_dtype="int4")
    with pytest.raises(TypeError, match="dtype"):
        PagedLatentCache(1, 2, 4, dtype=torch.int8)
