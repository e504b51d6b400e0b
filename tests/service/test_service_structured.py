"""Structured outputs and tools over HTTP with the official openai client, on the embedded model served with a
chat template that renders tools (tests/fixtures/tool_chat_template.jinja through ServiceConfig.chat_template;
SmolLM2's own has none): JSON-schema replies validate, tool_choice named / required come back as tool_calls
(streamed too), and every bad constraint is a 400 naming its field."""
import json

import jsonschema
import openai
import pytest

from _cluster import served, wait_for
from test_service_api import CONFIG, client
from test_service_tools_units import TEMPLATE, WEATHER

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER_SHORT = {**WEATHER, "function": {**WEATHER["function"], "parameters": {
    **WEATHER["function"]["parameters"],
    "properties": {"city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
pytestmark = pytest.mark.slow  # its own app: a deployment takes a minute or more on 2 cores
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def service(cluster):
    cfg = {**CONFIG, "kv_mode": "fp16", "max_model_len": 512, "default_max_tokens": 48, "chat_template": TEMPLATE}
    with served(cluster, cfg, "structured", "/structured") as s:
        yield s


def engine_idle(service) -> None:
    """No request left and every page free but those the prefix cache keeps (fp16 caches prefixes)."""
    def idle():
        st = service["engine"].stats.remote().result()
        return st["num_running"] == 0 and st["num_waiting"] == 0 and st["pages_used"] == st["prefix_cache_pages"]
    wait_for(idle, 30, what="the engine to finish every request and free its pages")


def _schema_format(schema=PERSON):
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


def test_a_json_schema_reply_validates_whole_and_streamed(service):
    c = client(service)
    msgs = [{"role": "user", "content": "Describe a person as JSON."}]
    out = c.chat.completions.create(model=service["model"], messages=msgs, temperature=0, max_tokens=48,
                                    response_format=_schema_format())
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)
    stream = c.chat.completions.create(model=service["model"], messages=msgs, temperature=0, max_tokens=48,
                                       response_format=_schema_format(), stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == out.choices[0].message.content
    obj = c.completions.create(model=service["model"], prompt="A JSON object describing a cat:", max_tokens=40,
                               temperature=0, extra_body={"response_format": {"type": "json_object"}})
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].text), dict)
    else:  # cut by max_tokens: still the start of an object
        assert obj.choices[0].text.startswith("{")
    engine_idle(service)


def test_tool_choice_named_and_required_come_back_as_tool_calls(service):
    c = client(service)
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = c.chat.completions.create(model=service["model"], messages=ASK, tools=[WEATHER_SHORT], tool_choice=named,
                                    temperature=0, max_tokens=64)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_SHORT["function"]["parameters"])
    stream = c.chat.completions.create(model=service["model"], messages=ASK, tools=[WEATHER_SHORT],
                                       tool_choice="required", parallel_tool_calls=False, temperature=0,
                                       max_tokens=64, stream=True)
    calls, finish = [], None
    for ch in stream:
        if ch.choices:
            calls += ch.choices[0].delta.tool_calls or []
            finish = ch.choices[0].finish_reason or finish
    assert finish == "tool_calls" and [tc.index for tc in calls] == [0]
    assert calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == json.loads(call.function.arguments)  # greedy: the same call
    engine_idle(service)


@pytest.mark.parametrize("extra, field", [
    ({"response_format": _schema_format({"type": "object", "properties": {"a": {"type": "no-such-type"}}})},
     "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
])
def test_bad_constraints_are_400s_naming_the_field(service, extra, field):
    with pytest.raises(openai.BadRequestError) as e:
        client(service).chat.completions.create(model=service["model"], messages=ASK, max_tokens=4,
                                                extra_body=extra)
    assert e.value.status_code == 400 and e.value.body["param"] == field, e.value.body
