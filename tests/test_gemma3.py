"""Gemma 3 / Gemma 2 against HF transformers (float32): tiny random configs with the real layer
pattern and a window smaller than the prompt, driven through HybridSWAKVCache + TorchRefBackend
(chunked prefill, then decode far past the window); and the real Gemma-3-270M (GGUF) greedy."""

from __future__ import annotations

import os

import pytest
import torch

from kvfit.attention.torch_ref import TorchRefBackend
from kvfit.engine.context import Context
from kvfit.kvcache.allocator import PageAllocator
from kvfit.kvcache.dtypes import kv_format
from kvfit.attention.meta_builder import build_hybrid_metadata, build_step_metadata
from kvfit.kvcache.hybrid_swa import HybridSWAKVCache
from kvfit.models.gemma3 import Gemma3ForCausalLM
from kvfit.models.weights import WeightSink

from modelhelpers import chunked_schedule, random_sequences

PAGE = 4


def _tiny_cfg(kind: str):
    import transformers

    common = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                  query_pre_attn_scalar=24, rms_norm_eps=1e-6)
    if kind == "gemma3":
        cfg = transformers.Gemma3TextConfig(num_hidden_layers=6, sliding_window=6, **common)
    else:
        cfg = transformers.Gemma2Config(num_hidden_layers=4, sliding_window=5,
                                        attn_logit_softcapping=2.0, final_logit_softcapping=40.0,
                                        **common)
    cfg._attn_implementation = "eager"
    return cfg


