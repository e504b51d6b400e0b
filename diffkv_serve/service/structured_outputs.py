"""OpenAI's `response_format`, `tools` and `tool_choice` request bodies, and the engine constraint each one asks
for (engine.structured_outputs.StructuredOutputsParams as a dict, with the request field a compile error names).

Tool calls are the Qwen / Hermes layout: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.
tool_choice "required" or a named function constrains the output to such blocks (a Lark grammar with the
calls' JSON schemas embedded); "auto" leaves the model free and the reply is parsed (service.tool_calls)."""
from __future__ import annotations

import json
from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_validator

NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)


class JSONSchemaFormat(_Strict):
    name: str = Field(pattern=NAME_PATTERN)
    description: Optional[str] = None
    json_schema: Optional[dict] = Field(None, alias="schema", description="the JSON schema the reply must match")
    strict: Optional[StrictBool] = Field(None, description="the schema is always enforced")


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JSONSchemaFormat] = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type json_schema, and only there")
        return self


class FunctionDefinition(_Strict):
    name: str = Field(pattern=NAME_PATTERN)
    description: Optional[str] = None
    parameters: Optional[dict] = Field(None, description="JSON schema of the arguments")
    strict: Optional[StrictBool] = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


class ToolCallFunction(_Strict):
    name: str
    arguments: str = Field(description="the arguments as JSON text")


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


def _compact(schema: dict) -> dict:
    # Tool-call JSON in the compact layout: a small model free to add whitespace can loop on it.
    return {**schema, "x-guidance": {"whitespace_flexible": False}}


def call_schema(tool: Tool) -> dict:
    """The JSON of one call to this tool: its name and arguments matching its parameters."""
    params = tool.function.parameters or {"type": "object"}
    return {"type": "object", "properties": {"name": {"const": tool.function.name}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def tool_call_grammar(tools: list[Tool], several: bool) -> str:
    """Lark: one tool-call block (several: one or more, newline-separated) of any of `tools`."""
    schemas = [call_schema(t) for t in tools]
    schema = _compact(schemas[0] if len(schemas) == 1 else {"anyOf": schemas})
    start = "start: call (\"\\n\" call)*" if several else "start: call"
    return (f"{start}\ncall: {json.dumps(CALL_OPEN + chr(10))} body {json.dumps(chr(10) + CALL_CLOSE)}\n"
            f"body: %json {json.dumps(schema)}\n")


def tools_active(tools: Optional[list[Tool]], tool_choice: Optional[ToolChoice]) -> bool:
    """Will the reply be read for tool calls (tools given, and tool_choice not "none")."""
    return bool(tools) and tool_choice != "none"


def engine_constraint(response_format: Optional[ResponseFormat], tools: Optional[list[Tool]] = None,
                      tool_choice: Optional[ToolChoice] = None,
                      parallel_tool_calls: bool = True) -> tuple[Optional[dict], Optional[str]]:
    """(StructuredOutputsParams fields, the request field it comes from) or (None, None): no constraint.
    A request that contradicts itself raises ConstraintError naming the field."""
    if isinstance(tool_choice, dict):
        tool_choice = NamedToolChoice.model_validate(tool_choice)
    forced = None
    if tool_choice is not None and not tools:
        raise ConstraintError("tool_choice", "tool_choice needs tools")
    if isinstance(tool_choice, NamedToolChoice):
        named = [t for t in tools if t.function.name == tool_choice.function.name]
        if not named:
            raise ConstraintError("tool_choice", f"tool_choice names function {tool_choice.function.name!r}, "
                                                 f"which is not among tools")
        forced = {"grammar": tool_call_grammar(named, several=False)}
    elif tool_choice == "required":
        forced = {"grammar": tool_call_grammar(tools, several=parallel_tool_calls)}
    if response_format is None or response_format.type == "text":
        return (forced, "tool_choice") if forced else (None, None)
    if forced:
        raise ConstraintError("response_format", "response_format cannot be combined with tool_choice "
                                                 "'required' or a named function (the reply is the tool call)")
    if response_format.type == "json_object":
        return {"json_object": True}, "response_format"
    schema = response_format.json_schema.json_schema
    return {"json": schema if schema is not None else {"type": "object"}}, "response_format"


class ConstraintError(ValueError):
    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param
