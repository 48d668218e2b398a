"""KV pool, slot allocator and request table."""

from __future__ import annotations

import pytest
import torch

from flashrec_core.kvcache import KVPool, OutOfSlotsError, RequestTable, SlotAllocator

CPU = torch.device("cpu")


def test_allocator_never_hands_out_the_padding_slot() -> None:
    alloc = SlotAllocator(8)
    assert alloc.num_free == 7
    slots = torch.cat([alloc.alloc(3), alloc.alloc(4)])
    assert slots.dtype == torch.int64
    assert sorted(slots.tolist()) == [1, 2, 3, 4, 5, 6, 7]
    assert KVPool.PAD_SLOT == 0 and 0 not in slots.tolist()
    assert alloc.num_free == 0


def test_allocator_first_allocation_is_ascending() -> None:
    assert SlotAllocator(16).alloc(5).tolist() == [1, 2, 3, 4, 5]


def test_allocator_free_round_trip() -> None:
    alloc = SlotAllocator(10)
    a, b = alloc.alloc(4), alloc.alloc(3)
    assert set(a.tolist()).isdisjoint(b.tolist())
    alloc.free(a)
    assert alloc.num_free == 6
    c = alloc.alloc(4)
    assert sorted(c.tolist()) == sorted(a.tolist()), "freed slots are handed out again"
    alloc.free(b)
    alloc.free(c)
    assert alloc.num_free == 9
    assert sorted(alloc.alloc(9).tolist()) == list(range(1, 10))


def test_allocator_exhaustion_message() -> None:
    alloc = SlotAllocator(8)
    alloc.alloc(5)
    with pytest.raises(OutOfSlotsError) as info:
        alloc.alloc(3)
    msg = str(info.value)
    assert "needs 3 free token slots but has 2 of 7" in msg and "--kv-cache-tokens" in msg
    assert alloc.num_free == 2, "a failed alloc takes nothing"


def test_allocator_double_free_is_caught() -> None:
    alloc = SlotAllocator(4)
    a = alloc.alloc(2)
    alloc.free(a)
    with pytest.raises(AssertionError, match="freeing more slots"):
        alloc.free(a)


def test_request_table_add_get_remove() -> None:
    table = RequestTable(max_requests=2, max_context=8, device=CPU)
    r0 = table.add(torch.tensor([4, 5, 6]))
    r1 = table.add(torch.tensor([9]))
    assert (r0, r1) == (0, 1) and table.num_active == 2
    assert table.get(r0).tolist() == [4, 5, 6]
    assert table.get(r1).tolist() == [9]
    table.remove(r0)
    assert table.num_active == 1
    assert table.get(r0).tolist() == []
    r2 = table.add(torch.tensor([1, 2, 3, 7, 8]))
    assert r2 == r0, "the freed row is reused"
    assert table.get(r2).tolist() == [1, 2, 3, 7, 8]
    assert table.get(r1).tolist() == [9], "other rows are untouched"


def test_request_table_full_message() -> None:
    table = RequestTable(max_requests=2, max_context=8, device=CPU)
    table.add(torch.tensor([1]))
    table.add(torch.tensor([2]))
    with pytest.raises(OutOfSlotsError, match=r"request table is full \(2 requests\)"):
        table.add(torch.tensor([3]))


def test_request_table_context_limit_message() -> None:
    table = RequestTable(max_requests=2, max_context=4, device=CPU)
    with pytest.raises(OutOfSlotsError) as info:
        table.add(torch.arange(1, 6))
    assert "prompt of 5 tokens exceeds the context limit 4" in str(info.value)
    assert table.num_active == 0, "a rejected prompt takes no row"


def test_request_table_double_remove_is_caught() -> None:
    table = RequestTable(max_requests=4, max_context=8, device=CPU)
    row = table.add(torch.tensor([1, 2]))
    table.remove(row)
    try:
        table.remove(row)
    except (AssertionError, KeyError, ValueError, RuntimeError):
        return  # rejected: fine
    a, b = table.add(torch.tensor([3])), table.add(torch.tensor([4]))
    assert a != b, f"two live requests were given the same row {a}"


