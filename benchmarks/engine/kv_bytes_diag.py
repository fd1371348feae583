"""Where two attention backends part on a real model: the K/V each engine stored after the
first prefill step of one prompt, layer by layer, dequantized and compared (the triton and torch
backends store fp8 pages of other sizes and V layouts; ``pool.gather_kv`` puts both in token
order). If layer 0's keys already differ, the store or the RoPE before it differ; if the first
layers agree and later ones drift, the attention outputs feeding them do.

Written for the real Gemma-3-270M's fp8 question (docs/benchmarks.md, "The real Gemma-3-270M on
the GPU": torch and triton part at the first token in float32 compute with fp8 KV, not with
float32 KV). Usage (GPU machine, the GGUF staged):
    KVFIT_GEMMA3_GGUF=/tmp/stage/g.gguf PYTHONPATH=src python3 benchmarks/engine/kv_bytes_diag.py \
        [--kv-dtype fp8_e4m3] [--dtype float32] [--tokens 256] [--backends torch,triton]
(``--device cpu --backends torch,torch`` checks the script itself on a CPU machine: no
difference. ``--backends torch,torch --device cuda,cpu`` compares the reference backend on the
GPU with itself on the CPU.)
Prints one line per layer: kind, max |k_a - k_b| / max |k_a|, the fraction of differing
elements, the same for v.
"""

from __future__ import annotations

import argparse
import os

import torch


def _stored(path, backend, kv_dtype, dtype, prompt, n_tokens, device):
    from kvfit.llm import LLM
    from kvfit.sampling_params import SamplingParams

    llm = LLM(path, attention_backend=backend, kv_dtype=kv_dtype, dtype=dtype, device=device,
              enforce_eager=True, num_pages=160, max_model_len=1200,
              max_num_batched_tokens=n_tokens, max_num_seqs=1, seed=3,
              enable_prefix_caching=False)
    eng = llm.engine
    eng.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    eng.step()  # the first prefill chunk: n_tokens tokens stored in every layer
    if device == "cuda":
        torch.cuda.synchronize()
    pool, req = eng.runner.pool, eng.requests["r"]
    sliding = pool.sliding_pages
    out = []
    for lid, spec in enumerate(pool.layers):
        pages = (sliding.table("r") if sliding is not None and spec.kind == "sliding"
                 else req.pages)
        t = torch.tensor(pages, dtype=torch.long, device=device)
        k, v = pool.gather_kv(lid, t, n_tokens, torch.float32)
        out.append((spec.kind, k.cpu(), v.cpu()))
    del llm
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--kv-dtype", default="fp8_e4m3")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--backends", default="torch,triton", help="a,b")
    p.add_argument("--device", default="cuda", help="one device, or a,b (e.g. cuda,cpu)")
    args = p.parse_args()
    path = os.environ["KVFIT_GEMMA3_GGUF"]
    be_a, be_b = args.backends.split(",")
    dev_a, dev_b = (args.device.split(",") * 2)[:2]
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(5, 262000, (700,), generator=g).tolist()
    a = _stored(path, be_a, args.kv_dtype, args.dtype, prompt, args.tokens, dev_a)
    b = _stored(path, be_b, args.kv_dtype, args.dtype, prompt, args.tokens, dev_b)
    print(f"{args.kv_dtype} KV, {args.dtype} compute, the first {args.tokens} tokens' K/V, "
          f"{be_a} on {dev_a} (a) against {be_b} on {dev_b} (b)")
    for lid, ((kind, ka, va), (_, kb, vb)) in enumerate(zip(a, b)):
        cells = []
        for x, y in ((ka, kb), (va, vb)):
            rel = ((x - y).abs().max() / x.abs().max().clamp_min(1e-30)).item()
            frac = (x != y).float().mean().item()
            cells.append(f"rel {rel:.2e}, {100 * frac:.3f}% differ")
        print(f"layer {lid:2d} {kind:7s}: k {cells[0]}; v {cells[1]}", flush=True)


if __name__ == "__main__":
    main()
