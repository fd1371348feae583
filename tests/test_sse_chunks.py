"""The streamed chunks' fast formatter writes exactly what the pydantic models write."""

import random

import pytest

from kvfit.server.protocol import (ChatChunkChoice, ChatCompletionChunk, ChatDelta,
                                   CompletionChoice, CompletionResponse)
from kvfit.server.sse_chunks import ChunkFormatter

ODD = ["", "plain", 'quote " and \\ backslash', "tab\tnew\nline\r", "\x00\x01\x1f\x7f",
       "é 漢字 🙂", "\u2028\u2029", "</script>", "a/b"]


def _texts(n: int = 200):
    rng = random.Random(0)
    alphabet = [chr(c) for c in (*range(0, 0x80), 0xe9, 0x4e2d, 0x1f600, 0x2028, 0xfffd)]
    return ODD + ["".join(rng.choice(alphabet) for _ in range(rng.randrange(12)))
                  for _ in range(n)]


@pytest.mark.parametrize("finish", [None, "stop", "length", "abort"])
def test_completion_chunk_matches_the_model(finish):
    meta = dict(id="cmpl-x\"y", created=1733000000, model="org/model \u00e9")
    fmt = ChunkFormatter(CompletionResponse(**meta, choices=[]))
    for i, text in enumerate(_texts()):
        want = CompletionResponse(**meta, choices=[CompletionChoice(
            index=i % 3, text=text, finish_reason=finish)]).model_dump_json()
        assert fmt.completion(i % 3, text, finish) == f"data: {want}\n\n".encode()


@pytest.mark.parametrize("finish", [None, "stop", "length"])
def test_chat_chunk_matches_the_model(finish):
    meta = dict(id="chatcmpl-1", created=5, model="m")
    fmt = ChunkFormatter(ChatCompletionChunk(**meta, choices=[]))
    for i, text in enumerate([None, *_texts()]):
        delta = ChatDelta() if text is None else ChatDelta(content=text)
        want = ChatCompletionChunk(**meta, choices=[ChatChunkChoice(
            index=i % 2, delta=delta, finish_reason=finish)]).model_dump_json()
        assert fmt.chat(i % 2, text, finish) == f"data: {want}\n\n".encode()


def test_unencodable_text_raises_like_the_model():
    fmt = ChunkFormatter(CompletionResponse(id="c", created=1, model="m", choices=[]))
    with pytest.raises(UnicodeEncodeError):
        fmt.completion(0, "\ud800", None)
