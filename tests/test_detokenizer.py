"""Incremental detokenization on the bundled real tokenizers (SmolLM2's byte-level BPE, Gemma 3's
SentencePiece-style): the stream path (``tokenizers.DecodeStream``) and the windowed path give,
token by token, prefixes of ``tokenizer.decode`` of everything so far, and at the end exactly
``decode`` of all the tokens (special tokens skipped or kept; multi-byte characters split over
tokens; a last token inside a UTF-8 sequence; random ids)."""

from __future__ import annotations

import functools
import random
import types

import pytest

from kvfit.config import make_config
from kvfit.engine.detokenizer import IncrementalDetokenizer
from kvfit.engine.settings import resolve_settings
from kvfit.models.registry import load_tokenizer

TEXT = ("Hello, world! Ünïcödé façade, naïve café — 你好，世界。 こんにちは 🙂🚀 "
        "def f(x):\n    return x ** 2  # tabs\tand  double  spaces\n")


@functools.cache
def _tokenizer(name):
    try:
        return load_tokenizer(resolve_settings(make_config(model=name, device="cpu")).source,
                              None)
    except Exception as e:  # noqa: BLE001 - a model package not installed
        pytest.skip(f"{name}: {e}")


def _windowed(tok):
    """The same tokenizer seen without its fast backend: the windowed path."""
    return types.SimpleNamespace(decode=tok.decode)


def _cases(tok, rng):
    ids = tok(TEXT)["input_ids"]
    specials = [t for t in tok.all_special_ids if t is not None][:3]
    mixed = ids[:10] + specials + ids[10:]
    rand = [rng.randrange(tok.vocab_size) for _ in range(120)]
    # a cut inside a multi-byte character: the emoji's bytes span several byte-level tokens
    emoji = tok("🙂🚀")["input_ids"]
    return [ids, mixed, rand, ids[:17] + emoji[:-1]]


@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
@pytest.mark.parametrize("skip", [True, False])
def test_incremental_text_equals_decode(model, skip):
    tok = _tokenizer(model)
    rng = random.Random(7)
    for ids in _cases(tok, rng):
        want = tok.decode(ids, skip_special_tokens=skip)
        for path in ("stream", "windowed"):
            d = IncrementalDetokenizer(tok if path == "stream" else _windowed(tok), skip)
            assert (d._stream is not None) == (path == "stream")
            live = list(ids) + [0, 0]  # the engine's list holds placeholders past n
            for n in range(1, len(ids) + 1):
                text = d.update(live, final=n == len(ids), n=n)
                if n < len(ids):
                    partial = tok.decode(ids[:n], skip_special_tokens=skip)
                    assert want.startswith(text) or partial.startswith(text), (path, n, text)
            assert text == want, (path, model, text[-40:], want[-40:])
