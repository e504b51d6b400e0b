"""Requests refused before they cost work, end to end over HTTP on one Serve app with API keys and small
limits: API keys (the official `openai` client with the right key, 401 without one or with a wrong one,
/health open, the key in no log), the body limit (413 before parsing, declared or chunked), the prompt limit
(400 before tokenizing), NaN / Infinity, and a body not sent as JSON."""
import time
from pathlib import Path

import httpx
import openai
import pytest

from _cluster import served

APP = "guard"
PREFIX = "/guard"
KEYS = ["sk-diffkv-test-current-4f1c2b", "sk-diffkv-test-next-9a8e7d"]  # two: rotation
MAX_BODY = 64 * 1024
MAX_PROMPT_CHARS = 2000
CONFIG = {
    "device": "cpu",
    "max_model_len": 160,
    "default_max_tokens": 4,
    "admission": {"ttft_target_s": 60.0},
    "api_keys": KEYS,
    "limits": {"max_body_bytes": MAX_BODY, "max_prompt_chars": MAX_PROMPT_CHARS},
}


@pytest.fixture(scope="module")
def service(cluster):
    with served(cluster, CONFIG, APP, PREFIX, headers=_auth(KEYS[0])) as s:
        yield s


def _auth(key):
    return {"Authorization": f"Bearer {key}"}


def _client(service, key):
    return openai.OpenAI(base_url=service["base"] + "/v1", api_key=key, max_retries=0, timeout=120)


def _post(service, path, key=KEYS[0], **kw):
    headers = {**_auth(key), **kw.pop("headers", {})}
    return httpx.post(service["base"] + path, headers=headers, timeout=60, **kw)


def _error(r, status):
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_openai_client_with_each_key_and_401_without_or_with_a_wrong_one(service):
    for key in KEYS:  # both keys of a rotation are accepted
        c = _client(service, key)
        assert [m.id for m in c.models.list().data] == [service["model"]]
        out = c.chat.completions.create(model=service["model"], max_tokens=2, temperature=0,
                                        messages=[{"role": "user", "content": "Hi"}])
        assert out.choices[0].finish_reason in ("stop", "length")
    for key in ("sk-wrong", KEYS[0] + "x", KEYS[0][:-1]):
        with pytest.raises(openai.AuthenticationError) as e:
            _client(service, key).chat.completions.create(model=service["model"], max_tokens=2,
                                                          messages=[{"role": "user", "content": "Hi"}])
        assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
        assert key not in str(e.value.body)  # the wrong key is not echoed
    with pytest.raises(openai.AuthenticationError):
        _client(service, "sk-wrong").models.list()


@pytest.mark.parametrize("path,method", [("/v1/models", "GET"), ("/v1/chat/completions", "POST"),
                                         ("/v1/completions", "POST"), ("/openapi.json", "GET")])
@pytest.mark.parametrize("authorization", [None, "Bearer", "Basic " + KEYS[0], "Bearer wrong"])
def test_every_route_but_health_needs_the_key(service, path, method, authorization):
    headers = {"Authorization": authorization} if authorization is not None else {}
    r = httpx.request(method, service["base"] + path, headers=headers, timeout=30,
                      json={"model": service["model"], "prompt": "Hi"} if method == "POST" else None)
    err = _error(r, 401)
    assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", "invalid_api_key", None)
    assert r.headers["www-authenticate"] == "Bearer"


def test_health_is_open_and_the_key_is_nowhere(service, cluster):
    r = httpx.get(service["base"] + "/health", timeout=30)
    assert r.status_code == 200 and r.json()["status"] == "ok"
    models = httpx.get(service["base"] + "/v1/models", headers=_auth(KEYS[1]), timeout=30).text
    assert not any(k in models for k in KEYS)
    import ray

    logs = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs"
    leaks = [p.name for p in logs.rglob("*") if p.is_file() and any(k.encode() in p.read_bytes() for k in KEYS)]
    assert not leaks, f"an API key appears in {leaks}"


def test_config_repr_and_dump_hide_the_keys():
    from diffkv_serve.service.config import ServiceConfig

    cfg = ServiceConfig.model_validate(CONFIG)
    for text in (repr(cfg), str(cfg), cfg.model_dump_json()):
        assert not any(k in text for k in KEYS)
    assert cfg.all_api_keys({"DIFFKV_API_KEY": f" {KEYS[1]} ,sk-extra,,"}) == [*KEYS, "sk-extra"]
    with pytest.raises(ValueError) as e:
        ServiceConfig(api_keys=["has space-secret"])
    assert "api_keys[0]" in str(e.value) and "secret" not in str(e.value)


def test_body_over_the_limit_is_413_before_parsing(service):
    junk = b"{" + b"x" * MAX_BODY  # not JSON: a parser would answer 400; the size check answers first
    err = _error(_post(service, "/v1/completions", content=junk, headers={"content-type": "application/json"}),
                 413)
    assert f"at most {MAX_BODY} bytes" in err["message"] and err["code"] == "request_too_large"

    def chunks():  # no Content-Length: counted while reading
        for _ in range(MAX_BODY // 4096 + 2):
            yield b"x" * 4096
    err = _error(_post(service, "/v1/completions", content=chunks(), headers={"content-type": "application/json"}),
                 413)
    assert f"exceeds {MAX_BODY} bytes" in err["message"]
    # just under the limit: parsed (and refused for what it says, not for its size)
    body = b'{"model": "m", "prompt": "' + b"y" * (MAX_BODY - 100) + b'"}'
    assert _post(service, "/v1/completions", content=body, headers={"content-type": "application/json"}
                 ).status_code == 400


@pytest.mark.parametrize("endpoint,field", [("completions", "prompt"), ("chat/completions", "messages")])
def test_prompt_over_the_char_limit_is_400_naming_the_field(service, endpoint, field):
    text = "word " * (MAX_PROMPT_CHARS // 5 + 1)
    body = {"model": service["model"], "max_tokens": 2}
    body.update({"prompt": text} if field == "prompt" else {"messages": [{"role": "user", "content": text}]})
    t0 = time.monotonic()
    err = _error(_post(service, f"/v1/{endpoint}", json=body), 400)
    assert time.monotonic() - t0 < 5
    assert err["param"] == field and err["code"] == "prompt_too_long"
    assert f"at most {MAX_PROMPT_CHARS}" in err["message"] and str(len(text)) in err["message"]


@pytest.mark.parametrize("field,literal", [("temperature", "NaN"), ("top_p", "Infinity"),
                                           ("presence_penalty", "-Infinity"), ("frequency_penalty", "NaN")])
def test_nan_and_infinity_are_not_finite_numbers(service, field, literal):
    raw = f'{{"model": "{service["model"]}", "prompt": "Hi", "max_tokens": 2, "{field}": {literal}}}'
    err = _error(_post(service, "/v1/completions", content=raw, headers={"content-type": "application/json"}), 400)
    assert err["param"] == field and err["message"].startswith(f"{field} must be a finite number"), err


@pytest.mark.parametrize("content_type", ["text/plain", None, "application/x-www-form-urlencoded"])
def test_body_not_sent_as_json_is_400(service, content_type):
    raw = f'{{"model": "{service["model"]}", "prompt": "Hi", "max_tokens": 2}}'
    headers = {"content-type": content_type} if content_type else {}
    err = _error(_post(service, "/v1/completions", content=raw, headers=headers), 400)
    assert "Content-Type: application/json" in err["message"], err
    ok = _post(service, "/v1/completions", content=raw, headers={"content-type": "application/json; charset=utf-8"})
    assert ok.status_code == 200, ok.text
