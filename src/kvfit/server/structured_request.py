"""How a request asks for structured output, and its translation into StructuredOutputsParams.

Four ways in, at most one per request: OpenAI's ``response_format`` (``json_object`` or
``json_schema`` with ``strict``), vLLM's ``structured_outputs`` object, and vLLM's older
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` fields. The engine
compiles the grammar; a spec that does not compile comes back as a 400 whose ``param`` is the
field the client used (``structured_param``).
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from kvfit.errors import RequestRejected
from kvfit.structured_params import StructuredOutputsParams


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: OpenAI's ``{"name", "description", "schema", "strict"}``."""

    model_config = ConfigDict(populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    description: Optional[str] = None
    json_schema: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class StructuredOutputsRequest(BaseModel):
    """vLLM's ``structured_outputs`` object (exactly one of its fields set)."""

    model_config = ConfigDict(extra="forbid")

    json_: Union[str, dict[str, Any], None] = Field(default=None, alias="json")
    json_object: Optional[bool] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None


def _params(param: str, **kw) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**kw)
    except RequestRejected as e:
        raise RequestRejected(str(e).replace("structured_outputs", param, 1), param=param)


def structured_outputs_of(req) -> tuple[Optional[str], Optional[StructuredOutputsParams]]:
    """(the request field used, its StructuredOutputsParams), or (None, None) when unconstrained.
    RequestRejected naming the field when the spec is incomplete or several fields are set."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    rf = req.response_format
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            found.append(("response_format", _params("response_format", json_object=True)))
        else:
            js = rf.json_schema
            if js is None or js.json_schema is None:
                raise RequestRejected("response_format of type json_schema needs "
                                      "json_schema.schema (the JSON schema to follow)",
                                      param="response_format")
            found.append(("response_format", _params("response_format", json=js.json_schema,
                                                     strict=bool(js.strict))))
    so = req.structured_outputs
    if so is not None:
        found.append(("structured_outputs", _params(
            "structured_outputs", json=so.json_, json_object=bool(so.json_object),
            regex=so.regex, choice=so.choice, grammar=so.grammar)))
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"),
                      ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        value = getattr(req, name)
        if value is not None:
            found.append((name, _params(name, **{key: value})))
    if len(found) > 1:
        raise RequestRejected(f"only one structured-output field may be set; got "
                              f"{', '.join(n for n, _ in found)}", param=found[1][0])
    return found[0] if found else (None, None)
