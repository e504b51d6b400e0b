"""The service's typed arguments: one pydantic model, `ServiceConfig`, for `diffkv serve`, `build_app` and
Serve config YAMLs (KubeRay). It holds the replicas' `EngineConfig` (engine.config defines every engine setting
and its default) next to the deployment, admission, router, retry and access settings; defaults run on a 2-core
CPU box with the embedded model.

    ServiceConfig(engine={"cache": {"kv_mode": "diffkv"}}, num_replicas=2, admission={"ttft_target_s": 2.0})
    ServiceConfig(kv_mode="diffkv", device="cpu")  # engine fields may be written at the top level too
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Literal, Mapping, Optional

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from diffkv_serve.engine.config import EngineConfig


class AdmissionConfig(BaseModel):
    """Admission control for Poisson arrivals (docs/ADMISSION.md has the model behind each knob)."""

    model_config = ConfigDict(extra="forbid")
    enabled: bool = Field(True, description="off: admit everything (requests queue in the engine)")
    ttft_target_s: float = Field(
        10.0, gt=0, description="admit while the predicted time to first token stays under this (seconds)")
    rate_window_s: float = Field(
        10.0, gt=0, description="time constant of the arrival-rate and service-rate estimates (seconds)")
    max_retry_after_s: int = Field(60, ge=1, description="cap on the Retry-After a 429 carries (seconds)")
    seed: Optional[int] = Field(None, description="seed of the coin that thins arrivals above the sustainable rate")


class PrefixRoutingConfig(BaseModel):
    """Prefix-aware routing (service.prefix_router): when to follow a cached prefix and how much to remember."""

    model_config = ConfigDict(extra="forbid")
    imbalance_threshold: float = Field(
        0.25, ge=0, description="largest spread of replica headroom (service.router.headroom, 1 = idle) at which "
                                "the longest cached prefix still decides; above it, the most headroom does")
    min_match_fraction: float = Field(
        0.1, ge=0, le=1, description="follow a prefix only when at least this fraction of the prompt's blocks "
                                     "matched")
    block_chars: int = Field(64, ge=1, description="characters per prefix block of a text prompt")
    block_tokens: int = Field(16, ge=1, description="token ids per prefix block of a token-id prompt")
    max_blocks_per_replica: int = Field(
        16384, ge=1, description="prefix blocks remembered per replica (least recently routed evicted first)")


class RouterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # prefix: on a CPU run with shared system prompts it raised the prefix-cache hit rate by 10-12 points and cut
    # mean TTFT by a third (fp16) to a half (diffkv) against kv_headroom (docs/DESIGN.md, "Service and router")
    policy: Literal["kv_headroom", "prefix", "pow2"] = Field(
        "prefix", description="kv_headroom: the replica with the most free KV pages and the shortest queue; "
                                   "prefix: the replica that holds the longest prefix of the prompt while "
                                   "headroom is balanced (router.prefix), kv_headroom otherwise; "
                                   "pow2: Serve's default power-of-two-choices")
    stats_period_s: float = Field(1.0, gt=0, description="how often Serve collects each replica's routing stats")
    prefix: PrefixRoutingConfig = Field(default_factory=PrefixRoutingConfig, description="policy prefix: its "
                                                                                         "thresholds and memory")


class RetryConfig(BaseModel):
    """Failover at the ingress: a request whose engine replica fails (its actor or node lost, its engine dead)
    before the replica returned anything is sent again to another replica. Once output has arrived the request
    ends with a 503 (or an SSE error event): a second generation could contradict what was streamed."""

    model_config = ConfigDict(extra="forbid")
    max_retries: int = Field(1, ge=0, le=3, description="re-sends of a request that got nothing from its replica "
                                                        "(0: none, the client gets the 503)")
    backoff_s: float = Field(0.5, ge=0, le=10, description="pause before a re-send, so the router learns of the "
                                                           "lost replica first (seconds)")


# The environment variable that supplies API keys (comma-separated, so a new key can be added before the old
# one is removed); read by `diffkv serve` and by every ingress replica (on KubeRay: from a Secret).
API_KEY_ENV = "DIFFKV_API_KEY"


def api_keys_from_env(environ: Mapping[str, str] = os.environ) -> list[str]:
    return [k.strip() for k in environ.get(API_KEY_ENV, "").split(",") if k.strip()]


class LimitsConfig(BaseModel):
    """Bounds checked before any work is spent on a request (docs/RELIABILITY.md, "Limits")."""

    model_config = ConfigDict(extra="forbid")
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024, description="largest request body; a larger one gets "
                                                                      "413 before it is parsed")
    max_prompt_chars: Optional[int] = Field(
        None, ge=1, description="longest prompt (all messages together) in characters, checked before "
                                "tokenizing; None: 32 x the context length (no tokenizer packs 32 characters "
                                "into every token, so a longer prompt cannot fit)")
    max_n: int = Field(128, ge=1, le=128, description="most choices (`n`) one request may ask for; each is a "
                                                      "sequence of its own (OpenAI's limit: 128)")


# Resources Ray defines itself: the dedicated fields (replica_cpus, worker_cpus, device) set them.
_BUILTIN_RESOURCES = {"CPU", "GPU", "memory", "object_store_memory"}


# Shorthands accepted at the top level of a ServiceConfig (flags, Serve YAML args): every EngineConfig field,
# and kv_mode for engine.cache.kv_mode.
_KV_MODE_SHORTHAND = "kv_mode"


def nest_engine_fields(data: dict) -> dict:
    """`data` with its top-level engine fields moved into data["engine"]; a field given in both places is an
    error naming it."""
    top = [k for k in data if k in EngineConfig.model_fields or k == _KV_MODE_SHORTHAND]
    if not top:
        return data
    data = dict(data)
    engine = data.get("engine") or {}
    if isinstance(engine, BaseModel):
        engine = engine.model_dump(exclude_unset=True)  # keeps unset fields unset (calibrated defaults)
    engine = dict(engine)
    for key in sorted(top, key=lambda k: k == _KV_MODE_SHORTHAND):  # kv_mode last: it writes into cache
        value = data.pop(key)
        if key == _KV_MODE_SHORTHAND:
            cache = engine.get("cache") or {}
            cache = dict(cache.model_dump(exclude_unset=True) if isinstance(cache, BaseModel) else cache)
            if cache.get("kv_mode", value) != value:
                raise ValueError(f"kv_mode={value!r} contradicts cache.kv_mode={cache['kv_mode']!r}")
            engine["cache"] = {**cache, "kv_mode": value}
        elif key in engine and engine[key] != value:
            raise ValueError(f"{key}: given both at the top level ({value!r}) and in engine ({engine[key]!r})")
        else:
            engine[key] = value
    data["engine"] = engine
    return data


class ServiceConfig(BaseModel):
    """Everything `build_app` needs: the engine replicas' EngineConfig and how they are deployed and guarded."""

    # hide_input_in_errors: a rejected API key must not be echoed in the error (messages still name the field)
    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)
    # ---- the model and its engine ----
    engine: EngineConfig = Field(
        default_factory=EngineConfig, description="every engine replica's EngineConfig (model, device, cache, "
                                                  "scheduler, tensor_parallel_size, seed, ...); its fields may "
                                                  "also be given at the top level, and kv_mode for cache.kv_mode")
    served_model_name: Optional[str] = Field(None, description="the name clients pass as `model`; default: the "
                                                               "checkpoint's name")
    default_max_tokens: int = Field(256, ge=1, description="max_tokens when a request gives none (capped by "
                                                           "what the context leaves)")
    chat_template: Optional[str] = Field(None, description="a Jinja chat template (its text, or a path to a file) "
                                                           "used instead of the model's, e.g. one that renders tools")

    @field_validator("chat_template")
    @classmethod
    def _chat_template(cls, v: Optional[str]) -> Optional[str]:
        """A path is read here, so the deployments get the text; the text must parse as Jinja."""
        if v is None:
            return v
        if "{" not in v and os.path.isfile(v):
            with open(v, encoding="utf-8") as f:
                v = f.read()
        import jinja2

        try:
            jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(v)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"chat_template is not a valid Jinja template: {e}") from e
        return v
    # ---- Serve deployments ----
    num_replicas: int = Field(1, ge=1, description="engine replicas (ignored when autoscaling is set)")
    autoscaling: Optional[dict[str, Any]] = Field(None, description="Serve autoscaling_config for engine replicas")
    max_ongoing_requests: int = Field(
        1024, ge=1, description="requests Serve sends one engine replica at once; admission control keeps the "
                                "real load far below (the engine queues what it cannot batch)")
    ingress_replicas: int = Field(1, ge=1, description="replicas of the HTTP ingress (validation, admission, "
                                                       "streaming)")
    replica_cpus: float = Field(0.5, gt=0, description="CPUs of an engine replica's actor (fractional on CPU)")
    worker_cpus: float = Field(0.25, gt=0, description="CPUs of each tensor-parallel worker actor (CPU runs)")
    ingress_cpus: float = Field(0.25, gt=0, description="CPUs of an ingress replica's actor")
    rank_resources: dict[str, float] = Field(
        default_factory=dict, description="custom Ray resources each rank holds (the replica for TP=1, each "
                                          "tensor-parallel worker otherwise): pins engines to the nodes that "
                                          "offer them, e.g. {\"diffkv_engine\": 1}")
    ingress_resources: dict[str, float] = Field(
        default_factory=dict, description="custom Ray resources an ingress replica holds: pins the ingress to "
                                          "nodes that offer them (e.g. the head, so a worker node's loss costs "
                                          "only engine replicas)")
    replica_memory_limit_gib: Optional[float] = Field(
        None, gt=0, allow_inf_nan=False,
        description="an engine replica whose resident memory is above this at one of its memory samples (every "
                    "2 s) ends itself (SIGKILL) and is reported as a `memory` death; Serve replaces it. Set it "
                    "below the node's (or pod's) memory so that a leak or an oversized cache costs one replica, "
                    "not whatever the OOM killer picks. None: no limit")
    health_check_period_s: float = Field(2.0, gt=0, description="how often Serve checks an engine replica's health")
    health_check_timeout_s: float = Field(30.0, gt=0, description="a health check slower than this fails the "
                                                                  "replica (seconds)")
    stats_period_s: float = Field(0.5, gt=0, description="how often an engine replica reads its engine's stats "
                                                         "into the metrics")
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig, description="admission control (429s)")
    router: RouterConfig = Field(default_factory=RouterConfig, description="how requests pick an engine replica")
    retry: RetryConfig = Field(default_factory=RetryConfig, description="re-sends after a replica failure")
    # ---- access and shutdown ----
    api_keys: list[SecretStr] = Field(
        default_factory=list, description=f"accepted `Authorization: Bearer` keys on /v1/* (empty: no key needed); "
                                          f"{API_KEY_ENV} (comma-separated) adds to them")
    limits: LimitsConfig = Field(default_factory=LimitsConfig, description="request bounds checked before any work")
    drain_timeout_s: float = Field(
        30.0, ge=0, description="on SIGTERM / Ctrl-C, how long requests in flight may run to completion before "
                                "they are ended (503 / an SSE error event)")

    @field_validator("rank_resources", "ingress_resources")
    @classmethod
    def _custom_resources(cls, v: dict[str, float], info) -> dict[str, float]:
        for name, amount in v.items():
            if name in _BUILTIN_RESOURCES:
                raise ValueError(f"{info.field_name}: {name!r} is Ray's own resource; set it with replica_cpus, "
                                 f"worker_cpus, ingress_cpus or device")
            if not amount > 0:
                raise ValueError(f"{info.field_name}: {name!r} must be > 0, got {amount}")
        return v

    @field_validator("api_keys")
    @classmethod
    def _key_format(cls, v: list[SecretStr]) -> list[SecretStr]:
        for i, key in enumerate(v):
            text = key.get_secret_value()
            # the message names the key's position, never the key
            if not text or not text.isascii() or not text.isprintable() or any(c in text for c in " ,"):
                raise ValueError(f"api_keys[{i}]: a key must be non-empty printable ASCII without spaces or commas")
        return v

    def all_api_keys(self, environ: Mapping[str, str] = os.environ) -> list[str]:
        """The configured keys and those of API_KEY_ENV in this process's environment, without repeats."""
        return list(dict.fromkeys([k.get_secret_value() for k in self.api_keys] + api_keys_from_env(environ)))

    @model_validator(mode="before")
    @classmethod
    def _movenest_engine_fields(cls, data: Any) -> Any:
        return nest_engine_fields(data) if isinstance(data, dict) else data

    def deployment_args(self) -> dict[str, Any]:
        """What build_app hands the deployments (they validate it again): the fields that were set, as JSON.
        A full dump would mark every cache field as set on the replica, and the engine would then never fill
        the model's calibrated thresholds and precisions (engine.model_settings) as it does for `diffkv
        generate`; unset fields must stay unset (the nested engine's too: exclude_unset recurses)."""
        args = self.model_dump(mode="json", exclude_unset=True)
        if self.api_keys:  # a JSON dump masks secrets; the ingress needs the keys themselves
            args["api_keys"] = [k.get_secret_value() for k in self.api_keys]
        return args

    def uses_gpu(self) -> bool:
        """Whether engine replicas (or their workers) get GPUs. For 'auto', whether the Ray cluster has any:
        build_app may run on a head node without one (KubeRay) while the workers have them."""
        if self.engine.device == "cpu":
            return False
        if self.engine.device.startswith("cuda"):
            return True
        import ray

        if ray.is_initialized():
            return ray.cluster_resources().get("GPU", 0) > 0
        import torch

        return torch.cuda.is_available()

    def uses_worker_actors(self) -> bool:
        """The engine runs its ranks as Ray actors (then the replica needs a placement group for them)."""
        return self.engine.executor_kind == "ray"


def config_digest(args: Mapping[str, Any]) -> str:
    """A short fingerprint of the deployment arguments (build_app's payload, API keys left out: only the ingress
    gets them). During a rolling update old and new engine replicas serve side by side; an ingress takes the
    model's description only from a replica of its own deployment, which has the same fingerprint."""
    shared = {k: v for k, v in args.items() if k != "api_keys"}
    return hashlib.sha256(json.dumps(shared, sort_keys=True, default=str).encode()).hexdigest()[:16]
