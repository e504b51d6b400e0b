"""Prefix-aware routing (diffkv_serve/service/prefix_router.py): the policy's pure parts against brute-force references on
random prompts, the Serve RequestRouter on stub replicas, its config, and two engine replicas behind it where
requests sharing a long prefix land on the replica that cached it."""
import asyncio
import random
from types import SimpleNamespace

import pydantic
import pytest

from diffkv_serve.service.prefix_router import PrefixIndex, block_keys, prompt_of, rank_by_prefix

IDLE = {"pages_total": 1000, "pages_used": 0, "num_running": 0, "max_num_seqs": 64, "pages_per_request": 10}


def _random_prompts(rng: random.Random, n: int, block: int) -> list[list[int]]:
    """Prompts that share random-length prefixes with each other (a few roots, random branches)."""
    roots = [[rng.randrange(1, 50_000) for _ in range(rng.randrange(1, 6) * block)] for _ in range(3)]
    out = []
    for _ in range(n):
        base = rng.choice(roots + out) if out else rng.choice(roots)
        keep = rng.randrange(0, len(base) + 1)
        out.append(base[:keep] + [rng.randrange(1, 50_000) for _ in range(rng.randrange(0, 4 * block))])
    return out


def _common_blocks(a: list, b: list, block: int) -> int:
    """Reference: how many full leading blocks two prompts share."""
    n = 0
    while (n + 1) * block <= min(len(a), len(b)) and a[n * block:(n + 1) * block] == b[n * block:(n + 1) * block]:
        n += 1
    return n


def test_prompt_of_reads_what_the_ingress_sends():
    chat = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}
    assert prompt_of(chat) == "<|system|>Be brief.<|user|>Hi"
    assert prompt_of({"prompt": "some text"}) == "some text"
    assert prompt_of({"prompt": [5, 7, 9]}) == [5, 7, 9]
    for nothing in (None, {}, {"prompt": [1, "x"]}, "text", {"messages": "nope"}):
        assert prompt_of(nothing) is None


def test_block_keys_name_a_block_by_its_whole_prefix():
    rng = random.Random(1)
    a = [rng.randrange(1, 1000) for _ in range(70)]
    b = a[:35] + [x + 1 for x in a[35:]]  # differs from token 35 on: blocks 0-1 (of 16) are shared
    ka, kb = block_keys(a, 16), block_keys(b, 16)
    assert len(ka) == 4 and ka[:2] == kb[:2] and all(x != y for x, y in zip(ka[2:], kb[2:]))
    # the same block content under another parent gets another name
    assert block_keys(a[16:32], 16)[0] != ka[1]
    text = "".join(chr(97 + rng.randrange(26)) for _ in range(200))
    assert block_keys(text, 64) == block_keys(text[:192] + "zz", 64) and len(block_keys(text, 64)) == 3
    with pytest.raises(ValueError, match="block_size"):
        block_keys(a, 0)


def test_longest_prefix_match_equals_the_brute_force_reference():
    rng = random.Random(7)
    block = 4
    index, routed = PrefixIndex(10_000), {"r0": [], "r1": []}
    for p in _random_prompts(rng, 40, block):
        replica = rng.choice(sorted(routed))
        index.insert(replica, block_keys(p, block))
        routed[replica].append(p)
    for q in _random_prompts(rng, 60, block):
        for replica, prompts in routed.items():
            expected = max((_common_blocks(q, p, block) for p in prompts), default=0)
            assert index.match(replica, block_keys(q, block)) == expected
    assert index.match("never-routed", block_keys(q, block)) == 0


def test_eviction_keeps_each_replica_within_its_bound_and_drops_later_blocks_first():
    rng = random.Random(3)
    index = PrefixIndex(max_blocks_per_replica=10)
    first = [rng.randrange(1, 1000) for _ in range(8 * 4)]  # 8 blocks of 4
    index.insert("r", block_keys(first, 4))
    second = [rng.randrange(1000, 2000) for _ in range(6 * 4)]  # 6 more: 4 of the first's must go
    index.insert("r", block_keys(second, 4))
    assert index.size("r") == 10
    assert index.match("r", block_keys(second, 4)) == 6
    assert index.match("r", block_keys(first, 4)) == 4  # its head survives: its tail went first
    for _ in range(50):
        index.insert("r", block_keys([rng.randrange(1, 10**6) for _ in range(rng.randrange(4, 80))], 4))
        assert index.size("r") <= 10
    index.insert("gone", block_keys(first, 4))
    index.retain({"r"})
    assert index.size("gone") == 0 and index.size("r") == 10
    with pytest.raises(ValueError, match="max_blocks_per_replica"):
        PrefixIndex(0)


