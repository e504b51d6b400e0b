"""Prefix-aware request routing, composed with KV headroom.

An engine replica's prefix cache (diffkv_serve/engine/kv/prefix_cache.py) saves the prefill of a prompt prefix it has seen,
but only on that replica. `PrefixAwareRouter` remembers, per replica, the prefixes it routed there and sends a
request to the replica holding the longest prefix of its prompt, as long as load is balanced: the spread of
replica headroom (service.router.headroom) stays within `imbalance_threshold`. Otherwise, or when no replica
holds at least `min_match_fraction` of the prompt, it ranks by headroom like KVHeadroomRouter; among replicas of
equal standing a prompt nobody holds goes to the replica remembering the fewest blocks, so distinct prefixes
spread over the caches.

The memory is approximate and local to this router (each ingress replica's handle has its own): prompts are
cut into blocks (characters of the text, or token ids), each named by a chain hash of its parent's name and
its own content, so a block matches only under the same whole prefix, as in the engine. Each replica keeps
at most `max_blocks_per_replica` names, least recently routed evicted first (a prompt's later blocks before
its earlier ones: a child is useless without its parent). A replica whose routing stats say its prefix cache
is off (`prefix_caching: false`, e.g. diffkv under "auto") never wins on prefix.
"""
from __future__ import annotations

import random
from collections import OrderedDict
from typing import Any, Callable, Hashable, Optional, Sequence

from diffkv_serve.service.router import headroom, rank_by_headroom

try:  # the public extension point (Ray >= 2.47)
    from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica
except ImportError:  # pragma: no cover - older Ray: service.app falls back to Serve's default router
    RequestRouter = None


def prompt_of(request: Any) -> Optional[Sequence]:
    """The prompt of what the ingress sends an engine replica (service.api: a dict with "messages" or
    "prompt"): chat messages as one string of role-tagged contents, a text prompt as is, token ids as a list.
    None when there is none to match (then routing is by headroom alone)."""
    if not isinstance(request, dict):
        return None
    messages = request.get("messages")
    if isinstance(messages, list):
        return "".join(f"<|{m.get('role', '')}|>{m.get('content') or ''}" for m in messages if isinstance(m, dict))
    prompt = request.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return prompt
    return None


def block_keys(prompt: Sequence, block_size: int) -> list[int]:
    """Chain-hash names of the prompt's full blocks of block_size characters or token ids."""
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be >= 1")
    keys, parent = [], 0
    for start in range(0, len(prompt) - block_size + 1, block_size):
        chunk = prompt[start:start + block_size]
        parent = hash((parent, chunk if isinstance(chunk, str) else tuple(chunk)))
        keys.append(parent)
    return keys


class PrefixIndex:
    """Per replica, the block names of the prompts routed to it: bounded, least recently routed evicted."""

    def __init__(self, max_blocks_per_replica: int):
        if max_blocks_per_replica < 1:
            raise ValueError(f"max_blocks_per_replica={max_blocks_per_replica} must be >= 1")
        self.max_blocks = max_blocks_per_replica
        self._blocks: dict[Hashable, OrderedDict[int, None]] = {}

    def match(self, replica: Hashable, keys: list[int]) -> int:
        """How many leading blocks of keys the replica holds (no side effects)."""
        held = self._blocks.get(replica)
        if not held:
            return 0
        n = 0
        for k in keys:  # chain names: the n-th block matches only if the whole prefix before it does
            if k not in held:
                break
            n += 1
        return n

    def insert(self, replica: Hashable, keys: list[int]) -> None:
        held = self._blocks.setdefault(replica, OrderedDict())
        for k in reversed(keys):  # the first block ends most recent, so it is evicted last
            held[k] = None
            held.move_to_end(k)
        while len(held) > self.max_blocks:
            held.popitem(last=False)

    def size(self, replica: Hashable) -> int:
        return len(self._blocks.get(replica, ()))

    def drop(self, replica: Hashable) -> None:
        self._blocks.pop(replica, None)

    def retain(self, replicas: set) -> None:
        """Forget replicas no longer in the deployment."""
        for r in [r for r in self._blocks if r not in replicas]:
            del self._blocks[r]


