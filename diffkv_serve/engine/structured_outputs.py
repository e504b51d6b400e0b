"""What a request's output must match (vLLM's StructuredOutputsParams, loosely): exactly one of a JSON schema,
any JSON object, a regular expression, a choice of strings, or a Lark grammar (llguidance's dialect, which
can embed JSON schemas with %json). Checked on construction; compiled by engine.grammar."""
from __future__ import annotations

import json as jsonlib
from dataclasses import dataclass
from typing import Any, Optional, Union

from diffkv_serve.engine.errors import InvalidRequestError

FIELD = "structured_outputs"


@dataclass
class StructuredOutputsParams:
    json: Optional[Union[dict, str]] = None  # a JSON schema (dict or its JSON text)
    json_object: bool = False  # any JSON object
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None  # Lark grammar
    # JSON: whitespace between tokens allowed (True) or the compact layout forced (False, the default: a
    # small model that may emit any whitespace can loop on it)
    whitespace_flexible: bool = False

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise InvalidRequestError(f"{FIELD} needs exactly one of json, json_object, regex, choice, grammar; "
                                      f"got {given or 'none'}", FIELD)
        if isinstance(self.json, str):
            try:
                self.json = jsonlib.loads(self.json)
            except ValueError as e:
                raise InvalidRequestError(f"{FIELD}.json is not valid JSON: {e}", FIELD) from e
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise InvalidRequestError(f"{FIELD}.json must be a JSON schema object", FIELD)
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or any(not isinstance(c, str) for c in self.choice)):
            raise InvalidRequestError(f"{FIELD}.choice must be a non-empty list of strings", FIELD)
        for k in ("regex", "grammar"):
            v = getattr(self, k)
            if v is not None and (not isinstance(v, str) or not v):
                raise InvalidRequestError(f"{FIELD}.{k} must be a non-empty string", FIELD)

    @classmethod
    def of(cls, value: Any) -> Optional["StructuredOutputsParams"]:
        """None, an instance, or a dict of its fields (unknown keys refused by name)."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise InvalidRequestError(f"{FIELD} must be an object", FIELD)
        unknown = set(value) - set(cls.__dataclass_fields__)
        if unknown:
            raise InvalidRequestError(f"{FIELD} has unknown keys {sorted(unknown)}", FIELD)
        return cls(**value)
