"""DeepSeek-V2 MLA against HF transformers (float32) on tiny random configs with DeepSeek-V2-Lite's
shape ratios (q_lora_rank None, MoE after the first dense layer, YaRN rope) and a V2-style one
(q_lora_rank set, group-limited routing), through MLAKVCache + TorchRefBackend: chunked prefill
and many decode steps; fp8 latent cache saturates and stays close to bf16."""

from __future__ import annotations

import pytest
import torch

from kvfit.attention.meta_builder import build_metadata
from kvfit.attention.registry import backend_class
from kvfit.engine.context import Context
from kvfit.kvcache.allocator import PageAllocator
from kvfit.kvcache.dtypes import kv_format
from kvfit.kvcache.mla import MLAKVCache
from kvfit.kvcache.registry import resolve_pool_class
from kvfit.kvcache.spec import KVLayerSpec, spec_kv_bytes_per_token
from kvfit.models.deepseek_v2 import DeepseekV2ForCausalLM
from kvfit.models.weights import WeightSink

from modelhelpers import chunked_schedule, random_sequences

PAGE = 4


def _tiny_cfg(variant: str):
    """A tiny DeepSeek-V2 config: "lite" (V2-Lite's features), "v2" (V2's), "slab576" (lite
    with DeepSeek's real 512 + 64 latent slab and 16 heads, the only slab FlashInfer's MLA
    reads)."""
    import transformers

    common = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                  num_hidden_layers=3, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                  v_head_dim=16, moe_intermediate_size=24, n_routed_experts=8,
                  num_experts_per_tok=2, n_shared_experts=2, first_k_dense_replace=1,
                  max_position_embeddings=256, rms_norm_eps=1e-6)
    if variant == "slab576":
        common.update(num_attention_heads=16, kv_lora_rank=512, qk_rope_head_dim=64)
        variant = "lite"
    if variant == "lite":  # V2-Lite: no q LoRA, greedy routing, YaRN
        cfg = transformers.DeepseekV2Config(
            q_lora_rank=None, topk_method="greedy",
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 64, "beta_fast": 32,
                             "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
            **common)
    else:  # V2: q LoRA, group-limited routing
        cfg = transformers.DeepseekV2Config(q_lora_rank=24, topk_method="group_limited_greedy",
                                            n_group=4, topk_group=2, routed_scaling_factor=1.5,
                                            **common)
    cfg._attn_implementation = "eager"
    return cfg


def _hf_and_ours(variant: str, seed: int = 0, tmp_dir=None):
    """HF model with fresh random weights, saved to ``tmp_dir`` (safetensors, per-expert names as
    on disk) and loaded into kvfit's model through ``iter_safetensors`` + ``WeightSink``."""
    import tempfile

    import transformers

    from kvfit.models.weights import iter_safetensors

    cfg = _tiny_cfg(variant)
    torch.manual_seed(seed)
    hf = transformers.DeepseekV2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0.0, 1.0 if "embed" in name else 0.08)
    ours = DeepseekV2ForCausalLM(cfg, max_positions=256).eval()
    sink = WeightSink(ours)
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(tmp_dir or d, safe_serialization=True)
        with torch.no_grad():
            for name, t in iter_safetensors(tmp_dir or d):
                sink.put(name, t)
    sink.check_complete()
    return cfg, hf, ours


