#!/bin/bash
# The int4 GPU job (lead's queue): the triton backend's and the kernel's GPU tests in parallel with
# the sweep's compiles (Triton's cache), then the timed sweep alone on the GPU, then (the slot's
# rest) one `kvfit bench seed` point for int4.
#   OUT_DIR=... bash benchmarks/kernels/int4_gpu_round.sh
set -u
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
T0=$(date +%s)
el() { echo "[t=$(( $(date +%s) - T0 ))s] $*"; }
el "start: $(nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader 2>&1); $(cat COMMIT 2>/dev/null)"
B=benchmarks/kernels/int4_decode_bench.py
P="python3 -m pytest -q -s -m gpu -p no:cacheprovider"
(timeout 45 $P tests/gpu/test_int4_triton.py -k "steps or store" > "$OUT_DIR/t_steps.txt" 2>&1; echo "rc=$?" >> "$OUT_DIR/t_steps.txt") &
(timeout 45 $P tests/gpu/test_int4_triton.py -k greedy > "$OUT_DIR/t_greedy.txt" 2>&1; echo "rc=$?" >> "$OUT_DIR/t_greedy.txt") &
(timeout 45 $P tests/gpu/test_int4_decode.py -k "matches_reference and not folded and not variants" > "$OUT_DIR/t_decode.txt" 2>&1; echo "rc=$?" >> "$OUT_DIR/t_decode.txt") &
(timeout 45 $P tests/gpu/test_int4_decode.py -k "variants or float32" > "$OUT_DIR/t_decode2.txt" 2>&1; echo "rc=$?" >> "$OUT_DIR/t_decode2.txt") &
N=8
for i in $(seq 0 $((N - 1))); do
  timeout 40 python3 $B --sweep --compile-only --part $i --parts $N > "$OUT_DIR/compile_$i.txt" 2>&1 &
done
wait
el "tests + compiles"
for f in "$OUT_DIR"/t_*.txt; do echo "== $(basename $f): $(grep -E 'passed|failed' $f | tail -1) $(tail -1 $f)"; grep -hE "rel error|relative|identical|Error|assert |FAILED" $f | head -14; done
for f in "$OUT_DIR"/compile_*.txt; do [ -s "$f" ] && { echo "== $f"; tail -3 "$f"; }; done
timeout 25 python3 $B --sweep --json "$OUT_DIR/sweep.json" > "$OUT_DIR/sweep.txt" 2>&1
el "sweep rc=$?"; cat "$OUT_DIR/sweep.txt"
M=src/kvfit/bench/configs/qwen3-1.7b.json
timeout ${SEED_S:-30} python3 -m kvfit.cli bench seed --model $M --kv-dtypes int4 --contexts 16384 \
  --batches 1,64 --prefill-len 1024 --steps 16 --out "$OUT_DIR/seed" > "$OUT_DIR/seed.txt" 2>&1
el "seed rc=$?"; grep -v "^INFO\|^WARNING\|^20" "$OUT_DIR/seed.txt" | tail -14
el "done"
