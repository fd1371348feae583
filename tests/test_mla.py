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
from kvfit.kvcache.spec import spec_kv_bytes_per_token
from kvfit.models.deepseek_v2 import DeepseekV2ForCausalLM
from kvfit.models.weights import WeightSink

from modelhelpers import chunked_schedule, random_sequences

PAGE = 4


def _tiny_cfg(variant: str):
    import transformers

    common = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                  num_hidden_layers=3, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                  v_head_dim=16, moe_intermediate_size=24, n_routed_experts=8,
                  num_experts_per_tok=2, n_shared_experts=2, first_k_dense_replace=1,
                  max_position_embeddings=256, rms_norm_eps=1e-6)
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
    with pytest.raises(UnsupportedCombinationError) as e:
        check_combination("fi", MLAKVCache, fmt, PAGE, "cuda", layers, assume_installed=True)
    assert "fi does not support the MLAKVCache pool" in str(e.value)
    assert "triton" in str(e.value)  # named as the backend that works


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
