#!/usr/bin/env bash
# Reproduces the published figures: every table of docs/benchmarks.md and the measurements that
# docs/kernels.md cites. Run from anywhere in the repository on the GPU machine (one H200 for the
# published figures); `quality` runs on any machine (CPU).
#
#   bash benchmarks/gpu/reproduce.sh [TARGET ...]        (default: seed kernels)
#
# Each target writes $OUT/<name>/ (OUT defaults to ./out) where <name> is the stem of the file in
# benchmarks/results/h200/ that holds the published run, plus <name>.log with the printed table.
# Device minutes per target on the H200 (device calls are limited to 10 minutes: run the groups
# one per call):
#   seed-defaults      `kvfit bench seed`, no engine flags (auto backend and page size)      ~3
#   seed-triton        the same with --attention-backend triton                             ~3
#   seed-fp8-page32    fp8 at pages of 32 on the triton and fi backends                     ~3
#   seed-batch1        batch 1 and 64 at 1k/16k (triton, pages of 16) + HF generate()       ~3
#   decode-page16      `kvfit bench kernels` decode grid at pages of 16, ours vs FlashInfer ~4
#   decode-page32      decode grid at pages of 32 (the fp8 default), ours vs FlashInfer    ~2
#   decode-page-size   fp8 decode at pages of 32 and 64, Qwen3 and Llama heads             ~2
#   prefill            `kvfit bench kernels --no-decode`: prefill vs FlashInfer fa2          ~2
#   studies            ncu, profiler and launch sweeps of docs/kernels.md (needs ncu)       ~10
#   quality            the CPU quality tables (`kvfit bench quality`): hours on 2 CPU cores
#   batch-invariance   rows_gemm vs cuBLAS rows across batch sizes and tiles, their speed, and
#                      the batch-1/64 decode step (bf16, fp8)                                ~2
#   gemv-rows          the GEMV of one-token steps (tenth session): tiles per rows per program,
#                      28 layers + LM head against cuBLAS, decode_gemv off/on at batch 1     ~5
#   engine-host        issue 13's engine path (seventh session): engine steps at batch 256/1,
#                      the sampler fused vs torch ops, bench throughput fp8/bf16, serve vs
#                      offline at concurrency 64                                            ~8
#   prefix-probe       issue 15's cached-4k probe: linked prefill graphs per growth, the
#                      probe's host split, trace and cProfile, extend-split launch shapes    ~4
#   mla-fi             issue 18's MLA through FlashInfer (fifteenth session): the MLA decode
#                      kernels, ours vs FlashInfer's, the plan's host cost, bf16 end to end on
#                      8 V2-Lite layers with each backend, the fi MLA GPU tests             ~6
#   mla-gluon          issue 18's Gluon MLA decode (sixteenth session): its GPU tests, the
#                      sweep against the Triton kernels, ours vs FlashInfer's MLA, end to end
#                      on 8 V2-Lite layers with the Gluon kernel on and off                 ~6
#   int4-gluon         issue 14's int4 decode in Gluon (seventeenth session): its GPU tests, the
#                      kernel beside fp8 and the Triton int4 kernel (CUDA-graph replays), int4
#                      and fp8 end to end with the Gluon kernel on and off, MLA fp8 vs bf16 e2e ~8
#   gluon-8bit         issue 14's 8-bit decode in Gluon (nineteenth session): its GPU tests,
#                      the sweep against the Triton kernels (benchmarks/gpu/gluon_8bit.txt),
#                      fp8 and int8 end to end with the kernel on and off                    ~3
#   mla-regs           issue 18's register-operand MLA decode (22nd/23rd sessions): its GPU
#                      tests, the sweep against the pipelined kernel, the ablation of its parts
#                      and its mma.sync candidate (checked against it),
#                      ncu of one launch (when ncu is there), 8 V2-Lite layers end to end     ~5
#   mla-splits         issue 18's MLA decode at each split count (24th session): the call as a
#                      graph replay and its decode and merge kernels' device time, e4m3 and bf16
#                      at 4 x 32k, 8 x 16k, 32 x 16k, 64 x 32k (benchmarks/kernels/mla_splits.py)  ~2
#   stalls             where the warps of the Hopper decode kernels wait, by instruction (ncu
#                      source counters tabulated by benchmarks/kernels/ncu_stalls.py): the MLA
#                      register kernel (e4m3, 64 x 32k), the int4 register kernel (128-d,
#                      64 x 2k) and the 8-bit Gluon decode (64-d, 128 x 16k); needs ncu     ~3
#   exchange           issue 14's one-barrier tile maximum in the 8-bit and int4 register
#                      decodes (EXCHANGE_MAX, on since 2026-12-06): its GPU tests (outputs equal
#                      to the default's), the 8-bit (decode_sweep.py, 64-d and 128-d) and int4
#                      (int4_decode_bench.py --graph --regs) kernel timings with it off and on ~6
#   int4-l2            issue 14's L2 prefetch in the int4 register decode (REGS_L2_AHEAD, off
#                      until timed): its GPU test (outputs equal with and without it), the
#                      kernel table (int4_decode_bench.py --graph --regs) with 0, 2 and 3 tiles
#                      ahead, and bench seed at 64 x 16k with 0 and 2                         ~8
#   mla-l2             issue 18's L2 prefetch in the MLA register decode (GLUON_REGS_L2_AHEAD,
#                      off until timed): its GPU test (the same bits with and without it) and
#                      mla_sweep.py with 0, 2 and 3 tiles ahead at 4 x 16k .. 64 x 32k, bf16
#                      beside it for the ratio                                                ~5
#   g8-l2              issue 14's L2 prefetch in the Gluon 8-bit decode (decode_8bit_gluon.L2_AHEAD,
#                      off until timed): its GPU test (the same bits) and decode_sweep.py at
#                      64-d and 128-d heads, fp8 and int8, with 0, 2 and 3 tiles ahead        ~6
#   tests              the GPU tests (tests/gpu)                                            ~4
# Groups: seed = the four seed-*; kernels = decode-page16 decode-page32 decode-page-size prefill.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
kvfit() { python3 -m kvfit.cli "$@"; }

