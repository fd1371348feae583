#!/bin/bash
# b1v GPU round B (80 s slot): after-figures of the batch-invariant decode path (bf16 and fp8,
# batch 1 and 64, 1k and 16k; PDL on/off; bf16 on the triton backend) and the GPU tests.
# The runners of every configuration start in parallel (CPU-bound: compiles, graph capture)
# while the GPU tests run; the tests hold a lock, then each configuration measures alone.
set -u
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
T0=$(date +%s)
el() { echo "[t=$(( $(date +%s) - T0 ))s] $*"; }
LOCK=/tmp/b1v_gpu.lock
BAR=/tmp/b1v_barrier
rm -rf "$LOCK" "$BAR"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
git log --oneline -1 2>/dev/null
el "precompile, tests (holding the lock) and runners starting, all at once"
timeout 20 python3 benchmarks/kernels/rows_precompile.py --model-shapes --pdl off,on --workers 6 \
  > "$OUT_DIR/precompile.txt" 2>&1 &
python3 -c "import fcntl,subprocess,sys; f=open(sys.argv[1],'a+'); fcntl.flock(f,fcntl.LOCK_EX); sys.exit(subprocess.call(sys.argv[2:]))" \
  "$LOCK" timeout 32 python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/gpu/test_overlap_cuda.py tests/gpu/test_rows_gemm_cuda.py -v --tb=short \
  > "$OUT_DIR/pytest.txt" 2>&1 &
TESTS=$!
sleep 1
PTS=1x1024,64x1024,1x16384
run() {  # label, extra args
  timeout $((75 - $(date +%s) + T0)) python3 benchmarks/engine/ab_decode_step.py --label "$1" \
    --points $PTS --steps 32 --repeats 2 --lock "$LOCK" --barrier "$BAR:4" "${@:2}" \
    > "$OUT_DIR/ab_$1.txt" 2>&1 &
}
run fp8 --kv-dtypes fp8_e4m3
run bf16 --kv-dtypes bfloat16
run fp8_pdl_flip --kv-dtypes fp8_e4m3 --pdl PDLFLIP --points 1x1024,64x1024
run bf16_triton --kv-dtypes bfloat16 --attention-backend triton --points 1x1024,64x1024
wait $TESTS
el "tests done"
grep -E "passed|failed|error|PASSED|FAILED" "$OUT_DIR/pytest.txt" | tail -40
wait
el "benchmarks done"
for f in "$OUT_DIR"/ab_*.txt; do echo "== $f"; grep -v "^RESULT\|^     " "$f" | tail -12; done
grep -h "^RESULT" "$OUT_DIR"/ab_*.txt | sed 's/^RESULT //' > "$OUT_DIR/results.jsonl"
el "done"
