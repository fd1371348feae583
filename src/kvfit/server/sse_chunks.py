"""Streamed chunks of a completion without building pydantic models per token.

A streaming response sends one SSE event per engine step and choice; at concurrency 64 that is
tens of thousands of events per second, all on the server's one event loop. Building a
``CompletionResponse`` / ``ChatCompletionChunk`` per event (two validations and a dump) was a
large part of that loop's time. ``ChunkFormatter`` renders the constant part of a stream's
chunks once with the pydantic model (so id, model name and field order are exactly the
model's) and per event formats only the choice: the text through ``json.dumps`` (the same
escaping as pydantic's JSON: non-ASCII kept, control characters as ``\\u00XX``) and the finish
reason. Events carrying logprobs or usage still go through the models.

The result is UTF-8 bytes: text that cannot be encoded (a lone surrogate) raises
``UnicodeEncodeError`` here, inside the handler's stream, as the model's dump did.
"""

from __future__ import annotations

import json
from typing import Optional

from pydantic import BaseModel

_dumps = json.JSONEncoder(ensure_ascii=False).encode


def _head_tail(template: BaseModel) -> tuple[str, str]:
    """The JSON of ``template`` (a chunk with ``choices=[]``) split around its empty choices."""
    whole = template.model_dump_json()
    mark = '"choices":[]'
    at = whole.index(mark) + len(mark) - 1
    return "data: " + whole[:at], whole[at:] + "\n\n"


class ChunkFormatter:
    """Formats one stream's plain (no logprobs) chunks. ``template``: the stream's chunk model
    with ``choices=[]`` (``CompletionResponse`` or ``ChatCompletionChunk``)."""

    __slots__ = ("head", "tail")

    def __init__(self, template: BaseModel):
        self.head, self.tail = _head_tail(template)

    def completion(self, index: int, text: str, finish: Optional[str]) -> bytes:
        """``data: {...,"choices":[{"index":..,"text":..,"logprobs":null,"finish_reason":..}],
        ...}`` as ``CompletionResponse.model_dump_json`` writes it."""
        return (f'{self.head}{{"index":{index},"text":{_dumps(text)},"logprobs":null,'
                f'"finish_reason":{_dumps(finish)}}}{self.tail}').encode()

    def chat(self, index: int, content: Optional[str], finish: Optional[str]) -> bytes:
        """The chat chunk of one choice's delta (``content`` None: an empty delta ``{}``)."""
        delta = "{}" if content is None else f'{{"content":{_dumps(content)}}}'
        return (f'{self.head}{{"index":{index},"delta":{delta},"logprobs":null,'
                f'"finish_reason":{_dumps(finish)}}}{self.tail}').encode()
