"""What a server runs with, and its API's edges: the effective cache configuration is the same under Serve
(build_app -> engine replica), `diffkv generate`, `python3 -m evals.cli eval` and the Python API; /v1/models shows it;
kv_compression on a server that would ignore it is a 400; every error body follows OpenAI's error object."""
import json
import math

import httpx
import pydantic
import pytest

from diffkv_serve.engine import CacheConfig, EngineConfig
from diffkv_serve.engine.model_settings import apply_model_settings, load_model_settings
from diffkv_serve.service.api import _check_kv_compression
from diffkv_serve.service.api_error import APIError
from diffkv_serve.service.app import build_app
from diffkv_serve.engine.flags import engine_config_from_args
from diffkv_serve.service.cli import build_parser
from diffkv_serve.service.config import ServiceConfig
from diffkv_serve.service.protocol import ErrorResponse, KVCompression, ModelCard

SMOLLM = "SmolLM2-135M-Instruct-Q4_1"  # the embedded model; it ships a settings file


def _payloads(app) -> tuple[dict, dict]:
    """The arguments build_app bound to (engine replica, ingress)."""
    engine_app, ingress_payload = app._bound_deployment.init_args
    (engine_payload,) = engine_app._bound_deployment.init_args
    return engine_payload, ingress_payload


def _replica_engine_config(payload: dict) -> EngineConfig:
    """What EngineReplica.__init__ hands its LLMEngine."""
    return ServiceConfig.model_validate(json.loads(json.dumps(payload))).engine  # Ray ships it as data


def test_the_payload_keeps_unset_cache_fields_unset():
    cfg = ServiceConfig(kv_mode="diffkv", device="cpu", cache={"num_pages": 512}, admission={"ttft_target_s": 2.0})
    # what build_app used to ship: a full dump, which marks every cache field as set on the replica
    full = ServiceConfig.model_validate(cfg.model_dump(mode="json")).engine
    assert {"alpha_high", "alpha_low", "high", "low"} <= full.cache.model_fields_set
    engine_payload, ingress_payload = _payloads(build_app(cfg))
    assert engine_payload == ingress_payload == cfg.deployment_args()
    replica = _replica_engine_config(engine_payload)
    assert replica.cache.model_fields_set == {"kv_mode", "num_pages"}
    assert replica == cfg.engine and ServiceConfig.model_validate(engine_payload) == cfg
    # what the user did set still wins over the model's settings file
    mine = ServiceConfig(kv_mode="diffkv", device="cpu", cache={"alpha_high": 2.0, "alpha_low": 0.5})
    resolved = apply_model_settings(_replica_engine_config(_payloads(build_app(mine))[0]), SMOLLM).cache
    assert (resolved.alpha_high, resolved.alpha_low) == (2.0, 0.5)


# Every EngineConfig field at a value other than its default (a new field fails the first assert below).
ALL_ENGINE_FIELDS = {"model": "random:tiny", "device": "cpu", "dtype": "float32", "max_model_len": 300, "seed": 11,
                     "enforce_eager": True, "max_graph_batch_size": 32, "max_prefill_graph_tokens": 512,
                     "tensor_parallel_size": 1,
                     "distributed_executor": "local", "cache": {"kv_mode": "diffkv", "num_pages": 96, "window": 32},
                     "scheduler": {"max_num_seqs": 8, "reservation": "learned"}}


