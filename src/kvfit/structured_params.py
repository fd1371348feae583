"""StructuredOutputsParams: the grammar one request's output must follow (vLLM's name and fields).

Exactly one of ``json`` (a JSON schema, dict or JSON text), ``json_object`` (any JSON object),
``regex``, ``choice`` (one of these strings) or ``grammar`` (xgrammar EBNF) is set. The engine
compiles it (``kvfit.engine.structured``); a spec that does not compile is a ``RequestRejected``
naming ``structured_outputs``.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass
from typing import Optional, Union

from kvfit.errors import RequestRejected

_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """``strict`` (json only): properties the schema does not list are refused unless it
    allows them (OpenAI's ``strict: true``); otherwise JSON Schema's own default applies."""

    json: Union[str, dict, None] = None
    json_object: bool = False
    regex: Optional[str] = None
    choice: Optional[tuple[str, ...]] = None
    grammar: Optional[str] = None
    strict: bool = False

    def __post_init__(self):
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        self.validate()

    def validate(self) -> None:
        set_ = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise RequestRejected(
                f"structured_outputs needs exactly one of {', '.join(_KINDS)}; got "
                f"{', '.join(set_) or 'none'}", param="structured_outputs")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise RequestRejected("structured_outputs.json must be a JSON schema object",
                                  param="structured_outputs")
        if self.choice is not None and (not self.choice or not all(
                isinstance(c, str) and c for c in self.choice)):
            raise RequestRejected("structured_outputs.choice must be a non-empty list of "
                                  "non-empty strings", param="structured_outputs")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise RequestRejected(f"structured_outputs.{name} must be a non-empty string",
                                      param="structured_outputs")

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def cache_key(self) -> tuple:
        """A hashable key naming the compiled grammar (equal specs share one compilation)."""
        value = getattr(self, self.kind)
        if isinstance(value, dict):
            value = _json.dumps(value, sort_keys=True)
        return (self.kind, value, self.strict)
