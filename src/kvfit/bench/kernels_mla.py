"""The MLA points of ``kvfit bench kernels``: our Triton MLA decode/prefill (kernels/mla.py) over
a paged latent cache in the DeepSeek-V2(-Lite) shape, random latents, pages of a request
scattered over the pool, several copies of the cache rotated so the timed inputs never sit in
L2. Decode reports latent bytes read / time against the copy bandwidth (the physical limit of
the weight-absorbed form: every latent byte is read once per (request, split), for all heads),
ours and, where FlashInfer imports and reads the slab (512 + 64, 16-bit or e4m3 latents), its
MLA kernel (``BatchMLAPagedAttentionWrapper``, FA3 on Hopper: the fi backend's MLA path), both
timed as CUDA-graph replays (the engine's decode; FlashInfer's Python ``run`` would otherwise
be timed too); prefill reports TFLOP/s of the absorbed form (QK over rank + rope, PV over rank).
"""

from __future__ import annotations

from functools import partial

import math

from kvfit.bench.kernels_common import L2_BYTES, graph_us, time_fi_into

# heads, kv_lora_rank, qk_rope_head_dim (config.json of DeepSeek-V2-Lite / DeepSeek-V2)
MLA_LAYOUTS = {"deepseek-v2-lite": (16, 512, 64), "deepseek-v2": (128, 512, 64)}