gpu_env() {
  [ -n "${_GPU_ENV:-}" ] && return 0
  # shellcheck source=benchmarks/gpu/setup.sh
  source benchmarks/gpu/setup.sh || { echo "GPU setup failed"; exit 1; }
  _GPU_ENV=1
}

# run NAME CMD...: CMD's output in $OUT/NAME.log (its files go where CMD's --out or OUT says)
run() {
  local name=$1; shift
  echo "== $name: $*"
  "$@" > "$OUT/$name.log" 2>&1
  echo "   rc=$? after ${SECONDS}s"; grep -E "^\|" "$OUT/$name.log" | head -40
}

# table NAME KIND: the markdown table of docs/benchmarks.md from a `kvfit bench kernels` run
table() {
  python3 benchmarks/kernels/tables.py "$OUT/$1/kernels.json" "$2" | tee "$OUT/$1.md"
}

SEED=(bench seed --kv-dtypes bfloat16,fp8_e4m3 --contexts 16384,32768 --batches 16,64 --steps 24
      --prefill-len 2048)

target() {
  case $1 in
    seed) for t in seed-defaults seed-triton seed-fp8-page32 seed-batch1; do target $t; done ;;
    kernels) for t in decode-page16 decode-page32 decode-page-size prefill; do target $t; done ;;
    seed-defaults) gpu_env
      run seed_default_flags kvfit "${SEED[@]}" --out "$OUT/seed_default_flags" ;;
    seed-triton) gpu_env
      run seed_triton_backend kvfit "${SEED[@]}" --attention-backend triton \
        --out "$OUT/seed_triton_backend" ;;
    seed-fp8-page32) gpu_env
      for be in triton fi; do
        run seed_fp8_page32_$be kvfit bench seed --kv-dtypes fp8_e4m3 --contexts 16384,32768 \
          --batches 16,64 --steps 24 --prefill-len 2048 --page-size 32 --attention-backend $be \
          --out "$OUT/seed_fp8_page32_$be"
      done ;;
    seed-batch1) gpu_env
      run seed_hf_baseline kvfit bench seed --kv-dtypes bfloat16,fp8_e4m3 --contexts 1024,16384 \
        --batches 1,64 --steps 32 --prefill-len 8192 --attention-backend triton --page-size 16 \
        --baseline hf --out "$OUT/seed_hf_baseline" ;;
    decode-page16) gpu_env
      run decode_vs_flashinfer_page16 kvfit bench kernels --page-size 16 --no-prefill \
        --out "$OUT/decode_vs_flashinfer_page16"
      table decode_vs_flashinfer_page16 decode ;;
    decode-page32) gpu_env
      run decode_vs_flashinfer_page32 kvfit bench kernels --page-size 32 --batches 8,32,128 \
        --contexts 4096,16384,65536 --no-prefill --out "$OUT/decode_vs_flashinfer_page32"
      table decode_vs_flashinfer_page32 decode ;;
    decode-page-size) gpu_env
      for ps in 32 64; do
        run decode_fp8_page_size_$ps kvfit bench kernels --page-size $ps \
          --layouts qwen3-1.7b,llama-3.1-8b --batches 32,128 --contexts 16384 --no-prefill \
          --no-fi --out "$OUT/decode_fp8_page_size_$ps"
        grep -E "^decode" "$OUT/decode_fp8_page_size_$ps.log"
      done ;;
    prefill) gpu_env
      run prefill_vs_flashinfer kvfit bench kernels --no-decode --out "$OUT/prefill_vs_flashinfer"
      table prefill_vs_flashinfer prefill ;;
    studies) gpu_env; studies ;;
    quality) quality ;;
    batch-invariance) gpu_env
      TILES="16,16,256,4,4;16,16,256,4,4,0,2;16,16,256,4,4,0,4;16,16,512,4,3,0,2;16,16,128,4,4,0,4;16,32,256,4,4;16,32,256,4,4,0,2;16,64,128,4,3;16,128,128,4,3,1;32,64,128,4,3;64,64,64,4,3;64,128,64,4,3,1;64,128,64,8,3;64,64,64,4,3,0,2;64,64,128,4,3,0,4;128,64,64,8,3,0,2"
      INV="16,16,256,4,4;16,64,128,4,3;64,64,64,4,3;128,64,64,8,3;16,128,128,4,3,1;64,128,64,4,3,1;16,16,256,4,4,0,2"
      python3 benchmarks/kernels/rows_precompile.py --model-shapes --pdl off,on --tiles "$TILES" \
        --variants plain,norm_add,gated --workers 15
      run batch_invariance_probe python3 benchmarks/kernels/rows_gemm_probe.py \
        --parts inv,time,chain --ms 1,2,3,8,33,64,256 --time-ms 1,64,256 --reps 20 \
        --tiles "$TILES" --inv-tiles "$INV" --json "$OUT/batch_invariance_probe.json"
      for kvd in bfloat16 fp8_e4m3; do
        run batch_invariance_step_$kvd python3 benchmarks/engine/ab_decode_step.py --label b1v \
          --kv-dtypes $kvd --points 1x1024,64x1024,1x16384 --steps 32 --repeats 3 --overlapped
      done ;;
    gemv-rows) gpu_env
      run gemv_rows_sweep python3 benchmarks/kernels/gemv_rows_sweep.py --json "$OUT/tiles.json"
      run gemv_rows_chain python3 benchmarks/kernels/gemv_rows_bench.py --tiles "$OUT/tiles.json" \
        --block-ms 1,2,4,8 --ms 1,2,3,4,6,8,12,16
      for path in off gemv; do
        run decode_gemv_$path python3 benchmarks/engine/ab_decode_step.py --label $path \
          --small-path $path --kv-dtypes bfloat16,fp8_e4m3 --points 1x1024,1x16384 --steps 32 \
          --repeats 2 --overlapped
      done ;;
    engine-host) gpu_env
      local M=src/kvfit/bench/configs/qwen3-1.7b.json
      run profile_engine_after python3 benchmarks/engine/profile_step.py fp8_e4m3 triton engine
      for n in 256 64 1; do
        run sampler_fused_vs_ops_$n python3 benchmarks/kernels/sampler_bench.py --fused-vs-ops \
          --batch $n
      done
      for kvd in fp8_e4m3 bfloat16; do
        run throughput_$kvd kvfit bench throughput --model $M --load-format dummy --kv-dtype $kvd \
          --output-json "$OUT/throughput_$kvd.json"
        grep -E "^output|^roofline" "$OUT/throughput_$kvd.log"
      done
      run serve_fp8_round3 kvfit bench serve --model $M --load-format dummy --kv-dtype fp8_e4m3 \
        --num-prompts 256 --input-len 1024 --output-len 256 --max-concurrency 64 --offline
      grep -E "throughput|TTFT|TPOT|server/offline" "$OUT/serve_fp8_round3.log" ;;
    prefix-probe) gpu_env
      local M=src/kvfit/bench/configs/qwen3-1.7b.json
      run probe_links python3 benchmarks/serve/probe_links.py --model $M --growths 0,3,1,2
      run probe_profile python3 benchmarks/serve/profile_probe.py --model $M --kv-dtype fp8_e4m3 \
        --repeats 7 --random-reps 0 --out-dir "$OUT/probe_profile"
      grep -E "^probe|cached probe" "$OUT/probe_profile.log"
      run extend_split python3 benchmarks/kernels/extend_split_bench.py --kv-dtypes fp8_e4m3 \
        --q-lens 128 --ctxs 4224 --variants plain "s8 t8" "s8 t8 m128 w8" "s16 t4" "s16 t4 st3" ;;
    mla-fi) gpu_env
      run mla_fi_check python3 benchmarks/kernels/mla_fi_bench.py
      run mla_kernels kvfit bench kernels --layouts deepseek-v2-lite --kv-dtypes bfloat16,fp8_e4m3 \
        --batches 4,32,64 --contexts 4096,16384,32768 --no-prefill --max-gib 8 \
        --out "$OUT/mla_kernels"
      grep -E "^decode|speedup" "$OUT/mla_kernels.log"
      run mla_plan_cost python3 benchmarks/kernels/fi_mla_plan_cost.py
      for i in 1 2; do for be in triton fi; do  # alternating, twice (host noise)
        run "mla_seed_${be}_$i" kvfit bench seed \
          --model benchmarks/gpu/deepseek-v2-lite-8layers.json --kv-dtypes bfloat16 \
          --contexts 16384 --batches 1,8,64 --steps 10 --prefill-len 1024 \
          --attention-backend $be --out "$OUT/mla_seed_${be}_$i"
      done; done
      run mla_fi_tests python3 -m pytest -q -p no:cacheprovider tests/gpu/test_mla_fi_cuda.py
      tail -3 "$OUT/mla_fi_tests.log" ;;
    mla-gluon) gpu_env
      run mla_gluon_tests python3 -m pytest -q -p no:cacheprovider tests/gpu/test_mla_decode_gluon.py
      tail -3 "$OUT/mla_gluon_tests.log"
      run mla_gluon_sweep python3 benchmarks/kernels/mla_sweep.py \
        --points fp8_e4m3:4:32768,fp8_e4m3:32:16384,fp8_e4m3:64:4096,bfloat16:4:32768,bfloat16:32:16384,bfloat16:64:4096 \
        --variants g:64:4:2,sh:32:4:4 --fp8-variants g:64:4:3,gq:64:4:3,gp:64:4:2,gp8:64:4:2,r:64:8:3 --rep 60 \
        --json "$OUT/mla_gluon_sweep.json"
      run mla_kernels kvfit bench kernels --layouts deepseek-v2-lite --kv-dtypes bfloat16,fp8_e4m3 \
        --batches 4,32,64 --contexts 4096,16384,32768 --no-prefill --max-gib 8 \
        --out "$OUT/mla_kernels"
      grep -E "^decode|speedup" "$OUT/mla_kernels.log"
      for v in on off; do  # the Gluon default (e4m3: pipelined), then the Triton kernels
        K=""; [ $v = off ] && K="kvfit.kernels.mla:GLUON_DTYPES=()"
        run "mla_seed_gluon_$v" python3 benchmarks/engine/with_knobs.py "$K" - bench seed \
          --model benchmarks/gpu/deepseek-v2-lite-8layers.json --kv-dtypes bfloat16,fp8_e4m3 \
          --contexts 16384 --batches 1,32 --steps 10 --prefill-len 1024
      done ;;
    mla-regs) gpu_env
      run mla_regs_tests python3 -m pytest -q -p no:cacheprovider tests/gpu/test_mla_decode_gluon.py \
        -k "regs or graph"
      tail -3 "$OUT/mla_regs_tests.log"
      run mla_regs_sweep python3 benchmarks/kernels/mla_sweep.py \
        --points fp8_e4m3:4:32768,fp8_e4m3:32:16384,fp8_e4m3:64:32768,fp8_e5m2:32:16384,bfloat16:32:16384,bfloat16:64:16384 \
        --variants g:64:4:2 --fp8-variants gr:64:4:1,gp8:64:4:2,g8:64:4:3 --rep 60 --no-default \
        --json "$OUT/mla_regs_sweep.json"
      run mla_regs_ablation python3 benchmarks/kernels/mla_regs_ablation.py \
        --points fp8_e4m3:32:16384,fp8_e4m3:64:32768,fp8_e4m3:4:32768 --rep 40 \
        --json "$OUT/mla_regs_ablation.json"
      if command -v ncu >/dev/null; then  # the profile and where its warps wait, by instruction
        run mla_regs_ncu ncu --clock-control none --kernel-name regex:_mla_decode_fp8_regs \
          --launch-skip 2 --launch-count 1 --section SpeedOfLight --section Occupancy \
          --section WarpStateStats --section ComputeWorkloadAnalysis --section SourceCounters \
          -o "$OUT/mla_regs_ncu" -f python3 benchmarks/kernels/ncu_mla.py fp8_e5m2 32 16384
        ncu -i "$OUT/mla_regs_ncu.ncu-rep" --page details > "$OUT/mla_regs_ncu_details.txt" 2>&1
        ncu -i "$OUT/mla_regs_ncu.ncu-rep" --page source --csv --print-source sass \
          > "$OUT/mla_regs_ncu_source.csv" 2>&1
        python3 benchmarks/kernels/ncu_stalls.py "$OUT/mla_regs_ncu_source.csv" --top 25 \
          | tee "$OUT/mla_regs_ncu_stalls.md"
        rm -f "$OUT/mla_regs_ncu.ncu-rep" "$OUT/mla_regs_ncu_source.csv"
      fi
      run mla_regs_seed kvfit bench seed --model benchmarks/gpu/deepseek-v2-lite-8layers.json \
        --kv-dtypes bfloat16,fp8_e4m3,fp8_e5m2 --contexts 16384 --batches 1,32 --steps 10 \
        --prefill-len 1024 --out "$OUT/mla_regs_seed" ;;
    int4-gluon) gpu_env
      run int4_gluon_tests python3 -m pytest -q -p no:cacheprovider --tb=short -rf \
        tests/gpu/test_int4_triton.py tests/gpu/test_int4_decode.py
      tail -3 "$OUT/int4_gluon_tests.log"
      run int4_gluon_kernel python3 benchmarks/kernels/int4_decode_bench.py --graph --gluon \
        --json "$OUT/int4_gluon_kernel.json"
      for v in on off; do  # the Gluon default, then the Triton int4 kernel
        K=""; [ $v = off ] && K="kvfit.kernels.decode_int4:GLUON=False"
        run "int4_seed_gluon_$v" python3 benchmarks/engine/with_knobs.py "$K" - bench seed \
          --kv-dtypes fp8_e4m3,int4 --contexts 16384 --batches 1,64 --steps 24 \
          --prefill-len 2048 --attention-backend triton
      done
      run mla_seed_fp8 kvfit bench seed --model benchmarks/gpu/deepseek-v2-lite-8layers.json \
        --kv-dtypes bfloat16,fp8_e4m3 --contexts 16384 --batches 32,64 --steps 10 \
        --prefill-len 1024 ;;
    gluon-8bit) gpu_env
      run gluon_8bit_tests python3 -m pytest -q -n 8 -p no:cacheprovider --tb=short -rf \
        tests/gpu/test_decode_8bit_gluon.py
      tail -3 "$OUT/gluon_8bit_tests.log"
      (cd benchmarks/kernels && OUT_DIR="$OUT" run gluon_8bit_sweep python3 decode_sweep.py \
        --jobs 12 $(grep -v '^#' ../gpu/gluon_8bit.txt))
      local on="{'H100': {('fp8', 64), ('fp8', 128), ('fp8', 256), ('int8', 64), ('int8', 128),"
      on+=" ('int8', 256)}, 'H200': {('fp8', 64), ('fp8', 128), ('fp8', 256), ('int8', 64),"
      on+=" ('int8', 128), ('int8', 256)}}"
      for v in off on; do  # the Triton kernels, then the Gluon kernel for every listed pair
        K="kvfit.kernels.decode_8bit_gluon:DEFAULT_ON={}"
        [ $v = on ] && K="kvfit.kernels.decode_8bit_gluon:DEFAULT_ON=$on"
        run "gluon_8bit_seed_$v" python3 benchmarks/engine/with_knobs.py "$K" - bench seed \
          --kv-dtypes fp8_e4m3,int8 --contexts 16384 --batches 1,64 --steps 16 \
          --prefill-len 1024 --attention-backend triton
      done ;;
    mla-splits) gpu_env
      run mla_splits python3 benchmarks/kernels/mla_splits.py \
        --points fp8_e4m3:4:32768,bfloat16:4:32768,fp8_e4m3:8:16384,bfloat16:8:16384,fp8_e4m3:32:16384,bfloat16:32:16384,fp8_e4m3:64:32768,bfloat16:64:32768 \
        --splits 4,8,16,32,64 --json "$OUT/mla_splits.json" ;;
    stalls) gpu_env
      command -v ncu >/dev/null || { echo "stalls: ncu is not installed"; return; }
      ncu_stalls mla_regs_stalls _mla_decode_fp8_regs 2 \
        python3 benchmarks/kernels/ncu_mla.py fp8_e4m3 64 32768
      ncu_stalls int4_regs_stalls _int4_decode_regs 3 \
        python3 benchmarks/kernels/int4_decode_bench.py --only 0 --regs
      ncu_stalls gluon_8bit_stalls _decode_8bit_gluon 3 \
        python3 benchmarks/kernels/decode_sweep.py smollm2:128x16384:fp8_e4m3:16:HDN:gluon=1 ;;
    exchange) gpu_env
      run exchange_tests python3 -m pytest -q -p no:cacheprovider --tb=short -rf \
        tests/gpu/test_decode_8bit_gluon.py tests/gpu/test_int4_decode.py -k exchanged
      tail -3 "$OUT/exchange_tests.log"
      for on in False True; do
        (export OUT_DIR="$OUT/exchange_8bit_$on"; mkdir -p "$OUT_DIR"
         with_flag kvfit.kernels.decode_8bit_gluon "$on" "exchange_8bit_$on" \
           benchmarks/kernels/decode_sweep.py --jobs 4 \
           qwen3-1.7b:32x16384:fp8_e4m3:32:HDN:gluon=1 qwen3-1.7b:32x16384:int8:32:HDN:gluon=1 \
           smollm2:128x16384:fp8_e4m3:16:HDN:gluon=1 smollm2:128x16384:int8:16:HDN:gluon=1 \
           qwen3-1.7b:1x16384:fp8_e4m3:32:HDN:gluon=1)
        with_flag kvfit.kernels.decode_int4 "$on" "exchange_int4_$on" \
          benchmarks/kernels/int4_decode_bench.py --graph --regs \
          --json "$OUT/exchange_int4_$on.json"
      done ;;
    int4-l2) gpu_env
      run int4_l2_tests python3 -m pytest -q -p no:cacheprovider --tb=short -rf \
        tests/gpu/test_int4_decode.py -k "l2_prefetch or regs_matches"
      tail -3 "$OUT/int4_l2_tests.log"
      for a in 0 2 3; do
        with_setting kvfit.kernels.decode_int4 REGS_L2_AHEAD "{64: $a, 128: $a, 256: $a}" \
          "int4_l2_$a" benchmarks/kernels/int4_decode_bench.py --graph --regs \
          --json "$OUT/int4_l2_$a.json"
      done
      for a in 0 2; do
        run "int4_l2_seed_$a" python3 benchmarks/engine/with_knobs.py \
          "kvfit.kernels.decode_int4:REGS_L2_AHEAD={64: $a, 128: $a, 256: $a}" - bench seed \
          --kv-dtypes fp8_e4m3,int4 --contexts 16384 --batches 1,64 --steps 24 \
          --prefill-len 2048 --attention-backend triton
      done ;;
    mla-l2) gpu_env
      run mla_l2_tests python3 -m pytest -q -p no:cacheprovider --tb=short -rf \
        tests/gpu/test_mla_decode_gluon.py -k "l2_prefetch or regs_decode"
      tail -3 "$OUT/mla_l2_tests.log"
      run mla_l2_sweep python3 benchmarks/kernels/mla_sweep.py \
        --points fp8_e4m3:4:16384,bfloat16:4:16384,fp8_e4m3:4:32768,bfloat16:4:32768,fp8_e4m3:8:32768,bfloat16:8:32768,fp8_e4m3:32:16384,bfloat16:32:16384,fp8_e4m3:64:32768,bfloat16:64:32768 \
        --variants g:64:4:2 --fp8-variants gr:64:4:1:2:0,gr:64:4:1:2:2,gr:64:4:1:2:3 \
        --rep 60 --no-default --json "$OUT/mla_l2_sweep.json" ;;
    g8-l2) gpu_env
      run g8_l2_tests python3 -m pytest -q -p no:cacheprovider --tb=short -rf \
        tests/gpu/test_decode_8bit_gluon.py -k "l2_prefetch"
      tail -3 "$OUT/g8_l2_tests.log"
      for a in 0 2 3; do  # (the sweep's compile workers do not see the setting: one job)
        (export OUT_DIR="$OUT/g8_l2_$a"; mkdir -p "$OUT_DIR"
         with_setting kvfit.kernels.decode_8bit_gluon L2_AHEAD "{64: $a, 128: $a, 256: $a}" \
           "g8_l2_$a" benchmarks/kernels/decode_sweep.py --jobs 1 \
           smollm2:128x16384:fp8_e4m3:16:HDN:gluon=1 smollm2:128x16384:int8:16:HDN:gluon=1 \
           smollm2:32x16384:fp8_e4m3:16:HDN:gluon=1 qwen3-1.7b:32x16384:fp8_e4m3:32:HDN:gluon=1 \
           qwen3-1.7b:32x16384:int8:32:HDN:gluon=1 qwen3-1.7b:4x16384:fp8_e4m3:32:HDN:gluon=1)
      done ;;
    tests) gpu_env
      run gpu_tests python3 -m pytest -q -n 14 -p no:cacheprovider --tb=short -rf tests/gpu
      tail -3 "$OUT/gpu_tests.log" ;;
    *) echo "unknown target $1; see the header of $0"; exit 2 ;;
  esac
}

