#!/bin/bash
# Round B of the 8-bit decode work (docs/kernels.md, "8-bit decode at fp8 speed"), in the
# order of what matters at merge: the 64-d prefill by V layout, the decode defaults against
# the old ones (benchmarks/kernels/decode_sweep.py, int8k_round_b.txt), the GPU tests of the
# new paths in parallel chunks, then one end-to-end `kvfit bench seed` int8 point (64 x 16k,
# 1,024-token prefill). Run from the repository root with PYTHONPATH=src; writes $OUT_DIR.
# Usage: OUT_DIR=dir bash benchmarks/gpu/int8k_round_b.sh [prefill-s] [sweep-s] [tests-s] [seed-s]
set -u
OUT_DIR=${OUT_DIR:-/tmp/int8k}
mkdir -p "$OUT_DIR"
export OUT_DIR
T_PREFILL=${1:-7}
T_SWEEP=${2:-19}
T_TESTS=${3:-26}
T_SEED=${4:-20}
CHUNKS=${CHUNKS:-14}
root=$(pwd)
( cd benchmarks/kernels && timeout "$T_PREFILL" python3 prefill_parts.py --v-layouts 2048 )
( cd benchmarks/kernels && timeout "$T_SWEEP" python3 decode_sweep.py --jobs 14 \
    $(grep -v '^#' "$root/benchmarks/gpu/int8k_round_b.txt") )
ids="$OUT_DIR/test_ids.txt"
# the test ids, collected and ordered on the CPU machine (most important first: every chunk
# takes every CHUNKS-th id, so each chunk starts with the new paths)
cp benchmarks/gpu/int8k_round_b_tests.txt "$ids"
n=$(wc -l < "$ids")
echo "$n GPU tests in $CHUNKS parallel chunks"
for ((c = 0; c < CHUNKS; c++)); do
  mapfile -t chunk < <(awk -v c="$c" -v k="$CHUNKS" '(NR - 1) % k == c' "$ids")
  [ ${#chunk[@]} -eq 0 ] && continue
  ( timeout "$T_TESTS" python3 -m pytest -v --tb=short -m gpu -p no:cacheprovider "${chunk[@]}" \
      > "$OUT_DIR/pytest_$c.txt" 2>&1; echo "rc=$?" >> "$OUT_DIR/pytest_$c.txt" ) &
done
wait
passed=$(cat "$OUT_DIR"/pytest_*.txt | grep -c " PASSED")
failed=$(cat "$OUT_DIR"/pytest_*.txt | grep -c " FAILED")
echo "GPU tests: $passed passed, $failed failed of $n (chunks cut by the limit: rc=124)"
grep -h " FAILED\|^E  \|rc=" "$OUT_DIR"/pytest_*.txt | head -40
timeout "$T_SEED" python3 -m kvfit.bench.seed --model src/kvfit/bench/configs/qwen3-1.7b.json \
  --kv-dtypes int8 --contexts 16384 --batches 64 --prefill-len 1024 --out "$OUT_DIR/seed" \
  2>&1 | grep -v "Warning\|warn(" | tail -30