def _rank(stats: dict, keys: list, index: PrefixIndex, queues=None, threshold=0.25, min_fraction=0.1, seed=0):
    names = sorted(stats)
    return rank_by_prefix(names, keys, index, lambda r: r, stats.get, (queues or {}).get, random.Random(seed),
                          threshold, min_fraction)


def test_balanced_load_follows_the_longest_prefix_and_imbalance_falls_back_to_headroom():
    rng = random.Random(11)
    prompt = [rng.randrange(1, 50_000) for _ in range(64)]
    keys = block_keys(prompt, 16)
    index = PrefixIndex(1000)
    index.insert("a", keys[:1])
    index.insert("b", keys)  # b holds the whole prompt, a only its first block
    busier_b = {"a": dict(IDLE), "b": {**IDLE, "num_running": 8}}  # headroom 1.0 vs 0.875: balanced
    assert _rank(busier_b, keys, index)[:2] == ["b", "a"]
    # the same prefix, but b is far busier than a: headroom decides
    swamped_b = {"a": dict(IDLE), "b": {**IDLE, "num_running": 40, "pages_used": 600}}
    assert _rank(swamped_b, keys, index) == ["a", "b"]
    assert _rank(swamped_b, keys, index, threshold=1.0) == ["b", "a"]  # unless the threshold allows it
    # equal matches: more headroom first
    index.insert("a", keys)
    assert _rank(busier_b, keys, index) == ["a", "b"]
    # a replica whose prefix cache is off (diffkv under "auto") never wins on prefix
    index.drop("a")
    off = {"a": dict(IDLE), "b": {**IDLE, "num_running": 8, "prefix_caching": False}}
    assert _rank(off, keys, index) == ["a", "b"]
    # a dead replica goes last whatever it holds
    dead = {"a": dict(IDLE), "b": {**IDLE, "dead": True}}
    assert _rank(dead, keys, index) == ["a", "b"]


def test_an_unheld_prompt_goes_to_the_replica_remembering_least():
    rng = random.Random(5)
    index = PrefixIndex(1000)
    index.insert("a", block_keys([rng.randrange(1, 50_000) for _ in range(160)], 16))
    index.insert("b", block_keys([rng.randrange(1, 50_000) for _ in range(32)], 16))
    new = block_keys([rng.randrange(1, 50_000) for _ in range(96)], 16)
    stats = {"a": dict(IDLE), "b": {**IDLE, "num_running": 4}, "c": {**IDLE, "num_running": 2}}
    assert _rank(stats, new, index) == ["c", "b", "a"]  # c remembers nothing, then b (2 blocks), then a (10)
    # a match below min_match_fraction counts as none
    long_prompt = block_keys([rng.randrange(1, 50_000) for _ in range(16 * 40)], 16)
    index.insert("a", long_prompt[:2])
    assert _rank(stats, long_prompt, index, min_fraction=0.1)[0] == "c"
    assert _rank(stats, long_prompt, index, min_fraction=0.0)[0] == "a"
    # no prompt (e.g. a stats() call through the handle): headroom alone
    assert _rank(stats, [], index)[0] == "a"


def test_router_learns_where_it_sent_each_prefix():
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID

    from diffkv_serve.service.prefix_router import PrefixAwareRouter

    router = PrefixAwareRouter(DeploymentID(name="EngineReplica", app_name="t"), DeploymentHandleSource.UNKNOWN,
                               use_replica_queue_len_cache=True)
    router.initialize_state(block_chars=8, seed=0)
    replicas = [SimpleNamespace(replica_id=ReplicaID(n, DeploymentID(name="EngineReplica", app_name="t")),
                                routing_stats=dict(IDLE), max_ongoing_requests=1024) for n in ("x", "y")]
    rng = random.Random(2)
    system = "".join(chr(97 + rng.randrange(26)) for _ in range(400))

    def request(user: str):
        return SimpleNamespace(args=[{"messages": [{"role": "system", "content": system},
                                                   {"role": "user", "content": user}]}], kwargs={})

    first = request("first question")
    chosen = asyncio.run(router.choose_replicas(replicas, first))[0][0]
    router.on_request_routed(first, chosen.replica_id, None)
    for i in range(5):  # the other replica is idle as well, yet the prefix decides
        ranks = asyncio.run(router.choose_replicas(replicas, request(f"question {i}")))
        assert ranks[0][0] is chosen
    with pytest.raises(ValueError, match="imbalance_threshold"):
        router.initialize_state(imbalance_threshold=-1.0)
    assert asyncio.run(router.choose_replicas([], first)) == []


