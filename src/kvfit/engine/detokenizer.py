"""Incremental detokenization: each step decodes a window of a few tokens, not the whole output.

The window is ``ids[prefix:]``; its text minus the text of ``ids[prefix:read]`` is the new text.
Decoding from a token slightly before the new ones keeps tokenizers that treat a leading space
specially (SentencePiece) right; a window ending in an incomplete UTF-8 sequence (U+FFFD) is held
until more tokens arrive or the request finishes.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    """Owns the decoded text of one request's output tokens (``text``), grown by ``update``."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.text = ""
        self._prefix = 0
        self._read = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def update(self, ids: list[int], final: bool = False, n: int | None = None) -> str:
        """Account for ``ids[:n]`` (all output tokens so far; ``n`` defaults to ``len(ids)``, so
        the caller can pass its live list without copying it); returns the text (mutates
        self)."""
        n = len(ids) if n is None else n
        if self.tokenizer is None or n == self._read:
            return self.text
        prefix_text = self._decode(ids[self._prefix:self._read])
        new_text = self._decode(ids[self._prefix:n])
        if len(new_text) > len(prefix_text) and (final or not new_text.endswith("\ufffd")):
            self.text += new_text[len(prefix_text):]
            self._prefix, self._read = self._read, n
        elif final:
            self._prefix = self._read = n
        return self.text
