"""Exception types users see. Each message names the problem and the fix."""

from __future__ import annotations


class ModelNotFoundError(FileNotFoundError):
    """--model names nothing kvfit can load (or a known model whose package is missing)."""


class UnsupportedCombinationError(NotImplementedError):
    """The (model, pool, backend, KV dtype, page size, device) combination is not implemented."""


class RequestRejected(ValueError):
    """A request that can never be served (too long, bad parameter). ``param`` names the field,
    ``code`` is OpenAI's error code when it has one (``context_length_exceeded``)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


class KVBudgetError(RuntimeError):
    """The KV cache cannot be sized as asked (not enough memory, context too long)."""


class ModelInputError(ValueError):
    """A model file or config that cannot be loaded as it is (truncated GGUF, missing or
    inconsistent config field). The message names the file, the field and the fix."""


class WorkerLostError(RuntimeError):
    """A tensor-parallel worker process exited while the engine ran; the engine cannot go on
    (the message names the rank and its exit code; restart the engine)."""