def test_router_config_selects_the_prefix_router():
    from diffkv_serve.service.app import engine_deployment_options
    from diffkv_serve.service.config import ServiceConfig

    cfg = ServiceConfig(device="cpu", router={"policy": "prefix", "prefix": {"imbalance_threshold": 0.5}})
    router = engine_deployment_options(cfg)["request_router_config"]
    assert router.request_router_class.endswith("PrefixAwareRouter")
    assert router.request_router_kwargs["imbalance_threshold"] == 0.5
    assert router.request_router_kwargs["block_chars"] == 64
    for bad, field in (({"min_match_fraction": 1.5}, "min_match_fraction"), ({"block_chars": 0}, "block_chars"),
                       ({"imbalance_threshold": -0.1}, "imbalance_threshold"), ({"nope": 1}, "nope")):
        with pytest.raises(pydantic.ValidationError, match=field):
            ServiceConfig(device="cpu", router={"policy": "prefix", "prefix": bad})


# ---- two engine replicas behind the prefix router ----------------------------------------------------------
APP = "prefixroute"
ROUTE = "/prefixroute"
CONFIG = {"device": "cpu", "model": "random:tiny", "num_replicas": 2, "default_max_tokens": 4,
          "router": {"policy": "prefix", "stats_period_s": 0.5}, "admission": {"enabled": False}}


@pytest.fixture(scope="module")
def service(cluster):
    from _cluster import served

    with served(cluster, CONFIG, APP, ROUTE) as s:
        yield s


def test_requests_sharing_a_prefix_land_on_the_replica_that_cached_it(service):
    """Three long prefixes, two requests each, one at a time (balanced load): every second request hits all of
    its prefix's blocks, so it reached the replica of the first (by chance: 1 in 8)."""
    import httpx

    from _cluster import wait_for

    rng = random.Random(23)
    prefix_tokens, block = 96, 16  # fp16's prefix blocks are block_size (16) tokens
    prefixes = [[rng.randrange(10, 250) for _ in range(prefix_tokens)] for _ in range(3)]
    with httpx.Client(timeout=60) as client:
        for prefix in prefixes:
            for _ in range(2):
                prompt = prefix + [rng.randrange(10, 250) for _ in range(8)]
                r = client.post(service["base"] + "/v1/completions", json={
                    "model": service["model"], "prompt": prompt, "max_tokens": 4, "temperature": 0})
                assert r.status_code == 200, r.text

    def per_replica():
        seen = {}
        for _ in range(12):
            st = service["engine"].stats.remote().result()
            seen[st["replica"]] = st
        return seen if len(seen) == 2 else None
    stats = wait_for(per_replica, 30, what="stats of both replicas")
    assert sum(st["prefix_cache_queries"] for st in stats.values()) == 6 * (prefix_tokens + 8)
    assert sum(st["prefix_cache_hits"] for st in stats.values()) == 3 * (prefix_tokens // block) * block


def test_headroom_counts_evictable_prefix_pages_as_free():
    """An idle replica whose pool is full of cached prefix blocks nobody reads has room: they are evicted on
    demand. Reference: the page room computed by hand on random pool states."""
    from diffkv_serve.service.router import headroom

    rng = random.Random(13)
    for _ in range(50):
        total = rng.randrange(100, 10_000)
        used = rng.randrange(0, total + 1)
        evictable = rng.randrange(0, used + 1)
        running = rng.randrange(0, 8)
        st = {"pages_total": total, "pages_used": used, "pages_evictable": evictable, "num_running": running,
              "max_num_seqs": 64, "pages_per_request": 0.0}
        expected = min(1.0 - (used - evictable) / total, 1.0 - running / 64)
        assert headroom(st, None) == pytest.approx(expected, rel=1e-12)
        assert headroom(st, None) >= headroom({**st, "pages_evictable": 0}, None)
