#!/usr/bin/env bash
# GPU tests of the sliding-window (Gemma 2/3) pool on the triton backend, in parallel pytest
# processes (Triton compiles are CPU-bound; one process takes ~2.5 min, this ~1 min on 16 cores).
#   bash benchmarks/gpu/swa_tests.sh [seconds per group, default 55]
# Prints one summary line per group (passed/failed counts, failures named).
cd "$(dirname "$0")/../.."
LIMIT=${1:-55}
OUT=$(mktemp -d)
T=tests/gpu/test_swa_triton_cuda.py
P="python3 -m pytest -q -m gpu -p no:cacheprovider -rf"
timeout "$LIMIT" $P $T -k "matches_torch and bfloat16" > "$OUT/1" 2>&1 &
timeout "$LIMIT" $P $T -k "matches_torch and float16 and not bfloat16" > "$OUT/2" 2>&1 &
timeout "$LIMIT" $P $T -k "matches_torch and fp8_e4m3" > "$OUT/3" 2>&1 &
timeout "$LIMIT" $P $T -k "matches_torch and fp8_e5m2" > "$OUT/4" 2>&1 &
timeout "$LIMIT" $P $T -k "softcap" > "$OUT/5" 2>&1 &
timeout "$LIMIT" $P $T -k "long_context" > "$OUT/6" 2>&1 &
timeout "$LIMIT" $P $T -k "gemma3_270m and float32" > "$OUT/7" 2>&1 &
timeout "$LIMIT" $P $T -k "gemma3_270m and fp8" > "$OUT/8" 2>&1 &
wait
for i in 1 2 3 4 5 6 7 8; do
  line=$(grep -E "[0-9]+ (passed|failed)|error" "$OUT/$i" | tail -1)
  echo "group $i: ${line:-TIMED OUT after ${LIMIT}s ($(head -c 200 "$OUT/$i" | tr -d '\n'))}"
  grep -E "^FAILED|^ERROR" "$OUT/$i"
done
