"""Workloads of ``kvfit bench prefix`` and the engine driver they run on (pure host code).

- shared system prompt: N requests = one shared prefix + unique suffix each, sent at once;
- multi-turn chat: C chats of T turns, every turn resends the whole history (previous prompt +
  the model's answer + a new user message), turns of all chats sent together, round by round;
- random prompts (nano-vllm's bench): N requests of random lengths, no shared prefix, the
  check that caching costs nothing when nothing is shared;
- capacity probe: distinct prefixes sent until the pool overflows, then counted in the cache.

Token ids are random in ``[lo, hi)``; every generation ignores EOS so lengths are fixed.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import statistics
import time
from dataclasses import dataclass

from kvfit.kvcache.prefix_cache import PrefixCachingAllocator, extend_page_keys
from kvfit.outputs import RequestOutput
from kvfit.sampling_params import SamplingParams

_ids = itertools.count()


@dataclass
class RunResult:
    """One workload on one engine: per-request TTFTs, totals and the prefix-cache counters."""

    workload: str
    num_requests: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    seconds: float = 0.0
    ttfts: list[float] = dataclasses.field(default_factory=list)

    def merge(self, other: "RunResult") -> None:
        self.num_requests += other.num_requests
        self.prompt_tokens += other.prompt_tokens
        self.output_tokens += other.output_tokens
        self.cached_tokens += other.cached_tokens
        self.seconds += other.seconds
        self.ttfts += other.ttfts

    def summary(self) -> dict:
        s = sorted(self.ttfts) or [0.0]
        p99 = s[min(len(s) - 1, int(round(0.99 * (len(s) - 1))))]
        dt = max(self.seconds, 1e-9)
        return {"workload": self.workload, "requests": self.num_requests,
                "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens,
                "ttft_median_ms": statistics.median(s) * 1e3, "ttft_p99_ms": p99 * 1e3,
                "output_tok_s": self.output_tokens / dt,
                "total_tok_s": (self.prompt_tokens + self.output_tokens) / dt,
                "seconds": self.seconds,
                "hit_rate": self.cached_tokens / max(self.prompt_tokens, 1)}


def drive(engine, prompts: list[list[int]], output_lens: list[int], workload: str
          ) -> tuple[RunResult, list[RequestOutput]]:
    """Queue every prompt at once, step the engine until all finish; outputs in prompt order."""
    rids = []
    t0 = time.monotonic()
    for p, n in zip(prompts, output_lens):
        rid = f"bench-{next(_ids)}"
        engine.add_request(rid, p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        rids.append(rid)
    done: dict[str, RequestOutput] = {}
    while len(done) < len(rids):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    seconds = time.monotonic() - t0
    outs = [done[r] for r in rids]
    res = RunResult(workload, len(outs), sum(map(len, prompts)),
                    sum(len(o.outputs[0].token_ids) for o in outs),
                    sum(o.num_cached_tokens for o in outs), seconds,
                    [o.metrics.first_token_time - o.metrics.arrival_time for o in outs])
    return res, outs


def token_range(vocab_size: int) -> tuple[int, int]:
    """Ids away from the specials at the start of real vocabularies, within tiny test vocabs."""
    return min(1000, vocab_size // 4), min(vocab_size, 30000)


def _rand(rng: random.Random, n: int, lo: int, hi: int) -> list[int]:
    return [rng.randrange(lo, hi) for _ in range(n)]


def shared_prefix(engine, num_requests: int, prefix_len: int, suffix_len: int, output_len: int,
                  seed: int) -> RunResult:
    lo, hi = token_range(engine.vocab_size)
    rng = random.Random(seed)
    prefix = _rand(rng, prefix_len, lo, hi)
    prompts = [prefix + _rand(rng, suffix_len, lo, hi) for _ in range(num_requests)]
    return drive(engine, prompts, [output_len] * num_requests, "shared-prefix")[0]


def multi_turn(engine, num_chats: int, turns: int, user_len: int, output_len: int,
               seed: int) -> RunResult:
    lo, hi = token_range(engine.vocab_size)
    rng = random.Random(seed)
    history = [[] for _ in range(num_chats)]
    total = RunResult("multi-turn")
    for _ in range(turns):
        prompts = [h + _rand(rng, user_len, lo, hi) for h in history]
        res, outs = drive(engine, prompts, [output_len] * num_chats, "multi-turn")
        total.merge(res)
        history = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]
    return total


def random_prompts(engine, num_requests: int, min_len: int, max_len: int, seed: int) -> RunResult:
    """nano-vllm's bench: input and output lengths uniform in [min_len, max_len]."""
    lo, hi = token_range(engine.vocab_size)
    rng = random.Random(seed)
    prompts = [_rand(rng, rng.randint(min_len, max_len), lo, hi) for _ in range(num_requests)]
    outs = [rng.randint(min_len, max_len) for _ in range(num_requests)]
    return drive(engine, prompts, outs, "random")[0]


def ttft_probe(engine, prefix_len: int, suffix_len: int, seed: int) -> dict:
    """TTFT of one request alone with a fresh prefix (uncached), then of one sharing it (cached)."""
    lo, hi = token_range(engine.vocab_size)
    rng = random.Random(seed)
    prefix = _rand(rng, prefix_len, lo, hi)
    first, _ = drive(engine, [prefix + _rand(rng, suffix_len, lo, hi)], [1], "probe")
    second, outs = drive(engine, [prefix + _rand(rng, suffix_len, lo, hi)], [1], "probe")
    return {"uncached_ttft_ms": first.ttfts[0] * 1e3, "cached_ttft_ms": second.ttfts[0] * 1e3,
            "cached_tokens": outs[0].num_cached_tokens}


def capacity_probe(engine, prefix_len: int, seed: int, max_prefixes: int) -> dict:
    """Send distinct prefixes (1 output token each) until the pool has overflowed, then count
    those whose every full page is still cached. Needs caching on."""
    alloc = engine.allocator
    if not isinstance(alloc, PrefixCachingAllocator):
        return {}
    ps = engine.config.page_size
    per_prefix = prefix_len // ps
    bound = alloc.num_pages // max(per_prefix, 1)
    n = min(bound + 2, max_prefixes)
    lo, hi = token_range(engine.vocab_size)
    rng = random.Random(seed)
    prompts = [_rand(rng, prefix_len + 1, lo, hi) for _ in range(n)]
    batch = max(1, min(engine.config.max_num_seqs, 64))
    for i in range(0, n, batch):
        drive(engine, prompts[i:i + batch], [1] * len(prompts[i:i + batch]), "capacity")
    cached = 0
    for p in prompts:
        keys: list[bytes] = []
        extend_page_keys(keys, alloc.root, lambda s, e, p=p: p[s:e], prefix_len, ps)
        cached += len(alloc.lookup(keys)) == per_prefix
    return {"prefixes_sent": n, "prefixes_cached": cached, "pages_total": alloc.num_pages,
            "pages_per_prefix": per_prefix, "bound": bound}
