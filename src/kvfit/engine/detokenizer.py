"""Incremental detokenization: each step turns only the new tokens into text.

Two ways, the same text:
- a Hugging Face fast tokenizer (every model kvfit loads today) goes through the ``tokenizers``
  library's ``DecodeStream``: one Rust call per token (~1 us on our CPU host against ~11 us for
  the windowed decode below, which ran two Python-level decodes per token and request on the
  engine's critical path);
- any other tokenizer decodes a window of a few tokens: the window is ``ids[prefix:]``; its text
  minus the text of ``ids[prefix:read]`` is the new text. Decoding from a token slightly before
  the new ones keeps tokenizers that treat a leading space specially (SentencePiece) right.
Either way a token that ends inside a UTF-8 sequence adds no text until the sequence completes;
when the request finishes the incomplete tail is decoded as ``decode`` would (U+FFFD).
"""

from __future__ import annotations

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # an old tokenizers: the windowed decode only
    DecodeStream = None


def _stream_backend(tokenizer):
    """The ``tokenizers.Tokenizer`` behind a HF fast tokenizer whose decode the stream
    reproduces, else None (no fast backend, or clean-up of tokenization spaces, which
    ``decode`` applies to the whole text and a stream cannot)."""
    if DecodeStream is None or tokenizer is None:
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend if hasattr(backend, "decode") else None


class IncrementalDetokenizer:
    """Owns the decoded text of one request's output tokens (``text``), grown by ``update``."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.text = ""
        self._prefix = 0  # window start (windowed decode) / token before the last emission
        self._read = 0  # tokens accounted for
        self._backend = _stream_backend(tokenizer)
        self._stream = (DecodeStream(skip_special_tokens=skip_special_tokens)
                        if self._backend is not None else None)
        self._emitted = 0  # stream: tokens up to the last one that produced text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def update(self, ids: list[int], final: bool = False, n: int | None = None) -> str:
        """Account for ``ids[:n]`` (all output tokens so far; ``n`` defaults to ``len(ids)``, so
        the caller can pass its live list without copying it); returns the text (mutates
        self)."""
        n = len(ids) if n is None else n
        if self.tokenizer is None or (n == self._read and not final):
            return self.text
        if self._stream is not None:
            return self._update_stream(ids, final, n)
        if n == self._read:
            return self.text
        prefix_text = self._decode(ids[self._prefix:self._read])
        new_text = self._decode(ids[self._prefix:n])
        if len(new_text) > len(prefix_text) and (final or not new_text.endswith("\ufffd")):
            self.text += new_text[len(prefix_text):]
            self._prefix, self._read = self._read, n
        elif final:
            self._prefix = self._read = n
        return self.text

    def _update_stream(self, ids: list[int], final: bool, n: int) -> str:
        for i in range(self._read, n):
            piece = self._stream.step(self._backend, ids[i])
            if piece:
                self.text += piece
                self._prefix, self._emitted = self._emitted, i + 1
        self._read = n
        if final and self._emitted < n:  # a tail inside a UTF-8 sequence: decode's U+FFFD
            before = self._decode(ids[self._prefix:self._emitted])
            after = self._decode(ids[self._prefix:n])
            if len(after) > len(before) and after.startswith(before):
                self.text += after[len(before):]
            self._emitted = n
        return self.text