def drive_mla(model, cfg, seqs, schedule, kv_dtype="float32", num_pages=64,
              compute_dtype=torch.float32, device="cpu", backend_name="torch"):
    dev = torch.device(device)
    layers = DeepseekV2ForCausalLM.kv_layer_specs(cfg)
    pool = MLAKVCache(layers, num_pages, PAGE, kv_format(kv_dtype), dev)
    for c in pool.kv_caches:
        c.fill_(float("nan"))  # poison: a read of an unwritten slot shows up
    backend = backend_class(backend_name)(pool, compute_dtype,
                                          DeepseekV2ForCausalLM.sm_scale(cfg))
    ctx = Context(backend, pool, compute_dtype)
    alloc = PageAllocator(num_pages)
    pages = [[] for _ in seqs]
    done = [0] * len(seqs)
    out = [[] for _ in seqs]
    for step in schedule:
        ids, pos, q_lens, kv_lens = [], [], [], []
        for r, n in step:
            s, e = done[r], done[r] + n
            pages[r] += alloc.allocate(max(0, -(-e // PAGE) - len(pages[r])))
            ids += seqs[r][s:e]
            pos += list(range(s, e))
            q_lens.append(n)
            kv_lens.append(e)
        meta = build_metadata(q_lens, kv_lens, [pages[r] for r, _ in step], PAGE, dev)
        backend.prepare(meta)
        with torch.no_grad():
            logits = model.compute_logits(model(torch.tensor(ids, device=dev),
                                                torch.tensor(pos, device=dev), ctx))
        i = 0
        for r, n in step:
            out[r].append(logits[i:i + n])
            i += n
            done[r] += n
    for layer in range(len(layers)):  # everything stored is finite (fp8 saturates, never NaN)
        for r, p in enumerate(pages):
            stored = pool.gather_latent(layer, torch.tensor(p, device=dev), done[r], torch.float32)
            assert torch.isfinite(stored).all()
    for p in pages:
        alloc.free(p)
    assert alloc.num_used == 0
    return [torch.cat(o) for o in out], pool


@pytest.mark.parametrize("variant", ["lite", "v2"])
def test_tiny_mla_matches_hf(variant):
    cfg, hf, ours = _hf_and_ours(variant)
    prompt_lens, decode = [11, 6], 20
    seqs = random_sequences(cfg, prompt_lens, decode)
    logits, pool = drive_mla(ours, cfg, seqs, chunked_schedule(prompt_lens, 4, decode))
    for seq, got in zip(seqs, logits):
        with torch.no_grad():
            ref = hf(torch.tensor([seq])).logits[0].float()
        rel = ((got - ref).abs().max() / ref.abs().max()).item()
        assert rel < 1e-4, f"{variant}: relative logit error {rel:.2e}"


def test_mla_pool_shape_price_and_selection():
    cfg = _tiny_cfg("lite")
    layers = DeepseekV2ForCausalLM.kv_layer_specs(cfg)
    assert resolve_pool_class(layers) is MLAKVCache
    for name in ("bfloat16", "fp8_e4m3", "fp8_e5m2"):
        fmt = kv_format(name)
        pool = MLAKVCache(layers, 10, PAGE, fmt, torch.device("cpu"))
        assert pool.kv_caches[0].shape == (10, PAGE, 32 + 8)
        assert spec_kv_bytes_per_token(layers, fmt) == 3 * 40 * fmt.itemsize
        assert pool.allocated_bytes() == pool.priced_bytes()
    with pytest.raises(ValueError, match="one scale per layer"):
        MLAKVCache(layers, 4, PAGE, kv_format("fp8_e4m3"), torch.device("cpu"),
                   k_scales=[1.0] * 3, v_scales=[2.0] * 3)


@pytest.mark.parametrize("name,tol", [("fp8_e4m3", 2 ** -4), ("fp8_e5m2", 2 ** -3)])
def test_mla_fp8_store_saturates_and_rounds(name, tol):
    fmt = kv_format(name)
    layers = DeepseekV2ForCausalLM.kv_layer_specs(_tiny_cfg("lite"))
    pool = MLAKVCache(layers, 4, PAGE, fmt, torch.device("cpu"), k_scales=[0.5, 1.0, 2.0])
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 40, generator=g) * 20
    x[0, :4] = torch.tensor([1e6, -1e6, 3e7, -3e7])  # far beyond the format's range
    slots = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8])
    for layer, scale in enumerate(pool.k_scales):
        pool.kv_caches[layer].fill_(float("nan"))  # poison: every read slot must be written
        pool.store_latent(layer, x.clone(), slots)  # NOTE: quantize may clamp its input
        got = pool.gather_latent(layer, torch.tensor([0, 1, 2]), 9, torch.float32)
        assert torch.isfinite(got).all()
        lim = fmt.max_finite * scale
        ref = x.clamp(-lim, lim)
        assert (got[0, :4].abs() == lim).all()  # saturated, not NaN
        err = (got - ref).abs()
        # relative rounding of the format, plus its smallest subnormal step (times the scale)
        sub = torch.finfo(fmt.torch_dtype).smallest_normal * scale
        assert (err <= tol * ref.abs() + sub).all()


