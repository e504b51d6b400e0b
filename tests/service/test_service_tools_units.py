"""Tools and response_format without a server: the chat template path (tests/fixtures/tool_chat_template.jinja,
a Hermes-layout template, against the embedded model's own, which has no tools), tool-call parsing whole and
streamed, the chat renderer's tool_calls, and the constraints tool_choice and response_format ask the engine
for (the tool-call grammar accepts exactly what the parser reads)."""
import copy
import json
import random
import types
from pathlib import Path

import pytest

from diffkv_serve.engine.errors import InvalidRequestError
from diffkv_serve.engine.grammar import compiler_for
from diffkv_serve.engine.structured_outputs import StructuredOutputsParams
from diffkv_serve.service.protocol import ChatCompletionRequest, ChatMessage, Usage
from diffkv_serve.service.replica import EngineReplica
from diffkv_serve.service.responses import chat_renderer
from diffkv_serve.service.structured_outputs import ConstraintError, ResponseFormat, Tool, engine_constraint
from diffkv_serve.service.tool_calls import ToolCallStream, parse_tool_calls

TEMPLATE = (Path(__file__).parents[1] / "fixtures" / "tool_chat_template.jinja").read_text()
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}


@pytest.fixture
def tool_tokenizer(smollm):
    tok = copy.copy(smollm.tokenizer)
    tok.chat_template = TEMPLATE
    return tok


def _replica(tokenizer):
    """EngineReplica._prompt_ids reads only the engine's tokenizer and model name."""
    return types.SimpleNamespace(engine=types.SimpleNamespace(tokenizer=tokenizer, model_name="test-model"))


def test_tools_reach_a_template_that_renders_them(tool_tokenizer):
    assert tool_tokenizer.supports_tools
    msgs = [ChatMessage(role="user", content="Weather in Paris?"),
            ChatMessage(role="assistant", tool_calls=[{"id": "c1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]),
            ChatMessage(role="tool", tool_call_id="c1", content='{"temp": 21}')]
    req = {"messages": [m.template_dict() for m in msgs], "tools": [WEATHER]}
    text = tool_tokenizer.decode(EngineReplica._prompt_ids(_replica(tool_tokenizer), req), skip_special_tokens=False)
    assert json.dumps(WEATHER) in text  # the tool's definition
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' in text
    assert '<tool_response>\n{"temp": 21}\n</tool_response>' in text


def test_tools_with_a_template_without_them_name_tools(smollm):
    assert not smollm.tokenizer.supports_tools  # SmolLM2's template has no tools
    req = {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]}
    with pytest.raises(InvalidRequestError) as e:
        EngineReplica._prompt_ids(_replica(smollm.tokenizer), req)
    assert e.value.param == "tools"
    assert EngineReplica._prompt_ids(_replica(smollm.tokenizer), {"messages": req["messages"]})  # no tools: fine


def test_parse_tool_calls():
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
            '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>')
    content, calls = parse_tool_calls(text)
    assert content == "Let me look."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "unit": "celsius"}
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert len({c["id"] for c in calls}) == 2
    # not a call: the text stays as the model wrote it
    for bad in ("<tool_call>{not json}</tool_call>", "<tool_call>[1, 2]</tool_call>", "no calls here",
                "<tool_call>{\"name\": \"f\"", '<tool_call>{"arguments": {}}</tool_call>'):
        assert parse_tool_calls(bad) == (bad, [])


@pytest.mark.parametrize("seed", range(5))
def test_streamed_calls_match_the_whole_reply(seed):
    text = ('Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
            '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": "<CET>"}}</tool_call>\n')
    rng = random.Random(seed)
    pieces, i = [], 0
    while i < len(text):
        n = rng.randint(1, 7)
        pieces.append(text[i:i + n])
        i += n
    stream, content, calls = ToolCallStream(), "", []
    for p in pieces:
        c, k = stream.feed(p)
        content, calls = content + c, calls + k
        assert "<tool" not in content
    content += stream.finish()
    whole_content, whole_calls = parse_tool_calls(text)
    assert content.strip() == whole_content
    assert [c["index"] for c in calls] == [0, 1]
    assert [c["function"] for c in calls] == [c["function"] for c in whole_calls]


