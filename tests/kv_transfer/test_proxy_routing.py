"""``widellm proxy``'s instance choice on its own (pure, no servers): prefix-chain keys,
affinity against load, cooldown of failed instances, the LRU bound, what a prefill is sent."""

from __future__ import annotations

from widellm.kv_transfer import proxy_routing as routing

PREFILL_DEFAULT = {"do_remote_decode": True, "do_remote_prefill": False}


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_block_keys_chain():
    a = routing.block_keys("x" * routing.PREFIX_BLOCK_CHARS * 2 + "tail")
    b = routing.block_keys("x" * routing.PREFIX_BLOCK_CHARS * 2 + "other tail")
    c = routing.block_keys("y" + "x" * (routing.PREFIX_BLOCK_CHARS * 2 - 1))
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]
    assert c[0] != a[0] and c[1] != a[1]  # a changed first block changes every later key
    assert routing.block_keys("") == []
    assert routing.prompt_text({"messages": [{"role": "u", "content": "c"}]}, chat=True) == \
        routing.prompt_text({"messages": [{"content": "c", "role": "u"}]}, chat=True)
    assert routing.prompt_text({"prompt": [1, 2, 3]}, chat=False) == "[1,2,3]"


def test_round_robin_when_nothing_matches():
    pool = routing.InstancePool(["a", "b", "c"])
    assert [pool.choose([]) for _ in range(4)] == [0, 1, 2, 0]
    assert pool.choose([], exclude=[0, 1, 2]) is None
    assert pool.choose([], exclude=[1]) == 2  # the cursor is at 1: 2 comes next


def test_prefix_affinity():
    pool = routing.InstancePool(["a", "b", "c"])
    shared = routing.block_keys("s" * routing.PREFIX_BLOCK_CHARS * 3)
    pool.record(2, shared[:2])
    pool.record(1, shared[:1])
    assert pool.matched_blocks(2, shared) == 2 and pool.matched_blocks(0, shared) == 0
    assert [pool.choose(shared) for _ in range(3)] == [2, 2, 2]
    assert pool.choose(routing.block_keys("unrelated")) == 0  # round-robin cursor after 2


def test_load_imbalance_overrides_affinity():
    pool = routing.InstancePool(["a", "b", "c"], max_load_imbalance=4)
    keys = routing.block_keys("p" * routing.PREFIX_BLOCK_CHARS)
    pool.record(1, keys)
    pool.in_flight[:] = [2, 6, 3]
    assert pool.choose(keys) == 1  # 6 - 2 == 4: still within the imbalance
    pool.in_flight[:] = [2, 7, 3]
    assert pool.choose(keys) == 0  # too busy: the least loaded instead
    pool.record(2, keys)
    assert pool.choose(keys) == 2  # the next best match within the imbalance
    pool.in_flight[:] = [1, 1, 0]
    assert pool.choose(routing.block_keys("none")) == 2  # no match: least loaded


def test_unhealthy_instances_are_skipped_for_the_cooldown():
    clock = FakeClock()
    pool = routing.InstancePool(["a", "b"], cooldown_s=5.0, clock=clock)
    keys = routing.block_keys("q")
    pool.record(0, keys)
    pool.mark_failed(0)
    assert pool.choose(keys) == 1
    clock.now += 4.9
    assert pool.choose(keys) == 1
    clock.now = 105.0
    assert pool.choose(keys) == 0
    pool.mark_failed(0)
    pool.mark_failed(1)
    assert pool.choose(keys) == 0  # all unhealthy: use them anyway, prefix still counts
    pool.mark_ok(1)
    assert pool.choose(keys) == 1


def test_seen_keys_are_lru_bounded():
    pool = routing.InstancePool(["a"], max_keys=2)
    k = routing.block_keys("k" * routing.PREFIX_BLOCK_CHARS * 3)
    pool.record(0, k)
    assert pool.matched_blocks(0, k) == 0  # k[0] was evicted: the chain breaks at once
    assert pool.matched_blocks(0, k[1:]) == 2


def test_prefill_body_and_skips():
    chat = {"messages": [], "max_tokens": 9, "max_completion_tokens": 9, "min_tokens": 3}
    assert routing.prefill_body(chat, chat=True) == {
        "messages": [], "max_tokens": 1, "max_completion_tokens": 1, "stream": False, "n": 1,
        "kv_transfer_params": PREFILL_DEFAULT}
    assert routing.prefill_body({"messages": []}, chat=True)["max_tokens"] == 1
    assert not routing.skips_disaggregation({"n": 1, "best_of": 1, "prompt": [1, 2, 3]})
    assert not routing.skips_disaggregation({"prompt": ["one"]})
    assert routing.skips_disaggregation({"n": 2})
    assert routing.skips_disaggregation({"prompt": [[1], [2]]})
    assert routing.skips_disaggregation({"prompt": "a", "echo": True, "logprobs": 2})
    assert routing.skips_disaggregation({"messages": [], "prompt_logprobs": 0})
    assert not routing.skips_disaggregation({"prompt": "a", "echo": True})
