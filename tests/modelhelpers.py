"""Test helpers shared by the CPU tests: tiny configs of the real families, a random HF
checkpoint maker, a step-by-step logits driver over kvfit's runner, and the relative error."""

from __future__ import annotations

import torch

# Tiny configs with the real families' structure (few layers, small hidden). GQA everywhere.
TINY = {
    "llama": dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                  max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False,
                  rope_theta=10000.0),
    "mistral": dict(model_type="mistral", hidden_size=64, intermediate_size=128,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                    vocab_size=256, max_position_embeddings=512, rms_norm_eps=1e-5,
                    rope_theta=1e6, sliding_window=None, head_dim=16),
    "qwen2": dict(model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                  max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=True,
                  rope_theta=1e6, use_sliding_window=False),
    "qwen3": dict(model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=256,
                  max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=True,
                  rope_theta=1e6),
}


def make_hf_model(arch: str, out_dir, seed: int = 0, **overrides):
    """Save a random-init HF model of a tiny config to ``out_dir``; return the HF model."""
    from transformers import AutoModelForCausalLM, CONFIG_MAPPING

    kw = dict(TINY[arch])
    kw.update(overrides)
    mt = kw.pop("model_type")
    cfg = CONFIG_MAPPING[mt](**kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # HF init leaves biases/norms trivial: make every weight matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    model.eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    return model


def stepwise_logits(runner, prompt: list[int], steps: int, chunk: int | None = None):
    """Drive ``runner`` directly: prefill ``prompt`` (in chunks of ``chunk``), then ``steps``
    greedy decode steps. Returns (list of float32 logits [V] per sampled position, tokens)."""
    from kvfit.kvcache.allocator import PageAllocator
    from kvfit.sampling_params import SamplingParams
    from kvfit.scheduler.request import Request

    alloc = PageAllocator(runner.pool.num_pages)
    req = Request("t", None, prompt, SamplingParams(temperature=0, max_tokens=steps), None, 0)
    logits, tokens = [], []
    ps = runner.pool.page_size
    while len(req.output_token_ids) < steps:
        n = req.num_tokens - req.num_computed_tokens
        if chunk is not None:
            n = min(n, chunk)
        need = -(-(req.num_computed_tokens + n) // ps) - len(req.pages)
        req.pages.extend(alloc.allocate(max(0, need)))
        last = req.num_computed_tokens + n == req.num_tokens
        res = runner.execute([(req, n)], [last], [False])
        req.num_computed_tokens += n
        if last:
            lg = res.sample_logits[0]
            logits.append(lg)
            tok = int(lg.argmax())
            tokens.append(tok)
            req.output_token_ids.append(tok)
    alloc.free(req.pages)
    return logits, tokens


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def chunked_schedule(prompt_lens: list[int], chunk: int, decode_steps: int):
    """Steps of (request, tokens) pairs: every prompt prefilled in chunks of ``chunk`` together,
    then ``decode_steps`` steps of one token per request."""
    steps, done = [], [0] * len(prompt_lens)
    while any(d < p for d, p in zip(done, prompt_lens)):
        step = []
        for r, p in enumerate(prompt_lens):
            if done[r] < p:
                n = min(chunk, p - done[r])
                step.append((r, n))
                done[r] += n
        steps.append(step)
    return steps + [[(r, 1) for r in range(len(prompt_lens))] for _ in range(decode_steps)]


def random_sequences(cfg, prompt_lens: list[int], decode: int, seed: int = 1) -> list[list[int]]:
    """Random token ids per request: prompt + the tokens its decode steps will feed."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, cfg.vocab_size, (p + decode,), generator=g).tolist()
            for p in prompt_lens]
