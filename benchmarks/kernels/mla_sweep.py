"""Launch-choice sweep of the MLA decode kernel (kernels/mla.py) on the DeepSeek-V2-Lite shape:
for each (KV dtype, batch, context) point, time ``decode_config``'s choice and the listed
(block_n, num_warps, num_stages) variants (split count from the same wave rule), print one table
of µs and latent TB/s (% of the measured copy bandwidth). Used to pick ``decode_config``'s tiles.

    python3 benchmarks/kernels/mla_sweep.py --points bfloat16:4:32768,fp8_e4m3:4:32768 \
        --variants 32:4:2,32:8:3,64:8:2
"""

from __future__ import annotations

import argparse
import dataclasses
import json


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--points", default="bfloat16:4:32768,fp8_e4m3:4:32768")
    p.add_argument("--variants", default="",
                   help="[KIND:]block_n:warps:stages[:bytes|:per_sm],... (default only; KIND "
                        "letters: g the Gluon kernel (64:4:STAGES), gq it with e4m3 logits by fp8 MMAs, gp the pipelined e4m3 kernel (64:4:2), gr the register-operand 8-bit kernel (64:4:1[:per_sm]), g8/gq8/gp8 them converting 8 values a thread, r the row kernel (heads as "
                        "M), s the swapped kernel (heads as N), q its fp8 x fp8 logits (e4m3), p its register prefetch of the next "
                        "tile, h its page ids of 1024 tokens loaded before their tiles; per_sm: "
                        "programs per SM for the split rule; bytes: fp8 P@C operand of the row "
                        "kernel from the byte tile)")
    p.add_argument("--fp8-variants", default=None,
                   help="the variants of the fp8 points (default: --variants)")
    p.add_argument("--rep", type=int, default=150, help="do_bench ms per timing")
    p.add_argument("--no-default", action="store_true", help="only the listed variants")
    p.add_argument("--warm", action="store_true",
                   help="one call per variant, no timing (compiles into the Triton cache; run "
                        "one process per variant in parallel before the timed sweep)")
    p.add_argument("--prefill-points", default="", help="kv_dtype:batch:prompt_len,...")
    p.add_argument("--prefill-variants", default="", help="block_m:block_n:warps:stages,...")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--page-size", type=int, default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    import torch

    from kvfit.bench.kernels_common import copy_bandwidth
    from kvfit.bench.kernels_mla import (LatentSet, time_mla_decode, time_mla_prefill,
                                         warm_mla_decode)
    from kvfit.kernels.mla import MLAConfig, decode_config, prefill_config

    bw = copy_bandwidth(torch.device("cuda"))
    print(f"GPU {torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    rows = []
    for point in args.points.split(","):
        kvd, b, ctx = point.split(":")
        b, ctx = int(b), int(ctx)
        page = args.page_size or (32 if kvd.startswith("fp8") else 16)
        ls = LatentSet(512, 64, kvd, b, ctx, page, "cuda")
        base = decode_config(b, args.heads, 512, ctx, ls.dtype, torch.bfloat16)
        cfgs = [] if args.no_default else [("default", base)]
        variants = args.variants
        if kvd.startswith("fp8") and args.fp8_variants is not None:
            variants = args.fp8_variants
        for v in filter(None, variants.split(",")):
            parts = v.split(":")  # [KIND:]block_n:warps:stages[:bytes]
            kind = parts.pop(0) if not parts[0].isdigit() else ""
            bn, w, st = map(int, parts[:3])
            per_sm = int(parts[3]) if len(parts) > 3 and parts[3].isdigit() else None
            if kind == "gr":  # the register-operand 8-bit kernel (mla_decode_fp8_regs); a
                # fifth field: tiles ahead asked of L2 (gr:64:4:1:2:3)
                cfg = decode_config(b, args.heads, 512, ctx, ls.dtype, torch.bfloat16,
                                    gluon=True, regs=True, programs_per_sm=per_sm)
                if len(parts) > 4:
                    cfg = dataclasses.replace(cfg, l2_ahead=int(parts[4]))
            elif kind.rstrip("8") in ("g", "gq", "gp"):  # Gluon (64:4:stages); gq fp8 logits,
                # gp pipelined; a trailing 8: 8 values a thread in the conversion (conv_vec)
                base = kind.rstrip("8")
                cfg = decode_config(b, args.heads, 512, ctx, ls.dtype, torch.bfloat16,
                                    gluon=True, num_stages=st, programs_per_sm=per_sm,
                                    qfp8=base == "gq", pipe=base == "gp", regs=False,
                                    conv_vec=8 if kind.endswith("8") else 16)
            elif kind == "r":  # the row kernel (heads as M)
                cfg = decode_config(b, args.heads, 512, ctx, ls.dtype, torch.bfloat16,
                                    block_n=bn, num_warps=w, num_stages=st, swap=False,
                                    programs_per_sm=per_sm)
            elif kind:  # s: swapped, q: + fp8 logits, p: + register prefetch (sp, sq, sqp, ...)
                cfg = decode_config(b, args.heads, 512, ctx, ls.dtype, torch.bfloat16,
                                    block_n=bn, num_warps=w, num_stages=st, swap=True,
                                    qfp8="q" in kind, prefetch="p" in kind,
                                    hoist=max(1, 1024 // bn) if "h" in kind else 0,
                                    programs_per_sm=per_sm)
            else:
                cfg = dataclasses.replace(decode_config(b, args.heads, 512, ctx, ls.dtype,
                                                        torch.bfloat16, swap=False),
                                          block_n=bn, num_warps=w, num_stages=st,
                                          pairs="bytes" not in parts)
            cfgs.append((v, cfg))
        for name, cfg in cfgs:
            try:
                if args.warm:
                    warm_mla_decode(ls, args.heads, cfg)
                    print(f"warm {kvd} {name} ok", flush=True)
                    continue
                us = time_mla_decode(ls, args.heads, cfg, rep=args.rep)
            except Exception as e:  # noqa: BLE001 - a variant that does not compile/fit
                print(f"{kvd:>9} b={b:<3} ctx={ctx:<6} {name:>9}: {type(e).__name__} "
                      f"{str(e)[:120]}", flush=True)
                continue
            tbps = ls.bytes / (us * 1e-6) / 1e12
            rows.append({"kv_dtype": kvd, "batch": b, "context": ctx, "variant": name,
                         "cfg": str(cfg), "us": us, "tbps": tbps,
                         "pct_copy": 100 * tbps * 1e12 / bw})
            print(f"{kvd:>9} b={b:<3} ctx={ctx:<6} {name:>11} splits={cfg.num_splits:<3} "
                  f"{us:9.1f} us {tbps:5.2f} TB/s ({100 * tbps * 1e12 / bw:4.0f}% of copy)",
                  flush=True)
        del ls
        torch.cuda.empty_cache()
    for point in filter(None, args.prefill_points.split(",")):
        kvd, b, n = point.split(":")
        b, n = int(b), int(n)
        page = args.page_size or (32 if kvd.startswith("fp8") else 16)
        ls = LatentSet(512, 64, kvd, b, n, page, "cuda")
        flops = b * 2 * args.heads * (2 * 512 + 64) * n * (n + 1) / 2
        cfgs = [("default", prefill_config(args.heads, ls.dtype, torch.bfloat16))]
        for v in filter(None, args.prefill_variants.split(",")):
            cfgs.append((v, MLAConfig(*map(int, v.split(":")))))
        for name, cfg in cfgs:
            try:
                us = time_mla_prefill(ls, args.heads, n, cfg)
            except Exception as e:  # noqa: BLE001
                print(f"prefill {kvd:>9} b={b} len={n} {name}: {type(e).__name__} "
                      f"{str(e)[:120]}", flush=True)
                continue
            rows.append({"kind": "prefill", "kv_dtype": kvd, "batch": b, "len": n,
                         "variant": name, "cfg": str(cfg), "us": us,
                         "tflops": flops / (us * 1e-6) / 1e12})
            print(f"prefill {kvd:>9} b={b:<3} len={n:<6} {name:>12} {us:9.1f} us "
                  f"{flops / (us * 1e-6) / 1e12:6.1f} TFLOP/s (absorbed)", flush=True)
        del ls
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_bw": bw, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