def rank_by_prefix(replicas: list, keys: list[int], index: PrefixIndex, id_of: Callable, stats_of: Callable,
                   queue_len_of: Callable, rng: random.Random, imbalance_threshold: float,
                   min_match_fraction: float) -> list:
    """Replicas best first (see the module docstring for the policy)."""
    rooms = {id(r): headroom(stats_of(r), queue_len_of(r)) for r in replicas}
    live = [rooms[id(r)] for r in replicas if rooms[id(r)] != float("-inf")]
    if not keys or not live or max(live) - min(live) > imbalance_threshold:
        return rank_by_headroom(replicas, stats_of, queue_len_of, rng)

    def matched(r) -> int:
        if (stats_of(r) or {}).get("prefix_caching") is False:
            return 0
        return index.match(id_of(r), keys)

    matches = {id(r): matched(r) for r in replicas}
    if max(matches.values()) < max(1, min_match_fraction * len(keys)):
        # nobody holds it: the replica remembering the fewest blocks, so prefixes spread over the caches
        keyed = [(rooms[id(r)] == float("-inf"), index.size(id_of(r)), -rooms[id(r)], rng.random(), i)
                 for i, r in enumerate(replicas)]
    else:
        keyed = [(rooms[id(r)] == float("-inf"), -matches[id(r)], -rooms[id(r)], rng.random(), i)
                 for i, r in enumerate(replicas)]
    keyed.sort()
    return [replicas[k[-1]] for k in keyed]


if RequestRouter is not None:

    class PrefixAwareRouter(RequestRouter):
        """Routes to the replica with the longest cached prefix while headroom is balanced (module docstring).
        No FIFOMixin: a replica chosen for one prompt must go to that request, not the oldest one waiting."""

        def initialize_state(self, imbalance_threshold: float = 0.25, min_match_fraction: float = 0.1,
                             block_chars: int = 64, block_tokens: int = 16, max_blocks_per_replica: int = 16384,
                             seed: Optional[int] = None, **kwargs) -> None:
            for name, value in (("imbalance_threshold", imbalance_threshold),
                                ("min_match_fraction", min_match_fraction)):
                if not value >= 0:
                    raise ValueError(f"{name}={value} must be >= 0")
            self._imbalance_threshold = imbalance_threshold
            self._min_match_fraction = min_match_fraction
            self._block_chars = block_chars
            self._block_tokens = block_tokens
            self._index = PrefixIndex(max_blocks_per_replica)
            self._rng = random.Random(seed)

        def _keys(self, pending_request: Optional[PendingRequest]) -> list[int]:
            if pending_request is None or not pending_request.args:
                return []
            prompt = prompt_of(pending_request.args[0])
            if prompt is None:
                return []
            return block_keys(prompt, self._block_chars if isinstance(prompt, str) else self._block_tokens)

        async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                                  pending_request: Optional[PendingRequest] = None) -> list[list[RunningReplica]]:
            if not candidate_replicas:
                return []
            cache = self.replica_queue_len_cache
            ranked = rank_by_prefix(candidate_replicas, self._keys(pending_request), self._index,
                                    lambda r: r.replica_id.unique_id, lambda r: r.routing_stats,
                                    lambda r: cache.get(r.replica_id), self._rng, self._imbalance_threshold,
                                    self._min_match_fraction)
            return [[r] for r in ranked]

        def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
            keys = self._keys(pending_request)
            if keys:
                self._index.insert(replica_id.unique_id, keys)

        def update_replicas(self, replicas: list[RunningReplica]) -> None:
            super().update_replicas(replicas)
            self._index.retain({r.replica_id.unique_id for r in replicas})
else:  # pragma: no cover
    PrefixAwareRouter = None