def test_every_engine_field_and_the_calibration_reach_the_replica():
    """ServiceConfig -> build_app -> Ray's serialization of the deployment's arguments -> the replica's
    ServiceConfig: the engine the replica builds has every field that was given, and the cache fields left
    out stay unset, so the model's calibrated thresholds and precisions fill them."""
    from ray import cloudpickle

    assert set(ALL_ENGINE_FIELDS) == set(EngineConfig.model_fields)
    settings = load_model_settings(SMOLLM)
    sent = EngineConfig(**ALL_ENGINE_FIELDS)
    flat = {k: v for k, v in ALL_ENGINE_FIELDS.items() if k != "cache"} | {"kv_mode": "diffkv",
                                                                            "cache": {"num_pages": 96, "window": 32}}
    for cfg in (ServiceConfig(engine=ALL_ENGINE_FIELDS, num_replicas=2), ServiceConfig(**flat, num_replicas=2)):
        engine_payload, _ = _payloads(build_app(cfg))
        received = ServiceConfig.model_validate(cloudpickle.loads(cloudpickle.dumps(engine_payload))).engine
        assert received == sent and received.model_fields_set == set(ALL_ENGINE_FIELDS)
        assert received.cache.model_fields_set == {"kv_mode", "num_pages", "window"}
        assert received.scheduler.model_fields_set == {"max_num_seqs", "reservation"}
        cache = apply_model_settings(received.model_copy(update={"model": None}), SMOLLM).cache
        assert (cache.alpha_high, cache.alpha_low) == (settings["alpha_high"], settings["alpha_low"])
        assert (cache.num_pages, cache.window) == (96, 32)
    # the same fields from `diffkv serve`'s flags
    from diffkv_serve.service.serve_command import _serve_config

    flags = ["serve", "--model", "random:tiny", "--device", "cpu", "--dtype", "float32", "--max-model-len", "300",
             "--engine-seed", "11", "--enforce-eager", "--max-graph-batch-size", "32", "--kv-mode", "diffkv",
             "--max-prefill-graph-tokens", "512",
             "--tensor-parallel-size", "1", "--max-num-seqs", "8"]
    engine = _serve_config(build_parser().parse_args(flags)).engine
    assert (engine.seed, engine.enforce_eager, engine.max_graph_batch_size, engine.max_prefill_graph_tokens,
            engine.scheduler.max_num_seqs) == (11, True, 32, 512, 8)
    assert engine.cache.model_fields_set == {"kv_mode"}


def test_engine_fields_given_twice_must_agree():
    with pytest.raises(ValueError, match="device: given both"):
        ServiceConfig(device="cpu", engine={"device": "cuda"})
    with pytest.raises(ValueError, match="kv_mode='int8' contradicts cache.kv_mode='fp8'"):
        ServiceConfig(kv_mode="int8", cache={"kv_mode": "fp8"})
    with pytest.raises(ValueError, match="enforce_eager"):
        ServiceConfig(engine={"enforce_eager": "sometimes"})


def test_serve_yaml_args_and_flags_resolve_the_calibrated_thresholds():
    """`serve run` / a Serve config YAML (Serve validates args into ServiceConfig) and `diffkv serve`'s flags."""
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

    from diffkv_serve.service.serve_command import _serve_config

    settings = load_model_settings(SMOLLM)
    apps = [call_user_app_builder_with_args_if_necessary(build_app, {"kv_mode": "diffkv", "device": "cpu"}),
            build_app(_serve_config(build_parser().parse_args(["serve", "--kv-mode", "diffkv", "--device", "cpu"])))]
    for app in apps:
        cache = apply_model_settings(_replica_engine_config(_payloads(app)[0]), SMOLLM).cache
        assert (cache.alpha_high, cache.alpha_low) == (settings["alpha_high"], settings["alpha_low"])
        assert (cache.alpha_high, cache.alpha_low) != (CacheConfig().alpha_high, CacheConfig().alpha_low)


def test_serve_generate_eval_and_the_python_api_run_the_same_cache():
    """Real engines on the embedded model, built the way each entry point builds them."""
    from diffkv_serve.engine import LLM
    from diffkv_serve.engine.llm_engine import LLMEngine
    from evals.cli import _kv_config
    from evals.runner import EvalModel
    from diffkv_serve.service.cli import _build_engine

    serve = LLMEngine(_replica_engine_config(_payloads(build_app({"kv_mode": "diffkv", "device": "cpu"}))[0]))
    generate = _build_engine(build_parser().parse_args(["generate", "--prompt", "x", "--kv-mode", "diffkv",
                                                        "--device", "cpu"]))
    from evals.cli import build_parser as evals_parser

    eval_args = evals_parser().parse_args(["eval", "--kv-mode", "diffkv", "--device", "cpu"])
    with EvalModel(eval_args.model, device="cpu").engine(_kv_config(eval_args).cache) as eng:
        evaluated = eng.config.cache.describe()
    api = LLM(device="cpu", cache={"kv_mode": "diffkv"}).engine
    settings = load_model_settings(serve.model_name)
    expected = {**CacheConfig(kv_mode="diffkv").describe(),
                **{k: settings[k] for k in ("alpha_high", "alpha_low", "high", "low") if settings.get(k) is not None}}
    for name, cache in [("serve", serve.config.cache.describe()), ("generate", generate.config.cache.describe()),
                        ("eval", evaluated), ("python api", api.config.cache.describe())]:
        assert cache == expected, name