def test_kv_pool_shapes() -> None:
    pool = KVPool(3, 2, 8, 16, torch.bfloat16, CPU)
    assert len(pool.k_cache) == len(pool.v_cache) == 3
    for t in (*pool.k_cache, *pool.v_cache):
        assert t.shape == (16, 2, 8) and t.dtype == torch.bfloat16
    assert len({t.data_ptr() for t in (*pool.k_cache, *pool.v_cache)}) == 6, "no shared storage"


def test_kv_pool_store_fp8() -> None:
    pool = KVPool(2, 2, 4, 8, torch.float8_e4m3fn, CPU)
    loc = torch.tensor([3, 6])
    # exactly representable in e4m3 except 0.3 (rounds to 0.3125) and 500 (saturates to 448)
    k = torch.tensor([[[0.5, -1.75, 448.0, 0.0625], [0.3, 2.0, -3.0, 1.0]]] * 2)
    k[1] *= -1
    v = torch.full((2, 2, 4), 500.0)
    pool.store(1, loc, k, v)
    got_k, got_v = pool.k_cache[1], pool.v_cache[1]
    assert got_k.dtype == torch.float8_e4m3fn
    assert got_k[3].float().tolist() == [[0.5, -1.75, 448.0, 0.0625], [0.3125, 2.0, -3.0, 1.0]]
    assert torch.equal(got_k[6].float(), -got_k[3].float())
    assert torch.equal(got_k[loc].view(torch.uint8), k.to(torch.float8_e4m3fn).view(torch.uint8))
    assert torch.equal(got_v[loc].view(torch.uint8), v.to(torch.float8_e4m3fn).view(torch.uint8))
    untouched = [i for i in range(8) if i not in (3, 6)]
    assert got_k[untouched].float().abs().sum() == 0 and got_v[untouched].float().abs().sum() == 0
    assert pool.k_cache[0].float().abs().sum() == 0, "other layers untouched"


@pytest.mark.parametrize(
    ("dtype", "size"),
    [(torch.float8_e4m3fn, 1), (torch.bfloat16, 2), (torch.float16, 2), (torch.float32, 4)],
)
def test_bytes_per_token(dtype: torch.dtype, size: int) -> None:
    # a Qwen3-8B-like shape: 36 layers, 8 KV heads of 128
    assert KVPool.bytes_per_token(36, 8, 128, dtype) == 2 * 8 * 128 * 36 * size
    pool = KVPool(3, 2, 8, 5, dtype, CPU)
    total = sum(t.numel() * t.element_size() for t in (*pool.k_cache, *pool.v_cache))
    assert KVPool.bytes_per_token(3, 2, 8, dtype) * 5 == total


def test_kv_pool_sizing_takes_the_memory_share_or_what_the_budgets_can_use() -> None:
    from flashrec_core.config import EngineConfig
    from flashrec_core.engine.build import CPU_KV_TOKENS, kv_pool_tokens, workload_kv_tokens

    per_token, free = 57_344, 100 * 2**30  # Qwen3-1.7B's FP8 KV per token; 100 GiB free
    default = EngineConfig(model_path="m")  # 1,024 requests x 16,384 tokens: more than fits
    share = int(free * default.mem_fraction) // per_token
    assert kv_pool_tokens(default, per_token, free, 16_384, 3)[0] == share
    assert kv_pool_tokens(default, per_token, free, 16_384, None)[0] == share
    small = EngineConfig(model_path="m", max_requests=64, max_context=1100)
    tokens, why = kv_pool_tokens(small, per_token, free, 1100, 3)
    assert tokens == workload_kv_tokens(small, 1100, 3) == 64 * 1100 + 2 * 8192 * 2 + 1
    assert "--max-requests" in why and tokens < share
    explicit = EngineConfig(model_path="m", kv_cache_tokens=12_345)
    assert kv_pool_tokens(explicit, per_token, free, 1100, 3) == (12_345, "--kv-cache-tokens")
    assert kv_pool_tokens(small, per_token, None, 1100, 3)[0] == CPU_KV_TOKENS