def test_stream_gives_back_text_that_never_became_a_call():
    stream = ToolCallStream()
    assert stream.feed("a <tool_") == ("a ", [])
    assert stream.feed("box> b") == ("<tool_box> b", [])
    assert stream.feed(" <tool_call>{\"name\"") == (" ", [])
    assert stream.finish() == '<tool_call>{"name"'


def _body(**kw):
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **kw)


def test_chat_renderer_reports_tool_calls_whole_and_streamed():
    reply = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>'
    render = chat_renderer(_body(tools=[WEATHER]), 0)
    full = render("full", text=reply, finish_reason="stop", usage=Usage.of(1, 2), rid="x",
                  items=[{"text": reply, "finish_reason": "stop"}])
    choice = full["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    render = chat_renderer(_body(tools=[WEATHER], stream=True), 0)
    chunks = [render("delta", text=reply[:20], finish_reason=None, item={}, rid="x"),
              render("delta", text=reply[20:], finish_reason="stop", item={}, rid="x")]
    assert chunks[0]["choices"][0]["delta"] == {}
    last = chunks[1]["choices"][0]
    assert last["finish_reason"] == "tool_calls" and last["delta"]["tool_calls"][0]["index"] == 0
    # tool_choice "none": the reply is text
    render = chat_renderer(_body(tools=[WEATHER], tool_choice="none"), 0)
    full = render("full", text=reply, finish_reason="stop", usage=Usage.of(1, 2), rid="x",
                  items=[{"text": reply, "finish_reason": "stop"}])
    assert full["choices"][0]["message"]["content"] == reply and full["choices"][0]["finish_reason"] == "stop"


def test_constraints_of_response_format_and_tool_choice():
    tools = [Tool.model_validate(WEATHER), Tool.model_validate(TIME)]
    assert engine_constraint(None) == (None, None)
    assert engine_constraint(ResponseFormat(type="text")) == (None, None)
    assert engine_constraint(ResponseFormat(type="json_object")) == ({"json_object": True}, "response_format")
    rf = ResponseFormat.model_validate({"type": "json_schema",
                                        "json_schema": {"name": "p", "schema": {"type": "object"}, "strict": True}})
    assert engine_constraint(rf) == ({"json": {"type": "object"}}, "response_format")
    assert engine_constraint(None, tools, "auto") == (None, None)
    spec, param = engine_constraint(None, tools, {"type": "function", "function": {"name": "get_time"}})
    assert param == "tool_choice" and "get_time" in spec["grammar"] and "get_weather" not in spec["grammar"]
    for args, field in (((None, None, "required"), "tool_choice"),
                        ((None, tools, {"type": "function", "function": {"name": "nope"}}), "tool_choice"),
                        ((ResponseFormat(type="json_object"), tools, "required"), "response_format")):
        with pytest.raises(ConstraintError) as e:
            engine_constraint(*args)
        assert e.value.param == field


@pytest.mark.parametrize("several", [False, True])
def test_the_tool_call_grammar_accepts_what_the_parser_reads(smollm, several):
    tok = smollm.tokenizer
    tools = [Tool.model_validate(WEATHER), Tool.model_validate(TIME)]
    choice = "required" if several else {"type": "function", "function": {"name": "get_weather"}}
    spec, _ = engine_constraint(None, tools, choice, parallel_tool_calls=several)
    comp = compiler_for(tok, smollm.arch.vocab_size)
    calls = ['<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo","unit":"celsius"}}\n</tool_call>']
    if several:
        calls.append('<tool_call>\n{"name":"get_time","arguments":{"zone":"CET"}}\n</tool_call>')
    text = "\n".join(calls)
    m = comp.matcher(StructuredOutputsParams(**spec))
    assert m.consume_tokens(tok.encode(text, add_special_tokens=False)) and m.is_accepting()
    assert [c["function"]["name"] for c in parse_tool_calls(text)[1]] == ["get_weather", "get_time"][:len(calls)]
    # the wrong function, or arguments off its schema, are refused
    for wrong in ('<tool_call>\n{"name":"get_time"' if not several else '<tool_call>\n{"name":"get_date"',
                  '<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo","unit":"kelvin"'):
        m = comp.matcher(StructuredOutputsParams(**spec))
        ids = tok.encode(wrong, add_special_tokens=False)
        assert not all(m.consume_token(t) for t in ids)
