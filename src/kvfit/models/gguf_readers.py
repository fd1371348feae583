"""One parse of a GGUF file's metadata per model load, shared by everything that reads it.

Loading a GGUF model reads its header four times: kvfit's file check (``validate``), the HF
config and the tokenizer (transformers' ``load_gguf_checkpoint``, twice) and the weights
(``weights.iter_gguf``). ``gguf.GGUFReader`` parses every metadata field at construction, and a
262k-token vocabulary (Gemma 3) is ~3 million numpy views: ~23 s per parse on a 2-core CPU, 92 of
the Gemma-3-270M GGUF's 124-s load under cProfile (docs/benchmarks.md, "Loading a GGUF").

Inside ``shared_gguf_readers()`` every ``gguf.GGUFReader(path)`` (ours and transformers', which
imports the name from ``gguf`` when it runs) returns one reader per file (same real path, size
and modification time), read-only, and ``shared_result(path, what, build)`` builds a value once
per file (the HF config, which transformers converts from all the metadata, 262k tokens
included, on every call: ``kvfit plan`` asks once per KV dtype) and hands out deep copies; on
leaving the outermost block both are dropped (the parsed fields are large) and
``gguf.GGUFReader`` is the library's class again. Re-entrant; owns the caches and the module
attribute while inside, nothing after.
"""

from __future__ import annotations

import contextlib
import copy
import os
import threading
from typing import Any, Callable, Iterator

_lock = threading.Lock()
_depth = 0
_readers: dict = {}
_results: dict = {}
_original = None


def _key(path) -> tuple:
    real = os.path.realpath(os.fspath(path))
    st = os.stat(real)
    return real, st.st_size, st.st_mtime_ns


def _shared_reader(path, mode: str = "r"):
    """``gguf.GGUFReader(path)`` as ``shared_gguf_readers`` hands it out: the cached reader of
    this file (read-only mode only; any other mode gets a fresh reader)."""
    if mode != "r":
        return _original(path, mode)
    key = _key(path)
    with _lock:
        reader = _readers.get(key)
    if reader is None:
        reader = _original(path, mode)  # may raise for a damaged file: nothing is cached
        with _lock:
            reader = _readers.setdefault(key, reader)
    return reader


@contextlib.contextmanager
def shared_gguf_readers() -> Iterator[None]:
    """Within the block, one ``GGUFReader`` per GGUF file for every reader of it."""
    global _depth, _original
    try:
        import gguf
    except ImportError:  # no GGUF support installed: nothing to share
        yield
        return
    with _lock:
        if _depth == 0:
            _original = gguf.GGUFReader
            gguf.GGUFReader = _shared_reader
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                gguf.GGUFReader = _original
                _readers.clear()
                _results.clear()


def shared_result(path, what: str, build: Callable[[], Any]) -> Any:
    """``build()`` for the GGUF file ``path``: inside ``shared_gguf_readers`` once per (file,
    ``what``), each call returning a deep copy (callers may change what they get); outside, a
    fresh ``build()`` every call."""
    if _depth == 0:
        return build()
    key = (*_key(path), what)
    with _lock:
        hit = key in _results
        value = _results.get(key)
    if not hit:
        value = build()  # may raise: nothing is cached
        with _lock:
            value = _results.setdefault(key, value)
    return copy.deepcopy(value)