def test_generate_flags_set_only_what_they_name():
    args = build_parser().parse_args(["generate", "--prompt", "x", "--kv-mode", "diffkv", "--alpha-high", "3"])
    cache = apply_model_settings(engine_config_from_args(args), SMOLLM).cache
    assert (cache.alpha_high, cache.alpha_low) == (3.0, load_model_settings(SMOLLM)["alpha_low"])


# ---- the model card --------------------------------------------------------------------------------------------
def test_model_card_carries_the_effective_cache():
    diffkv = apply_model_settings(EngineConfig(cache={"kv_mode": "diffkv"}), SMOLLM).cache
    card = ModelCard(id="m", created=0, diffkv={**diffkv.describe(), "cache_dtype": "float32"}).model_dump()
    assert card["diffkv"]["alpha_high"] == load_model_settings(SMOLLM)["alpha_high"]
    settings = load_model_settings(SMOLLM)
    defaults = CacheConfig(kv_mode="diffkv").describe()
    assert card["diffkv"]["high"] == (settings.get("high") or defaults["high"])
    assert card["diffkv"]["low"] == (settings.get("low") or defaults["low"])
    assert card["diffkv"]["prefix_caching"] is False and card["diffkv"]["policy"] == "thresholds"
    fp16_cache = CacheConfig(kv_mode="fp16").describe()
    fp16 = ModelCard(id="m", created=0, diffkv={**fp16_cache, "cache_dtype": "bfloat16"}).model_dump()
    assert fp16["diffkv"]["kv_mode"] == "fp16" and fp16["diffkv"]["high"] == "K16V16"
    assert fp16["diffkv"]["low"] is None and fp16["diffkv"]["alpha_high"] is None
    budget = CacheConfig(kv_mode="diffkv", policy="budget", budget=0.25).describe()
    assert budget["budget"] == 0.25 and "alpha_high" not in budget


# ---- API edges ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, -1.0, 2e6])
def test_kv_compression_alpha_must_be_a_finite_number(value):
    with pytest.raises(pydantic.ValidationError) as e:
        KVCompression(alpha_high=value)
    assert "a finite number >= 0" in str(e.value)
    assert KVCompression(alpha_high=0.0, alpha_low=0.0).alpha_high == 0.0


@pytest.mark.parametrize("cache,mode", [({"kv_mode": "fp16"}, "'fp16'"), ({"kv_mode": "int4"}, "'int4'"),
                                        ({"kv_mode": "diffkv", "policy": "budget"}, "policy 'budget'")])
def test_kv_compression_on_a_server_that_would_ignore_it_is_refused(cache, mode):
    info = {"kv_mode": cache["kv_mode"], "kv_cache": CacheConfig(**cache).describe()}
    with pytest.raises(APIError) as e:
        _check_kv_compression(info)
    assert (e.value.status, e.value.param, e.value.type) == (400, "kv_compression", "invalid_request_error")
    assert mode in e.value.message
    _check_kv_compression({"kv_mode": "diffkv", "kv_cache": CacheConfig(kv_mode="diffkv").describe()})