def test_mla_fp8_model_close_to_bf16():
    """Documented tolerance: with fp8_e4m3 (e5m2) latents, logits stay within 5% (10%) of the
    bf16-cache logits' scale on the tiny random model, and top-1 agrees on >= 90% (80%) of the
    positions (random weights make near-ties common)."""
    cfg, _, ours = _hf_and_ours("lite")
    prompt_lens, decode = [10, 7], 8
    seqs = random_sequences(cfg, prompt_lens, decode, seed=5)
    sched = chunked_schedule(prompt_lens, 6, decode)
    base, _ = drive_mla(ours, cfg, seqs, sched, kv_dtype="bfloat16")
    for name, tol, min_agree in (("fp8_e4m3", 0.05, 0.9), ("fp8_e5m2", 0.10, 0.8)):
        got, pool = drive_mla(ours, cfg, seqs, sched, kv_dtype=name)
        for b, q in zip(base, got):
            rel = ((q - b).abs().max() / b.abs().max()).item()
            agree = (q.argmax(-1) == b.argmax(-1)).float().mean().item()
            assert rel < tol and agree >= min_agree, f"{name}: rel {rel:.3f}, top-1 agreement {agree}"


def test_guard_refuses_mla_on_backends_without_it():
    from kvfit.engine.guard import check_combination
    from kvfit.errors import UnsupportedCombinationError

    layers = DeepseekV2ForCausalLM.kv_layer_specs(_tiny_cfg("lite"))
    fmt = kv_format("fp8_e4m3")
    check_combination("torch", MLAKVCache, fmt, PAGE, "cpu", layers)  # implemented
    for name in ("bfloat16", "fp8_e4m3", "fp8_e5m2"):  # the triton MLA kernels, any slab width
        for page in (16, 32):
            check_combination("triton", MLAKVCache, kv_format(name), page, "cuda", layers,
                              assume_installed=True)
    # FlashInfer's MLA kernels read only DeepSeek's 512 + 64 slabs: the tiny model's are refused
    with pytest.raises(UnsupportedCombinationError) as e:
        check_combination("fi", MLAKVCache, fmt, PAGE, "cuda", layers, assume_installed=True)
    assert f"fi does not support head_dim [{layers[0].head_dim}]" in str(e.value)
    assert "(supports 576)" in str(e.value)
    assert "triton" in str(e.value)  # named as the backend that works


def test_guard_and_auto_take_flashinfer_mla_for_deepseek_slabs():
    """V2-Lite's slabs (512 + 64): fi reads 16-bit and e4m3 latents and refuses e5m2 naming
    triton; ``auto`` keeps triton for every MLA pool (fi measured faster only for batched
    16-bit decode, slower at batch 1 and for fp8: docs/benchmarks.md)."""
    from kvfit.attention.registry import select_backend
    from kvfit.engine.guard import check_combination
    from kvfit.errors import UnsupportedCombinationError

    layers = [KVLayerSpec("mla", 1, 576) for _ in range(3)]
    for name in ("bfloat16", "float16", "fp8_e4m3"):
        for page in (16, 32, 64):
            check_combination("fi", MLAKVCache, kv_format(name), page, "cuda", layers,
                              assume_installed=True)
    with pytest.raises(UnsupportedCombinationError) as e:
        check_combination("fi", MLAKVCache, kv_format("fp8_e5m2"), 16, "cuda", layers,
                          assume_installed=True)
    msg = str(e.value)
    assert "fi does not read fp8_e5m2 KV in the MLAKVCache pool" in msg
    assert "--attention-backend triton" in msg and "these backends support it: torch, triton" in msg

    def auto(kvd, slab=576):
        return select_backend("auto", "cuda", "MLAKVCache", kvd, slab, assume_installed=True)

    assert auto("bfloat16") == "triton" and auto("float16") == "triton"
    assert auto("fp8_e4m3") == "triton" and auto("fp8_e5m2") == "triton"
    assert auto("bfloat16", slab=80) == "triton"
    # MHA pools keep their choices
    assert select_backend("auto", "cuda", "MHAKVCache", "bfloat16", 64,
                          assume_installed=True) == "fi"
    assert select_backend("auto", "cuda", "MHAKVCache", "fp8_e4m3", 128,
                          assume_installed=True) == "triton"


