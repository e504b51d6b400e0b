"""KV-headroom request routing through Ray Serve's request-router extension point.

`KVHeadroomRouter` is a Serve `RequestRouter`: Serve keeps the replica set, health, retries, backoff and
autoscaling; we only rank the candidates. Each engine replica publishes its KV pages and queue through
`record_routing_stats()` (every router.stats_period_s); Serve's queue-length cache adds the requests sent
since. A replica's headroom is the smaller of its free page fraction (after the pages its queued requests
will take; pages of cached prefix blocks nobody reads count as free, they are evicted on demand) and its free
batch slot fraction; candidates go best first, one per rank, so Serve tries the
replica with the most headroom and falls back in order (it still skips replicas at max_ongoing_requests).
"""
from __future__ import annotations

import random
from typing import Optional

try:  # the public extension point (Ray >= 2.47)
    from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica
except ImportError:  # pragma: no cover - older Ray: service.app falls back to Serve's default router
    RequestRouter = None


def headroom(stats: Optional[dict], queue_len: Optional[int]) -> float:
    """In [-inf, 1]: 1 = idle and empty. stats: a replica's routing stats (may be empty before the first
    collection); queue_len: requests Serve has sent it and not seen finish (None if not cached)."""
    stats = stats or {}
    if stats.get("dead"):  # its engine died: Serve is replacing it
        return float("-inf")
    slots = max(1, int(stats.get("max_num_seqs") or 64))
    running = int(stats.get("num_running") or 0)
    queued = queue_len if queue_len is not None else running + int(stats.get("num_waiting") or 0)
    slot_room = 1.0 - queued / slots
    total = int(stats.get("pages_total") or 0)
    if total <= 0:
        return slot_room
    per_request = float(stats.get("pages_per_request") or 0.0)
    # Requests that are queued (or just sent) hold no pages yet; they will take about per_request each.
    pending = max(0, queued - running) * per_request
    # pages of cached prefix blocks nobody reads are evicted on demand: free for this purpose
    used = int(stats.get("pages_used") or 0) - int(stats.get("pages_evictable") or 0)
    page_room = 1.0 - (max(0, used) + pending) / total
    return min(page_room, slot_room)


def rank_by_headroom(replicas: list, stats_of, queue_len_of, rng: random.Random) -> list:
    """Replicas sorted by headroom, best first; ties broken at random so equal replicas share the load."""
    keyed = [(headroom(stats_of(r), queue_len_of(r)), rng.random(), i) for i, r in enumerate(replicas)]
    keyed.sort(key=lambda k: (-k[0], k[1]))
    return [replicas[i] for _, _, i in keyed]


if RequestRouter is not None:

    class KVHeadroomRouter(FIFOMixin, RequestRouter):
        """Routes each request to the engine replica with the most KV headroom (see the module docstring)."""

        def initialize_state(self, seed: Optional[int] = None, **kwargs) -> None:
            self._rng = random.Random(seed)

        async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                                  pending_request: Optional[PendingRequest] = None) -> list[list[RunningReplica]]:
            if not candidate_replicas:
                return []
            rng = getattr(self, "_rng", None) or random.Random()
            cache = self.replica_queue_len_cache
            ranked = rank_by_headroom(candidate_replicas, lambda r: r.routing_stats,
                                      lambda r: cache.get(r.replica_id), rng)
            return [[r] for r in ranked]
else:  # pragma: no cover
    KVHeadroomRouter = None