with_flag() {  # MODULE VALUE NAME SCRIPT ARGS...: SCRIPT run with MODULE.EXCHANGE_MAX = VALUE
  local mod=$1 val=$2; shift 2
  with_setting "$mod" EXCHANGE_MAX "$val" "$@"
}

with_setting() {  # MODULE ATTR VALUE NAME SCRIPT ARGS...: SCRIPT run with MODULE.ATTR = VALUE
  local mod=$1 attr=$2 val=$3 name=$4 script=$5; shift 5
  run "$name" python3 -c "import runpy, sys, $mod as m; m.$attr = $val; \
sys.argv = sys.argv[1:]; sys.path.insert(0, 'benchmarks/kernels'); \
runpy.run_path(sys.argv[0], run_name='__main__')" "$script" "$@"
}

ncu_stalls() {  # NAME KERNEL SKIP CMD...: one launch of KERNEL (after SKIP) under ncu's source
  # counters; $OUT/NAME.md is the stall table of benchmarks/kernels/ncu_stalls.py
  local name=$1 kernel=$2 skip=$3; shift 3
  run "$name" ncu --clock-control none -k "regex:$kernel" --launch-skip "$skip" --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section SourceCounters -o "$OUT/$name" -f "$@"
  ncu -i "$OUT/$name.ncu-rep" --page source --csv --print-source sass > "$OUT/$name.csv" 2>&1
  python3 benchmarks/kernels/ncu_stalls.py "$OUT/$name.csv" --top 25 | tee "$OUT/$name.md"
  rm -f "$OUT/$name.ncu-rep" "$OUT/$name.csv"
}

