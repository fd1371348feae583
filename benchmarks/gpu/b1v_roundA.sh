#!/bin/bash
# b1v GPU round A (08:05, 75-s slot): the batch-invariant decode path as configured (rows_gemm
# to MAX_ROWS, norms in their kernels): model-level invariance and overlap tests, holding a
# lock, while the runners of the end-to-end timing start; then fp8 and bf16 measure in turn.
set -u
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
T0=$(date +%s)
el() { echo "[t=$(( $(date +%s) - T0 ))s] $*"; }
LOCK=/tmp/b1v_gpu.lock
BAR=/tmp/b1v_barrier
rm -rf "$LOCK" "$BAR"
python3 -c "import fcntl,subprocess,sys; f=open(sys.argv[1],'a+'); fcntl.flock(f,fcntl.LOCK_EX); sys.exit(subprocess.call(sys.argv[2:]))" \
  "$LOCK" timeout 38 python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/gpu/test_overlap_cuda.py tests/gpu/test_rows_gemm_cuda.py \
  -k "(request_logits and True-) or (overlap and False)" -v --tb=short \
  > "$OUT_DIR/pytest.txt" 2>&1 &
TESTS=$!
sleep 1
run() {  # label, extra args
  timeout $((73 - $(date +%s) + T0)) python3 benchmarks/engine/ab_decode_step.py --label "$1" \
    --points 1x1024,64x1024,1x16384 --steps 32 --repeats 2 --lock "$LOCK" --barrier "$BAR:2" \
    "${@:2}" > "$OUT_DIR/ab_$1.txt" 2>&1 &
}
run fp8 --kv-dtypes fp8_e4m3
run bf16 --kv-dtypes bfloat16
wait $TESTS
el "tests done"
grep -E "PASSED|FAILED|ERROR|assert|Error" "$OUT_DIR/pytest.txt" | cut -c1-220 | tail -30
wait
el "benchmarks done"
for f in "$OUT_DIR"/ab_*.txt; do echo "== $f"; grep -v "^RESULT" "$f" | grep -v "^\s*$" | tail -22; done
el "done"