def test_error_bodies_follow_openai_error_object():
    for err in [APIError(400, "bad", "invalid_request_error", "temperature"),
                APIError(400, "no such model", "invalid_request_error", "model", "model_not_found"),
                APIError(429, "busy", "rate_limit_error", None, "queue_delay", retry_after=3),
                APIError(503, "restarting", "service_unavailable", retry_after=5)]:
        body = json.loads(err.response().body)
        assert set(body["error"]) == {"message", "type", "param", "code"}
        assert body["error"]["code"] is None or isinstance(body["error"]["code"], str), body
        ErrorResponse.model_validate(body)
    with pytest.raises(pydantic.ValidationError):  # the status is never the code
        ErrorResponse.model_validate({"error": {"message": "m", "type": "t", "code": 400}})


# ---- a server that is not diffkv, over HTTP ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fp16_service(cluster):
    from _cluster import served

    config = {"device": "cpu", "model": "random:tiny", "default_max_tokens": 4, "cache": {"num_pages": 256}}
    with served(cluster, config, "fp16cfg", "/fp16cfg") as s:
        yield s


def test_fp16_server_card_and_kv_compression(fp16_service):
    base, model = fp16_service["base"], fp16_service["model"]
    card = httpx.get(base + "/v1/models", timeout=30).json()["data"][0]
    assert card["diffkv"]["kv_mode"] == "fp16" and card["diffkv"]["cache_dtype"] == "float32"
    assert card["diffkv"]["prefix_caching"] is True
    body = {"model": model, "prompt": "hi", "max_tokens": 2}
    assert httpx.post(base + "/v1/completions", json=body, timeout=60).status_code == 200
    r = httpx.post(base + "/v1/completions", json={**body, "kv_compression": {"alpha_high": 0.5}}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "kv_compression" and "'fp16'" in err["message"] and err["code"] is None


def test_config_digest_tells_configurations_apart_and_ignores_keys():
    """An ingress keeps the model's description only from an engine replica of its own configuration (a
    rolling update runs old and new replicas side by side); the engine replicas get no API keys."""
    from diffkv_serve.service.config import ServiceConfig, config_digest

    old = ServiceConfig(device="cpu", model="random:tiny", limits={"max_prompt_chars": 400}).deployment_args()
    new = ServiceConfig(device="cpu", model="random:tiny", limits={"max_prompt_chars": 200}).deployment_args()
    keyed = ServiceConfig(device="cpu", model="random:tiny", limits={"max_prompt_chars": 400},
                          api_keys=["sk-one"]).deployment_args()
    assert config_digest(old) != config_digest(new)
    assert config_digest(keyed) == config_digest(old)
    assert config_digest(dict(reversed(list(old.items())))) == config_digest(old)  # key order does not matter


def test_replaced_replicas_get_the_drain_timeout_and_the_ingress_surges():
    """A rolling update stops old replicas through Serve's graceful shutdown: an engine replica gets
    drain_timeout_s (and a margin for its __del__) to finish its requests; an ingress waits for its own, which
    end on their engine replicas, and its replacement starts before it stops."""
    from diffkv_serve.service.app import ENGINE_STOP_MARGIN_S, INGRESS_STOP_TIMEOUT_S

    app = build_app({"device": "cpu", "drain_timeout_s": 12})
    ingress = app._bound_deployment._deployment_config
    engine = app._bound_deployment.init_args[0]._bound_deployment._deployment_config
    assert engine.graceful_shutdown_timeout_s == 12 + ENGINE_STOP_MARGIN_S
    assert ingress.graceful_shutdown_timeout_s == INGRESS_STOP_TIMEOUT_S > 12 + ENGINE_STOP_MARGIN_S
    assert ingress.max_surge_percent == 100 and engine.max_surge_percent == 0


@pytest.mark.parametrize("value,says", [(math.nan, "finite number"), (math.inf, "finite number"),
                                        (0, "greater than 0"), (-1.0, "greater than 0")])
def test_replica_memory_limit_must_be_a_positive_finite_number(value, says):
    with pytest.raises(pydantic.ValidationError) as e:
        ServiceConfig(device="cpu", replica_memory_limit_gib=value)
    assert "replica_memory_limit_gib" in str(e.value) and says in str(e.value)
    assert ServiceConfig(device="cpu", replica_memory_limit_gib=1.5).replica_memory_limit_gib == 1.5