ncu_decode() {  # NAME VARIANT LAYOUT BATCH CONTEXT PAGE: ncu of the split + merge decode kernels
  local name=$1; shift
  run "$name" ncu --clock-control none -k regex:_decode --launch-skip 3 --launch-count 2 \
    --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats \
    --section SchedulerStats --section MemoryWorkloadAnalysis \
    --metrics smsp__inst_executed.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,smsp__sass_inst_executed_op_shared_ld.sum \
    python3 benchmarks/kernels/ncu_decode.py "$@"
}

studies() {
  ncu_decode ncu_decode_fp8_page16 fp8_vt qwen3-1.7b 32 16384 16
  ncu_decode ncu_decode_fp8_smollm2_128x16k fp8_hnd smollm2 128 16384 16
  ncu_decode ncu_decode_fp8_smollm2_32x16k fp8_hnd smollm2 32 16384 16
  ncu_decode ncu_decode_fp8_llama_8x16k fp8_vt llama-3.1-8b 8 16384 32
  for v in bf16 fp8; do
    for stages in 2 5; do
      local which=$v; [ $stages = 2 ] && which=${v}_s2
      run ncu_prefill_${v}_${stages}stages ncu --clock-control none -k regex:_prefill \
        --launch-skip 3 --launch-count 1 --section SpeedOfLight --section WarpStateStats \
        --section Occupancy --section ComputeWorkloadAnalysis --metrics smsp__inst_executed.sum \
        python3 benchmarks/kernels/ncu_prefill.py $which
    done
  done
  run profile_prefill_step python3 benchmarks/kernels/profile_prefill_step.py
  # the sweeps write $OUT/explore_prefill.json or $OUT/explore_vt.json: one folder each
  local d
  for d in explore_prefill_launch explore_prefill_256d explore_decode_fp8_misses_page16 \
           explore_decode_fp8_misses_page32; do mkdir -p "$OUT/$d"; done
  run explore_prefill_launch env OUT="$OUT/explore_prefill_launch" \
    python3 benchmarks/kernels/explore_prefill.py
  run explore_prefill_256d env NO_FI=1 LAYOUTS=gemma3-4b CTXS=4096,16384 \
    OUT="$OUT/explore_prefill_256d" python3 benchmarks/kernels/explore_prefill.py
  for ps in 16 32; do
    run explore_decode_fp8_misses_page$ps env PAGE=$ps OUT="$OUT/explore_decode_fp8_misses_page$ps" \
      python3 benchmarks/kernels/explore_vt.py small
  done
}

quality() {  # the CPU tables of docs/benchmarks.md, as published (float32 compute, 1 thread)
  export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} OMP_NUM_THREADS=1
  run quality_smollm2_2k kvfit bench quality --model smollm2-135m --context 2048 --auto-scales \
    --device cpu
  run quality_qwen_coder_4k kvfit bench quality --model qwen2.5-coder-0.5b --context 4096 \
    --keys 1 --kl-tokens 2000 --chunk 2048 --device cpu
  run quality_gemma3_2k kvfit bench quality --model gemma3-270m --context 2048 --keys 2 \
    --kl-tokens 2000 --device cpu
  run needle_smollm2_4k kvfit bench quality --model smollm2-135m --context 4096 --keys 3 \
    --needle-only --auto-scales fp8_e4m3 --device cpu
  run needle_gemma3_4k kvfit bench quality --model gemma3-270m --context 4096 --keys 3 \
    --needle-only --device cpu
  run serve_cpu kvfit bench serve --num-prompts 16 --max-concurrency 4 --input-len 128 \
    --output-len 32 --device cpu
}

[ $# -gt 0 ] || set -- seed kernels
for t in "$@"; do target "$t"; done