class LatentSet:
    """R copies of one paged latent cache ``[pages, P, rank + rope]`` and a shared block table."""

    def __init__(self, rank, rope, kv_dtype, batch, context, page_size, device, seed=0):
        import torch

        from kvfit.kvcache.dtypes import kv_format

        self.dtype = kv_format(kv_dtype).torch_dtype
        self.kv_dtype, self.rank, self.slab = kv_dtype, rank, rank + rope
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        self.pages_per_req = -(-context // page_size)
        num_pages = batch * self.pages_per_req + 1
        self.bytes = batch * context * self.slab * itemsize  # latent bytes one decode reads
        self.reps = max(1, min(16, math.ceil(4 * L2_BYTES / (num_pages * page_size * self.slab
                                                              * itemsize))))
        g = torch.Generator(device=device)
        g.manual_seed(seed)
        self.caches = []
        for _ in range(self.reps):
            t = torch.empty((num_pages, page_size, self.slab), dtype=self.dtype, device=device)
            step = max(1, (1 << 27) // (page_size * self.slab))
            for p0 in range(0, num_pages, step):
                chunk = torch.randn(t[p0:p0 + step].shape, generator=g, device=device)
                t[p0:p0 + step] = chunk.to(self.dtype)
            self.caches.append(t)
        perm = torch.randperm(num_pages - 1, generator=g, device=device).to(torch.int32) + 1
        self.block_table = perm[: batch * self.pages_per_req].view(batch, -1).contiguous()
        self.kv_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        self.batch, self.context, self.page_size = batch, context, page_size


def _decode_call(ls: LatentSet, heads: int, cfg, i: int = 0):
    """A callable running one ``mla_decode`` over copy ``i`` of the cache (fresh q, out)."""
    import torch

    from kvfit.kernels.mla import mla_decode

    cu = torch.arange(ls.batch + 1, dtype=torch.int32, device="cuda")
    q = torch.randn(ls.batch, heads, ls.slab, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(ls.batch, heads, ls.rank, device="cuda", dtype=torch.bfloat16)
    s = cfg.num_splits
    scratch = (torch.empty((ls.batch * heads * s, ls.rank), dtype=torch.float32, device="cuda"),
               torch.empty((ls.batch * heads * s,), dtype=torch.float32, device="cuda"))
    return lambda: mla_decode(q, ls.caches[i], ls.block_table, cu, ls.kv_lens, out, ls.rank,
                              0.1, cfg, scratch=scratch if s > 1 else None)


def warm_mla_decode(ls: LatentSet, heads: int, cfg) -> None:
    """One call (compiles the variant into the Triton cache), synchronized."""
    import torch

    _decode_call(ls, heads, cfg)()
    torch.cuda.synchronize()


def time_mla_decode(ls: LatentSet, heads: int, cfg, rep: int = 150,
                    graphs: bool = False) -> float:
    """Median µs of one ``mla_decode`` call (the merge included): ``do_bench`` over ``rep`` ms,
    or with ``graphs`` CUDA-graph replays (no host launch time)."""
    import triton

    fns = [_decode_call(ls, heads, cfg, i) for i in range(ls.reps)]
    if graphs:
        return graph_us(fns)
    return triton.testing.do_bench(rotating(fns), warmup=25, rep=rep, return_mode="median") * 1e3


def fi_mla_reason(ls: LatentSet, heads: int) -> str | None:
    """None when FlashInfer's MLA wrapper can read this latent set here, else why not."""
    from kvfit.attention.flashinfer_mla import SLAB_DIM

    try:
        import flashinfer.mla  # noqa: F401
    except Exception as e:  # noqa: BLE001 - not installed or broken
        return f"FlashInfer does not import ({type(e).__name__})"
    if ls.slab != SLAB_DIM:
        return f"FlashInfer's MLA reads 512 + 64 slabs, not {ls.slab}"
    if ls.kv_dtype not in ("bfloat16", "float16", "fp8_e4m3"):
        return f"FlashInfer's MLA reads 16-bit and e4m3 latents, not {ls.kv_dtype}"
    return None


def fi_mla_decode_calls(ls: LatentSet, heads: int, q, outs, sm_scale: float = 0.1):
    """Callables running FlashInfer's MLA decode (the fi backend's kernel, planned once for the
    whole batch) over copy i of the cache into ``outs[i]``, q ``[batch, heads, slab]`` bf16."""
    import torch
    from flashinfer.mla import BatchMLAPagedAttentionWrapper, MLAPlanMetadata

    major, _ = torch.cuda.get_device_capability()
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    w = BatchMLAPagedAttentionWrapper(ws, backend="fa3" if major == 9 else "fa2")
    cu = torch.arange(ls.batch + 1, dtype=torch.int32)
    w.plan(metadata=MLAPlanMetadata.csr(cu, cu * ls.pages_per_req,
                                        ls.block_table.reshape(-1).contiguous(),
                                        ls.kv_lens.cpu()),
           num_heads=heads, head_dim_ckv=ls.rank, head_dim_kpe=ls.slab - ls.rank,
           page_size=ls.page_size, causal=False, sm_scale=sm_scale,
           q_data_type=torch.bfloat16, kv_data_type=ls.dtype)
    scales = {} if ls.caches[0].element_size() == 2 else dict(ckv_scale=1.0, kpe_scale=1.0)
    return [lambda i=i: w.run(query=q, kv_cache=ls.caches[i], out=outs[i], **scales)
            for i in range(ls.reps)]


def time_fi_mla_decode(ls: LatentSet, heads: int) -> float:
    """Median µs of one FlashInfer MLA decode over the same pages, CUDA-graph replays."""
    import torch

    q = torch.randn(ls.batch, heads, ls.slab, device="cuda", dtype=torch.bfloat16)
    outs = [torch.empty(ls.batch, heads, ls.rank, device="cuda", dtype=torch.bfloat16)
            for _ in range(ls.reps)]
    return graph_us(fi_mla_decode_calls(ls, heads, q, outs))


def time_mla_prefill(ls: LatentSet, heads: int, q_len: int, cfg=None) -> float:
    """Median µs of one ``mla_prefill`` of ``q_len`` new tokens per request (``cfg``: the
    launch, default ``prefill_config``'s)."""
    import torch
    import triton

    from kvfit.kernels.mla import mla_prefill, order_mla_blocks, prefill_config

    cfg = cfg or prefill_config(heads, ls.dtype, torch.bfloat16)
    blocks = order_mla_blocks([q_len] * ls.batch, [ls.context] * ls.batch, heads, cfg.block_m,
                              "cuda")
    cu = torch.arange(ls.batch + 1, dtype=torch.int32, device="cuda") * q_len
    q = torch.randn(ls.batch * q_len, heads, ls.slab, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(ls.batch * q_len, heads, ls.rank, device="cuda", dtype=torch.bfloat16)
    fns = [lambda i=i: mla_prefill(q, ls.caches[i], ls.block_table, cu, ls.kv_lens, blocks, out,
                                   ls.rank, 0.1, cfg) for i in range(ls.reps)]
    return triton.testing.do_bench(rotating(fns), warmup=10, rep=100, return_mode="median") * 1e3


def rotating(fns):
    """One callable running ``fns`` in turn (each call the next copy: inputs never in L2)."""
    state = [0]

    def call():
        fns[state[0] % len(fns)]()
        state[0] += 1

    return call


def _page(args, kv_dtype: str, slab: int) -> int:
    """--page-size, else the page size the engine picks for the MLA pool on triton."""
    from kvfit.attention.triton_backend import TritonBackend

    return args.page_size or TritonBackend.default_page_size(kv_dtype, slab)


def run_mla_decode(args, layout: str, device, copy_bw, results) -> None:
    import torch

    from kvfit.kernels.mla import decode_config

    heads, rank, rope = MLA_LAYOUTS[layout]
    heads //= args.tensor_parallel_size  # one rank's query heads; the latent is whole
    for b in map(int, args.batches.split(",")):
        for ctx in map(int, args.contexts.split(",")):
            row = {}
            for kvd in args.kv_dtypes.split(","):
                ls = LatentSet(rank, rope, kvd, b, ctx, _page(args, kvd, rank + rope), device)
                if ls.bytes > args.max_gib * (1 << 30):
                    continue
                cfg = decode_config(b, heads, rank, ctx, ls.dtype, torch.bfloat16, rope=rope)
                us = time_mla_decode(ls, heads, cfg, graphs=True)
                rec = {"kind": "decode", "layout": layout, "kv_dtype": kvd, "batch": b,
                       "context": ctx, "kv_bytes": ls.bytes, "page_size": ls.page_size,
                       "ours_us": us, "ours_cfg": str(cfg),
                       "ours_tbps": ls.bytes / (us * 1e-6) / 1e12,
                       "ours_pct_copy": 100 * ls.bytes / (us * 1e-6) / copy_bw,
                       "ours_elem_per_s": ls.bytes / ls.caches[0].element_size() / (us * 1e-6)}
                row[kvd] = rec
                results.append(rec)
                line = (f"decode {layout:>16} {kvd:>9} b={b:<4} ctx={ctx:<6} ours {us:9.1f} us "
                        f"{rec['ours_tbps']:5.2f} TB/s ({rec['ours_pct_copy']:4.0f}% of copy) "
                        f"splits={cfg.num_splits}")
                why = fi_mla_reason(ls, heads)
                time_fi_into(rec, args, why, partial(time_fi_mla_decode, ls, heads))
                if "fi_us" in rec:
                    t = rec["fi_us"] * 1e-6
                    rec.update(fi_tbps=ls.bytes / t / 1e12,
                               fi_pct_copy=100 * ls.bytes / t / copy_bw)
                    line += (f" | fi {rec['fi_us']:9.1f} us {rec['fi_tbps']:5.2f} TB/s "
                             f"({rec['fi_pct_copy']:4.0f}% of copy)")
                elif why is None and "fi_error" in rec:  # tried and failed: say why
                    line += f" | fi failed: {rec['fi_error'][:120]}"
                print(line, flush=True)
                del ls
                torch.cuda.empty_cache()
            if "bfloat16" in row and "fp8_e4m3" in row:
                sp = row["bfloat16"]["ours_us"] / row["fp8_e4m3"]["ours_us"]
                row["fp8_e4m3"]["ours_fp8_speedup"] = sp
                line = f"    fp8/bf16 speedup: ours {sp:.2f}x"
                if "fi_us" in row["bfloat16"]:
                    best16 = min(row["bfloat16"]["ours_us"], row["bfloat16"]["fi_us"])
                    sp = best16 / row["fp8_e4m3"]["ours_us"]
                    row["fp8_e4m3"]["fp8_speedup_vs_best_bf16"] = sp
                    line += f", ours fp8 against the faster bf16 kernel {sp:.2f}x"
                print(line)


def run_mla_prefill(args, layout: str, device, results) -> None:
    heads, rank, rope = MLA_LAYOUTS[layout]
    heads //= args.tensor_parallel_size  # one rank's query heads; the latent is whole
    for ctx in map(int, args.prefill_contexts.split(",")):
        b = max(1, 16384 // ctx)
        for kvd in args.kv_dtypes.split(","):
            ls = LatentSet(rank, rope, kvd, b, ctx, _page(args, kvd, rank + rope), device)
            flops = b * 2 * heads * (2 * rank + rope) * ctx * (ctx + 1) / 2
            us = time_mla_prefill(ls, heads, ctx)
            rec = {"kind": "prefill", "layout": layout, "kv_dtype": kvd, "batch": b,
                   "context": ctx, "flops": flops, "page_size": ls.page_size, "ours_us": us,
                   "ours_tflops": flops / (us * 1e-6) / 1e12}
            print(f"prefill {layout:>16} {kvd:>9} b={b:<3} len={ctx:<6} ours {us:9.1f} us "
                  f"{rec['ours_tflops']:6.1f} TFLOP/s (absorbed form)", flush=True)
            results.append(rec)
            del ls