def engine_greedy(tmp_path, variant, seed, device, **llm_kw):
    """A tiny DeepSeek-V2 (``_hf_and_ours(variant, seed)``) saved to ``tmp_path`` and run by
    ``kvfit.LLM`` (``llm_kw``: backend, dtype, graphs): three random prompts, 12 greedy tokens
    each. Returns (cfg, the HF model on ``device``, prompts, token lists, the LLM)."""
    from test_gemma3 import tiny_tokenizer_dir

    from kvfit import LLM, SamplingParams

    cfg, hf, _ = _hf_and_ours(variant, seed=seed)
    hf.save_pretrained(str(tmp_path), safe_serialization=True)
    tiny_tokenizer_dir(tmp_path, cfg.vocab_size)
    llm = LLM(str(tmp_path), device=device, num_tokens=512, max_model_len=128, page_size=16,
              max_num_batched_tokens=8, **llm_kw)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (13, 7, 21)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)
    return cfg, hf.to(device), prompts, [list(o.outputs[0].token_ids) for o in outs], llm


def test_engine_tiny_mla_matches_hf(tmp_path):
    from test_gemma3 import engine_matches_hf

    cfg, hf, _ = _hf_and_ours("lite", seed=4)
    llm = engine_matches_hf(tmp_path, hf, cfg.vocab_size)
    assert llm.engine.runner.pool.name == "MLAKVCache"


def test_moe_grouped_experts_match_the_loop():
    """The stacked experts' grouped-GEMM path (no host sync: what decode CUDA graphs capture)
    gives the loop's result, in bfloat16, with experts chosen by no token and a repeated one;
    stacking leaves the experts' parameters as views of the stacked weights."""
    from kvfit.models.deepseek_v2 import MoE

    cfg = _tiny_cfg("lite")
    torch.manual_seed(1)
    moe = MoE(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.2)
    x = torch.randn(5, cfg.hidden_size).to(torch.bfloat16)
    idx = torch.tensor([[0, 3], [3, 5], [5, 0], [7, 3], [3, 0]])
    w = torch.rand(5, 2)
    loop = moe.experts(x, idx, w)
    moe.experts.stack_weights()
    assert moe.experts[3].down_proj.weight.data_ptr() == moe.experts.w_down[3].data_ptr()
    grouped = moe.experts(x, idx, w)
    assert torch.isfinite(grouped).all()
    rel = ((grouped.float() - loop.float()).abs().max() / loop.float().abs().max()).item()
    assert rel < 2e-2, rel


def test_moe_every_expert_path_matches_the_loop():
    """The sync-free path CUDA-graph capture takes for non-bf16 models: every expert on every
    token, masked by the routing weights, equals the loop (float32)."""
    from kvfit.models.deepseek_v2 import MoE

    cfg = _tiny_cfg("lite")
    torch.manual_seed(2)
    moe = MoE(cfg)
    x = torch.randn(4, cfg.hidden_size)
    idx = torch.tensor([[1, 2], [2, 6], [6, 1], [0, 2]])
    w = torch.rand(4, 2)
    with torch.no_grad():
        torch.testing.assert_close(moe.experts.every_expert(x, idx, w), moe.experts(x, idx, w),
                                   rtol=1e-5, atol=1e-5)


def test_mla_decode_config_fills_the_gpu():
    """Launch choices of the triton MLA decode (kernels/mla.py, pure host code): a few long
    requests split their context over the SMs, many short ones do not; 128 heads take four
    32-row programs per request; a rank that is not a power of two keeps one split."""
    from kvfit.kernels.mla import decode_config

    few_long = decode_config(2, 16, 512, 65536, torch.bfloat16, torch.bfloat16)
    assert few_long.block_m == 16 and few_long.num_splits >= 32
    many = decode_config(256, 16, 512, 1024, torch.bfloat16, torch.bfloat16)
    assert many.num_splits <= 2
    v2 = decode_config(4, 128, 512, 65536, torch.float8_e4m3fn, torch.bfloat16)
    assert v2.block_m == 32 and 4 * 4 * v2.num_splits >= 0.9 * 132
    assert decode_config(2, 16, 48, 65536, torch.bfloat16, torch.bfloat16).num_splits == 1