def _hf_and_ours(kind: str, seed: int = 0):
    import transformers

    cfg = _tiny_cfg(kind)
    torch.manual_seed(seed)
    hf_cls = transformers.Gemma3ForCausalLM if kind == "gemma3" else transformers.Gemma2ForCausalLM
    hf = hf_cls(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():  # fresh, not-small random weights everywhere
            p.normal_(0.0, 1.0 if "embed" in name else (0.3 if "norm" in name else 0.08))
    ours = Gemma3ForCausalLM(cfg, max_positions=256).eval()
    sink = WeightSink(ours)
    for name, t in hf.state_dict().items():
        sink.put(name, t)
    sink.check_complete()
    return cfg, hf, ours


def drive_hybrid(model, cfg, seqs, schedule, kv_dtype="float32", num_pages=64, num_swa_pages=64,
                 page_size=None, logits_from=0, device="cpu", compute_dtype=torch.float32):
    """Run ``schedule`` (list of steps, each a list of (request index, n new tokens)) through the
    model; returns per-request logits [len - logits_from, vocab] (positions >= logits_from) and
    the pool/allocators for page checks."""
    ps = page_size or PAGE
    layers = type(model).kv_layer_specs(cfg)
    dev = torch.device(device)
    pool = HybridSWAKVCache(layers, num_pages, ps, kv_format(kv_dtype), dev,
                            num_swa_pages=num_swa_pages)
    for spec, kc, vc in zip(layers, pool.k_caches, pool.v_caches):
        for c in (kc, vc):  # poison: reading an unwritten slot turns the logits NaN
            c.fill_(float("nan"))
            if spec.kind == "sliding":
                c[pool.null_page] = 0
    backend = TorchRefBackend(pool, compute_dtype, type(model).sm_scale(cfg),
                              type(model).logit_softcap_of(cfg))
    ctx = Context(backend, pool, compute_dtype)
    alloc = PageAllocator(num_pages)
    pages = [[] for _ in seqs]
    done = [0] * len(seqs)
    out = [[] for _ in seqs]
    swa_used = []
    for step in schedule:
        ids, pos, q_lens, kv_lens = [], [], [], []
        for r, n in step:
            s, e = done[r], done[r] + n
            need = -(-e // ps) - len(pages[r])
            pages[r] += alloc.allocate(max(0, need))
            pool.sliding_pages.reserve(str(r), s, e)
            ids += seqs[r][s:e]
            pos += list(range(s, e))
            q_lens.append(n)
            kv_lens.append(e)
        meta = build_step_metadata(pool, q_lens, kv_lens, [pages[r] for r, _ in step],
                                   [str(r) for r, _ in step], dev)
        backend.prepare(meta)
        keep = torch.tensor(pos, device=dev) >= logits_from
        with torch.no_grad():
            h = model(torch.tensor(ids, device=dev), torch.tensor(pos, device=dev), ctx)
            logits = model.compute_logits(h[keep])
        i = 0
        for r, n in step:
            m = sum(1 for p in range(done[r], done[r] + n) if p >= logits_from)
            out[r].append(logits[i:i + m])
            i += m
            done[r] += n
            pool.sliding_pages.release(str(r), done[r])
        swa_used.append(pool.sliding_pages.num_used)
    return [torch.cat(o) for o in out], pool, alloc, pages, swa_used


@pytest.mark.parametrize("kind", ["gemma3", "gemma2"])
def test_tiny_matches_hf_through_window(kind):
    cfg, hf, ours = _hf_and_ours(kind)
    prompt_lens, decode = [13, 7], 22
    seqs = random_sequences(cfg, prompt_lens, decode)
    logits, pool, alloc, pages, swa_used = drive_hybrid(ours, cfg, seqs,
                                                        chunked_schedule(prompt_lens, 5, decode))
    for seq, got in zip(seqs, logits):
        with torch.no_grad():
            ref = hf(torch.tensor([seq])).logits[0].float()
        assert got.shape == ref.shape
        rel = ((got - ref).abs().max() / ref.abs().max()).item()
        assert rel < 1e-4, f"{kind}: relative logit error {rel:.2e}"
    # window 5-6 tokens, page 4: each request keeps at most ceil((W-1)/P) + 2 live sliding pages
    bound = len(seqs) * (-(-(pool.window - 1) // PAGE) + 2)
    assert max(swa_used[-decode:]) <= bound
    assert sum(-(-len(s) // PAGE) for s in seqs) > bound  # ... far fewer than the full layers
    for r in range(len(seqs)):
        table = pool.sliding_pages.table(str(r))
        assert table[0] == -1 and table[-1] >= 0  # the oldest pages were released
        pool.sliding_pages.free(str(r))
        alloc.free(pages[r])
    assert pool.sliding_pages.num_used == 0 and alloc.num_used == 0


def test_hybrid_metadata_needs_live_window():
    cfg = _tiny_cfg("gemma3")
    layers = Gemma3ForCausalLM.kv_layer_specs(cfg)
    assert [l.kind for l in layers] == ["sliding"] * 5 + ["full"]
    with pytest.raises(ValueError, match="freed pages inside its window"):
        build_hybrid_metadata([1], [20], [[0, 1, 2, 3, 4]], [[-1, -1, -1, -1, 7]], PAGE, 6, 99,
                              torch.device("cpu"))


def _gemma_gguf():
    from kvfit.errors import ModelNotFoundError
    from kvfit.models.registry import resolve_model

    try:
        return resolve_model("gemma3-270m")
    except ModelNotFoundError as e:
        if os.environ.get("CI"):  # CI installs it (scripts/setup.sh): never pass by skipping
            pytest.fail(str(e))
        pytest.skip(str(e))


# token ids (Gemma tokenizer, BOS first) of "The capital of France is", "def fibonacci(n):\n    ",
# "Once upon a time, in a small village by the sea,"
REAL_PROMPTS = [[2, 818, 5279, 529, 7001, 563],
                [2, 2063, 10779, 78113, 236769, 236749, 1473, 107, 140],
                [2, 14946, 3324, 496, 990, 236764, 528, 496, 1944, 9744, 684, 506, 5442, 236764]]


@pytest.fixture(scope="module")
def real_gemma():
    """(cfg, HF model read by transformers' GGUF loader, kvfit model read by iter_gguf)."""
    if os.environ.get("KVFIT_SKIP_REAL") == "1":
        pytest.skip("KVFIT_SKIP_REAL=1")
    from transformers import AutoModelForCausalLM

    from kvfit.models.weights import iter_gguf

    src = _gemma_gguf()
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(src.path),
                                              gguf_file=os.path.basename(src.path),
                                              dtype=torch.float32).eval()
    cfg = hf.config
    ours = Gemma3ForCausalLM(cfg, max_positions=1024).eval()
    sink = WeightSink(ours)
    with torch.no_grad():
        for name, t in iter_gguf(src.path, cfg):
            sink.put(name, t)
    sink.check_complete()
    return cfg, hf, ours


def test_real_gemma3_270m_greedy_matches_hf(real_gemma):
    cfg, hf, ours = real_gemma
    new = 16
    seqs = []
    for p in REAL_PROMPTS[:2]:
        with torch.no_grad():
            seqs.append(hf.generate(torch.tensor([p]), max_new_tokens=new, do_sample=False,
                                    min_new_tokens=new)[0].tolist())
    # teacher-force HF's greedy continuation (batched, chunked prefill); our argmax must
    # reproduce every generated token
    plens = [len(p) for p in REAL_PROMPTS[:2]]
    logits, *_ = drive_hybrid(ours, cfg, seqs, chunked_schedule(plens, 4, new - 1), page_size=16)
    for seq, plen, lg in zip(seqs, plens, logits):
        assert lg[plen - 1:].argmax(-1).tolist() == seq[plen:]


def _long_sequence(n: int) -> list[int]:
    body = [t for p in REAL_PROMPTS for t in p[1:]]
    return [2] + (body * (n // len(body) + 1))[: n - 1]


def test_real_gemma3_270m_past_the_window_and_fp8(real_gemma):
    """600 tokens (window 512) prefilled in chunks of 256 then 6 decode steps, pages of 16:
    logits match HF (rel < 5e-4, float32 noise) where sliding pages have been released; fp8 K/V
    stays close to the float32 cache (documented: top-1 agreement >= 0.9 for e4m3 on the last
    100 positions; measured 1.000, mean KL 0.0012 over 400 positions of a 1,000-token text)."""
    cfg, hf, ours = real_gemma
    n, decode, tail = 600, 6, 100
    seq = _long_sequence(n + decode)
    sched = chunked_schedule([n], 256, decode)
    got, pool, *_, used = drive_hybrid(ours, cfg, [seq], sched, page_size=16, num_pages=64,
                                       num_swa_pages=64, logits_from=n + decode - tail)
    with torch.no_grad():
        ref = hf(torch.tensor([seq]), logits_to_keep=tail).logits[0].float()
    rel = ((got[0] - ref).abs().max() / ref.abs().max()).item()
    # NOTE: float32 noise on this model is ~1e-4: HF's own eager and sdpa attention differ by
    # 3e-4 (relative max) at 1,000 tokens; an off-by-one window would be orders larger
    assert rel < 5e-4, f"relative logit error {rel:.2e}"
    assert max(used[-decode:]) <= -(-511 // 16) + 2  # only the window's pages stay
    base = got[0].argmax(-1)
    for name, min_agree in (("fp8_e4m3", 0.9),):  # e5m2: tiny models, tests/test_swa_pool.py
        q, *_ = drive_hybrid(ours, cfg, [seq], sched, kv_dtype=name, page_size=16, num_pages=64,
                             num_swa_pages=64, logits_from=n + decode - tail)
        assert torch.isfinite(q[0]).all()
        agree = (q[0].argmax(-1) == base).float().mean().item()
        assert agree >= min_agree, f"{name}: top-1 agreement {agree:.3f}"


def tiny_tokenizer_dir(d, vocab: int) -> None:
    """A word-level tokenizer (``t0`` .. ``t{vocab-1}``) so the engine can load a tiny model dir."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=t, unk_token="t0").save_pretrained(str(d))


def engine_matches_hf(tmp_path, hf, vocab: int, prompt_lens=(13, 7), new=20, **engine_kw):
    """Save ``hf`` to ``tmp_path``, generate greedily through ``kvfit.LLM`` (chunked prefill of
    5 tokens), and check every generated token is HF's argmax on the same prefix."""
    from kvfit import LLM, SamplingParams

    hf.save_pretrained(str(tmp_path), safe_serialization=True)
    tiny_tokenizer_dir(tmp_path, vocab)
    llm = LLM(str(tmp_path), device="cpu", num_tokens=256, max_model_len=128, page_size=PAGE,
              max_num_batched_tokens=5, **engine_kw)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in prompt_lens]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True),
                        use_tqdm=False)
    for p, o in zip(prompts, outs):
        toks = list(o.outputs[0].token_ids)
        assert len(toks) == new
        with torch.no_grad():
            ref = hf(torch.tensor([p + toks])).logits[0].float()
        assert ref[len(p) - 1:-1].argmax(-1).tolist() == toks
    assert llm.engine.stats()["pages_used"] == 0
    return llm


def test_engine_tiny_gemma3_matches_hf(tmp_path):
    cfg, hf, _ = _hf_and_ours("gemma3", seed=4)
    llm = engine_matches_hf(tmp_path, hf, cfg.vocab_size)
    pool = llm.engine.runner.pool
    assert pool.name == "HybridSWAKVCache"
    assert pool.sliding_pages is not None  # the engine drives the sliding pages ...
    assert pool.sliding_pages.num_used == 0  # ... all back after the requests
