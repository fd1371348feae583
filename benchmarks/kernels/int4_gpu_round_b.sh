#!/bin/bash
# The int4 GPU job, second round (lead's queue): the chosen kernel's and the triton backend's GPU
# tests in parallel with the bench's compiles, then the kernel bench (default launches) alone on
# the GPU, then one `kvfit bench seed` point (int4 first, fp8_e4m3 if the slot allows).
#   OUT_DIR=... bash benchmarks/kernels/int4_gpu_round_b.sh
set -u
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
T0=$(date +%s)
el() { echo "[t=$(( $(date +%s) - T0 ))s] $*"; }
el "start: $(nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader 2>&1); $(cat COMMIT 2>/dev/null)"
B=benchmarks/kernels/int4_decode_bench.py
P="python3 -m pytest -q -s -m gpu -p no:cacheprovider"
(timeout 50 $P tests/gpu/test_int4_decode.py > "$OUT_DIR/t_decode.txt" 2>&1; echo "rc=$?" >> "$OUT_DIR/t_decode.txt") &
(timeout 50 $P tests/gpu/test_int4_triton.py -k "steps or store" > "$OUT_DIR/t_steps.txt" 2>&1; echo "rc=$?" >> "$OUT_DIR/t_steps.txt") &
(timeout 50 $P tests/gpu/test_int4_triton.py -k greedy > "$OUT_DIR/t_greedy.txt" 2>&1; echo "rc=$?" >> "$OUT_DIR/t_greedy.txt") &
for i in 0 1 2 3; do
  timeout 40 python3 $B --compile-only --part $i --parts 4 > "$OUT_DIR/compile_$i.txt" 2>&1 &
done
wait
el "tests + compiles"
for f in "$OUT_DIR"/t_*.txt; do echo "== $(basename $f): $(grep -E 'passed|failed' $f | tail -1) $(tail -1 $f)"; grep -hE "rel error|relative|identical|Error|assert " $f | head -12; done
timeout 25 python3 $B --json "$OUT_DIR/bench.json" > "$OUT_DIR/bench.txt" 2>&1
el "bench rc=$?"; cat "$OUT_DIR/bench.txt"
M=src/kvfit/bench/configs/qwen3-1.7b.json
timeout 60 python3 -m kvfit.cli bench seed --model $M --kv-dtypes int4,fp8_e4m3 --contexts 16384 \
  --batches 1,64 --prefill-len 1024 --steps 16 --out "$OUT_DIR/seed" > "$OUT_DIR/seed.txt" 2>&1
el "seed rc=$?"; grep -v "^INFO\|^WARNING\|^20" "$OUT_DIR/seed.txt" | tail -16
el "done"
