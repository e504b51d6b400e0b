"""Every metric the service exports, named once, with its description, kind, labels and buckets.

Metrics go through Ray's metrics system (ray.util.metrics): every process records its own, each node's
agent exports them in Prometheus format on the metrics export port with a `ray_` prefix
(`diffkv_num_requests_running` is scraped as `ray_diffkv_num_requests_running`), and Prometheus sums across
replicas with the labels below. The README lists the same table; the Grafana dashboard and the scrape
test use these names.

Ray's recorder exports a histogram's `_sum` from bucket midpoints, not from the observed values (112 steps at
batch size 1 export a sum of 56), so every histogram has a counter beside it, `<name>_exact_sum_total`,
carrying the exact sum: means are `rate(<name>_exact_sum_total) / rate(<name>_count)`. `_count` and the
buckets are exact.
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Optional

from diffkv_serve.service.replica_deaths import CAUSES

# Label keys.
REPLICA = "replica"  # engine replica id (Serve's replica tag)
RANK = "rank"  # tensor-parallel rank inside the replica
REASON = "reason"  # why a request was rejected (admission reasons, or "invalid")
ENDPOINT = "endpoint"  # chat | completions
KV_MODE = "kv_mode"  # engine.config.KV_MODES
CAUSE = "cause"  # why an engine replica died (service.replica_deaths.CAUSES)

LATENCY_BUCKETS_S = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0]
TPOT_BUCKETS_S = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]
MM_BUCKETS_S = [1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1]
BATCH_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]


ENDPOINTS = ("chat", "completions")
REJECT_REASONS = ("queue_delay", "arrival_rate", "invalid", "engine_dead", "error", "unauthorized", "too_large",
                  "draining")
FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: str  # counter | gauge | histogram
    description: str
    tags: tuple[str, ...] = ()
    buckets: Optional[tuple[float, ...]] = None
    feature: Optional[str] = None  # CacheConfig switch without which the series never appears
    vllm: Optional[str] = None  # the vLLM engine metric with this meaning (docs/METRICS.md maps them)
    where: str = "engine"  # engine | ingress: the deployment that records it
    label_values: tuple[tuple[str, tuple[str, ...]], ...] = ()  # a label's values known up front


def _ingress(*specs: MetricSpec) -> tuple[MetricSpec, ...]:
    return tuple(dataclasses.replace(s, where="ingress") for s in specs)


SPECS: tuple[MetricSpec, ...] = (
    # ---- engine replicas (recorded by each engine replica) ----
    MetricSpec("diffkv_num_requests_running", "gauge", "Requests in the engine's running batch.", (REPLICA,),
               vllm="vllm:num_requests_running"),
    MetricSpec("diffkv_num_requests_waiting", "gauge", "Requests queued in the engine, waiting for a batch slot "
                                                       "or KV pages (includes preempted ones).", (REPLICA,),
               vllm="vllm:num_requests_waiting"),
    MetricSpec("diffkv_kv_cache_usage_perc", "gauge", "Fraction of the replica's KV page pool in use (0-1; pages "
                                                      "summed over tensor-parallel ranks).", (REPLICA,),
               vllm="vllm:kv_cache_usage_perc"),
    MetricSpec("diffkv_batch_size", "histogram", "Sequences in each engine step (prefill or decode).", (REPLICA,),
               tuple(BATCH_BUCKETS)),
    MetricSpec("diffkv_kv_pages_used", "gauge", "KV pages in use, per replica and tensor-parallel rank.",
               (REPLICA, RANK)),
    MetricSpec("diffkv_kv_pages_total", "gauge", "KV pages in the pool, per replica and rank.", (REPLICA, RANK)),
    MetricSpec("diffkv_kv_page_occupancy", "gauge", "Fraction of the KV page pool in use (0-1), per replica and "
                                                    "rank.", (REPLICA, RANK)),
    MetricSpec("diffkv_mm_seconds", "histogram", "Memory-management (KV compaction: allocation, recycling, page "
                                                 "table) time of a decode step, per rank; sampled each stats period "
                                                 "when steps ran.", (REPLICA, RANK), tuple(MM_BUCKETS_S)),
    MetricSpec("diffkv_kv_compression_ratio", "gauge", "Bytes an fp16 cache would use / bytes the KV cache uses, "
                                                       "over the running requests (while idle: the last value "
                                                       "measured with requests running).", (REPLICA, KV_MODE)),
    MetricSpec("diffkv_kv_tokens_high_fraction", "gauge", "Fraction of cached (token, layer, KV head) entries kept "
                                                          "at high precision.", (REPLICA, KV_MODE)),
    MetricSpec("diffkv_kv_tokens_low_fraction", "gauge", "Fraction kept at low precision.", (REPLICA, KV_MODE)),
    MetricSpec("diffkv_kv_tokens_pruned_fraction", "gauge", "Fraction pruned (dropped from the cache).",
               (REPLICA, KV_MODE)),
    MetricSpec("diffkv_num_preemptions_total", "counter", "Requests preempted (recomputed later) for lack of KV "
                                                          "pages.", (REPLICA,), vllm="vllm:num_preemptions_total"),
    MetricSpec("diffkv_prompt_tokens_total", "counter", "Prompt tokens of the requests that reached their first "
                                                        "token (prefill done).", (REPLICA,),
               vllm="vllm:prompt_tokens_total"),
    MetricSpec("diffkv_generation_tokens_total", "counter", "Tokens generated.", (REPLICA,),
               vllm="vllm:generation_tokens_total"),
    MetricSpec("diffkv_prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache "
                                                               "(admitted prompts).", (REPLICA,),
               feature="enable_prefix_caching", vllm="vllm:prefix_cache_queries_total"),
    MetricSpec("diffkv_prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache (read from "
                                                            "cached blocks instead of computed).", (REPLICA,),
               feature="enable_prefix_caching", vllm="vllm:prefix_cache_hits_total"),
    MetricSpec("diffkv_request_queue_time_seconds", "histogram", "Time a request waited in the engine's queue, "
                                                                 "from its arrival at the replica to its first "
                                                                 "scheduling.", (REPLICA,), tuple(LATENCY_BUCKETS_S),
               vllm="vllm:request_queue_time_seconds"),
    MetricSpec("diffkv_service_rate", "gauge", "Measured requests per second one replica completes at its KV "
                                               "capacity (the admission model's c * mu; 0 until measured).",
               (REPLICA,)),
) + _ingress(
    # ---- the ingress (recorded by each ingress replica) ----
    MetricSpec("diffkv_time_to_first_token_seconds", "histogram", "Time to first token, from arrival at the "
                                                                  "ingress.", (ENDPOINT,), tuple(LATENCY_BUCKETS_S),
               vllm="vllm:time_to_first_token_seconds"),
    MetricSpec("diffkv_inter_token_latency_seconds", "histogram", "Time between consecutive output tokens at the "
                                                                  "ingress, one observation per token after the "
                                                                  "first.", (ENDPOINT,), tuple(TPOT_BUCKETS_S),
               vllm="vllm:inter_token_latency_seconds"),
    MetricSpec("diffkv_time_per_output_token_seconds", "histogram", "Same observations as "
                                                                    "diffkv_inter_token_latency_seconds (vLLM's "
                                                                    "older name for it).", (ENDPOINT,),
               tuple(TPOT_BUCKETS_S), vllm="vllm:time_per_output_token_seconds"),
    MetricSpec("diffkv_request_time_per_output_token_seconds", "histogram", "Time per output token after the "
                                                                            "first, one observation per request "
                                                                            "(its mean).", (ENDPOINT,),
               tuple(TPOT_BUCKETS_S), vllm="vllm:request_time_per_output_token_seconds"),
    MetricSpec("diffkv_e2e_request_latency_seconds", "histogram", "End-to-end request latency at the ingress.",
               (ENDPOINT,), tuple(LATENCY_BUCKETS_S), vllm="vllm:e2e_request_latency_seconds"),
    MetricSpec("diffkv_requests_admitted_total", "counter", "Requests admitted by admission control.", (ENDPOINT,)),
    MetricSpec("diffkv_requests_rejected_total", "counter", "Requests rejected, by reason: queue_delay / "
                                                            "arrival_rate (admission, 429), invalid (400), "
                                                            "engine_dead (503), error (other failures before the "
                                                            "first token), unauthorized (401), too_large (413), "
                                                            "draining (503 while shutting down).", (ENDPOINT, REASON),
               label_values=((REASON, REJECT_REASONS),)),
    MetricSpec("diffkv_replica_deaths_total", "counter", "Engine replica deaths, by cause: memory, process_died, "
                                                         "killed, engine_dead, node_lost, init_failed, "
                                                         "unschedulable, owner_died, unknown (each also logged "
                                                         "by the ingress with its detail; replicas Serve stops "
                                                         "on purpose are not counted).", (CAUSE,),
               label_values=((CAUSE, CAUSES),)),
    MetricSpec("diffkv_requests_retried_total", "counter", "Re-sends of admitted requests to another engine "
                                                           "replica after theirs failed before any output "
                                                           "(replica or node lost).", (ENDPOINT,)),
    MetricSpec("diffkv_requests_finished_total", "counter", "Admitted requests that completed, by finish reason "
                                                            "(stop, length, abort, error).", (ENDPOINT, REASON),
               label_values=((REASON, FINISH_REASONS),)),
    MetricSpec("diffkv_arrival_rate", "gauge", "Estimated arrival rate (requests/s) at this ingress (Poisson "
                                               "estimate, exponentially weighted).", ()),
    MetricSpec("diffkv_admission_predicted_ttft_seconds", "gauge", "Predicted TTFT of the last arrival under the "
                                                                   "queueing model.", ()),
    MetricSpec("diffkv_requests_in_flight", "gauge", "Admitted requests not yet finished at this ingress.", ()),
)

EXACT_SUM_SUFFIX = "_exact_sum_total"


def exact_sum_spec(hist: MetricSpec) -> MetricSpec:
    """The counter carrying a histogram's exact sum (Ray's own `_sum` is computed from bucket midpoints)."""
    return MetricSpec(hist.name + EXACT_SUM_SUFFIX, "counter", f"Exact sum of the values observed by "
                      f"{hist.name} (use it for means: its `_sum` is approximated from bucket midpoints).",
                      hist.tags, feature=hist.feature, where=hist.where)


SPECS = SPECS + tuple(exact_sum_spec(s) for s in SPECS if s.kind == "histogram")
LABEL_VALUES: dict[str, tuple[str, ...]] = {ENDPOINT: ENDPOINTS}  # labels whose values every metric shares
BY_NAME = {s.name: s for s in SPECS}
PROMETHEUS_PREFIX = "ray_"  # Ray's exporter prefixes application metrics


class Metrics:
    """This process's metric objects, created on first use (Ray must be initialized by then)."""

    def __init__(self, default_tags: Optional[dict[str, str]] = None):
        self._default_tags = dict(default_tags or {})
        self._objs: dict[str, object] = {}

    def _get(self, name: str):
        obj = self._objs.get(name)
        if obj is None:
            from ray.util import metrics as rm

            s = BY_NAME[name]
            if s.kind == "counter":
                obj = rm.Counter(s.name, description=s.description, tag_keys=s.tags)
            elif s.kind == "gauge":
                obj = rm.Gauge(s.name, description=s.description, tag_keys=s.tags)
            else:
                obj = rm.Histogram(s.name, description=s.description, boundaries=list(s.buckets), tag_keys=s.tags)
            defaults = {k: v for k, v in self._default_tags.items() if k in s.tags}
            if defaults:
                obj.set_default_tags(defaults)
            self._objs[name] = obj
        return obj

    def _tags(self, name: str, tags: Optional[dict[str, str]]) -> Optional[dict[str, str]]:
        return {k: str(v) for k, v in tags.items()} if tags else None

    def start_counters(self, where: str, features: Optional[dict[str, bool]] = None, **known) -> None:
        """Export every counter that deployment `where` records at 0 now, for each label set known up front
        (its labels' values from LABEL_VALUES, the spec's label_values and `known`, e.g. rank=("0", "1")), so
        that rate() and increase() read 0 rather than "No data" until the first event. A counter whose
        feature is off in `features` is left out."""
        features = features or {}
        for s in SPECS:
            if s.kind != "counter" or s.where != where or not features.get(s.feature, True):
                continue
            free = [t for t in s.tags if t not in self._default_tags]
            values = {**LABEL_VALUES, **dict(s.label_values), **known}
            if any(t not in values for t in free):
                continue  # a label whose values appear only at run time
            for combo in itertools.product(*(values[t] for t in free)):
                # Counter.inc refuses 0; _record is what it calls, and records a 0 increment as a series at 0
                self._get(s.name)._record(0, tags=dict(zip(free, combo)) or None)

    def inc(self, name: str, value: float = 1.0, **tags) -> None:
        if value > 0:
            self._get(name).inc(value, tags=self._tags(name, tags))

    def set(self, name: str, value: float, **tags) -> None:
        self._get(name).set(float(value), tags=self._tags(name, tags))

    def observe(self, name: str, value: float, **tags) -> None:
        """Observe `value` in histogram `name` and add it to the histogram's exact-sum counter."""
        self._get(name).observe(float(value), tags=self._tags(name, tags))
        self.inc(name + EXACT_SUM_SUFFIX, value, **tags)
