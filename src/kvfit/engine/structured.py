"""Structured output through xgrammar: grammars compiled once per spec, one matcher per request,
the step's token bitmask filled on the host, each sampled token fed back to its matcher.

``StructuredOutputs`` owns the xgrammar tokenizer info, the compiler and the compiled-grammar
cache (keyed by ``StructuredOutputsParams.cache_key``). It never touches the model: the engine
calls ``new_matcher`` when a request is added (the matcher lives on ``Request.grammar``),
``fill_bitmask`` after the forward is launched and before sampling (so on a GPU the host work
overlaps the forward), and ``accept`` with every sampled token. The bitmask is xgrammar's packed
convention: int32 ``[N, ceil(V/32)]``, bit set = token allowed, unconstrained rows all ones.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from typing import Optional, Sequence

import torch

from kvfit.errors import RequestRejected
from kvfit.structured_params import StructuredOutputsParams

log = logging.getLogger("kvfit")

_CACHE_SIZE = 256  # compiled grammars kept (least recently used dropped first)


class StructuredOutputs:
    """Built lazily by the engine on the first structured request (imports xgrammar then)."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: Sequence[int]):
        import xgrammar as xgr

        if tokenizer is None:
            raise RequestRejected("structured output needs the model's tokenizer; this model "
                                  "has none", param="structured_outputs")
        self._xgr = xgr
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(eos_ids) or None)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict = OrderedDict()
        self.num_words = (vocab_size + 31) // 32

    # -- compile ----------------------------------------------------------------------------
    def _compile(self, spec: StructuredOutputsParams):
        c, kind = self._compiler, spec.kind
        if kind == "json":
            schema = spec.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise RequestRejected(f"the JSON schema is not valid JSON: {e}",
                                          param="structured_outputs") from None
            if not isinstance(schema, dict):
                raise RequestRejected("the JSON schema must be a JSON object",
                                      param="structured_outputs")
            return c.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                         strict_mode=spec.strict)
        if kind == "json_object":
            # any JSON object (OpenAI's JSON mode), compact as the schema mode
            return c.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                         strict_mode=False)
        if kind == "regex":
            return c.compile_regex(spec.regex)
        if kind == "choice":
            alts = " | ".join(json.dumps(s, ensure_ascii=False) for s in spec.choice)
            return c.compile_grammar(f"root ::= {alts}")
        return c.compile_grammar(spec.grammar)

    def compiled(self, spec: StructuredOutputsParams):
        """The compiled grammar for ``spec`` (cached); RequestRejected if it does not compile."""
        key = spec.cache_key()
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        try:
            grammar = self._compile(spec)
        except RequestRejected:
            raise
        except (RuntimeError, ValueError, TypeError) as e:
            # xgrammar's message starts with "[time] /path/file.cc:line: "; keep the reason
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            msg = msg.split(": ", 1)[1] if msg.startswith("[") and ": " in msg else msg
            raise RequestRejected(f"invalid {_WHAT[spec.kind]}: {msg}",
                                  param="structured_outputs") from None
        self._cache[key] = grammar
        if len(self._cache) > _CACHE_SIZE:
            self._cache.popitem(last=False)
        return grammar

    def new_matcher(self, spec: StructuredOutputsParams):
        """A fresh GrammarMatcher for one request."""
        return self._xgr.GrammarMatcher(self.compiled(spec))

    # -- per step ---------------------------------------------------------------------------
    def fill_bitmask(self, matchers: Sequence[Optional[object]]) -> Optional[torch.Tensor]:
        """int32 [N, ceil(V/32)] for the step's sampled rows (None when no row is structured);
        row i is all ones when ``matchers[i]`` is None."""
        if all(m is None for m in matchers):
            return None
        mask = torch.full((len(matchers), self.num_words), -1, dtype=torch.int32)
        for i, m in enumerate(matchers):
            if m is not None:
                m.fill_next_token_bitmask(mask, i)
        return mask

    @staticmethod
    def accept(matcher, token: int) -> bool:
        """Advance ``matcher`` by the sampled token; True once the grammar is complete (the
        request is then finished, like a stop token)."""
        if not matcher.accept_token(token):
            # cannot happen for a token the bitmask allowed; finish rather than run unguided
            log.warning("structured output: token %d rejected by the grammar", token)
            return True
        return matcher.is_terminated()


_WHAT = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex",
         "choice": "choice list", "grammar": "grammar"}
